"""Each rank's block of each tensor: the local data and where it sits in the full tensor.

This is the whole contract between a parallel layout and the checkpoint. A block is read from
``tessera.context.ShardInfo`` (global shape and offsets written by the layer that split the
parameter), from an FSDP2 ``DTensor`` (its chunk of the data-parallel shard), or from both when
FSDP2 shards a tensor-parallel block; a tensor with neither is whole on every rank. The engine
never needs to know which layer produced a split, so any layout that writes ShardInfo (1D,
2D, 2.5D, 3D, sequence) is saved and resharded the same way.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from tessera.context import get_shard_info

from .errors import CheckpointError

__all__ = [
    "Block",
    "block_of",
    "dtensor_type",
    "local_part",
    "model_tensors",
    "parameter_names",
    "unwrap_modules",
]


@dataclass(frozen=True)
class Block:
    """One rank's block of a tensor.

    ``local`` is ``full[offsets[0] : offsets[0] + local.shape[0], ...]`` of a tensor of
    ``global_shape`` (offsets all zero for a tensor that is whole on every rank).
    """

    local: torch.Tensor
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]

    @property
    def local_shape(self) -> tuple[int, ...]:
        """Shape of the local block."""
        return tuple(self.local.shape)


def dtensor_type() -> type | None:
    """Torch's ``DTensor`` class (``None`` on a torch built without distributed)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed
        return None
    return DTensor


def local_part(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (FSDP2), else the tensor itself (detached)."""
    dtensor = dtensor_type()
    if dtensor is not None and isinstance(t, dtensor):
        local = t.to_local()  # type: ignore[attr-defined]
        assert isinstance(local, torch.Tensor)
        return local.detach()
    return t.detach()


def block_of(name: str, t: torch.Tensor, shard_of: torch.Tensor | None = None) -> Block:
    """The block of ``t`` (a parameter, a buffer or an optimizer state like it).

    Args:
        name: For error messages.
        t: The tensor (plain or DTensor).
        shard_of: The parameter whose ShardInfo describes ``t`` (default: ``t`` itself).

    Raises:
        CheckpointError: the ShardInfo does not describe a tensor of ``t``'s shape.
    """
    info = get_shard_info(shard_of if shard_of is not None else t)
    dtensor = dtensor_type()
    if dtensor is not None and isinstance(t, dtensor):
        chunks = t.__create_chunk_list__()  # type: ignore[attr-defined]
        if len(chunks) != 1:
            raise CheckpointError(f"{name}: a DTensor with {len(chunks)} local chunks")
        inner_offsets = tuple(int(o) for o in chunks[0].offsets)
        inner_shape = tuple(int(s) for s in t.shape)
        local = local_part(t)
    else:
        local = t.detach()
        inner_offsets = (0,) * local.dim()
        inner_shape = tuple(local.shape)
    if info is None:
        return Block(local, inner_shape, inner_offsets)
    if inner_shape != info.local_shape:
        raise CheckpointError(
            f"{name}: tensor of shape {inner_shape} but its ShardInfo describes a local block "
            f"of shape {info.local_shape} (global {info.global_shape})"
        )
    offsets = tuple(o + i for o, i in zip(info.offsets, inner_offsets, strict=True))
    return Block(local, info.global_shape, offsets)


def unwrap_modules(model: nn.Module | Sequence[nn.Module]) -> list[nn.Module]:
    """The modules of ``model`` without DDP wrappers (their names are the full model's)."""
    modules = [model] if isinstance(model, nn.Module) else list(model)
    return [m.module if isinstance(m, nn.parallel.DistributedDataParallel) else m for m in modules]


def model_tensors(modules: Sequence[nn.Module]) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of every entry of the modules' state dicts (parameters kept as such).

    Raises:
        CheckpointError: a state-dict entry is not a tensor (``get_extra_state``).
    """
    for module in modules:
        for name, value in module.state_dict(keep_vars=True).items():
            if not isinstance(value, torch.Tensor):
                raise CheckpointError(
                    f"state-dict entry {name!r} of {type(module).__name__} is a "
                    f"{type(value).__name__}; checkpoints hold tensors only"
                )
            yield name, value


def parameter_names(modules: Sequence[nn.Module]) -> dict[int, tuple[str, nn.Parameter]]:
    """``id(parameter) -> (full-model name, parameter)`` (a tied parameter: its first name)."""
    names: dict[int, tuple[str, nn.Parameter]] = {}
    for module in modules:
        for name, p in module.named_parameters():
            names.setdefault(id(p), (name, p))
    return names
