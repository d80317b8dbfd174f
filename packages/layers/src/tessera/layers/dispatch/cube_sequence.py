"""Builders of the dispatching layers for tensor modes ``'3d'`` and ``'sequence'``.

3D: a ``Linear`` must say which activation layout it takes, because the cube alternates the
roles of its INPUT and OUTPUT axes from one linear layer to the next (see ``cube/layout.py``). The
dispatching ``Linear`` uses 1D's words for it: ``parallel="col"`` takes the layout between
blocks (``"y"``) and returns ``"z"``, ``parallel="row"`` takes ``"z"`` back to ``"y"``, so one
Megatron-style model definition serves 1D and 3D. Without ``parallel`` it raises: both layouts
have the same local shape, so a wrong guess would compute garbage silently. ``LayerNorm``,
embeddings, heads and losses work on layout ``"y"``.

Sequence: everything but attention is token-wise, so the builders return the plain torch
modules (``nn.Linear``, ``nn.LayerNorm``, ``nn.Embedding``, ``SerialClassifier``,
``nn.CrossEntropyLoss``) working on the local sub-sequence, with every parameter marked
replicated over SEQUENCE with partial gradients (``mark_sequence_replicated``). The patch
embedding is :class:`SequencePatchEmbedding`, which embeds only the rank's chunk of the
tokens (class token and patches) from the whole images. The loss is the mean over the rank's
own tokens, which is what the engine's sequence-parallel gradient handler
(``average="sequence_dp"``) expects. Attention is :class:`RingSelfAttention`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from tessera.context import ParallelContext

from ..cube.dropout import SequenceDropout
from ..cube.layout import Layout3D
from ..cube.linear import Linear3D
from ..sequence.patch_embedding import SequencePatchEmbedding
from ..sequence.replicated import SequenceAccuracy, mark_sequence_replicated
from ..shared.initializers import Initializer
from ..shared.serial import SerialClassifier, SerialLinear
from ..shared.tables import zero_row
from .grid import GRID_BUILDERS

__all__ = ["BUILDERS_3D", "SEQUENCE_BUILDERS"]

Builder = Callable[..., nn.Module]


def _no_1d_options(
    layer: str,
    ctx: ParallelContext,
    *,
    sequence_parallel: bool | None = None,
    gather_output: bool = False,
    parallel_input: bool = True,
) -> None:
    mode = ctx.config.tensor_mode
    if sequence_parallel:
        raise ValueError(
            f"{layer}: sequence_parallel=True is a 1D option; tensor mode {mode!r} already "
            "splits the activations"
        )
    if gather_output or not parallel_input:
        raise ValueError(
            f"{layer}: gather_output / parallel_input=False are 1D options; under {mode!r} "
            "inputs and outputs are in activation layout (use split_activation / "
            "gather_activation)"
        )


# ---------------------------------------------------------------------------- 3d


def _linear_3d(
    ctx: ParallelContext,
    *,
    in_features: int,
    out_features: int,
    bias: bool,
    parallel: str | None,
    gather_output: bool,
    parallel_input: bool,
    sequence_parallel: bool | None,
    **common: Any,
) -> nn.Module:
    _no_1d_options(
        f"Linear({in_features}, {out_features})",
        ctx,
        sequence_parallel=sequence_parallel,
        gather_output=gather_output,
        parallel_input=parallel_input,
    )
    if parallel not in ("col", "row"):
        raise ValueError(
            f"Linear({in_features}, {out_features}) under tensor mode '3d' needs "
            "parallel='col' (input in the layout between blocks, 'y') or parallel='row' "
            f"(input in the layout a 'col' layer returns, 'z'), got {parallel!r}"
        )
    layout: Layout3D = "y" if parallel == "col" else "z"
    return Linear3D(in_features, out_features, bias, input_layout=layout, context=ctx, **common)


#: dispatching layer -> builder for tensor mode '3d': the grid builders, shared with 2D.
BUILDERS_3D: dict[str, Builder] = {"Linear": _linear_3d, **GRID_BUILDERS}


# ---------------------------------------------------------------------------- sequence


def _reinit(
    param: torch.Tensor | None, init: Initializer | None, fan_in: int, fan_out: int
) -> None:
    if param is not None and init is not None:
        with torch.no_grad():
            init(param, fan_in, fan_out)


def _no_vocab_parallel(layer: str, vocab_parallel: bool) -> None:
    if vocab_parallel:
        raise ValueError(
            f"{layer}(vocab_parallel=True): under tensor mode 'sequence' every rank holds the "
            "whole vocabulary; build it with vocab_parallel=False"
        )


def _linear_sequence(
    ctx: ParallelContext,
    *,
    in_features: int,
    out_features: int,
    bias: bool,
    parallel: str | None,
    gather_output: bool,
    parallel_input: bool,
    sequence_parallel: bool | None,
    skip_bias_add: bool,
    dtype: torch.dtype | None,
    device: torch.device | str | None,
    weight_initializer: Initializer | None,
    bias_initializer: Initializer | None,
) -> nn.Module:
    del parallel  # token-wise: nothing to split
    _no_1d_options(
        f"Linear({in_features}, {out_features})",
        ctx,
        sequence_parallel=sequence_parallel,
        gather_output=gather_output,
        parallel_input=parallel_input,
    )
    cls = SerialLinear if skip_bias_add else nn.Linear
    linear = cls(in_features, out_features, bias, device=device, dtype=dtype)
    _reinit(linear.weight, weight_initializer, in_features, out_features)
    _reinit(linear.bias, bias_initializer, in_features, out_features)
    return mark_sequence_replicated(linear, ctx)


def _layer_norm_sequence(
    ctx: ParallelContext,
    *,
    normalized_shape: int | tuple[int, ...],
    eps: float,
    elementwise_affine: bool,
    bias: bool,
    parallel_input: bool,
    sequence_parallel: bool | None,
    dtype: torch.dtype | None,
    device: torch.device | str | None,
) -> nn.Module:
    del parallel_input  # every sequence layer is token-wise: one layout
    _no_1d_options("LayerNorm", ctx, sequence_parallel=sequence_parallel)
    norm = nn.LayerNorm(
        normalized_shape, eps, elementwise_affine, bias=bias, device=device, dtype=dtype
    )
    return mark_sequence_replicated(norm, ctx)


def _embedding_sequence(
    ctx: ParallelContext,
    *,
    num_embeddings: int,
    embedding_dim: int,
    padding_idx: int | None,
    vocab_parallel: bool,
    sequence_parallel: bool | None,
    dtype: torch.dtype | None,
    device: torch.device | str | None,
    weight_initializer: Initializer | None,
) -> nn.Module:
    _no_vocab_parallel("Embedding", vocab_parallel)
    _no_1d_options("Embedding", ctx, sequence_parallel=sequence_parallel)
    embedding = nn.Embedding(num_embeddings, embedding_dim, padding_idx, device=device, dtype=dtype)
    if weight_initializer is not None:
        init = zero_row(weight_initializer, embedding.padding_idx)
        _reinit(embedding.weight, init, num_embeddings, embedding_dim)
    return mark_sequence_replicated(embedding, ctx)


def _patch_embedding_sequence(
    ctx: ParallelContext, *, sequence_parallel: bool | None, **kwargs: Any
) -> nn.Module:
    _no_1d_options("PatchEmbedding", ctx, sequence_parallel=sequence_parallel)
    return SequencePatchEmbedding(context=ctx, **kwargs)


def _classifier_sequence(
    ctx: ParallelContext, *, vocab_parallel: bool, sequence_parallel: bool | None, **kwargs: Any
) -> nn.Module:
    _no_vocab_parallel("Classifier", vocab_parallel)
    _no_1d_options("Classifier", ctx, sequence_parallel=sequence_parallel)
    return mark_sequence_replicated(SerialClassifier(**kwargs), ctx)


def _dropout_sequence(
    ctx: ParallelContext, *, p: float, inplace: bool, parallel_input: bool
) -> nn.Module:
    del parallel_input  # every rank holds other tokens: always the TENSOR stream
    return SequenceDropout(p, inplace, context=ctx)


def _cross_entropy_sequence(
    ctx: ParallelContext, *, reduction: str, ignore_index: int, vocab_parallel: bool
) -> nn.Module:
    _no_vocab_parallel("CrossEntropyLoss", vocab_parallel)
    return nn.CrossEntropyLoss(reduction=reduction, ignore_index=ignore_index)


def _accuracy_sequence(ctx: ParallelContext, *, vocab_parallel: bool) -> nn.Module:
    _no_vocab_parallel("Accuracy", vocab_parallel)
    return SequenceAccuracy(context=ctx)


#: dispatching layer -> builder for tensor mode 'sequence'.
SEQUENCE_BUILDERS: dict[str, Builder] = {
    "Linear": _linear_sequence,
    "LayerNorm": _layer_norm_sequence,
    "Embedding": _embedding_sequence,
    "PatchEmbedding": _patch_embedding_sequence,
    "Classifier": _classifier_sequence,
    "Dropout": _dropout_sequence,
    "CrossEntropyLoss": _cross_entropy_sequence,
    "Accuracy": _accuracy_sequence,
}
