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
import torch.nn.functional as F

from tessera.context import ParallelContext

from ..comm.ops import apply_function
from .base import Module1D

__all__ = [
    "VOCAB_SPLIT_ATTR",
    "VocabParallelCrossEntropyLoss1D",
    "mark_vocab_split",
    "vocab_parallel_cross_entropy",
]

_REDUCTIONS = ("mean", "sum", "none")


#: The attribute a vocab-parallel head sets on its logits: the whole vocabulary's size.
VOCAB_SPLIT_ATTR = "_tessera_vocab_split"


def mark_vocab_split(logits: torch.Tensor, num_classes: int) -> torch.Tensor:
    """Mark ``logits [.., C/p]`` as a head's slice of ``num_classes`` classes; returns them.

    The mark is what tells the loss, without a collective, that these are a slice; it does not
    survive an operation on the logits (a soft cap, a scale), where the loss checks the ranks'
    logits instead (see :func:`vocab_parallel_cross_entropy`).
    """
    setattr(logits, VOCAB_SPLIT_ATTR, num_classes)
    return logits


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-sample loss from logits ``[N, C/p]`` and targets ``[N]`` (global class ids).

    Computed in fp32 from half-precision logits, as torch's ``cross_entropy`` is under
    autocast: a bf16 sum of exponentials over the vocabulary loses the loss's third digit.
    """

    @staticmethod
    def forward(
        ctx: Any,
        logits: torch.Tensor,
        target: torch.Tensor,
        group: dist.ProcessGroup,
        vocab_start: int,
        ignore_index: int,
        check_replicated: bool,
    ) -> torch.Tensor:
        local_classes = logits.shape[-1]
        ctx.logits_dtype = logits.dtype
        values = logits.detach()
        if values.dtype in (torch.float16, torch.bfloat16):
            values = values.float()
        row_max = values.max(dim=-1).values  # [N]
        if check_replicated:
            # Logits alike on every rank are whole ones, not a slice each: their fingerprint's
            # max and -min ride on the same all-reduce as the row maxima (no extra collective).
            fingerprint = row_max.sum().view(1)
            row_max = torch.cat((row_max, fingerprint, -fingerprint))  # [N + 2]
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        if check_replicated:
            if bool(row_max[-2] == -row_max[-1]):
                raise ValueError(_replicated_logits(logits, dist.get_world_size(group)))
            row_max = row_max[:-2]
        shifted = values - row_max.unsqueeze(-1)  # [N, C/p]
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
    def backward(
        ctx: Any, grad_loss: torch.Tensor
    ) -> tuple[torch.Tensor, None, None, None, None, None]:
        softmax, local_target, outside, ignored = ctx.saved_tensors
        grad = softmax.clone()  # [N, C/p]
        owned = (~outside).to(grad.dtype)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -owned.unsqueeze(-1))
        scale = grad_loss.masked_fill(ignored, 0.0).unsqueeze(-1).to(grad.dtype)  # [N, 1]
        return grad.mul_(scale).to(ctx.logits_dtype), None, None, None, None, None


def _replicated_logits(logits: torch.Tensor, world: int) -> str:
    width = logits.shape[-1]
    return (
        f"vocab-parallel cross-entropy: the logits [.., {width}] are the same on all {world} "
        f"ranks of the group, so they look like whole logits (a plain model's output, or "
        f"gathered ones), which this loss would read as one slice of {world * width} classes "
        "per rank. Pass the whole vocabulary's size as vocab_size= (whole logits then get the "
        "plain cross-entropy), or give the loss a vocab-parallel head's own output"
    )


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    group: dist.ProcessGroup,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    vocab_size: int | None = None,
) -> torch.Tensor:
    """``F.cross_entropy`` of the full logits, computed from this rank's class slice.

    Whole logits are told from a slice by ``vocab_size``, else by the mark a vocab-parallel
    head sets (:func:`mark_vocab_split`), else by comparing the ranks' logits on the all-reduce
    the loss makes anyway: whole logits are alike on every rank, and reading them as a slice
    would give a wrong loss without an error.

    Args:
        logits: ``[.., C/p]``; rank ``r`` holds classes ``[r*C/p, (r+1)*C/p)``. Or whole
            ``[.., C]`` where ``vocab_size`` says ``C``.
        target: ``[..]`` global class ids (``ignore_index`` for none).
        group: The group the classes are split over.
        ignore_index: Targets equal to it add no loss and no gradient.
        reduction: ``"mean"`` (over non-ignored targets, as torch), ``"sum"`` or ``"none"``.
        vocab_size: ``C``, the whole vocabulary, if known (transformers passes it to its loss).

    Raises:
        ValueError: the shapes disagree, or unmarked logits are alike on every rank (whole
            ones, which only ``vocab_size`` can tell from a slice).
    """
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    if tuple(logits.shape[:-1]) != tuple(target.shape):
        raise ValueError(
            f"logits {list(logits.shape)} and target {list(target.shape)} differ in the "
            "leading dims"
        )
    world, width = dist.get_world_size(group), logits.shape[-1]
    marked = getattr(logits, VOCAB_SPLIT_ATTR, None)
    if vocab_size is not None and world > 1 and width == vocab_size:  # whole logits
        return F.cross_entropy(
            logits.reshape(-1, width),
            target.reshape(-1),
            ignore_index=ignore_index,
            reduction=reduction,
        ).view(target.shape if reduction == "none" else ())
    known = vocab_size if vocab_size is not None else marked
    if known is not None and width * world != known:
        raise ValueError(
            f"vocab-parallel cross-entropy: logits [.., {width}] on each of {world} ranks are "
            f"neither the whole vocabulary of {known} nor a slice of it ({known} / {world} = "
            f"{known / world:g} per rank)"
        )
    vocab_start = dist.get_rank(group) * width
    flat = logits.reshape(-1, width)  # [N, C/p]
    check = known is None and world > 1
    loss = apply_function(
        _VocabParallelCrossEntropy,
        flat,
        target.reshape(-1),
        group,
        vocab_start,
        ignore_index,
        check,
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
