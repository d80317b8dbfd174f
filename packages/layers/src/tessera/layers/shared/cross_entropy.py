"""Cross-entropy on vocab-parallel logits ``[.., C/p]`` without gathering them.

Megatron-LM (Shoeybi et al. 2019, section 3, "fusing the output embedding GEMM with the cross
entropy loss"): each rank holds a slice of the classes. The loss needs only three numbers per
sample from the whole row: the max (all-reduce MAX, for a stable softmax), the target's logit
and the sum of exponentials (one all-reduce SUM of both). The backward is local:
``softmax - onehot(target)`` on each rank's slice.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from tessera.context import ParallelContext

from ..comm.ops import apply_function
from .base import Module1D

__all__ = ["VocabParallelCrossEntropyLoss1D", "vocab_parallel_cross_entropy"]

_REDUCTIONS = ("mean", "sum", "none")


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-sample loss from logits ``[N, C/p]`` and targets ``[N]`` (global class ids)."""

    @staticmethod
    def forward(
        ctx: Any,
        logits: torch.Tensor,
        target: torch.Tensor,
        group: dist.ProcessGroup,
        vocab_start: int,
        ignore_index: int,
    ) -> torch.Tensor:
        local_classes = logits.shape[-1]
        row_max = logits.detach().max(dim=-1).values  # [N]
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits.detach() - row_max.unsqueeze(-1)  # [N, C/p]
        outside = (target < vocab_start) | (target >= vocab_start + local_classes)  # [N]
        local_target = (target - vocab_start).masked_fill(outside, 0)
        picked = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)  # [N]
        picked = picked.masked_fill(outside, 0.0)
        exp = shifted.exp()  # [N, C/p]
        both = torch.stack((picked, exp.sum(dim=-1)))  # [2, N]: one all-reduce for both
        dist.all_reduce(both, group=group)
        picked, sum_exp = both[0], both[1]
        ignored = target == ignore_index
        loss = (sum_exp.log() - picked).masked_fill(ignored, 0.0)  # [N]
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_target, outside, ignored)
        return loss

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
        softmax, local_target, outside, ignored = ctx.saved_tensors
        grad = softmax.clone()  # [N, C/p]
        owned = (~outside).to(grad.dtype)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -owned.unsqueeze(-1))
        scale = grad_loss.masked_fill(ignored, 0.0).unsqueeze(-1)  # [N, 1]
        return grad.mul_(scale), None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    group: dist.ProcessGroup,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> torch.Tensor:
    """``F.cross_entropy`` of the full logits, computed from this rank's class slice.

    Args:
        logits: ``[.., C/p]``; rank ``r`` holds classes ``[r*C/p, (r+1)*C/p)``.
        target: ``[..]`` global class ids (``ignore_index`` for none).
        group: The group the classes are split over.
        ignore_index: Targets equal to it add no loss and no gradient.
        reduction: ``"mean"`` (over non-ignored targets, as torch), ``"sum"`` or ``"none"``.
    """
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    if tuple(logits.shape[:-1]) != tuple(target.shape):
        raise ValueError(
            f"logits {list(logits.shape)} and target {list(target.shape)} differ in the "
            "leading dims"
        )
    vocab_start = dist.get_rank(group) * logits.shape[-1]
    flat = logits.reshape(-1, logits.shape[-1])  # [N, C/p]
    loss = apply_function(
        _VocabParallelCrossEntropy, flat, target.reshape(-1), group, vocab_start, ignore_index
    )  # [N]
    if reduction == "none":
        return loss.view(target.shape)
    if reduction == "sum":
        return loss.sum()
    count = (target != ignore_index).sum()
    return loss.sum() / count


class VocabParallelCrossEntropyLoss1D(Module1D):
    """Cross-entropy on the logits of a ``VocabParallelClassifier1D`` (``[.., C/p]``).

    Args:
        reduction: ``"mean"``, ``"sum"`` or ``"none"``, as torch's.
        ignore_index: As torch's.
        context: The ParallelContext (default the current one).
    """

    def __init__(
        self,
        reduction: str = "mean",
        ignore_index: int = -100,
        *,
        context: ParallelContext | None = None,
    ) -> None:
        super().__init__(context=context)
        if reduction not in _REDUCTIONS:
            raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
        self.reduction, self.ignore_index = reduction, ignore_index

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """See the class docstring for shapes."""
        return vocab_parallel_cross_entropy(
            logits,
            target,
            self.tp.group,
            ignore_index=self.ignore_index,
            reduction=self.reduction,
        )
