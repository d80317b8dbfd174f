"""Creating sharded parameters and describing them with ``ShardInfo``.

Every tensor-parallel mode describes a parameter the same way: for each dimension, the modes
it is split over (outermost first); the modes it is replicated over. ``shard_info`` turns that
into a ``tessera.context.ShardInfo`` for this rank, and ``new_parameter`` draws the full
tensor, keeps this rank's block and attaches the description. ``state/state_dict.py`` reads only
the description, so 2D, 2.5D and 3D layers get full state dicts without code of their own.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn

from tessera.context import ModeLike, ParallelContext, ShardInfo, set_shard_info

from ..comm.collectives import check_divisible
from .initializers import Initializer

__all__ = ["new_parameter", "shard_info"]


def shard_info(
    context: ParallelContext,
    global_shape: Sequence[int],
    splits: Mapping[int, Sequence[ModeLike]] | None = None,
    replicated: Sequence[ModeLike] = (),
    partial_grad: Sequence[ModeLike] = (),
    *,
    owner: str = "parameter",
) -> ShardInfo:
    """This rank's ShardInfo for a parameter of ``global_shape``.

    Args:
        context: Supplies each mode's local rank and world size.
        global_shape: The full parameter's shape (the single-process model's).
        splits: ``{dim: (mode, ...)}``: the modes each split dim is divided over, outermost
            first (the block index is the mixed-radix number of the local ranks).
        replicated: Modes over which this rank's block is identical on every rank.
        partial_grad: Subset of ``replicated`` whose ranks hold partial gradients.
        owner: Names the parameter in error messages, e.g. ``"Linear1DCol.weight"``.

    Raises:
        ValueError: a split dim is not divisible by the product of its modes' sizes.
    """
    shape = tuple(int(s) for s in global_shape)
    table: dict[int, list[tuple[ModeLike, int, int]]] = {}
    for dim, modes in (splits or {}).items():
        parts = [(m, context.get_local_rank(m), context.get_world_size(m)) for m in modes]
        count = 1
        for _, _, size in parts:
            count *= size
        names = " * ".join(f"{m} ({size})" for m, _, size in parts)
        check_divisible(
            shape[dim], count, f"{owner}: dim {dim} of {list(shape)} split over {names}"
        )
        table[dim] = parts
    return ShardInfo.from_split(shape, table, replicated, partial_grad)


def new_parameter(
    info: ShardInfo,
    initializer: Initializer,
    *,
    fan_in: int,
    fan_out: int,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> nn.Parameter:
    """Draw the full tensor with ``initializer``, keep this rank's block, attach ``info``.

    Drawing the full tensor costs one full-size temporary per parameter at construction, and
    buys initial values identical to the single-process model's for any split.
    """
    full = torch.empty(info.global_shape, dtype=dtype, device=device)
    with torch.no_grad():
        initializer(full, fan_in, fan_out)
    param = nn.Parameter(full[info.slices].clone())
    set_shard_info(param, info)
    return param
