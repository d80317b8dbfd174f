"""2D and 2.5D cross-entropy and accuracy on batch-split logits.

The logits of a mesh classifier are split along the batch over the batch group (COL in 2D,
XZ in 2.5D) and either replicated over the mesh row (:class:`MeshClassifier`, ``[b/(depth q),
..., C]``) or split over it by class (:class:`MeshVocabParallelClassifier`, ``[.., C/q]``).

* Per-sample losses come from ``F.cross_entropy`` on the local rows, or from the
  vocab-parallel cross-entropy over the ROW group (Megatron-LM's: one all-reduce MAX, one of
  the target logit and the sum of exponentials, a local backward).
* The batch reduction sums the local losses and all-reduces the sum over the batch group
  (``reduce_from_group``: the result is the whole loss on every rank, so its backward is the
  identity under tessera's gradient convention); ``mean`` divides by the number of
  non-ignored targets of the whole batch.
* Accuracy counts correct predictions locally (the argmax of a vocab-parallel row by the
  distributed argmax over ROW) and all-reduces the count over the batch group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tessera.context import ParallelContext

from .accuracy import vocab_parallel_argmax
from .comm import reduce_from_group
from .context_access import GroupInfo
from .cross_entropy import vocab_parallel_cross_entropy
from .mesh import MeshModule

__all__ = [
    "Accuracy2D",
    "Accuracy2p5D",
    "CrossEntropyLoss2D",
    "CrossEntropyLoss2p5D",
    "MeshAccuracy",
    "MeshCrossEntropyLoss",
    "VocabParallelAccuracy2D",
    "VocabParallelAccuracy2p5D",
    "VocabParallelCrossEntropyLoss2D",
    "VocabParallelCrossEntropyLoss2p5D",
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
    if batch.world_size > 1:
        dist.all_reduce(count, group=batch.group)
    return total / count


class MeshCrossEntropyLoss(MeshModule):
    """Cross-entropy of batch-split logits; ``vocab_parallel`` for class-split ones.

    Logits ``[b/(depth q), ..., C]`` (replicated over the mesh row), or ``[.., C/q]`` with
    ``vocab_parallel``; targets ``[b/(depth q), ...]`` (use ``split_batch``). The loss is that
    of the whole batch on every rank (``reduction="none"``: the local rows' losses).

    Args:
        reduction: ``"mean"``, ``"sum"`` or ``"none"``, as torch's.
        ignore_index: As torch's.
        context: The ParallelContext (default the current one).
    """

    #: Whether the logits are split by class over the mesh row.
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
        mesh = self.mesh
        if self.VOCAB_PARALLEL:
            per_sample = vocab_parallel_cross_entropy(
                logits, target, mesh.row.group, ignore_index=self.ignore_index, reduction="none"
            )
        else:
            per_sample = F.cross_entropy(
                logits.reshape(-1, logits.shape[-1]),
                target.reshape(-1),
                ignore_index=self.ignore_index,
                reduction="none",
            ).view(target.shape)
        return reduce_batch_loss(per_sample, target, self.ignore_index, self.reduction, mesh.batch)


class MeshAccuracy(MeshModule):
    """The number of correct predictions in the whole batch, from batch-split logits.

    Logits as :class:`MeshCrossEntropyLoss`; a count, like ``SerialAccuracy``.
    """

    #: Whether the logits are split by class over the mesh row.
    VOCAB_PARALLEL = False

    def __init__(self, *, context: ParallelContext | None = None) -> None:
        super().__init__(context)

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """See the class docstring for shapes."""
        mesh = self.mesh
        with torch.no_grad():
            if self.VOCAB_PARALLEL:
                predicted = vocab_parallel_argmax(logits, mesh.row.group)
            else:
                predicted = logits.argmax(dim=-1)
            count = (predicted == target).sum()
            if mesh.batch.world_size > 1:
                dist.all_reduce(count, group=mesh.batch.group)
            return count


class CrossEntropyLoss2D(MeshCrossEntropyLoss):
    """2D cross-entropy of a ``Classifier2D``'s logits; see :class:`MeshCrossEntropyLoss`."""

    MESH = "2d"


class CrossEntropyLoss2p5D(MeshCrossEntropyLoss):
    """2.5D cross-entropy of a ``Classifier2p5D``'s logits; see :class:`MeshCrossEntropyLoss`."""

    MESH = "2.5d"


class VocabParallelCrossEntropyLoss2D(MeshCrossEntropyLoss):
    """2D cross-entropy of a ``VocabParallelClassifier2D``'s logits ``[.., C/q]``."""

    MESH = "2d"
    VOCAB_PARALLEL = True


class VocabParallelCrossEntropyLoss2p5D(MeshCrossEntropyLoss):
    """2.5D cross-entropy of a ``VocabParallelClassifier2p5D``'s logits ``[.., C/q]``."""

    MESH = "2.5d"
    VOCAB_PARALLEL = True


class Accuracy2D(MeshAccuracy):
    """2D accuracy of a ``Classifier2D``'s logits; see :class:`MeshAccuracy`."""

    MESH = "2d"


class Accuracy2p5D(MeshAccuracy):
    """2.5D accuracy of a ``Classifier2p5D``'s logits; see :class:`MeshAccuracy`."""

    MESH = "2.5d"


class VocabParallelAccuracy2D(MeshAccuracy):
    """2D accuracy of a ``VocabParallelClassifier2D``'s logits ``[.., C/q]``."""

    MESH = "2d"
    VOCAB_PARALLEL = True


class VocabParallelAccuracy2p5D(MeshAccuracy):
    """2.5D accuracy of a ``VocabParallelClassifier2p5D``'s logits ``[.., C/q]``."""

    MESH = "2.5d"
    VOCAB_PARALLEL = True
