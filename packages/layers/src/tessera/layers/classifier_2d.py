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

In 2.5D the weights are replicated over depth and their gradients summed over DEP.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tessera.context import ModeLike, ParallelContext

from .classifier_1d import check_shared_weight
from .comm import gather_along_dim, reduce_from_group
from .initializers import Initializer, fan_in_uniform, kaiming_uniform
from .mesh import MeshModule
from .shards import shard_info
from .summa import summa_abt

__all__ = [
    "Classifier2D",
    "Classifier2p5D",
    "MeshClassifier",
    "MeshVocabParallelClassifier",
    "VocabParallelClassifier2D",
    "VocabParallelClassifier2p5D",
]


class _MeshHead(MeshModule):
    """Weight (own or shared) and bias of a classifier; subclasses say how they are split."""

    def __init__(
        self,
        in_features: int,
        num_classes: int,
        weight: nn.Parameter | None,
        bias: bool,
        dtype: torch.dtype | None,
        weight_initializer: Initializer | None,
        bias_initializer: Initializer | None,
        device: torch.device | str | None,
        context: ParallelContext | None,
    ) -> None:
        super().__init__(context, device)
        self.in_features, self.num_classes = in_features, num_classes
        mesh = self.mesh
        shape = (num_classes, in_features)
        weight_split = self.weight_splits()
        if weight is not None:
            expected = shard_info(
                self.context,
                shape,
                weight_split,
                mesh.depth_modes,
                owner=f"{self.owner}.weight",
            )
            check_shared_weight(weight, expected, self.owner)
            self.weight = weight
        else:
            self.weight = self.make_parameter(
                "weight",
                shape,
                weight_initializer or kaiming_uniform(),
                fan_in=in_features,
                fan_out=num_classes,
                splits=weight_split,
                replicated=mesh.depth_modes,
                dtype=dtype,
            )
        bias_split, bias_replicated = self.bias_layout()
        self.bias = (
            self.make_parameter(
                "bias",
                (num_classes,),
                bias_initializer or fan_in_uniform(),
                fan_in=in_features,
                fan_out=num_classes,
                splits=bias_split,
                replicated=bias_replicated,
                dtype=dtype,
            )
            if bias
            else None
        )

    def weight_splits(self) -> dict[int, tuple[ModeLike, ...]]:
        """How the ``[C, in]`` weight is split."""
        raise NotImplementedError

    def bias_layout(self) -> tuple[dict[int, tuple[ModeLike, ...]], tuple[ModeLike, ...]]:
        """How the ``[C]`` bias is split, and what it is replicated over."""
        raise NotImplementedError

    def _add_bias(self, logits: torch.Tensor) -> torch.Tensor:
        # every batch block adds the bias: its gradient is summed over the batch group
        return logits if self.bias is None else logits + self.mesh.over_batch(self.bias)

    def extra_repr(self) -> str:
        """The summary shown by ``print(module)``."""
        return (
            f"in_features={self.in_features}, num_classes={self.num_classes}, "
            f"bias={self.bias is not None}, " + super().extra_repr()
        )


class MeshClassifier(_MeshHead):
    """Classifier with replicated classes: weight ``[C, in/q^2]``, bias ``[C]`` (replicated).

    Input ``[b/(depth q), ..., in/q]``; output ``[b/(depth q), ..., C]``, the same on every
    rank of a mesh row.

    Args:
        in_features: Input features, divisible by ``q * q``.
        num_classes: C.
        weight: A shared weight (e.g. a :class:`MeshEmbedding`'s) instead of a new one.
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
        super().__init__(
            in_features,
            num_classes,
            weight,
            bias,
            dtype,
            weight_initializer,
            bias_initializer,
            device,
            context,
        )

    def weight_splits(self) -> dict[int, tuple[ModeLike, ...]]:
        """``in`` over ROW then COL (block ``j * q + i``), like ``MeshEmbedding``'s table."""
        return {1: (self.mesh.row.mode, self.mesh.col.mode)}

    def bias_layout(self) -> tuple[dict[int, tuple[ModeLike, ...]], tuple[ModeLike, ...]]:
        """Whole on every rank."""
        mesh = self.mesh
        return {}, (mesh.row.mode, mesh.col.mode, *mesh.depth_modes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """See the class docstring for shapes."""
        mesh = self.mesh
        mesh.check_local(x, -1, self.in_features // mesh.q, f"{self.owner} input")
        weight = mesh.over_depth(self.weight)
        weight = gather_along_dim(weight, 1, mesh.col.group, partial_grad=True)  # [C, in/q]
        logits = reduce_from_group(F.linear(x, weight), mesh.row.group)  # [b/(dq), .., C]
        return self._add_bias(logits)


class MeshVocabParallelClassifier(_MeshHead):
    """Classifier with the classes split: weight ``W[C_i, in_j]`` ``[C/q, in/q]``, bias ``[C/q]``.

    Input ``[b/(depth q), ..., in/q]``; output vocab-parallel logits ``[b/(depth q), ..., C/q]``
    (classes block ``j``).

    Args: as :class:`MeshClassifier`, with ``in_features`` and ``num_classes`` divisible by q;
        a shared weight comes from a :class:`MeshVocabParallelEmbedding`.
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
        super().__init__(
            in_features,
            num_classes,
            weight,
            bias,
            dtype,
            weight_initializer,
            bias_initializer,
            device,
            context,
        )

    def weight_splits(self) -> dict[int, tuple[ModeLike, ...]]:
        """Classes over COL, features over ROW, like ``MeshVocabParallelEmbedding``'s table."""
        return {0: (self.mesh.col.mode,), 1: (self.mesh.row.mode,)}

    def bias_layout(self) -> tuple[dict[int, tuple[ModeLike, ...]], tuple[ModeLike, ...]]:
        """Classes over ROW (the logits' layout), replicated over the batch group."""
        mesh = self.mesh
        return {0: (mesh.row.mode,)}, (mesh.col.mode, *mesh.depth_modes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """See the class docstring for shapes."""
        mesh = self.mesh
        local_in = self.in_features // mesh.q
        mesh.check_local(x, -1, local_in, f"{self.owner} input")
        weight = mesh.over_depth(self.weight)  # [C/q, in/q]: W[C_i, in_j]
        logits = summa_abt(x.reshape(-1, local_in), weight, mesh.row, mesh.col)  # [m, C/q]
        return self._add_bias(logits.view(*x.shape[:-1], logits.shape[-1]))


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
