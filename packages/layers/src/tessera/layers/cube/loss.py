"""3D cross-entropy and accuracy on the logits of the 3D classifiers (layout ``"y"`` rows).

The logits' rows are the batch block ``z q + x`` of layout ``"y"`` (split over
``PARALLEL_3D_OUTPUT_X_WEIGHT``); the classes are whole (``Classifier3D``, replicated over
INPUT) or split over INPUT (``VocabParallelClassifier3D``, ``[.., C/q]``). Targets come from
``split_batch``. The implementation is shared with 2D (:mod:`tessera.layers.grid.loss`).

* Per-sample losses: ``F.cross_entropy`` on the local rows, or the vocab-parallel
  cross-entropy over INPUT (Megatron-LM's: all-reduce MAX, one all-reduce of the target logit
  and the sum of exponentials, a local backward).
* The batch reduction is :func:`~tessera.layers.grid.loss.reduce_batch_loss` over the batch
  group: the local sum is all-reduced (``reduce_from_group``, identity backward: the result
  is the whole loss on every rank) and ``mean`` divides by the number of non-ignored
  targets of the whole batch.
* Accuracy counts locally (the distributed argmax over INPUT for split logits) and sums the
  count over the batch group.
"""

from __future__ import annotations

from ..grid.loss import GridAccuracy, GridCrossEntropyLoss
from .layout import CubeModule

__all__ = [
    "Accuracy3D",
    "CrossEntropyLoss3D",
    "VocabParallelAccuracy3D",
    "VocabParallelCrossEntropyLoss3D",
]


class CrossEntropyLoss3D(GridCrossEntropyLoss, CubeModule):
    """Cross-entropy of a ``Classifier3D``'s logits ``[b/q^2, ..., C]``.

    Targets ``[b/q^2, ...]`` (``split_batch``). The loss is that of the whole batch on every
    rank (``reduction="none"``: the local rows' losses). The implementation is
    :class:`~tessera.layers.grid.loss.GridCrossEntropyLoss`'s.

    Args:
        reduction: ``"mean"``, ``"sum"`` or ``"none"``, as torch's.
        ignore_index: As torch's.
        context: The ParallelContext (default the current one).
    """


class VocabParallelCrossEntropyLoss3D(CrossEntropyLoss3D):
    """Cross-entropy of a ``VocabParallelClassifier3D``'s logits ``[b/q^2, ..., C/q]``."""

    VOCAB_PARALLEL = True


class Accuracy3D(GridAccuracy, CubeModule):
    """The number of correct predictions in the whole batch from ``Classifier3D`` logits.

    A count, like ``SerialAccuracy``; targets from ``split_batch``.
    """


class VocabParallelAccuracy3D(Accuracy3D):
    """Accuracy from ``VocabParallelClassifier3D`` logits ``[b/q^2, ..., C/q]``."""

    VOCAB_PARALLEL = True
