"""2D and 2.5D cross-entropy and accuracy on batch-split logits.

The logits of a mesh classifier are split along the batch over the batch group (COL in 2D,
XZ in 2.5D) and either replicated over the mesh row (:class:`MeshClassifier`, ``[b/(depth q),
..., C]``) or split over it by class (:class:`MeshVocabParallelClassifier`, ``[.., C/q]``).

The implementation is shared with 3D (:mod:`tessera.layers.grid.loss`):

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

from ..grid.loss import GridAccuracy, GridCrossEntropyLoss, reduce_batch_loss
from .layout import MeshModule

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


class MeshCrossEntropyLoss(GridCrossEntropyLoss, MeshModule):
    """Cross-entropy of batch-split logits; ``vocab_parallel`` for class-split ones.

    Logits ``[b/(depth q), ..., C]`` (replicated over the mesh row), or ``[.., C/q]`` with
    ``vocab_parallel``; targets ``[b/(depth q), ...]`` (use ``split_batch``). The loss is that
    of the whole batch on every rank (``reduction="none"``: the local rows' losses). The
    implementation is :class:`~tessera.layers.grid.loss.GridCrossEntropyLoss`'s.

    Args:
        reduction: ``"mean"``, ``"sum"`` or ``"none"``, as torch's.
        ignore_index: As torch's.
        context: The ParallelContext (default the current one).
    """


class MeshAccuracy(GridAccuracy, MeshModule):
    """The number of correct predictions in the whole batch, from batch-split logits.

    Logits as :class:`MeshCrossEntropyLoss`; a count, like ``SerialAccuracy``.
    """


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
