"""Finding the ParallelContext a component works in, and its groups, without forcing one.

Every engine component takes ``context=``; when it is ``None`` the launcher's current context
is used, and when there is none either the component runs as a single process (a plain
PyTorch job needs no tessera context).
"""

from __future__ import annotations

from tessera.context import ParallelContext, ParallelMode, group_if_parallel, resolve_context

__all__ = ["group_if_parallel", "replica_mode", "resolve_context"]


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
