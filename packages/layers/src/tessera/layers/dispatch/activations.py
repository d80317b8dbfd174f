"""``split_activation`` / ``gather_activation``: full activations <-> local blocks.

The local block is what a tensor mode's layers take and return between each other.

Each mode registers one pair in ``SPLITTERS`` / ``GATHERERS``. 1D keeps activations between
blocks replicated, so both are the identity, unless 1D sequence parallelism is on
(``tensor=dict(mode="1d", sequence_parallel=True)``), where they split / gather dim 1
(``[batch, seq, hidden]``). 2D and 2.5D split the batch (dim 0) over the mesh's batch group
(``depth * q`` blocks) and the hidden dim (last) over the mesh row (``q`` blocks), see
``mesh/layout.py``. ``split_batch`` splits only the batch (token ids, targets, images): the identity
in 1D. Sizes are checked before any collective.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tessera.context import ParallelContext, ParallelMode

from ..comm.collectives import check_divisible
from ..comm.ops import gather_along_dim, split_along_dim
from ..cube.layout import (
    cube_of,
    gather_cube_activation,
    split_cube_activation,
    split_cube_batch,
)
from ..mesh.layout import gather_mesh_activation, mesh_of, split_mesh_activation, split_mesh_batch
from ..sequence.replicated import gather_sequence_activation, split_sequence_activation
from ..shared.context_access import current_or_none, sequence_parallel_default, tensor_mode
from ..shared.errors import ModeNotImplementedError

__all__ = [
    "BATCH_SPLITTERS",
    "GATHERERS",
    "SPLITTERS",
    "gather_activation",
    "split_activation",
    "split_batch",
]

ActivationMap = Callable[[torch.Tensor, ParallelContext], torch.Tensor]


def _sequence_dim(x: torch.Tensor, what: str) -> None:
    if x.dim() < 2:
        raise ValueError(
            f"{what}: 1D sequence parallelism splits dim 1 of [batch, seq, ...], but the "
            f"activation has shape {list(x.shape)}"
        )


def _split_1d(x: torch.Tensor, context: ParallelContext) -> torch.Tensor:
    if not sequence_parallel_default(context):
        return x
    _sequence_dim(x, "split_activation")
    world = context.get_world_size(ParallelMode.PARALLEL_1D)
    check_divisible(
        x.shape[1], world, f"split_activation: dim 1 (sequence) of activation {list(x.shape)}"
    )
    return split_along_dim(x, 1, context.get_group(ParallelMode.PARALLEL_1D))


def _gather_1d(x: torch.Tensor, context: ParallelContext) -> torch.Tensor:
    if not sequence_parallel_default(context):
        return x
    _sequence_dim(x, "gather_activation")
    return gather_along_dim(x, 1, context.get_group(ParallelMode.PARALLEL_1D))


def _split_mesh(x: torch.Tensor, context: ParallelContext) -> torch.Tensor:
    return split_mesh_activation(x, mesh_of(context, str(context.config.tensor_mode)))


def _gather_mesh(x: torch.Tensor, context: ParallelContext) -> torch.Tensor:
    return gather_mesh_activation(x, mesh_of(context, str(context.config.tensor_mode)))


def _split_batch_mesh(x: torch.Tensor, context: ParallelContext) -> torch.Tensor:
    return split_mesh_batch(x, mesh_of(context, str(context.config.tensor_mode)))


#: tensor mode -> full activation to local block.
SPLITTERS: dict[str, ActivationMap] = {"1d": _split_1d, "2d": _split_mesh, "2.5d": _split_mesh}
#: tensor mode -> local block to full activation (every rank gets it).
GATHERERS: dict[str, ActivationMap] = {
    "1d": _gather_1d,
    "2d": _gather_mesh,
    "2.5d": _gather_mesh,
}
#: tensor mode -> full batch ``[b, ...]`` (ids, targets, images) to this rank's rows.
BATCH_SPLITTERS: dict[str, ActivationMap] = {
    "1d": lambda x, context: x,
    "2d": _split_batch_mesh,
    "2.5d": _split_batch_mesh,
}

# 3D (cube/layout.py): layout "y": batch block z*q + x over PARALLEL_3D_OUTPUT_X_WEIGHT,
# hidden block y over PARALLEL_3D_INPUT (rank (x, y, z) holds [b/q^2, ..., h/q]); the batch
# alone for ids. Sequence (sequence/replicated.py): dim 1 split over SEQUENCE ([b, s/N, ...],
# chunk r on rank r), also for token ids and targets.
SPLITTERS["3d"] = lambda x, context: split_cube_activation(x, cube_of(context))
GATHERERS["3d"] = lambda x, context: gather_cube_activation(x, cube_of(context))
BATCH_SPLITTERS["3d"] = lambda x, context: split_cube_batch(x, cube_of(context))
SPLITTERS["sequence"] = split_sequence_activation
GATHERERS["sequence"] = gather_sequence_activation
BATCH_SPLITTERS["sequence"] = split_sequence_activation


def split_activation(x: torch.Tensor, context: ParallelContext | None = None) -> torch.Tensor:
    """Map a full activation ``[batch, ..., hidden]`` to this rank's block for the current mode.

    The backward is the adjoint (e.g. an all-gather of the block gradients).

    Raises:
        ValueError: a size is not divisible by what the mode splits it into (before any
            collective).
        ModeNotImplementedError: the mode has no layers yet.
    """
    ctx = current_or_none(context)
    mode = tensor_mode(ctx)
    if ctx is None or mode is None:
        return x
    if mode not in SPLITTERS:
        raise ModeNotImplementedError("split_activation", mode, SPLITTERS)
    return SPLITTERS[mode](x, ctx)


def gather_activation(
    x_local: torch.Tensor, context: ParallelContext | None = None
) -> torch.Tensor:
    """Inverse of :func:`split_activation`: every rank gets the full activation.

    Raises:
        ModeNotImplementedError: the mode has no layers yet.
    """
    ctx = current_or_none(context)
    mode = tensor_mode(ctx)
    if ctx is None or mode is None:
        return x_local
    if mode not in GATHERERS:
        raise ModeNotImplementedError("gather_activation", mode, GATHERERS)
    return GATHERERS[mode](x_local, ctx)


def split_batch(x: torch.Tensor, context: ParallelContext | None = None) -> torch.Tensor:
    """This rank's rows of a full batch ``[b, ...]`` (token ids, targets, images).

    The inputs of an embedding or patch embedding and the targets of a loss are split only
    along the batch: ``[b/(depth q), ...]`` in 2D/2.5D, whole in 1D (the identity).

    Raises:
        ValueError: the batch is not divisible by the number of batch blocks (before any
            collective).
        ModeNotImplementedError: the mode has no layers yet.
    """
    ctx = current_or_none(context)
    mode = tensor_mode(ctx)
    if ctx is None or mode is None:
        return x
    if mode not in BATCH_SPLITTERS:
        raise ModeNotImplementedError("split_batch", mode, BATCH_SPLITTERS)
    return BATCH_SPLITTERS[mode](x, ctx)
