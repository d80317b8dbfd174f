"""Replicas agree on buffers: every buffer overwritten with the first replica's copy.

Buffers are not gradients, yet replicas must agree on them too: BatchNorm's running statistics
are updated by each replica's own forwards, so without a sync they drift apart, and evaluation
or a checkpoint depends on which rank is asked. torch's DDP broadcasts them from the first
replica (``broadcast_buffers=True``, its default); tessera does the same once per optimizer
step, after the gradients, wherever the replicas are not DDP's: the data-parallel handler of
pipelines and chunks, the sequence handler (over SEQUENCE_DP) and ZeRO-2/3, whose FSDP2 syncs
parameters only (:class:`BufferBroadcastHandler`). To use every replica's batch in the
statistics instead, convert the model with ``torch.nn.SyncBatchNorm.convert_sync_batchnorm``.
"""

from __future__ import annotations

import torch
from torch import nn

from tessera.context import ParallelContext, ParallelMode

from ..buckets import DEFAULT_BUCKET_BYTES, broadcast_coalesced
from ..context_lookup import group_if_parallel
from .base import BaseGradientHandler, ModelLike

__all__ = ["BufferBroadcastHandler", "broadcast_buffers"]


def broadcast_buffers(
    model: ModelLike,
    context: ParallelContext,
    mode: ParallelMode = ParallelMode.DATA,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> None:
    """Overwrite every buffer of ``model`` with the copy of the first rank of ``mode``'s group.

    Nothing happens without such a group (one replica) or without buffers.
    """
    group = group_if_parallel(context, mode)
    if group is None:
        return
    modules = [model] if isinstance(model, nn.Module) else list(model)
    buffers = [b for m in modules for b in m.buffers()]
    if buffers:
        src = context.get_ranks_in_group(mode)[0]
        broadcast_coalesced(buffers, src, group, bucket_bytes=bucket_bytes)


class BufferBroadcastHandler(BaseGradientHandler):
    """Leaves the gradients alone; copies the first data-parallel replica's buffers.

    The engine adds it under ZeRO-2/3 (FSDP2 reduces the gradients but never syncs buffers),
    unless ``ddp=dict(broadcast_buffers=False)``.

    Args:
        model: The module or chunks.
        optimizer: Unused.
        context: The ParallelContext (default: the current one).
        mode: The group whose first rank's buffers the others take.
    """

    def __init__(
        self,
        model: ModelLike,
        optimizer: torch.optim.Optimizer | None = None,
        context: ParallelContext | None = None,
        mode: ParallelMode = ParallelMode.DATA,
    ) -> None:
        super().__init__(model, optimizer, context)
        self.mode = mode

    def handle_gradient(self) -> None:
        """Broadcast the buffers (see the class docstring)."""
        if self._context is not None:
            broadcast_buffers(self._model, self._context, self.mode)
