"""1D classifiers (the output head), each tieable to the matching 1D embedding's weight.

``Classifier1D`` splits the input features (weight ``[C, in/p]``, like ``Embedding1D``'s
``[V, D/p]``) and all-reduces replicated logits; ``VocabParallelClassifier1D`` splits the
classes (weight ``[C/p, in]``, like ``VocabParallelEmbedding1D``'s ``[V/p, D]``) and returns
vocab-parallel logits ``[.., C/p]`` for :func:`vocab_parallel_cross_entropy` (Megatron-LM's
output layer, Shoeybi et al. 2019, section 3).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tessera.context import ParallelContext

from ..comm.collectives import check_divisible
from ..comm.ops import copy_to_group, gather_along_dim, reduce_from_group, split_along_dim
from ..shared.base import Module1D
from ..shared.cross_entropy import mark_vocab_split
from ..shared.dense import DenseHead, check_shared_weight
from ..shared.initializers import Initializer
from ..shared.input_checks import check_input_dim

__all__ = ["Classifier1D", "VocabParallelClassifier1D", "check_shared_weight"]


class Classifier1D(DenseHead, Module1D):
    """Classifier with the input features split: weight ``[C, in/p]``, bias ``[C]``.

    Input ``[.., in]`` replicated (split here); output logits ``[.., C]`` replicated. With
    sequence parallelism the input ``[b, s/p, in]`` is first gathered along the sequence.

    Args:
        in_features: Input features, divisible by the 1D size.
        num_classes: C.
        weight: A shared weight (e.g. an ``Embedding1D``'s) instead of a new one. It may have
            more rows than ``num_classes`` (a vocabulary tied to fewer classes, as Colossal-AI's
            heads allow): the first ``num_classes`` rows are the classes.
        bias: Whether to learn a bias (replicated).
        dtype, weight_initializer, bias_initializer, sequence_parallel, device, context:
            as in :class:`Linear1DRow`.
    """

    # A tied weight may have more rows (a vocabulary) than classes: the first rows are the
    # classes, as in Colossal-AI's heads; every rank holds whole rows, so it can slice.
    whole_rows = True

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
        sequence_parallel: bool = False,
        device: torch.device | str | None = None,
        context: ParallelContext | None = None,
    ) -> None:
        super().__init__(sequence_parallel=sequence_parallel, context=context, device=device)
        check_divisible(in_features, self.tp.world_size, "Classifier1D in_features")
        self.in_features, self.num_classes = in_features, num_classes
        self.make_dense(
            in_features,
            num_classes,
            bias,
            dtype,
            weight_initializer,
            bias_initializer,
            weight_splits={1: (self.split_mode,)},
            bias_replicated=(self.split_mode,),
            shared=weight,
            rows=self.weight_rows(weight),
        )  # weight [C, in/p], bias [C]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """See the class docstring for shapes."""
        check_input_dim(
            x,
            self.in_features,
            self.signature,
            "in_features",
            hint=" (the head splits the features itself)",
        )
        group = self.tp.group
        if self.sequence_parallel:
            x = gather_along_dim(x, self.SEQUENCE_DIM, group)  # [b, s, in]
        x = split_along_dim(x, -1, group)  # [.., in/p]
        weight = self.weight[: self.num_classes]  # [C, in/p]: the first rows of a tied weight
        logits = reduce_from_group(F.linear(x, weight), group)  # [.., C]
        return logits if self.bias is None else logits + self.bias


class VocabParallelClassifier1D(DenseHead, Module1D):
    """Classifier with the classes split: weight ``[C/p, in]``, bias ``[C/p]``.

    Input ``[.., in]`` replicated (``[b, s/p, in]`` with sequence parallelism, gathered here);
    output vocab-parallel logits ``[.., C/p]`` (``[.., C]`` with ``gather_output``).

    Args:
        in_features: Input features.
        num_classes: C, divisible by the 1D size.
        weight: A shared weight (e.g. a ``VocabParallelEmbedding1D``'s) instead of a new one.
        bias: Whether to learn a bias (split like the classes).
        gather_output: All-gather the logits.
        dtype, weight_initializer, bias_initializer, sequence_parallel, device, context:
            as in :class:`Linear1DCol`.
    """

    def __init__(
        self,
        in_features: int,
        num_classes: int,
        weight: nn.Parameter | None = None,
        bias: bool = True,
        gather_output: bool = False,
        dtype: torch.dtype | None = None,
        weight_initializer: Initializer | None = None,
        bias_initializer: Initializer | None = None,
        *,
        sequence_parallel: bool = False,
        device: torch.device | str | None = None,
        context: ParallelContext | None = None,
    ) -> None:
        super().__init__(sequence_parallel=sequence_parallel, context=context, device=device)
        check_divisible(num_classes, self.tp.world_size, "VocabParallelClassifier1D num_classes")
        self.in_features, self.num_classes = in_features, num_classes
        self.gather_output = gather_output
        split = {0: (self.split_mode,)}
        self.make_dense(
            in_features,
            num_classes,
            bias,
            dtype,
            weight_initializer,
            bias_initializer,
            weight_splits=split,
            bias_splits=split,
            shared=weight,
            rows=self.weight_rows(weight),
        )  # weight [C/p, in], bias [C/p]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """See the class docstring for shapes."""
        check_input_dim(
            x,
            self.in_features,
            self.signature,
            "in_features",
            hint=" (a vocab-parallel head's input holds every feature)",
        )
        group = self.tp.group
        if self.sequence_parallel:
            x = gather_along_dim(x, self.SEQUENCE_DIM, group, partial_grad=True)  # [b, s, in]
        else:
            x = copy_to_group(x, group)  # f
        logits = F.linear(x, self.weight, self.bias)  # [.., C/p]
        if self.gather_output:
            return gather_along_dim(logits, -1, group)  # [.., C]
        return mark_vocab_split(logits, self.num_classes)
