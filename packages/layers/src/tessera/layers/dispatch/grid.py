"""Builders of the dispatching layers for the grid modes ``'2d'``, ``'2.5d'`` and ``'3d'``.

One builder per dispatching layer serves every grid mode: it picks the ``...2D``, ``...2p5D``
or ``...3D`` class from the context's mode's ``ModeLayers.classes`` (mesh/mode.py,
cube/mode.py). ``Linear`` serves the mesh modes only: 3D's needs a layout, see
``dispatch/cube_sequence.py``. The 1D-only options of the dispatching layers
(``gather_output``, ``parallel_input=False``, ``sequence_parallel``) have no meaning on a mesh
and raise instead of being silently dropped; ``parallel="col"/"row"`` is accepted and ignored
(2D splits both dims of every weight), so one model definition serves 1D, 2D and 2.5D.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from tessera.context import ParallelContext

from ..shared.mode_layers import find_mode_layers

__all__ = ["GRID_BUILDERS", "MESH_BUILDERS"]


def _cls(key: str, ctx: ParallelContext) -> Callable[..., nn.Module]:
    """The class ``key`` of the context's mode (its folder's ``ModeLayers.classes``)."""
    mode = ctx.config.tensor_mode
    layers = find_mode_layers(mode)
    classes = {} if layers is None else layers.classes
    if key not in classes:  # only reachable by calling a builder directly
        raise ValueError(
            f"{key}: tensor mode {mode!r} has no class for the grid builders (its ModeLayers "
            f"classes: {sorted(classes)})"
        )
    return classes[key]


def _vocab(key: str, vocab_parallel: bool) -> str:
    return f"VocabParallel{key}" if vocab_parallel else key


def _no_sequence_parallel(layer: str, ctx: ParallelContext, sequence_parallel: bool | None) -> None:
    if sequence_parallel:
        raise ValueError(
            f"{layer}: sequence_parallel=True is a 1D option; tensor mode "
            f"{ctx.config.tensor_mode!r} already splits the activations in two dims"
        )


def _linear(
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
    del parallel  # both dims of a mesh weight are split: col/row does not apply
    mode = ctx.config.tensor_mode
    if gather_output or not parallel_input:
        raise ValueError(
            f"Linear({in_features}, {out_features}): gather_output / parallel_input=False are "
            f"1D options; under {mode!r} inputs and outputs are in activation layout (use "
            "split_activation / gather_activation)"
        )
    _no_sequence_parallel("Linear", ctx, sequence_parallel)
    return _cls("Linear", ctx)(in_features, out_features, bias, context=ctx, **common)


def _layer_norm(
    ctx: ParallelContext, *, sequence_parallel: bool | None, parallel_input: bool, **kwargs: Any
) -> nn.Module:
    _no_sequence_parallel("LayerNorm", ctx, sequence_parallel)
    layers = find_mode_layers(ctx.config.tensor_mode)
    if layers is not None and layers.two_layouts:  # 3D: a column layer's output is in "z"
        kwargs["layout"] = "z" if parallel_input else "y"
    return _cls("LayerNorm", ctx)(context=ctx, **kwargs)


def _embedding(
    ctx: ParallelContext,
    *,
    vocab_parallel: bool,
    sequence_parallel: bool | None,
    **kwargs: Any,
) -> nn.Module:
    _no_sequence_parallel("Embedding", ctx, sequence_parallel)
    return _cls(_vocab("Embedding", vocab_parallel), ctx)(context=ctx, **kwargs)


def _patch_embedding(
    ctx: ParallelContext, *, sequence_parallel: bool | None, **kwargs: Any
) -> nn.Module:
    _no_sequence_parallel("PatchEmbedding", ctx, sequence_parallel)
    return _cls("PatchEmbedding", ctx)(context=ctx, **kwargs)


def _classifier(
    ctx: ParallelContext,
    *,
    vocab_parallel: bool,
    sequence_parallel: bool | None,
    **kwargs: Any,
) -> nn.Module:
    _no_sequence_parallel("Classifier", ctx, sequence_parallel)
    return _cls(_vocab("Classifier", vocab_parallel), ctx)(context=ctx, **kwargs)


def _dropout(ctx: ParallelContext, *, p: float, inplace: bool, parallel_input: bool) -> nn.Module:
    del parallel_input  # every mesh activation is sharded: always the TENSOR stream
    return _cls("Dropout", ctx)(p, inplace, context=ctx)


def _cross_entropy(
    ctx: ParallelContext, *, reduction: str, ignore_index: int, vocab_parallel: bool
) -> nn.Module:
    cls = _cls(_vocab("CrossEntropyLoss", vocab_parallel), ctx)
    return cls(reduction, ignore_index, context=ctx)


def _accuracy(ctx: ParallelContext, *, vocab_parallel: bool) -> nn.Module:
    return _cls(_vocab("Accuracy", vocab_parallel), ctx)(context=ctx)


#: dispatching layer -> builder serving every grid mode ('2d', '2.5d', '3d'); no ``Linear``.
GRID_BUILDERS: dict[str, Callable[..., nn.Module]] = {
    "LayerNorm": _layer_norm,
    "Embedding": _embedding,
    "PatchEmbedding": _patch_embedding,
    "Classifier": _classifier,
    "Dropout": _dropout,
    "CrossEntropyLoss": _cross_entropy,
    "Accuracy": _accuracy,
}

#: dispatching layer -> builder serving both mesh modes ('2d', '2.5d').
MESH_BUILDERS: dict[str, Callable[..., nn.Module]] = {"Linear": _linear, **GRID_BUILDERS}
