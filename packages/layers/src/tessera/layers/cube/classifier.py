"""3D classifiers: logits of layout-``"y"`` activations, full or split by class.

Input ``[b/q^2, ..., h/q]`` in layout ``"y"`` (hidden block ``y``, batch block ``z q + x``).

* ``Classifier3D``: weight ``[C, h]`` split like ``Embedding3D``'s table (``[C, h/q^2]`` over
  INPUT x WEIGHT, replicated over OUTPUT), all-gathered over WEIGHT into ``[C, h/q]``; each
  rank's partial logits are summed over INPUT (``reduce_from_group``): logits
  ``[b/q^2, ..., C]`` for the rank's batch block, replicated over INPUT.
* ``VocabParallelClassifier3D``: weight split like ``VocabParallelEmbedding3D``'s
  (``[C/q^2, h]``), all-gathered over WEIGHT into class block ``y``; the input's hidden
  blocks are all-gathered over INPUT (backward: reduce-scatter); logits ``[b/q^2, ..., C/q]``
  with class block ``y``: exactly layout ``"y"`` (Megatron-LM's vocabulary-parallel head on
  the INPUT axis, feeding a vocab-parallel cross-entropy without gathering the logits).

Either can share its embedding's weight (same split), for tied language-model heads. The
bias is replicated over the ranks whose rows differ (the batch group ``OUTPUT x WEIGHT``)
and its gradient is summed over them. The weight/bias handling and ``Classifier3D``'s
forward are shared with 2D (:mod:`tessera.layers.grid.classifier`).
"""

from __future__ import annotations

import torch

from tessera.context import ModeLike

from ..comm.collectives import check_divisible
from ..comm.ops import gather_along_dim
from ..grid.classifier import GridClassifier, GridHead, Splits
from .layout import CubeModule

__all__ = ["Classifier3D", "VocabParallelClassifier3D"]


class Classifier3D(GridClassifier, CubeModule):
    """Classifier with full logits: weight ``[C, h/q^2]``, bias ``[C]``.

    Input ``[b/q^2, ..., h/q]`` (layout ``"y"``); output ``[b/q^2, ..., C]``, replicated over
    INPUT (feed :class:`CrossEntropyLoss3D` with targets from ``split_batch``). ``in_features``
    must be divisible by ``q * q``; a shared weight comes from an ``Embedding3D``. Arguments:
    :class:`~tessera.layers.grid.classifier.GridHead`'s; the forward is
    :class:`~tessera.layers.grid.classifier.GridClassifier`'s.
    """

    def bias_layout(self) -> tuple[Splits, tuple[ModeLike, ...]]:
        """Whole on every rank."""
        cube = self.cube
        return {}, (cube.input.mode, cube.output.mode, cube.weight.mode)


class VocabParallelClassifier3D(GridHead, CubeModule):
    """Classifier with class-split logits: weight ``[C/q^2, h]``, bias ``[C/q]``.

    Input ``[b/q^2, ..., h/q]`` (layout ``"y"``); output ``[b/q^2, ..., C/q]`` (class block
    ``y``; feed :class:`VocabParallelCrossEntropyLoss3D`).

    Args: as :class:`Classifier3D`, with C divisible by ``q * q`` and h by q; a shared weight
    comes from a ``VocabParallelEmbedding3D``.
    """

    def check_features(self) -> None:
        """The input's hidden blocks are gathered over INPUT: ``in_features`` divisible by q."""
        check_divisible(self.in_features, self.cube.q, f"{self.owner} in_features")

    def weight_splits(self) -> Splits:
        """Classes over INPUT x WEIGHT, like ``VocabParallelEmbedding3D``'s table."""
        return {0: self.cube.table_modes}

    def bias_layout(self) -> tuple[Splits, tuple[ModeLike, ...]]:
        """Classes over INPUT (the logits' layout), replicated over the batch group."""
        cube = self.cube
        return {0: (cube.input.mode,)}, (cube.output.mode, cube.weight.mode)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """See the class docstring for shapes."""
        cube = self.cube
        cube.check_local(x, -1, self.in_features // cube.q, self.signature, name="in_features")
        full = gather_along_dim(x, -1, cube.input.group, partial_grad=True)  # [b/q^2, .., h]
        weight = self.gather_table(self.weight, 0)  # [C/q, h]: class block y
        return self.add_bias(torch.matmul(full, weight.t()))  # [b/q^2, ..., C/q]
