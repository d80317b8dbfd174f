"""The ``[out, in]`` weight and ``[out]`` bias of every parallel linear layer and classifier.

The 1D, 2D, 2.5D and 3D linear layers and classifier heads differ in how they split these
parameters and how they multiply, not in how the parameters are made: torch's ``nn.Linear``
initialization by default (Kaiming-uniform weight, ``U(-1/sqrt(in), 1/sqrt(in))`` bias, both
from the *full* fan-in), and a classifier weight may instead be shared with (tied to) the
matching embedding's table, which must then hold exactly the block this layer would hold.

A *fused* layer computes several outputs of one input in one matmul (an attention's q, k and
v): its ``out`` features are ``fused`` equal parts, and each part is split over the ranks on
its own, so a rank holds the same heads of q, k and v. Its weight is kept as
``[fused, out/fused, in]`` (bias ``[fused, out/fused]``), so that ``ShardInfo`` describes the
rank's blocks exactly and the full form is the same for every layout;
:func:`flat_weight` / :func:`flat_bias` give the ``[out_local, in_local]`` matrix.

:class:`DenseModule` is the mixin every such layer is built on (its sizes, its two parameters
made in one call, the signature naming it in errors, the head of its repr) and
:class:`DenseHead` adds what every classifier head does with a tied weight.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import ClassVar

import torch
from torch import nn

from tessera.context import ModeLike, ShardInfo, get_shard_info

from .base import ParallelModule
from .initializers import Initializer, fan_in_uniform, kaiming_uniform
from .shards import shard_info

__all__ = [
    "DenseHead",
    "DenseModule",
    "LinearOutput",
    "check_fused",
    "check_shared_weight",
    "dense_bias",
    "dense_weight",
    "flat_bias",
    "flat_weight",
    "fused_splits",
]

#: A linear layer returns ``y``, or ``(y, bias)`` with ``skip_bias_add=True`` (the caller fuses
#: the bias add into what follows, Megatron-style).
LinearOutput = torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]


def check_fused(out_features: int, fused: int, owner: str) -> None:
    """``out_features`` must be ``fused`` equal parts."""
    if fused < 1 or out_features % fused != 0:
        raise ValueError(
            f"{owner}: out_features {out_features} is not {fused} equal fused parts "
            f"({out_features} % {fused} = {out_features % max(fused, 1)})"
        )


def fused_splits(
    splits: Mapping[int, Sequence[ModeLike]], fused: int
) -> dict[int, Sequence[ModeLike]]:
    """``splits`` of the ``[out, in]`` form moved to ``[fused, out/fused, in]``."""
    return {dim + (1 if fused > 1 else 0): modes for dim, modes in splits.items()}


def flat_weight(weight: torch.Tensor) -> torch.Tensor:
    """The local ``[out_local, in_local]`` matrix of a (possibly fused) weight."""
    return weight if weight.dim() == 2 else weight.reshape(-1, weight.shape[-1])


def flat_bias(bias: torch.Tensor | None) -> torch.Tensor | None:
    """The local ``[out_local]`` vector of a (possibly fused) bias."""
    return bias if bias is None or bias.dim() == 1 else bias.reshape(-1)


def check_shared_weight(weight: nn.Parameter, expected: ShardInfo, owner: str) -> None:
    """A weight shared from another layer must hold the block this layer would hold."""
    got = get_shard_info(weight)
    if tuple(weight.shape) != expected.local_shape or (
        got is not None
        and (got.global_shape, got.offsets) != (expected.global_shape, expected.offsets)
    ):
        where = f", global {list(got.global_shape)} at {list(got.offsets)}" if got else ""
        raise ValueError(
            f"{owner}: the shared weight is the block {list(weight.shape)}{where}, but this layer "
            f"needs {list(expected.local_shape)} of global {list(expected.global_shape)} at "
            f"offsets {list(expected.offsets)}"
        )


def shared_rows(weight: nn.Parameter) -> int:
    """The full number of rows of a shared weight (its ShardInfo's, else its own)."""
    info = get_shard_info(weight)
    return int(info.global_shape[0]) if info is not None else int(weight.shape[0])


def check_tied_rows(weight: nn.Parameter, num_classes: int, owner: str) -> None:
    """Refuse a tied weight with more rows than classes in a head that cannot slice it.

    Colossal-AI's heads accept an embedding's weight with more rows (its vocabulary) than
    classes and use the first rows. Heads holding whole rows on every rank do the same
    (``SerialClassifier``, ``Classifier1D``, the 2D / 2.5D / 3D ``Classifier``); a
    vocabulary-parallel head splits the rows over ranks, so its first rows would sit on some
    ranks only.
    """
    rows = shared_rows(weight)
    if weight.dim() == 2 and rows > num_classes:
        raise ValueError(
            f"{owner}: the tied weight has {rows} rows but num_classes is {num_classes}. A head "
            f"that uses the first {num_classes} rows of a larger tied weight must hold whole "
            f"rows on every rank (the non-vocab-parallel heads); {owner} splits the rows over "
            f"ranks, so its first {num_classes} rows would sit on some ranks only. Build it "
            f"with num_classes={rows} and use logits[..., :{num_classes}], or give the head its "
            "own weight"
        )


def dense_weight(
    module: ParallelModule,
    out_features: int,
    in_features: int,
    initializer: Initializer | None,
    *,
    splits: Mapping[int, Sequence[ModeLike]],
    replicated: Sequence[ModeLike] = (),
    dtype: torch.dtype | None,
    shared: nn.Parameter | None = None,
    fused: int = 1,
) -> nn.Parameter:
    """``module``'s ``weight`` ``[out, in]``: ``shared`` (checked block by block) or a new one.

    A new weight is registered on ``module`` and filled by ``initializer`` (default
    Kaiming-uniform, torch's); the caller assigns the result to ``module.weight``. With
    ``fused > 1`` it is ``[fused, out/fused, in]`` and ``splits`` (given for ``[out, in]``)
    apply to the last two dims.
    """
    owner = type(module).__name__
    check_fused(out_features, fused, owner)
    shape: tuple[int, ...] = (out_features, in_features)
    if fused > 1:
        shape = (fused, out_features // fused, in_features)
        splits = fused_splits(splits, fused)
    if shared is not None:
        expected = shard_info(module.context, shape, splits, replicated, owner=f"{owner}.weight")
        check_shared_weight(shared, expected, owner)
        return shared
    return module.make_parameter(
        "weight",
        shape,
        initializer or kaiming_uniform(),
        fan_in=in_features,
        fan_out=out_features,
        splits=splits,
        replicated=replicated,
        dtype=dtype,
    )


def dense_bias(
    module: ParallelModule,
    out_features: int,
    in_features: int,
    bias: bool,
    initializer: Initializer | None,
    *,
    splits: Mapping[int, Sequence[ModeLike]] | None = None,
    replicated: Sequence[ModeLike] = (),
    dtype: torch.dtype | None,
    fused: int = 1,
) -> nn.Parameter | None:
    """``module``'s ``bias`` ``[out]`` (torch's fan-in uniform by default), ``None`` without.

    ``[fused, out/fused]`` with ``fused > 1`` (``splits`` given for ``[out]``).
    """
    if not bias:
        return None
    shape: tuple[int, ...] = (out_features,)
    if fused > 1:
        shape = (fused, out_features // fused)
        splits = fused_splits(splits or {}, fused)
    return module.make_parameter(
        "bias",
        shape,
        initializer or fan_in_uniform(),
        fan_in=in_features,
        fan_out=out_features,
        splits=splits,
        replicated=replicated,
        dtype=dtype,
    )


class DenseModule(ParallelModule):
    """Mixin of the parallel linear layers and classifier heads (listed before the mode's base).

    The 1D, 2D, 2.5D and 3D layers differ in how they split ``weight`` ``[out, in]`` and
    ``bias`` ``[out]`` and in how they multiply; what they hold is the same. So the pair of
    parameters is made here in one call (:meth:`make_dense`: the weight first, as torch
    registers it, so the state dict's order is ``nn.Linear``'s), and so are the signature
    naming the layer in error messages and the sizes that open its ``print``.

    Attributes (set by the layer before :meth:`make_dense`): ``in_features`` and the output
    size, named by :attr:`OUT_SIZE`; :meth:`make_dense` sets ``weight`` and ``bias``.
    """

    #: The attribute holding the output size: ``out_features``, or ``num_classes`` for a head.
    OUT_SIZE: ClassVar[str] = "out_features"

    in_features: int
    weight: nn.Parameter
    bias: nn.Parameter | None

    def make_dense(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        dtype: torch.dtype | None,
        weight_initializer: Initializer | None,
        bias_initializer: Initializer | None,
        *,
        weight_splits: Mapping[int, Sequence[ModeLike]],
        weight_replicated: Sequence[ModeLike] = (),
        bias_splits: Mapping[int, Sequence[ModeLike]] | None = None,
        bias_replicated: Sequence[ModeLike] = (),
        shared: nn.Parameter | None = None,
        rows: int | None = None,
        fused: int = 1,
    ) -> None:
        """Set ``weight`` (:func:`dense_weight`) and then ``bias`` (:func:`dense_bias`).

        Both get the same sizes, dtype and ``fused``; only their splits differ, so a layer
        states those and nothing else.

        Args:
            in_features: Input features of the full layer.
            out_features: Output features (classes) of the full layer; the bias's size.
            bias: Whether to learn a bias.
            dtype: Parameter dtype.
            weight_initializer: Fills the full weight (default torch's Kaiming-uniform).
            bias_initializer: Fills the full bias (default torch's fan-in uniform).
            weight_splits: How ``[out, in]`` is split, ``{dim: (mode, ...)}``.
            weight_replicated: The modes the weight is replicated over.
            bias_splits: How ``[out]`` is split (``None``: whole).
            bias_replicated: The modes the bias is replicated over.
            shared: A weight shared (tied) from another layer instead of a new one.
            rows: The weight's rows where a head keeps all rows of a larger tied weight
                (default ``out_features``).
            fused: The output is this many equal parts, each split on its own.
        """
        self.weight = dense_weight(
            self,
            out_features if rows is None else rows,
            in_features,
            weight_initializer,
            splits=weight_splits,
            replicated=weight_replicated,
            dtype=dtype,
            shared=shared,
            fused=fused,
        )
        self.bias = dense_bias(
            self,
            out_features,
            in_features,
            bias,
            bias_initializer,
            splits=bias_splits,
            replicated=bias_replicated,
            dtype=dtype,
            fused=fused,
        )

    @property
    def signature(self) -> str:
        """``Class(in_features, out_features)``, naming the layer in error messages."""
        return f"{type(self).__name__}({self.in_features}, {getattr(self, self.OUT_SIZE)})"

    def dense_repr(self) -> str:
        """``in_features=.., out_features=.., bias=.., ``: how every such layer's repr opens."""
        return (
            f"in_features={self.in_features}, {self.OUT_SIZE}={getattr(self, self.OUT_SIZE)}, "
            f"bias={self.bias is not None}, "
        )


class DenseHead(DenseModule):
    """Mixin of the classifier heads: :class:`DenseModule` with classes and a tieable weight.

    Every head may share (tie) the matching embedding's table as its weight. A head whose
    ranks hold whole rows (:attr:`whole_rows`) accepts one with more rows than classes and
    uses its first rows, as Colossal-AI's heads do; one that splits the rows refuses it
    (:func:`check_tied_rows`). :meth:`weight_rows` says which, once for every mode.
    """

    OUT_SIZE = "num_classes"

    #: Whether every rank holds whole rows (classes) of the weight, so that a tied weight with
    #: more rows than classes can be sliced (its first rows are the classes).
    whole_rows: ClassVar[bool] = False

    num_classes: int

    def weight_rows(self, weight: nn.Parameter | None) -> int:
        """The rows of the head's weight: ``num_classes``, or all of a larger tied ``weight``'s.

        Pass the result as :meth:`make_dense`'s ``rows`` (with ``shared=weight``), after
        setting ``num_classes``.

        Raises:
            ValueError: ``weight`` has more rows than classes and the head splits the rows.
        """
        if weight is None:
            return self.num_classes
        if self.whole_rows:  # the first rows of a larger tied weight are the classes
            return max(shared_rows(weight), self.num_classes)
        check_tied_rows(weight, self.num_classes, type(self).__name__)
        return self.num_classes
