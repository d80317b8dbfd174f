"""``split_activation`` / ``gather_activation``: full activations <-> local blocks.

The local block is what a tensor mode's layers take and return between each other.

Each mode's folder registers its maps in a ``ModeLayers`` (shared/mode_layers.py;
``parallel_1d/mode.py``, ``mesh/mode.py``, ``cube/mode.py``, ``sequence/mode.py``), and a
mode of your own registers its own the same way. 1D keeps activations between blocks
replicated, so both are the identity, unless 1D sequence parallelism is on, where they split /
gather dim 1 (``[batch, seq, hidden]``). 2D and 2.5D split the batch (dim 0) over the mesh's
batch group (``depth * q`` blocks) and the hidden dim (last) over the mesh row (``q``
blocks). ``split_batch`` splits only the batch (token ids, targets, images): the identity in
1D. Sizes are checked before any collective.
"""

from __future__ import annotations

from typing import Any

import torch

from tessera.context import ParallelContext

from ..cube.mode import LAYERS_3D
from ..mesh.mode import LAYERS_2D, LAYERS_2P5D
from ..parallel_1d.mode import LAYERS_1D
from ..sequence.mode import LAYERS_SEQUENCE
from ..shared.context_access import current_or_none, tensor_mode
from ..shared.errors import ModeNotImplementedError
from ..shared.mode_layers import MODE_LAYERS, ModeLayers, find_mode_layers

__all__ = [
    "BUILTIN_MODE_LAYERS",
    "activation_as_dtensor",
    "activation_placements",
    "gather_activation",
    "split_activation",
    "split_batch",
]

#: tessera's own modes' layers, each registered by its folder's ``mode.py``.
BUILTIN_MODE_LAYERS: tuple[ModeLayers, ...] = (
    LAYERS_1D,
    LAYERS_2D,
    LAYERS_2P5D,
    LAYERS_3D,
    LAYERS_SEQUENCE,
)


def _mode_layers(
    what: str, context: ParallelContext | None
) -> tuple[ParallelContext, ModeLayers] | None:
    """The context and its mode's layers, ``None`` without tensor parallelism."""
    ctx = current_or_none(context)
    mode = tensor_mode(ctx)
    if ctx is None or mode is None:
        return None
    layers = find_mode_layers(mode)
    if layers is None:
        raise ModeNotImplementedError(what, mode, MODE_LAYERS)
    return ctx, layers


def split_activation(x: torch.Tensor, context: ParallelContext | None = None) -> torch.Tensor:
    """Map a full activation ``[batch, ..., hidden]`` to this rank's block for the current mode.

    The backward is the adjoint (e.g. an all-gather of the block gradients).

    Raises:
        ValueError: a size is not divisible by what the mode splits it into (before any
            collective).
        ModeNotImplementedError: the mode has no layers yet.
    """
    found = _mode_layers("split_activation", context)
    return x if found is None else found[1].split(x, found[0])


def gather_activation(
    x_local: torch.Tensor, context: ParallelContext | None = None
) -> torch.Tensor:
    """Inverse of :func:`split_activation`: every rank gets the full activation.

    Raises:
        ModeNotImplementedError: the mode has no layers yet.
    """
    found = _mode_layers("gather_activation", context)
    return x_local if found is None else found[1].gather(x_local, found[0])


def split_batch(x: torch.Tensor, context: ParallelContext | None = None) -> torch.Tensor:
    """This rank's rows of a full batch ``[b, ...]`` (token ids, targets, images).

    The inputs of an embedding or patch embedding and the targets of a loss are split only
    along the batch: ``[b/(depth q), ...]`` in 2D/2.5D, whole in 1D (the identity).

    Raises:
        ValueError: the batch is not divisible by the number of batch blocks (before any
            collective).
        ModeNotImplementedError: the mode has no layers yet.
    """
    found = _mode_layers("split_batch", context)
    return x if found is None else found[1].split_batch(x, found[0])


def activation_placements(ndim: int, context: ParallelContext | None = None) -> tuple[Any, ...]:
    """The DTensor placements of an ``ndim``-dim activation between blocks, on the mode's mesh.

    The layout :func:`split_activation` makes (``ModeLayers.activation_cuts``), one placement
    per axis of ``tessera.context.tensor_mesh_of``: 1D ``Replicate()`` (``Shard(1)`` with
    sequence parallelism), 2D ``Shard(0)`` on the row axis and ``Shard(ndim - 1)`` on the
    column axis, 3D layout "y" rows on the output and weight axes, features on the input axis,
    ``'sequence'`` ``Shard(1)``.

    Raises:
        ModeNotImplementedError: the mode's layers state no layout of their activations.
    """
    from tessera.context import cut_placements

    found = _mode_layers("activation_placements", context)
    if found is None:
        raise ValueError("activation_placements: no tensor mode, so no mesh to place on")
    ctx, layers = found
    if layers.activation_cuts is None:
        raise ModeNotImplementedError("activation_placements", layers.name, MODE_LAYERS)
    return cut_placements(layers.activation_cuts(ctx, ndim), ndim, ctx)


def activation_as_dtensor(x_local: torch.Tensor, context: ParallelContext | None = None) -> Any:
    """This rank's block of an activation (as :func:`split_activation` gives it) as a ``DTensor``.

    Code a plan leaves out can then compute on it under DTensor's own propagation, which
    redistributes where an operator needs another layout (a norm over the split features, a
    reshape of the heads) instead of reading a block as the whole; ``full_tensor()`` is
    :func:`gather_activation`'s result. The blocks must be equal in size (tessera's are).
    """
    from torch.distributed.tensor import DTensor

    from tessera.context import tensor_mesh_of

    ctx = current_or_none(context)
    if ctx is None:
        raise ValueError("activation_as_dtensor: no tensor mode, so no mesh to place on")
    placements = activation_placements(x_local.dim(), ctx)
    return DTensor.from_local(x_local, tensor_mesh_of(ctx), placements, run_check=False)
