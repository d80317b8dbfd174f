"""3D cross-entropy and accuracy on the logits of the 3D classifiers (layout ``"y"`` rows).

The logits' rows are the batch block ``z q + x`` of layout ``"y"`` (split over
``PARALLEL_3D_OUTPUT_X_WEIGHT``); the classes are whole (``Classifier3D``, replicated over
INPUT) or split over INPUT (``VocabParallelClassifier3D``, ``[.., C/q]``). Targets come from
``split_batch``.

* Per-sample losses: ``F.cross_entropy`` on the local rows, or the vocab-parallel
  cross-entropy over INPUT (Megatron-LM's: all-reduce MAX, one all-reduce of the target logit
  and the sum of exponentials, a local backward).
* The batch reduction is 2D's :func:`reduce_batch_loss` over the batch group: the local sum
  is all-reduced (``reduce_from_group``, identity backward: the result is the whole loss on
  every rank) and ``mean`` divides by the number of non-ignored targets of the whole batch.
* Accuracy counts locally (the distributed argmax over INPUT for split logits) and sums the
  count over the batch group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tessera.context import ParallelContext

from .accuracy import vocab_parallel_argmax
from .cross_entropy import vocab_parallel_cross_entropy
from .cube import CubeModule
from .loss_2d import reduce_batch_loss

__all__ = [
    "Accuracy3D",
    "CrossEntropyLoss3D",
    "VocabParallelAccuracy3D",
    "VocabParallelCrossEntropyLoss3D",
]

_REDUCTIONS = ("mean", "sum", "none")


class CrossEntropyLoss3D(CubeModule):
    """Cross-entropy of a ``Classifier3D``'s logits ``[b/q^2, ..., C]``.

    Targets ``[b/q^2, ...]`` (``split_batch``). The loss is that of the whole batch on every
    rank (``reduction="none"``: the local rows' losses).

    Args:
        reduction: ``"mean"``, ``"sum"`` or ``"none"``, as torch's.
        ignore_index: As torch's.
        context: The ParallelContext (default the current one).
    """

    #: Whether the logits are split by class over INPUT.
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
                "differ in the leading dims (split the targets with split_batch)"
            )
        cube = self.cube
        if self.VOCAB_PARALLEL:
            per_sample = vocab_parallel_cross_entropy(
                logits, target, cube.input.group, ignore_index=self.ignore_index, reduction="none"
            )
        else:
            per_sample = F.cross_entropy(
                logits.reshape(-1, logits.shape[-1]),
                target.reshape(-1),
                ignore_index=self.ignore_index,
                reduction="none",
            ).view(target.shape)
        return reduce_batch_loss(
            per_sample, target, self.ignore_index, self.reduction, cube.output_x_weight
        )


class VocabParallelCrossEntropyLoss3D(CrossEntropyLoss3D):
    """Cross-entropy of a ``VocabParallelClassifier3D``'s logits ``[b/q^2, ..., C/q]``."""

    VOCAB_PARALLEL = True


class Accuracy3D(CubeModule):
    """The number of correct predictions in the whole batch from ``Classifier3D`` logits.

    A count, like ``SerialAccuracy``; targets from ``split_batch``.
    """

    #: Whether the logits are split by class over INPUT.
    VOCAB_PARALLEL = False

    def __init__(self, *, context: ParallelContext | None = None) -> None:
        super().__init__(context)

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """See the class docstring for shapes."""
        cube = self.cube
        with torch.no_grad():
            if self.VOCAB_PARALLEL:
                predicted = vocab_parallel_argmax(logits, cube.input.group)
            else:
                predicted = logits.argmax(dim=-1)
            count = (predicted == target).sum()
            if cube.output_x_weight.world_size > 1:
                dist.all_reduce(count, group=cube.output_x_weight.group)
            return count


class VocabParallelAccuracy3D(Accuracy3D):
    """Accuracy from ``VocabParallelClassifier3D`` logits ``[b/q^2, ..., C/q]``."""

    VOCAB_PARALLEL = True
