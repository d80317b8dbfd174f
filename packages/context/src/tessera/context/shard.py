"""``ShardInfo``: how a parameter is split across ranks -- the contract between packages.

tessera-layers writes a ShardInfo on every parameter it shards; tessera-engine reads it for
gradient clipping (a norm over the split modes must be all-reduced, over replicated modes not;
``grad_norm``, which ``torch.nn.utils.clip_grad_norm_`` then uses too: ``torch_clipping``),
gradient handlers (partial gradients must be summed) and checkpoints (where the local block
sits in the full tensor), without knowing any layer class.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .modes import ModeLike, mode_key

__all__ = ["SHARD_INFO_ATTR", "ShardInfo", "get_shard_info", "set_shard_info"]

#: The attribute under which ``set_shard_info`` stores the description on a tensor.
SHARD_INFO_ATTR = "_tessera_shard_info"


def _ints(name: str, values: Sequence[int]) -> tuple[int, ...]:
    out = tuple(values)
    for v in out:
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"ShardInfo.{name} must hold non-negative ints, got {out}")
    return out


def _modes(name: str, values: Sequence[ModeLike]) -> tuple[str, ...]:
    if isinstance(values, str):
        raise ValueError(f"ShardInfo.{name} must be a sequence of modes, got the string {values!r}")
    out = tuple(mode_key(m) for m in values)
    if len(set(out)) != len(out):
        raise ValueError(f"ShardInfo.{name} lists a mode twice: {out}")
    return out


@dataclass(frozen=True)
class ShardInfo:
    """The placement of one rank's block of a parameter in the full (global) tensor.

    The local tensor is ``full[offsets[0] : offsets[0] + local_shape[0], ...]``.

    Attributes:
        global_shape: Shape of the full parameter, as the single-process model holds it.
        offsets: Start of the local block in each dimension.
        local_shape: Shape of the local block (the tensor this rank holds).
        split_modes: One tuple per dimension: the modes that dimension is split over,
            outermost first (the first mode's local rank varies slowest along the dimension).
            ``()`` for a dimension that is not split. E.g. a 2D linear weight
            ``[out/q, in/q]`` has ``(("parallel_2d_col",), ("parallel_2d_row",))``.
        replicated_modes: Modes over which the local block is identical on every rank of the
            group (e.g. a bias kept whole across a 1D group). DATA and PIPELINE are never
            listed: every parameter is replicated over DATA and lives on one pipeline stage.
        partial_grad_modes: A subset of ``replicated_modes`` over which each rank's gradient
            is only a partial sum that must be all-reduced (summed) before the optimizer step,
            e.g. a weight replicated over SEQUENCE while every rank saw a different slice
            of the sequence. Over the other replicated modes the gradients are already equal.

    Modes are stored as plain strings (``ParallelMode`` members are accepted and normalized).
    """

    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    local_shape: tuple[int, ...]
    split_modes: tuple[tuple[str, ...], ...] = ()
    replicated_modes: tuple[str, ...] = ()
    partial_grad_modes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "global_shape", _ints("global_shape", self.global_shape))
        set_(self, "offsets", _ints("offsets", self.offsets))
        set_(self, "local_shape", _ints("local_shape", self.local_shape))
        ndim = len(self.global_shape)
        split = tuple(self.split_modes) or ((),) * ndim
        set_(self, "split_modes", tuple(_modes("split_modes", dim) for dim in split))
        set_(self, "replicated_modes", _modes("replicated_modes", self.replicated_modes))
        set_(self, "partial_grad_modes", _modes("partial_grad_modes", self.partial_grad_modes))

        lengths = {
            "offsets": len(self.offsets),
            "local_shape": len(self.local_shape),
            "split_modes": len(self.split_modes),
        }
        for name, n in lengths.items():
            if n != ndim:
                raise ValueError(
                    f"ShardInfo.{name} has {n} entries but global_shape {self.global_shape} "
                    f"has {ndim} dimensions"
                )
        for dim in range(ndim):
            o, n, g = self.offsets[dim], self.local_shape[dim], self.global_shape[dim]
            if o + n > g:
                raise ValueError(
                    f"ShardInfo dim {dim}: offset {o} + local size {n} = {o + n} exceeds the "
                    f"global size {g}"
                )
            if not self.split_modes[dim] and (o, n) != (0, g):
                raise ValueError(
                    f"ShardInfo dim {dim} is split over no mode but holds [{o}, {o + n}) of "
                    f"{g}; name the modes it is split over in split_modes[{dim}]"
                )
        flat = [m for dim in self.split_modes for m in dim]
        if len(set(flat)) != len(flat):
            raise ValueError(f"ShardInfo.split_modes uses a mode for two dims: {self.split_modes}")
        both = set(flat) & set(self.replicated_modes)
        if both:
            raise ValueError(f"ShardInfo: modes {sorted(both)} are both split and replicated")
        extra = set(self.partial_grad_modes) - set(self.replicated_modes)
        if extra:
            raise ValueError(
                f"ShardInfo.partial_grad_modes {sorted(extra)} are not in replicated_modes "
                f"{self.replicated_modes}; a partial gradient is summed over ranks that hold "
                "the same block"
            )

    @classmethod
    def from_split(
        cls,
        global_shape: Sequence[int],
        splits: Mapping[int, Sequence[tuple[ModeLike, int, int]]],
        replicated_modes: Sequence[ModeLike] = (),
        partial_grad_modes: Sequence[ModeLike] = (),
    ) -> ShardInfo:
        """Describe an even split: ``splits[dim]`` lists ``(mode, local_rank, world_size)``.

        Modes of one dim are outermost first, so the block index along ``dim`` is the mixed
        radix number of the local ranks (e.g. 2.5D splits a dim over (DEP, COL): index
        ``dep * q + col`` of ``depth * q`` blocks).

        Raises:
            ValueError: a split dimension is not divisible by the product of its world sizes.
        """
        shape = tuple(global_shape)
        offsets = [0] * len(shape)
        local = list(shape)
        split_modes: list[tuple[str, ...]] = [()] * len(shape)
        for dim, parts in splits.items():
            if not 0 <= dim < len(shape):
                raise ValueError(f"split dim {dim} is outside global shape {shape}")
            index, count = 0, 1
            for _, rank, size in parts:
                if not 0 <= rank < size:
                    raise ValueError(f"local rank {rank} is outside group size {size}")
                index, count = index * size + rank, count * size
            if shape[dim] % count != 0:
                sizes = " * ".join(str(size) for _, _, size in parts)
                raise ValueError(
                    f"dim {dim} of size {shape[dim]} is not divisible into {sizes} = {count} "
                    "equal blocks"
                )
            local[dim] = shape[dim] // count
            offsets[dim] = index * local[dim]
            split_modes[dim] = tuple(mode_key(mode) for mode, _, _ in parts)
        return cls(
            global_shape=shape,
            offsets=tuple(offsets),
            local_shape=tuple(local),
            split_modes=tuple(split_modes),
            replicated_modes=tuple(mode_key(m) for m in replicated_modes),
            partial_grad_modes=tuple(mode_key(m) for m in partial_grad_modes),
        )

    @property
    def is_sharded(self) -> bool:
        """Whether any dimension is split (the local block is smaller than the full tensor)."""
        return any(self.split_modes)

    @property
    def split_dims(self) -> dict[int, tuple[str, ...]]:
        """The split dimensions only: ``{dim: modes}``."""
        return {dim: modes for dim, modes in enumerate(self.split_modes) if modes}

    @property
    def sharded_modes(self) -> tuple[str, ...]:
        """Every mode any dimension is split over (a norm must be summed over these)."""
        return tuple(m for dim in self.split_modes for m in dim)

    @property
    def slices(self) -> tuple[slice, ...]:
        """Index of the local block in the full tensor: ``full[info.slices]``."""
        return tuple(slice(o, o + n) for o, n in zip(self.offsets, self.local_shape, strict=True))

    @property
    def global_numel(self) -> int:
        """Number of elements of the full tensor."""
        return math.prod(self.global_shape)

    def to_dict(self) -> dict[str, Any]:
        """Plain lists and strings (for checkpoints saved with ``weights_only`` loading)."""
        return {
            "global_shape": list(self.global_shape),
            "offsets": list(self.offsets),
            "local_shape": list(self.local_shape),
            "split_modes": [list(m) for m in self.split_modes],
            "replicated_modes": list(self.replicated_modes),
            "partial_grad_modes": list(self.partial_grad_modes),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ShardInfo:
        """Inverse of ``to_dict``."""
        return cls(
            global_shape=tuple(data["global_shape"]),
            offsets=tuple(data["offsets"]),
            local_shape=tuple(data["local_shape"]),
            split_modes=tuple(tuple(m) for m in data["split_modes"]),
            replicated_modes=tuple(data["replicated_modes"]),
            partial_grad_modes=tuple(data["partial_grad_modes"]),
        )


def set_shard_info(tensor: torch.Tensor, info: ShardInfo) -> None:
    """Attach ``info`` to ``tensor`` (usually an ``nn.Parameter``).

    Raises:
        ValueError: the tensor's shape is not ``info.local_shape``.
    """
    if tuple(tensor.shape) != info.local_shape:
        raise ValueError(
            f"tensor of shape {tuple(tensor.shape)} cannot carry a ShardInfo whose local_shape "
            f"is {info.local_shape}"
        )
    setattr(tensor, SHARD_INFO_ATTR, info)
    if info.sharded_modes:  # torch's clip_grad_norm_ and DDP then know split parameters
        from .torch_clipping import guard_torch_clipping
        from .torch_ddp import guard_torch_ddp

        guard_torch_clipping()
        guard_torch_ddp()


def get_shard_info(tensor: torch.Tensor) -> ShardInfo | None:
    """The ShardInfo attached to ``tensor``, or ``None`` for a parameter nobody split."""
    info = getattr(tensor, SHARD_INFO_ATTR, None)
    return info if isinstance(info, ShardInfo) else None
