"""The little that layers read from a ParallelContext: which context, and a mode's group.

Layers resolve their context once, at construction (``context=`` or the current one), and keep
a :class:`GroupInfo` per mode they communicate over, so ``forward`` does no lookups.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from tessera.context import ModeLike, ParallelContext, get_context, has_context

__all__ = [
    "GroupInfo",
    "current_or_none",
    "group_info",
    "resolve_context",
    "sequence_parallel_default",
    "tensor_mode",
]


@dataclass(frozen=True)
class GroupInfo:
    """One mode's process group as seen from this rank.

    Attributes:
        mode: The mode's name.
        group: The process group.
        rank: This rank's index in the group.
        world_size: The number of ranks in the group.
    """

    mode: str
    group: dist.ProcessGroup
    rank: int
    world_size: int


def resolve_context(context: ParallelContext | None) -> ParallelContext:
    """``context`` if given, else the current context (``RuntimeError`` if none is current)."""
    return context if context is not None else get_context()


def current_or_none(context: ParallelContext | None) -> ParallelContext | None:
    """``context`` if given, else the current context, else ``None`` (no parallelism at all)."""
    if context is not None:
        return context
    return get_context() if has_context() else None


def group_info(context: ParallelContext, mode: ModeLike) -> GroupInfo:
    """This rank's view of ``mode``'s group in ``context``."""
    return GroupInfo(
        mode=str(mode),
        group=context.get_group(mode),
        rank=context.get_local_rank(mode),
        world_size=context.get_world_size(mode),
    )


def tensor_mode(context: ParallelContext | None) -> str | None:
    """The tensor mode of ``context`` (``None`` without a context or tensor parallelism)."""
    if context is None:
        return None
    return context.config.tensor_mode


def sequence_parallel_default(context: ParallelContext | None) -> bool:
    """Whether the config says ``tensor=dict(..., sequence_parallel=True)``."""
    if context is None:
        return False
    return bool(context.config.tensor_args.get("sequence_parallel", False))
