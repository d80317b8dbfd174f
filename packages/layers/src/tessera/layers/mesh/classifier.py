"""2D and 2.5D classifiers (the output head), each tieable to the matching mesh embedding.

Input ``[b/(depth q), ..., in/q]`` (activation layout).

* ``Classifier2D``: weight ``[C, in/q^2]`` (the layout of :class:`MeshEmbedding`'s table,
  block ``j * q + i`` of ``in``), all-gathered over COL into ``[C, in/q]``; the partial logits
  of a mesh row are all-reduced over ROW. Output ``[b/(depth q), ..., C]``: split along the
  batch, replicated over the row, as the loss and metric of this mode expect.
* ``VocabParallelClassifier2D``: weight ``W[C_i, in_j]`` ``[C/q, in/q]`` (the layout of
  :class:`MeshVocabParallelEmbedding`'s table), logits ``X W^T`` by SUMMA's ``A B^T`` product
  (:func:`summa_abt`, Xu et al. 2021's transposed variant): ``[b/(depth q), ..., C/q]``,
  classes split over ROW like any activation's hidden dim, for the vocab-parallel loss.

In 2.5D the weights are replicated over depth and their gradients summed over DEP. The
weight/bias handling and ``Classifier2D``'s forward are shared with 3D
(:mod:`tessera.layers.grid.classifier`).
"""

from __future__ import annotations

import torch

from tessera.context import ModeLike

from ..grid.classifier import GridClassifier, GridHead, Splits
from .layout import MeshModule
from .summa import summa_abt

__all__ = [
    "Classifier2D",
    "Classifier2p5D",
    "MeshClassifier",
    "MeshVocabParallelClassifier",
    "VocabParallelClassifier2D",
    "VocabParallelClassifier2p5D",
]


class MeshClassifier(GridClassifier, MeshModule):
    """Classifier with replicated classes: weight ``[C, in/q^2]``, bias ``[C]`` (replicated).

    Input ``[b/(depth q), ..., in/q]``; output ``[b/(depth q), ..., C]``, the same on every
    rank of a mesh row. ``in_features`` must be divisible by ``q * q``; a shared weight comes
    from a :class:`MeshEmbedding`. Arguments: :class:`~tessera.layers.grid.classifier.GridHead`'s;
    the forward is :class:`~tessera.layers.grid.classifier.GridClassifier`'s.
    """

    DEPTH_SUMMED = ("weight",)  # gathered through Mesh.over_depth; the bias: batch group

    def bias_layout(self) -> tuple[Splits, tuple[ModeLike, ...]]:
        """Whole on every rank."""
        mesh = self.mesh
        return {}, (mesh.row.mode, mesh.col.mode, *mesh.depth_modes)


class MeshVocabParallelClassifier(GridHead, MeshModule):
    """Classifier with the classes split: weight ``W[C_i, in_j]`` ``[C/q, in/q]``, bias ``[C/q]``.

    Input ``[b/(depth q), ..., in/q]``; output vocab-parallel logits ``[b/(depth q), ..., C/q]``
    (classes block ``j``).

    Args: as :class:`MeshClassifier`, with ``in_features`` and ``num_classes`` divisible by q;
        a shared weight comes from a :class:`MeshVocabParallelEmbedding`.
    """

    DEPTH_SUMMED = ("weight",)  # through Mesh.over_depth; the bias: batch group

    def weight_splits(self) -> Splits:
        """Classes over COL, features over ROW, like ``MeshVocabParallelEmbedding``'s table."""
        return {0: (self.mesh.col.mode,), 1: (self.mesh.row.mode,)}

    def bias_layout(self) -> tuple[Splits, tuple[ModeLike, ...]]:
        """Classes over ROW (the logits' layout), replicated over the batch group."""
        mesh = self.mesh
        return {0: (mesh.row.mode,)}, (mesh.col.mode, *mesh.depth_modes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """See the class docstring for shapes."""
        mesh = self.mesh
        local_in = self.in_features // mesh.q
        mesh.check_local(x, -1, local_in, self.signature, name="in_features")
        weight = mesh.over_depth(self.weight)  # [C/q, in/q]: W[C_i, in_j]
        logits = summa_abt(x.reshape(-1, local_in), weight, mesh.row, mesh.col)  # [m, C/q]
        return self.add_bias(logits.view(*x.shape[:-1], logits.shape[-1]))


class Classifier2D(MeshClassifier):
    """2D classifier (replicated classes); see :class:`MeshClassifier`."""

    MESH = "2d"


class Classifier2p5D(MeshClassifier):
    """2.5D classifier (replicated classes); see :class:`MeshClassifier`."""

    MESH = "2.5d"


class VocabParallelClassifier2D(MeshVocabParallelClassifier):
    """2D vocab-parallel classifier; see :class:`MeshVocabParallelClassifier`."""

    MESH = "2d"


class VocabParallelClassifier2p5D(MeshVocabParallelClassifier):
    """2.5D vocab-parallel classifier; see :class:`MeshVocabParallelClassifier`."""

    MESH = "2.5d"
