"""Gradients of a sequence-parallel model: partial over SEQUENCE, replicated over DATA.

Under sequence parallelism (Li et al. 2021, "Sequence Parallelism: Long Sequence Training from
System Perspective") every rank of a SEQUENCE group holds all of the weights but sees only a
slice of each sequence, so its weight gradient is a partial one; the ranks of SEQUENCE_DP
(data x sequence) hold the same weights. One all-reduce over SEQUENCE_DP sums the partial
gradients over the sequence and over the replicas at once; the divisor then sets the
convention of the loss:

* ``average="sequence_dp"`` (default): divide by the SEQUENCE_DP size. Right when each rank's
  loss is the *mean* over its own sub-sequence: the full-sequence mean loss is the mean of the
  equal-sized slices' means, so its gradient is the mean of the partial gradients.
* ``average="data"``: divide by the DATA size only. Right when each rank's loss is already
  normalized by the whole sequence's token count (a partial *sum*).
"""

from __future__ import annotations

from typing import Literal

import torch

from tessera.context import ParallelContext, ParallelMode

from ..buckets import DEFAULT_BUCKET_BYTES, all_reduce_coalesced
from ..context_lookup import group_if_parallel
from .base import BaseGradientHandler, DenseGrads, ModelLike
from .buffers import broadcast_buffers

__all__ = ["SequenceParallelGradientHandler"]


class SequenceParallelGradientHandler(BaseGradientHandler):
    """Sum the partial gradients over SEQUENCE and average over the replicas.

    Args:
        model: The module or chunks.
        optimizer: Unused.
        context: The ParallelContext (default: the current one); it must hold SEQUENCE_DP.
        average: ``"sequence_dp"`` or ``"data"``, see the module docstring.
        bucket_size_mb: Size of one coalesced all-reduce.
        broadcast_buffers: After the gradients, copy the first SEQUENCE_DP rank's buffers to
            the others (buffers.py), as the data-parallel handler does over DATA.

    Raises:
        ValueError: ``average`` is neither value, or the context has no SEQUENCE_DP mode.
    """

    def __init__(
        self,
        model: ModelLike,
        optimizer: torch.optim.Optimizer | None = None,
        context: ParallelContext | None = None,
        average: Literal["sequence_dp", "data"] = "sequence_dp",
        bucket_size_mb: float = DEFAULT_BUCKET_BYTES / 2**20,
        broadcast_buffers: bool = True,
    ) -> None:
        super().__init__(model, optimizer, context)
        self.broadcast_buffers = broadcast_buffers
        if average not in ("sequence_dp", "data"):
            raise ValueError(f"average must be 'sequence_dp' or 'data', got {average!r}")
        ctx = self._context
        if ctx is None or not ctx.is_initialized(ParallelMode.SEQUENCE_DP):
            held = "no ParallelContext" if ctx is None else f"modes {ctx.modes}"
            raise ValueError(
                "SequenceParallelGradientHandler needs a context with tensor mode 'sequence' "
                f"(mode 'sequence_dp'); found {held}"
            )
        self.average = average
        self._bucket_bytes = int(bucket_size_mb * 2**20)

    def handle_gradient(self) -> None:
        """Sum over SEQUENCE_DP, divide by the chosen group size."""
        ctx = self._context
        assert ctx is not None
        group = group_if_parallel(ctx, ParallelMode.SEQUENCE_DP)
        mode = ParallelMode.SEQUENCE_DP if self.average == "sequence_dp" else ParallelMode.DATA
        divisor = ctx.get_world_size(mode) if ctx.is_initialized(mode) else 1
        dense = DenseGrads(self.parameters())
        all_reduce_coalesced(
            dense.tensors, group, divisor=float(divisor), bucket_bytes=self._bucket_bytes
        )
        dense.drop_unused()
        if self.broadcast_buffers:
            broadcast_buffers(self._model, ctx, ParallelMode.SEQUENCE_DP, self._bucket_bytes)
