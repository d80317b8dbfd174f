"""Mode-dispatching layers with torch-like signatures.

``Linear(...)``, ``LayerNorm(...)`` ... build the implementation of the context's tensor mode:
plain torch without tensor parallelism (no context, or ``tensor_mode is None``), the mode's
class otherwise, looked up in ``IMPLEMENTATIONS[layer][mode]`` (a read-only view; a mode of
your own, or your own class for a mode, goes in with :func:`register_implementation`). A mode
without an entry raises :class:`ModeNotImplementedError`: never a silent fallback to an
unparallel layer. The 2D and
2.5D builders live in ``dispatch/grid.py`` (one builder per layer serves both), the 3D and
sequence ones in ``dispatch/cube_sequence.py``. Every layer has an implementation in every mode.

They are factories (functions with class-like names): the object returned *is* the torch or
tessera module, so parameter names are exactly those of the plain torch model.

1D needs to know whether a ``Linear`` is column- or row-parallel: say it with
``parallel="col"`` or ``parallel="row"`` (other modes ignore it). Nothing alternates
implicitly, so two models built in one process never interfere.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, Literal

import torch
from torch import nn

from tessera.context import ParallelContext

from ..cube.mode import LAYERS_3D
from ..mesh.mode import LAYERS_2D, LAYERS_2P5D
from ..parallel_1d.classifier import Classifier1D, VocabParallelClassifier1D
from ..parallel_1d.dropout import Dropout1D
from ..parallel_1d.embedding import Embedding1D, VocabParallelEmbedding1D, zero_row
from ..parallel_1d.linear import Linear1DCol, Linear1DRow
from ..parallel_1d.mode import LAYERS_1D
from ..parallel_1d.norm import LayerNorm1D
from ..parallel_1d.patch_embedding import PatchEmbedding1D
from ..sequence.mode import LAYERS_SEQUENCE
from ..shared.accuracy import VocabParallelAccuracy1D
from ..shared.context_access import current_or_none, sequence_parallel_default, tensor_mode
from ..shared.cross_entropy import VocabParallelCrossEntropyLoss1D
from ..shared.errors import ModeNotImplementedError
from ..shared.initializers import Initializer
from ..shared.serial import SerialAccuracy, SerialClassifier, SerialLinear, SerialPatchEmbedding
from .cube_sequence import BUILDERS_3D, SEQUENCE_BUILDERS
from .grid import MESH_BUILDERS

__all__ = [
    "IMPLEMENTATIONS",
    "register_implementation",
    "unregister_implementation",
    "Accuracy",
    "Classifier",
    "CrossEntropyLoss",
    "Dropout",
    "Embedding",
    "LayerNorm",
    "Linear",
    "PatchEmbedding",
]

#: ``builder(context, **arguments of the dispatching layer) -> module``.
Builder = Callable[..., nn.Module]

Parallel = Literal["col", "row"]


def _build(layer: str, context: ParallelContext | None, **kwargs: Any) -> nn.Module | None:
    """The mode's module, or ``None`` without tensor parallelism (the caller builds torch's)."""
    ctx = current_or_none(context)
    mode = tensor_mode(ctx)
    if ctx is None or mode is None:
        return None
    table = _TABLE[layer]
    if mode not in table:
        raise ModeNotImplementedError(layer, mode, table)
    return table[mode](ctx, **kwargs)


def _reinit(
    param: torch.Tensor | None, init: Initializer | None, fan_in: int, fan_out: int
) -> None:
    if param is not None and init is not None:
        with torch.no_grad():
            init(param, fan_in, fan_out)


def _sp(ctx: ParallelContext, value: bool | None) -> bool:
    return sequence_parallel_default(ctx) if value is None else value


# ---------------------------------------------------------------------------- Linear


def _linear_1d(
    ctx: ParallelContext,
    *,
    in_features: int,
    out_features: int,
    bias: bool,
    parallel: Parallel | None,
    gather_output: bool,
    parallel_input: bool,
    sequence_parallel: bool | None,
    **common: Any,
) -> nn.Module:
    sp = _sp(ctx, sequence_parallel)
    if parallel == "col":
        return Linear1DCol(
            in_features,
            out_features,
            bias,
            gather_output,
            sequence_parallel=sp,
            context=ctx,
            **common,
        )
    if parallel == "row":
        return Linear1DRow(
            in_features,
            out_features,
            bias,
            parallel_input,
            sequence_parallel=sp,
            context=ctx,
            **common,
        )
    raise ValueError(
        f"Linear({in_features}, {out_features}) under tensor mode '1d' needs "
        f"parallel='col' or parallel='row', got {parallel!r}"
    )


def Linear(
    in_features: int,
    out_features: int,
    bias: bool = True,
    *,
    parallel: Parallel | None = None,
    gather_output: bool = False,
    parallel_input: bool = True,
    sequence_parallel: bool | None = None,
    skip_bias_add: bool = False,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    weight_initializer: Initializer | None = None,
    bias_initializer: Initializer | None = None,
    context: ParallelContext | None = None,
) -> nn.Module:
    """``torch.nn.Linear`` for the context's tensor mode (weight ``[out, in]`` in full form).

    With ``skip_bias_add=True`` the module returns ``(y, bias)`` and leaves the add to the
    caller (Megatron-LM fuses it into the GeLU or dropout that follows), in every mode. ``bias``
    is always what must be added to ``y``'s last dim (``bias.shape == y.shape[-1:]``; ``None``
    with ``bias=False``), and ``y + bias`` has the values and gradients of the layer without
    ``skip_bias_add``:

    - no tensor parallelism: :class:`SerialLinear` (an ``nn.Linear``), the bias parameter;
    - ``'sequence'``: the same, marked replicated with partial gradients like every
      parameter of that mode;
    - ``'1d'``, ``parallel="col"``: the local block ``[out/p]`` (the block of the output's
      features this rank holds, described by ``module.bias``'s ``ShardInfo``), or the whole
      bias all-gathered with ``gather_output=True``; ``parallel="row"``: the whole
      (replicated) bias, routed so its gradient is summed over the 1D group under sequence
      parallelism;
    - ``'2d'`` / ``'2.5d'`` / ``'3d'``: the local block ``[out/q]`` matching the output's
      hidden block (``module.bias``'s ``ShardInfo``: split over the hidden axis, replicated
      over the batch group), routed through ``copy_to_group`` over the batch group so that
      its gradient, summed over the batch blocks that add it, is complete in ``.grad``.

    Args:
        in_features: As torch's.
        out_features: As torch's.
        bias: As torch's.
        parallel: 1D only: ``"col"`` (split the outputs) or ``"row"`` (split the inputs); a
            Megatron MLP is ``Linear(h, 4h, parallel="col")`` then ``Linear(4h, h,
            parallel="row")``. Ignored by the other modes.
        gather_output: 1D column only: all-gather the output.
        parallel_input: 1D row only: the input is already split (default).
        sequence_parallel: 1D only; default the config's ``tensor.sequence_parallel``.
        skip_bias_add: Return ``(y, bias)`` without adding the bias (see above).
        dtype: Of the parameters.
        device: Of the parameters.
        weight_initializer: Fills the full weight (default torch's init).
        bias_initializer: Fills the full bias (default torch's init).
        context: The ParallelContext; default the current one (none: plain torch).
    """
    module = _build(
        "Linear",
        context,
        in_features=in_features,
        out_features=out_features,
        bias=bias,
        parallel=parallel,
        gather_output=gather_output,
        parallel_input=parallel_input,
        sequence_parallel=sequence_parallel,
        skip_bias_add=skip_bias_add,
        dtype=dtype,
        device=device,
        weight_initializer=weight_initializer,
        bias_initializer=bias_initializer,
    )
    if module is not None:
        return module
    cls = SerialLinear if skip_bias_add else nn.Linear
    linear = cls(in_features, out_features, bias, device=device, dtype=dtype)
    _reinit(linear.weight, weight_initializer, in_features, out_features)
    _reinit(linear.bias, bias_initializer, in_features, out_features)
    return linear


# ---------------------------------------------------------------------------- LayerNorm


def _layer_norm_1d(
    ctx: ParallelContext, *, sequence_parallel: bool | None, parallel_input: bool, **kwargs: Any
) -> nn.Module:
    del parallel_input  # LayerNorm1D tells a split input by its shape
    return LayerNorm1D(sequence_parallel=_sp(ctx, sequence_parallel), context=ctx, **kwargs)


def LayerNorm(
    normalized_shape: int | tuple[int, ...],
    eps: float = 1e-5,
    elementwise_affine: bool = True,
    bias: bool = True,
    *,
    parallel_input: bool = False,
    sequence_parallel: bool | None = None,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    context: ParallelContext | None = None,
) -> nn.Module:
    """``torch.nn.LayerNorm`` for the context's tensor mode (same parameters in full form).

    Between a ``parallel="col"`` and a ``parallel="row"`` ``Linear`` (the paper's Listing 1:
    Linear -> LayerNorm -> Linear) the input is the column layer's output: under 1D its
    features are split (told by its shape, normalized over the 1D group); under 3D it is in
    layout ``"z"``, which has the same shape as the layout between blocks, so say
    ``parallel_input=True`` there (a 3D LayerNorm given the column layer's output directly
    without it raises). 2D and 2.5D keep one layout and need nothing.

    Args:
        normalized_shape: As torch's.
        eps: As torch's.
        elementwise_affine: As torch's.
        bias: As torch's.
        parallel_input: The input is a ``parallel="col"`` Linear's output (3D: layout
            ``"z"``).
        sequence_parallel: 1D only; default the config's ``tensor.sequence_parallel``.
        dtype: Of the parameters.
        device: Of the parameters.
        context: The ParallelContext; default the current one (none: plain torch).
    """
    module = _build(
        "LayerNorm",
        context,
        normalized_shape=normalized_shape,
        eps=eps,
        elementwise_affine=elementwise_affine,
        bias=bias,
        parallel_input=parallel_input,
        sequence_parallel=sequence_parallel,
        dtype=dtype,
        device=device,
    )
    if module is not None:
        return module
    return nn.LayerNorm(
        normalized_shape, eps, elementwise_affine, bias=bias, device=device, dtype=dtype
    )


# ---------------------------------------------------------------------------- Embedding


def _embedding_1d(
    ctx: ParallelContext,
    *,
    vocab_parallel: bool,
    sequence_parallel: bool | None,
    **kwargs: Any,
) -> nn.Module:
    cls = VocabParallelEmbedding1D if vocab_parallel else Embedding1D
    return cls(sequence_parallel=_sp(ctx, sequence_parallel), context=ctx, **kwargs)


def Embedding(
    num_embeddings: int,
    embedding_dim: int,
    padding_idx: int | None = None,
    *,
    vocab_parallel: bool = False,
    sequence_parallel: bool | None = None,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    weight_initializer: Initializer | None = None,
    context: ParallelContext | None = None,
) -> nn.Module:
    """``torch.nn.Embedding`` for the context's tensor mode (weight ``[V, D]`` in full form).

    Args:
        num_embeddings: As torch's.
        embedding_dim: As torch's.
        padding_idx: As torch's.
        vocab_parallel: Split the vocabulary (large V, e.g. a language model) instead of the
            embedding dim.
        sequence_parallel: 1D only; default the config's ``tensor.sequence_parallel``.
        dtype: Of the weight.
        device: Of the weight.
        weight_initializer: Fills the full weight (default Normal(0, 1), torch's).
        context: The ParallelContext; default the current one (none: plain torch).
    """
    module = _build(
        "Embedding",
        context,
        num_embeddings=num_embeddings,
        embedding_dim=embedding_dim,
        padding_idx=padding_idx,
        vocab_parallel=vocab_parallel,
        sequence_parallel=sequence_parallel,
        dtype=dtype,
        device=device,
        weight_initializer=weight_initializer,
    )
    if module is not None:
        return module
    embedding = nn.Embedding(num_embeddings, embedding_dim, padding_idx, device=device, dtype=dtype)
    if weight_initializer is not None:
        init = zero_row(weight_initializer, embedding.padding_idx)
        _reinit(embedding.weight, init, num_embeddings, embedding_dim)
    return embedding


# ---------------------------------------------------------------------------- PatchEmbedding


def _patch_embedding_1d(
    ctx: ParallelContext, *, sequence_parallel: bool | None, **kwargs: Any
) -> nn.Module:
    return PatchEmbedding1D(sequence_parallel=_sp(ctx, sequence_parallel), context=ctx, **kwargs)


def PatchEmbedding(
    img_size: int,
    patch_size: int,
    in_chans: int,
    embed_size: int,
    *,
    sequence_parallel: bool | None = None,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    weight_initializer: Initializer | None = None,
    bias_initializer: Initializer | None = None,
    position_embed_initializer: Initializer | None = None,
    context: ParallelContext | None = None,
) -> nn.Module:
    """ViT patch embedding for the context's tensor mode (see :class:`SerialPatchEmbedding`).

    Input: the images, whole (no tensor parallelism, 1D, ``'sequence'``) or ``split_batch``
    (2D, 2.5D, 3D); output ``[b, N_p + 1, E]`` in the mode's activation layout. Under
    ``'sequence'`` it is :class:`SequencePatchEmbedding`: chunk ``r`` of the ``N_p + 1``
    tokens, which must split over the SEQUENCE ranks (``ValueError`` otherwise; build
    ``SequencePatchEmbedding(..., class_token=False)`` for a sequence of the patches only).
    """
    kwargs: dict[str, Any] = dict(
        img_size=img_size,
        patch_size=patch_size,
        in_chans=in_chans,
        embed_size=embed_size,
        dtype=dtype,
        device=device,
        weight_initializer=weight_initializer,
        bias_initializer=bias_initializer,
        position_embed_initializer=position_embed_initializer,
    )
    module = _build("PatchEmbedding", context, sequence_parallel=sequence_parallel, **kwargs)
    return module if module is not None else SerialPatchEmbedding(**kwargs)


# ---------------------------------------------------------------------------- Classifier


def _classifier_1d(
    ctx: ParallelContext,
    *,
    vocab_parallel: bool,
    sequence_parallel: bool | None,
    **kwargs: Any,
) -> nn.Module:
    cls = VocabParallelClassifier1D if vocab_parallel else Classifier1D
    return cls(sequence_parallel=_sp(ctx, sequence_parallel), context=ctx, **kwargs)


def Classifier(
    in_features: int,
    num_classes: int,
    weight: nn.Parameter | None = None,
    bias: bool = True,
    *,
    vocab_parallel: bool = False,
    sequence_parallel: bool | None = None,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    weight_initializer: Initializer | None = None,
    bias_initializer: Initializer | None = None,
    context: ParallelContext | None = None,
) -> nn.Module:
    """The output head: ``logits = x W^T + b``, weight ``[num_classes, in]`` in full form.

    Args:
        in_features: Input features.
        num_classes: Output classes.
        weight: A shared weight (tie it to the ``Embedding`` with the same ``vocab_parallel``).
        bias: Whether to learn a bias.
        vocab_parallel: Return vocab-parallel logits (feed :func:`CrossEntropyLoss` with
            ``vocab_parallel=True``) instead of full ones.
        sequence_parallel: 1D only; default the config's ``tensor.sequence_parallel``.
        dtype: Of the parameters.
        device: Of the parameters.
        weight_initializer: Fills the full weight (default torch's Linear init).
        bias_initializer: Fills the full bias (default torch's Linear init).
        context: The ParallelContext; default the current one (none: plain torch).
    """
    kwargs: dict[str, Any] = dict(
        in_features=in_features,
        num_classes=num_classes,
        weight=weight,
        bias=bias,
        dtype=dtype,
        device=device,
        weight_initializer=weight_initializer,
        bias_initializer=bias_initializer,
    )
    module = _build(
        "Classifier",
        context,
        vocab_parallel=vocab_parallel,
        sequence_parallel=sequence_parallel,
        **kwargs,
    )
    return module if module is not None else SerialClassifier(**kwargs)


# ---------------------------------------------------------------------------- Dropout


def _dropout_1d(
    ctx: ParallelContext, *, p: float, inplace: bool, parallel_input: bool
) -> nn.Module:
    return Dropout1D(
        p,
        inplace,
        parallel_input=parallel_input,
        sequence_parallel=sequence_parallel_default(ctx),
        context=ctx,
    )


def Dropout(
    p: float = 0.5,
    inplace: bool = False,
    *,
    parallel_input: bool = False,
    context: ParallelContext | None = None,
) -> nn.Module:
    """``torch.nn.Dropout`` drawing from the right RNG stream.

    Args:
        p: Drop probability.
        inplace: As torch's.
        parallel_input: The input is sharded across tensor ranks (e.g. attention
            probabilities of a rank's heads): masks must differ per rank. Otherwise the input
            is replicated and masks agree (unless sequence parallelism splits it).
        context: The ParallelContext; default the current one (none: plain torch).
    """
    module = _build("Dropout", context, p=p, inplace=inplace, parallel_input=parallel_input)
    return module if module is not None else nn.Dropout(p, inplace)


# ---------------------------------------------------------------------------- loss and metric


def _cross_entropy_1d(
    ctx: ParallelContext, *, reduction: str, ignore_index: int, vocab_parallel: bool
) -> nn.Module:
    if vocab_parallel:
        return VocabParallelCrossEntropyLoss1D(reduction, ignore_index, context=ctx)
    # 1D logits that are not vocab-parallel are replicated: torch's loss is exact.
    return nn.CrossEntropyLoss(reduction=reduction, ignore_index=ignore_index)


def CrossEntropyLoss(
    reduction: str = "mean",
    ignore_index: int = -100,
    *,
    vocab_parallel: bool = False,
    context: ParallelContext | None = None,
) -> nn.Module:
    """``torch.nn.CrossEntropyLoss`` for the logits of the mode's ``Classifier``.

    Args:
        reduction: As torch's.
        ignore_index: As torch's.
        vocab_parallel: The logits come from ``Classifier(..., vocab_parallel=True)``.
        context: The ParallelContext; default the current one (none: plain torch).
    """
    module = _build(
        "CrossEntropyLoss",
        context,
        reduction=reduction,
        ignore_index=ignore_index,
        vocab_parallel=vocab_parallel,
    )
    if module is not None:
        return module
    return nn.CrossEntropyLoss(reduction=reduction, ignore_index=ignore_index)


def _accuracy_1d(ctx: ParallelContext, *, vocab_parallel: bool) -> nn.Module:
    return VocabParallelAccuracy1D(context=ctx) if vocab_parallel else SerialAccuracy()


def Accuracy(*, vocab_parallel: bool = False, context: ParallelContext | None = None) -> nn.Module:
    """The number of correct predictions (``argmax`` of the logits equals the target)."""
    module = _build("Accuracy", context, vocab_parallel=vocab_parallel)
    return module if module is not None else SerialAccuracy()


#: 1D's builder of each dispatching layer.
BUILDERS_1D: dict[str, Builder] = {
    "Linear": _linear_1d,
    "LayerNorm": _layer_norm_1d,
    "Embedding": _embedding_1d,
    "PatchEmbedding": _patch_embedding_1d,
    "Classifier": _classifier_1d,
    "Dropout": _dropout_1d,
    "CrossEntropyLoss": _cross_entropy_1d,
    "Accuracy": _accuracy_1d,
}

#: layer -> tensor mode -> builder, the table itself: changed only through
#: :func:`register_implementation` and :func:`unregister_implementation`.
_TABLE: dict[str, dict[str, Builder]] = {layer: {} for layer in BUILDERS_1D}
for _layers, _builders in (
    (LAYERS_1D, BUILDERS_1D),
    (LAYERS_2D, MESH_BUILDERS),
    (LAYERS_2P5D, MESH_BUILDERS),
    (LAYERS_3D, BUILDERS_3D),
    (LAYERS_SEQUENCE, SEQUENCE_BUILDERS),
):
    for _layer, _builder in _builders.items():  # each mode's row, as register_implementation
        _TABLE[_layer][_layers.name] = _builder

#: layer -> tensor mode -> builder, read-only (a live view of the table).
IMPLEMENTATIONS: Mapping[str, Mapping[str, Builder]] = MappingProxyType(
    {layer: MappingProxyType(row) for layer, row in _TABLE.items()}
)


def register_implementation(
    layer: str, mode: str, builder: Builder, *, replace: bool = False
) -> None:
    """Make the dispatching ``layer`` build ``builder(context, **its arguments)`` under ``mode``.

    For a tensor mode of your own (registered with the context's initializers), or your own
    class for one of tessera's modes.

    Args:
        layer: A dispatching layer's name (``"Linear"``, ``"LayerNorm"``, ...).
        mode: The tensor mode (``config.tensor_mode``).
        builder: Called with the context and the dispatching layer's arguments; returns the
            module.
        replace: Allow replacing a builder already registered for ``(layer, mode)``.

    Raises:
        KeyError: ``layer`` is not a dispatching layer (the message lists them).
        ValueError: ``(layer, mode)`` has a builder already and ``replace`` is false.
        TypeError: ``builder`` is not callable.
    """
    row = _row(layer)
    if not callable(builder):
        raise TypeError(
            f"register_implementation({layer!r}, {mode!r}): the builder must be callable, got "
            f"{type(builder).__name__}"
        )
    if mode in row and not replace:
        raise ValueError(
            f"register_implementation: {layer!r} already has a builder for tensor mode {mode!r} "
            f"({getattr(row[mode], '__qualname__', row[mode])}); pass replace=True to replace it"
        )
    row[mode] = builder


def unregister_implementation(layer: str, mode: str) -> Builder:
    """Remove and return ``layer``'s builder for ``mode`` (the layer then raises under it).

    Raises:
        KeyError: ``layer`` is not a dispatching layer, or has no builder for ``mode``.
    """
    row = _row(layer)
    if mode not in row:
        raise KeyError(f"{layer!r} has no builder for tensor mode {mode!r} (it has {sorted(row)})")
    return row.pop(mode)


def _row(layer: str) -> dict[str, Builder]:
    if layer not in _TABLE:
        raise KeyError(f"{layer!r} is not a dispatching layer; they are {', '.join(_TABLE)}")
    return _TABLE[layer]
