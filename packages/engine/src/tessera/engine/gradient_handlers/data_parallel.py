"""Averaging gradients over data-parallel replicas, in buckets.

Each replica computed the gradient of its own slice of the batch; the mean over replicas is the
gradient of the whole batch (synchronous data parallelism, as in Li et al. 2020, "PyTorch
Distributed"). Used where torch's DDP does not fit: a pipeline stage runs several forwards
before its backwards, which DDP's reducer does not expect.

Buffers are not gradients, yet replicas must agree on them too: like DDP
(``broadcast_buffers=True``, its default), the handler overwrites every buffer with the first
replica's copy once per optimizer step, after the gradients (buffers.py).
"""

from __future__ import annotations

import torch

from tessera.context import ParallelContext, ParallelMode

from ..buckets import DEFAULT_BUCKET_BYTES, all_reduce_coalesced
from ..context_lookup import group_if_parallel
from .base import BaseGradientHandler, DenseGrads, ModelLike
from .buffers import broadcast_buffers

__all__ = ["DataParallelGradientHandler"]


class DataParallelGradientHandler(BaseGradientHandler):
    """All-reduce every gradient over DATA in buckets and divide by the data size.

    Args:
        model: The module or chunks.
        optimizer: Unused.
        context: The ParallelContext (default: the current one).
        bucket_size_mb: Size of one coalesced all-reduce.
        broadcast_buffers: After the gradients, copy the first data-parallel replica's
            buffers (BatchNorm's running statistics) to the others, as DDP's option of that
            name; ``initialize`` takes it from ``ddp=dict(broadcast_buffers=...)``.
    """

    def __init__(
        self,
        model: ModelLike,
        optimizer: torch.optim.Optimizer | None = None,
        context: ParallelContext | None = None,
        bucket_size_mb: float = DEFAULT_BUCKET_BYTES / 2**20,
        broadcast_buffers: bool = True,
    ) -> None:
        super().__init__(model, optimizer, context)
        self._bucket_bytes = int(bucket_size_mb * 2**20)
        self.broadcast_buffers = broadcast_buffers

    def handle_gradient(self) -> None:
        """Average the gradients over the data-parallel group; then sync the buffers."""
        group = group_if_parallel(self._context, ParallelMode.DATA)
        if group is None or self._context is None:
            return
        size = self._context.get_world_size(ParallelMode.DATA)
        dense = DenseGrads(self.parameters())
        all_reduce_coalesced(dense.tensors, group, divisor=size, bucket_bytes=self._bucket_bytes)
        dense.drop_unused()
        if self.broadcast_buffers:
            broadcast_buffers(self._model, self._context, ParallelMode.DATA, self._bucket_bytes)
