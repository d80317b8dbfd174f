"""Weights tied across pipeline stages (an embedding used by the first and the last stage).

In a single process a tied weight is one Parameter that receives the gradient of both uses
(Press & Wolf 2017, "Using the Output Embedding to Improve Language Models"). Split into a
pipeline, the first and the last stage each hold a copy; summing the two copies' gradients over
a group made of exactly those two ranks (per data and tensor coordinate), as Megatron-LM does
with its embedding group (Narayanan et al. 2021), gives both copies the full gradient, and
identical initial values plus identical updates keep them equal.

Mark the copies with ``mark_pipeline_shared(param, key)`` (tessera.context, re-exported here) on
both stages; the keys pair them. ``initialize`` adds this handler to every pipeline job.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from tessera.context import (
    PIPELINE_SHARED_ATTR,
    ParallelContext,
    mark_pipeline_shared,
    pipeline_shared_key,
)

from ..buckets import all_reduce_coalesced, broadcast_coalesced
from .base import BaseGradientHandler, ModelLike

__all__ = ["PIPELINE_SHARED_ATTR", "PipelineSharedModuleGradientHandler", "mark_pipeline_shared"]


class PipelineSharedModuleGradientHandler(BaseGradientHandler):
    """Sum the gradients of tied weights over the first and the last pipeline stage.

    Construction is collective (every rank of the job creates the pairs' groups, in the same
    order) and makes the copies equal by broadcasting the first stage's values.

    Args:
        model: This stage's module or chunks.
        optimizer: Unused.
        context: The ParallelContext (default: the current one).

    Raises:
        RuntimeError: there is no context, or the first and last stage mark different keys or
            shapes (raised on both ranks of the pair, before any gradient collective).
    """

    def __init__(
        self,
        model: ModelLike,
        optimizer: torch.optim.Optimizer | None = None,
        context: ParallelContext | None = None,
    ) -> None:
        super().__init__(model, optimizer, context)
        ctx = self._context
        if ctx is None:
            raise RuntimeError("PipelineSharedModuleGradientHandler needs a ParallelContext")
        shared: dict[str, nn.Parameter] = {}
        for p in self.parameters():
            key = pipeline_shared_key(p)
            if key is not None:
                if key in shared and shared[key] is not p:
                    raise RuntimeError(f"two parameters on this stage are marked with key {key!r}")
                shared[key] = p
        self._shared = [shared[k] for k in sorted(shared)]
        self._group: dist.ProcessGroup | None = None
        self._is_copy = False
        pp = ctx.pipeline_size
        if pp == 1:
            return
        dp, tp = ctx.data_size, ctx.tensor_size
        me = ctx.global_rank
        for d in range(dp):
            for t in range(tp):
                pair = [d * pp * tp + t, d * pp * tp + (pp - 1) * tp + t]
                group = dist.new_group(pair, timeout=ctx.timeout)
                if me in pair:
                    self._group = group
                    self._is_copy = me == pair[1]
        if self._group is None:
            self._shared = []  # a middle stage holds no copy
            return
        described = [(k, tuple(shared[k].shape)) for k in sorted(shared)]
        both: list[object] = [None, None]
        dist.all_gather_object(both, described, group=self._group)
        if both[0] != both[1]:
            raise RuntimeError(
                f"tied weights differ between the first and last pipeline stage: first stage "
                f"marks {both[0]}, last stage marks {both[1]} (mark_pipeline_shared keys and "
                "shapes must match)"
            )
        src = dist.get_global_rank(self._group, 0)
        broadcast_coalesced([p.data for p in self._shared], src, self._group)

    @property
    def shared_parameters(self) -> list[nn.Parameter]:
        """This rank's tied copies, sorted by key."""
        return list(self._shared)

    def handle_gradient(self) -> None:
        """Sum the tied copies' gradients over the pair (first and last stage)."""
        if self._group is None or not self._shared:
            return
        grads: list[torch.Tensor] = []
        for p in self._shared:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
        all_reduce_coalesced(grads, self._group)

    def duplicate_parameters(self) -> list[torch.Tensor]:
        """On the last stage, its copies: the first stage's copy is counted in the norm."""
        return list(self._shared) if self._is_copy else []
