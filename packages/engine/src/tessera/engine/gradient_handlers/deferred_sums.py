"""Sums of gradients that tensor-parallel layers left to the training loop, once per step.

A layer whose weight is replicated over ranks that each compute part of its gradient (2.5D's
depth layers, Wang et al. 2021) sums the parts inside autograd: one all-reduce per layer and
per backward. Under the engine, which knows when the optimizer steps, that sum can wait for the
step: one bucketed all-reduce per group for every layer together, and with gradient
accumulation or pipeline microbatches once per step instead of once per backward. Sums are
linear, so the result is the same (tessera.context.gradient_sums).
"""

from __future__ import annotations

import torch
from torch import nn

from tessera.context import ParallelContext, defer_gradient_sums

from ..buckets import DEFAULT_BUCKET_BYTES, all_reduce_coalesced
from ..context_lookup import group_if_parallel
from .base import BaseGradientHandler, DenseGrads, ModelLike

__all__ = ["DeferredSumGradientHandler"]


class DeferredSumGradientHandler(BaseGradientHandler):
    """Take over the gradient sums of the model's deferring layers; sum them at each step.

    Building the handler switches every layer of ``model`` that implements
    :class:`tessera.context.DefersGradientSum` to leave its sums out of autograd, so from then
    on the model's gradients are complete only after :meth:`handle_gradient` (the engine calls
    it before clipping and the optimizer step). A loop that reads ``.grad`` between backward
    and step sees each rank's part.

    Args:
        model: The module or chunks.
        optimizer: Unused.
        context: The ParallelContext (default: the current one).
        bucket_size_mb: Size of one coalesced all-reduce.

    Raises:
        ValueError: the layers leave sums over a mode the context does not hold.
    """

    def __init__(
        self,
        model: ModelLike,
        optimizer: torch.optim.Optimizer | None = None,
        context: ParallelContext | None = None,
        bucket_size_mb: float = DEFAULT_BUCKET_BYTES / 2**20,
    ) -> None:
        super().__init__(model, optimizer, context)
        modules = [model] if isinstance(model, nn.Module) else list(model)
        self._bucket_bytes = int(bucket_size_mb * 2**20)
        #: ``{mode: parameters}`` whose gradients this handler sums over the mode's group.
        self.sums = defer_gradient_sums(modules)
        ctx = self._context
        missing = [m for m in self.sums if ctx is None or not ctx.is_initialized(m)]
        if missing:
            # the layers were built in another context: nothing here could sum them
            raise ValueError(
                f"DeferredSumGradientHandler: the model's layers leave gradient sums over "
                f"{missing} to the handler, but its context holds no such group "
                f"({'no context' if ctx is None else f'modes {ctx.modes}'}); pass the "
                "context the layers were built in"
            )

    def handle_gradient(self) -> None:
        """Sum each deferred gradient over its group, in buckets (no division)."""
        for mode, params in self.sums.items():
            group = group_if_parallel(self._context, mode)
            dense = DenseGrads(iter(params))
            all_reduce_coalesced(dense.tensors, group, bucket_bytes=self._bucket_bytes)
            dense.drop_unused()
