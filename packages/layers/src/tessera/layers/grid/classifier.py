"""The classifier heads 2D, 2.5D and 3D share: weight (own or tied), bias and full logits.

Every 2D/2.5D/3D head takes the activation layout between blocks (``[b/B, ..., in/q]``: the
batch over the grid's batch axis, the features over its hidden axis) and owns a ``[C, in]``
weight (or shares an embedding's, checked block by block) and an optional bias whose
gradient is summed over the batch axis. :class:`GridHead` holds that; the mode's head says
how the weight and bias are split. :class:`GridClassifier` is the head with whole classes,
identical in every mode: its weight is split like :class:`~tessera.layers.grid.embedding.
GridEmbedding`'s table (so a language model can tie them), all-gathered into the hidden
axis's block, and the partial logits are summed over the hidden axis (Xu et al. 2021;
Bian et al. 2021), leaving ``[b/B, ..., C]`` replicated over it.
"""

from __future__ import annotations

import torch
from torch import nn

from tessera.context import ModeLike, ParallelContext

from ..comm.ops import copy_to_group, reduce_from_group
from ..shared.dense import DenseHead
from ..shared.initializers import Initializer
from .base import GridModule

__all__ = ["GridClassifier", "GridHead"]

#: ``{dim: (mode, ...)}``, as ``make_parameter``'s ``splits``.
Splits = dict[int, tuple[ModeLike, ...]]


class GridHead(DenseHead, GridModule):
    """Weight (own or shared) and bias of a grid classifier; subclasses say how they split.

    Args:
        in_features: Input features.
        num_classes: C.
        weight: A shared weight (the matching embedding's) instead of a new one.
        bias: Whether to learn a bias.
        dtype: Parameter dtype.
        weight_initializer: Fills the full ``[C, in]`` weight (torch's Linear default).
        bias_initializer: Fills the full ``[C]`` bias (torch's Linear default).
        device: Parameter device (default the context's).
        context: The ParallelContext (default the current one).
    """

    def __init__(
        self,
        in_features: int,
        num_classes: int,
        weight: nn.Parameter | None = None,
        bias: bool = True,
        dtype: torch.dtype | None = None,
        weight_initializer: Initializer | None = None,
        bias_initializer: Initializer | None = None,
        *,
        device: torch.device | str | None = None,
        context: ParallelContext | None = None,
    ) -> None:
        super().__init__(context, device)
        self.in_features, self.num_classes = in_features, num_classes
        self.check_features()
        bias_split, bias_replicated = self.bias_layout()
        self.make_dense(
            in_features,
            num_classes,
            bias,
            dtype,
            weight_initializer,
            bias_initializer,
            weight_splits=self.weight_splits(),
            weight_replicated=self.grid.table_replicated,
            bias_splits=bias_split,
            bias_replicated=bias_replicated,
            shared=weight,
            rows=self.weight_rows(weight),
        )

    def check_features(self) -> None:
        """Raise ``ValueError`` for sizes the split cannot take (beyond the weight's own)."""

    def weight_splits(self) -> Splits:
        """How the ``[C, in]`` weight is split."""
        raise NotImplementedError

    def bias_layout(self) -> tuple[Splits, tuple[ModeLike, ...]]:
        """How the ``[C]`` bias is split, and what it is replicated over."""
        raise NotImplementedError

    def add_bias(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits + bias``; every batch block adds it, so its gradient is summed over them."""
        if self.bias is None:
            return logits
        return logits + copy_to_group(self.bias, self.grid.batch_axis.group)

    def extra_repr(self) -> str:
        """The summary shown by ``print(module)``."""
        return self.dense_repr() + super().extra_repr()


class GridClassifier(GridHead):
    """Classifier with whole classes: weight ``[C, in/q^2]``, bias ``[C]`` (replicated).

    Input ``[b/B, ..., in/q]``; output ``[b/B, ..., C]``, replicated over the hidden axis.
    ``in_features`` must be divisible by ``q * q``. A tied weight may have more rows than
    ``num_classes``: the first rows are the classes.
    """

    whole_rows = True

    def weight_splits(self) -> Splits:
        """``in`` over the table modes, like :class:`GridEmbedding`'s table."""
        return {1: self.grid.table_modes}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """See the class docstring for shapes."""
        grid = self.grid
        grid.check_local(x, -1, self.in_features // grid.q, self.signature, name="in_features")
        weight = grid.gather_table(self.weight[: self.num_classes], 1)  # [C, in/q]
        partial = torch.matmul(x, weight.t())  # [b/B, ..., C], partial over hidden blocks
        return self.add_bias(reduce_from_group(partial, grid.hidden_axis.group))
