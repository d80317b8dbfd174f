"""The ``[out, in]`` weight and ``[out]`` bias of every parallel linear layer and classifier.

The 1D, 2D, 2.5D and 3D linear layers and classifier heads differ in how they split these
parameters and how they multiply, not in how the parameters are made: torch's ``nn.Linear``
initialization by default (Kaiming-uniform weight, ``U(-1/sqrt(in), 1/sqrt(in))`` bias, both
from the *full* fan-in), and a classifier weight may instead be shared with (tied to) the
matching embedding's table, which must then hold exactly the block this layer would hold.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn

from tessera.context import ModeLike, ShardInfo, get_shard_info

from .base import ParallelModule
from .initializers import Initializer, fan_in_uniform, kaiming_uniform
from .shards import shard_info

__all__ = ["check_shared_weight", "dense_bias", "dense_weight"]


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
) -> nn.Parameter:
    """``module``'s ``weight`` ``[out, in]``: ``shared`` (checked block by block) or a new one.

    A new weight is registered on ``module`` and filled by ``initializer`` (default
    Kaiming-uniform, torch's); the caller assigns the result to ``module.weight``.
    """
    owner = type(module).__name__
    shape = (out_features, in_features)
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
) -> nn.Parameter | None:
    """``module``'s ``bias`` ``[out]`` (torch's fan-in uniform by default), ``None`` without."""
    if not bias:
        return None
    return module.make_parameter(
        "bias",
        (out_features,),
        initializer or fan_in_uniform(),
        fan_in=in_features,
        fan_out=out_features,
        splits=splits,
        replicated=replicated,
        dtype=dtype,
    )
