"""Cross-entropy and accuracy on batch-split logits, written once for 2D, 2.5D and 3D.

The logits of a 2D/2.5D/3D classifier are split along the batch over the grid's batch axis
(COL in 2D, XZ in 2.5D, OUTPUT x WEIGHT in 3D) and either replicated over its hidden axis
(``[b/B, ..., C]``) or split over it by class (vocab-parallel, ``[.., C/q]``).

* Per-sample losses come from ``F.cross_entropy`` on the local rows, or from the
  vocab-parallel cross-entropy over the hidden axis (Megatron-LM's: one all-reduce MAX, one of
  the target logit and the sum of exponentials, a local backward).
* The batch reduction (:func:`reduce_batch_loss`) sums the local losses and all-reduces the
  sum over the batch axis (``reduce_from_group``: the result is the whole loss on every rank,
  so its backward is the identity under tessera's gradient convention); ``mean`` divides by
  the number of non-ignored targets of the whole batch.
* Accuracy counts correct predictions locally (the argmax of a vocab-parallel row by the
  distributed argmax over the hidden axis) and all-reduces the count over the batch axis.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tessera.context import ParallelContext

from ..comm.inflight import start_all_reduce
from ..comm.ops import gather_along_dim, reduce_from_group
from ..shared.accuracy import vocab_parallel_argmax
from ..shared.context_access import GroupInfo
from ..shared.cross_entropy import vocab_parallel_cross_entropy
from ..shared.mode_layers import check_targets
from .base import Grid, GridModule

__all__ = [
    "GridAccuracy",
    "GridCrossEntropyLoss",
    "gather_grid_logits",
    "grid_cross_entropy",
    "grid_token_loss",
    "reduce_batch_loss",
]

_REDUCTIONS = ("mean", "sum", "none")


def reduce_batch_loss(
    per_sample: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int,
    reduction: str,
    batch: GroupInfo,
) -> torch.Tensor:
    """Reduce per-sample losses of this rank's batch block to the loss of the whole batch.

    Args:
        per_sample: ``[..]`` losses of the local rows (0 where the target is ignored).
        target: ``[..]`` the local targets.
        ignore_index: Targets that count for nothing (excluded from the mean's count).
        reduction: ``"none"`` (the local losses), ``"sum"`` or ``"mean"`` (whole batch).
        batch: The group the batch is split over.
    """
    if reduction == "none":
        return per_sample
    total = reduce_from_group(per_sample.sum(), batch.group)  # the whole batch's sum
    if reduction == "sum":
        return total
    count = (target != ignore_index).sum().to(total.dtype)
    count = start_all_reduce(count, batch.group, batch.world_size).wait()
    return total / count


class GridCrossEntropyLoss(GridModule):
    """Cross-entropy of batch-split logits; ``VOCAB_PARALLEL`` for class-split ones.

    Logits ``[b/B, ..., C]`` (replicated over the hidden axis), or ``[.., C/q]`` with
    ``VOCAB_PARALLEL``; targets ``[b/B, ...]`` (use ``split_batch``). The loss is that of the
    whole batch on every rank (``reduction="none"``: the local rows' losses).

    Args:
        reduction: ``"mean"``, ``"sum"`` or ``"none"``, as torch's.
        ignore_index: As torch's.
        context: The ParallelContext (default the current one).
    """

    #: Whether the logits are split by class over the grid's hidden axis.
    VOCAB_PARALLEL = False

    def __init__(
        self,
        reduction: str = "mean",
        ignore_index: int = -100,
        *,
        context: ParallelContext | None = None,
    ) -> None:
        super().__init__(context)
        if reduction not in _REDUCTIONS:
            raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
        self.reduction, self.ignore_index = reduction, ignore_index

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """See the class docstring for shapes."""
        if tuple(logits.shape[:-1]) != tuple(target.shape):
            raise ValueError(
                f"{self.owner}: logits {list(logits.shape)} and target {list(target.shape)} "
                "differ in the leading dims (split both with split_batch)"
            )
        return grid_cross_entropy(
            logits,
            target,
            self.grid,
            vocab_parallel=self.VOCAB_PARALLEL,
            ignore_index=self.ignore_index,
            reduction=self.reduction,
        )


def grid_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    grid: Grid,
    *,
    vocab_parallel: bool,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> torch.Tensor:
    """:class:`GridCrossEntropyLoss` as a function of the grid (no module built per call).

    Logits ``[b/B, ..., C]``, or ``[.., C/q]`` with ``vocab_parallel``; targets ``[b/B, ...]``.
    """
    if vocab_parallel:
        per_sample = vocab_parallel_cross_entropy(
            logits, target, grid.hidden_axis.group, ignore_index=ignore_index, reduction="none"
        )
    else:
        per_sample = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]),
            target.reshape(-1),
            ignore_index=ignore_index,
            reduction="none",
        ).view(target.shape)
    return reduce_batch_loss(per_sample, target, ignore_index, reduction, grid.batch_axis)


class GridAccuracy(GridModule):
    """The number of correct predictions in the whole batch, from batch-split logits.

    Logits as :class:`GridCrossEntropyLoss`; a count, like ``SerialAccuracy``.
    """

    #: Whether the logits are split by class over the grid's hidden axis.
    VOCAB_PARALLEL = False

    def __init__(self, *, context: ParallelContext | None = None) -> None:
        super().__init__(context)

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """See the class docstring for shapes."""
        grid = self.grid
        with torch.no_grad():
            if self.VOCAB_PARALLEL:
                predicted = vocab_parallel_argmax(logits, grid.hidden_axis.group)
            else:
                predicted = logits.argmax(dim=-1)
            count = (predicted == target).sum()
            if grid.batch_axis.world_size > 1:
                dist.all_reduce(count, group=grid.batch_axis.group)
            return count


def grid_token_loss(
    logits: torch.Tensor,
    targets: torch.Tensor,
    grid: Grid,
    mode: str,
    *,
    ignore_index: int,
    reduction: str,
) -> torch.Tensor:
    """``tessera.layers.token_loss`` under a grid mode: logits ``[b/B, s, V]``, rows split.

    ``targets``: this rank's rows of them (the mode's ``split_batch``). A function of the
    grid, so no module is built per call (and ``torch.compile`` traces it whole).
    """
    check_targets(logits, targets, mode)
    return grid_cross_entropy(
        logits, targets, grid, vocab_parallel=False, ignore_index=ignore_index, reduction=reduction
    )


def gather_grid_logits(logits: torch.Tensor, grid: Grid) -> torch.Tensor:
    """Logits ``[b/B, s, V]`` to the whole batch's on every rank (over the batch axis)."""
    return gather_along_dim(logits, 0, grid.batch_axis.group)
