"""``split_activation`` / ``gather_activation``: full activations <-> local blocks.

The local block is what a tensor mode's layers take and return between each other.

Each mode registers one pair in ``SPLITTERS`` / ``GATHERERS``. 1D keeps activations between
blocks replicated, so both are the identity, unless 1D sequence parallelism is on
(``tensor=dict(mode="1d", sequence_parallel=True)``), where they split / gather dim 1
(``[batch, seq, hidden]``). Sizes are checked before any collective.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tessera.context import ParallelContext, ParallelMode

from .collectives import check_divisible
from .comm import gather_along_dim, split_along_dim
from .context_access import current_or_none, sequence_parallel_default, tensor_mode
from .errors import ModeNotImplementedError

__all__ = ["GATHERERS", "SPLITTERS", "gather_activation", "split_activation"]

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


#: tensor mode -> full activation to local block.
SPLITTERS: dict[str, ActivationMap] = {"1d": _split_1d}
#: tensor mode -> local block to full activation (every rank gets it).
GATHERERS: dict[str, ActivationMap] = {"1d": _gather_1d}


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
