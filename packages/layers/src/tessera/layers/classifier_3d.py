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
and its gradient is summed over them.
"""

from __future__ import annotations

import torch
from torch import nn

from tessera.context import ParallelContext

from .classifier_1d import check_shared_weight
from .collectives import check_divisible
from .comm import copy_to_group, gather_along_dim, reduce_from_group
from .cube import CubeModule
from .initializers import Initializer, fan_in_uniform, kaiming_uniform
from .shards import shard_info

__all__ = ["Classifier3D", "VocabParallelClassifier3D"]


class _CubeHead(CubeModule):
    """Weight (own or shared) and bias of a 3D classifier; subclasses say how they split."""

    #: The dim of ``[C, h]`` split over INPUT x WEIGHT.
    WEIGHT_DIM = 1

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
        cube = self.cube
        self.in_features, self.num_classes = in_features, num_classes
        shape = (num_classes, in_features)
        split = {self.WEIGHT_DIM: (cube.input.mode, cube.weight.mode)}
        replicated = (cube.output.mode,)
        if weight is not None:
            expected = shard_info(
                self.context, shape, split, replicated, owner=f"{self.owner}.weight"
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
                splits=split,
                replicated=replicated,
                dtype=dtype,
            )
        bias_split = {0: (cube.input.mode,)} if self.WEIGHT_DIM == 0 else {}
        bias_replicated = (
            (cube.output.mode, cube.weight.mode)
            if self.WEIGHT_DIM == 0
            else (cube.input.mode, cube.output.mode, cube.weight.mode)
        )
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

    def add_bias(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits + bias``, the bias gradient summed over the batch group."""
        if self.bias is None:
            return logits
        return logits + copy_to_group(self.bias, self.cube.output_x_weight.group)

    def extra_repr(self) -> str:
        """The summary shown by ``print(module)``."""
        return (
            f"in_features={self.in_features}, num_classes={self.num_classes}, "
            f"bias={self.bias is not None}, " + super().extra_repr()
        )


class Classifier3D(_CubeHead):
    """Classifier with full logits: weight ``[C, h/q^2]``, bias ``[C]``.

    Input ``[b/q^2, ..., h/q]`` (layout ``"y"``); output ``[b/q^2, ..., C]``, replicated over
    INPUT (feed :class:`CrossEntropyLoss3D` with targets from ``split_batch``).

    Args:
        in_features: h, divisible by ``q * q``.
        num_classes: C.
        weight: A shared weight (an ``Embedding3D``'s) instead of a new one.
        bias: Whether to learn a bias.
        dtype: Parameter dtype.
        weight_initializer: Fills the full ``[C, h]`` weight (torch's Linear default).
        bias_initializer: Fills the full ``[C]`` bias (torch's Linear default).
        device: Parameter device (default the context's).
        context: The ParallelContext (default the current one).
    """

    WEIGHT_DIM = 1

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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """See the class docstring for shapes."""
        cube = self.cube
        cube.check_local(x, -1, self.in_features // cube.q, f"{self.owner} input")
        weight = self.gather_table(self.weight, 1)  # [C, h/q]: block y
        partial = torch.matmul(x, weight.t())  # [b/q^2, ..., C], partial over hidden blocks
        return self.add_bias(reduce_from_group(partial, cube.input.group))


class VocabParallelClassifier3D(_CubeHead):
    """Classifier with class-split logits: weight ``[C/q^2, h]``, bias ``[C/q]``.

    Input ``[b/q^2, ..., h/q]`` (layout ``"y"``); output ``[b/q^2, ..., C/q]`` (class block
    ``y``; feed :class:`VocabParallelCrossEntropyLoss3D`).

    Args: as :class:`Classifier3D`, with C divisible by ``q * q`` and h by q; a shared weight
    comes from a ``VocabParallelEmbedding3D``.
    """

    WEIGHT_DIM = 0

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
        check_divisible(in_features, self.cube.q, f"{self.owner} in_features")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """See the class docstring for shapes."""
        cube = self.cube
        cube.check_local(x, -1, self.in_features // cube.q, f"{self.owner} input")
        full = gather_along_dim(x, -1, cube.input.group, partial_grad=True)  # [b/q^2, .., h]
        weight = self.gather_table(self.weight, 0)  # [C/q, h]: class block y
        return self.add_bias(torch.matmul(full, weight.t()))  # [b/q^2, ..., C/q]
