"""Finding the ParallelContext a component works in, and its groups, without forcing one.

Every engine component takes ``context=``; when it is ``None`` the launcher's current context
is used, and when there is none either the component runs as a single process (a plain
PyTorch job needs no tessera context).
"""

from __future__ import annotations

import torch.distributed as dist

from tessera.context import ModeLike, ParallelContext, ParallelMode, get_context, has_context

__all__ = ["group_if_parallel", "replica_mode", "resolve_context"]


def resolve_context(context: ParallelContext | None) -> ParallelContext | None:
    """``context`` if given, else the current context, else ``None`` (single process)."""
    if context is not None:
        return context
    if has_context():
        return get_context()
    return None


def group_if_parallel(context: ParallelContext | None, mode: ModeLike) -> dist.ProcessGroup | None:
    """The group of ``mode`` if it spans more than one rank, else ``None`` (nothing to reduce).

    A mode the context does not hold counts as size 1: e.g. SEQUENCE in a job without sequence
    parallelism.
    """
    if context is None or not context.is_initialized(mode):
        return None
    if context.get_world_size(mode) <= 1:
        return None
    return context.get_group(mode)


def replica_mode(context: ParallelContext) -> str:
    """The group over which a whole parameter is replicated.

    DATA, or the tensor mode's wider group where it names one and the context holds it
    (sequence parallelism: data x sequence ranks).
    """
    mode = context.config.mode
    wider = None if mode is None else mode.replica_group
    if wider is not None and context.is_initialized(wider):
        return wider
    return ParallelMode.DATA.value
