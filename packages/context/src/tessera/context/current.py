"""The current ParallelContext: the one piece of module-level mutable state in tessera.

A launcher installs the context it builds here, like torch's default process group; every
tessera component takes an optional ``context=`` that overrides it, so two contexts can live in
one process.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .context import ParallelContext

__all__ = ["get_context", "has_context", "set_context"]

_current: ParallelContext | None = None


def get_context() -> ParallelContext:
    """Return the current context.

    Raises:
        RuntimeError: no context is current (no launcher ran, or it was destroyed).
    """
    if _current is None:
        raise RuntimeError(
            "no current ParallelContext: call tessera.context.launch(...) (or launch_from_torch, "
            "launch_from_slurm, launch_from_openmpi), or set_context(create_context(...)), or "
            "pass context= explicitly"
        )
    return _current


def has_context() -> bool:
    """Whether a context is current."""
    return _current is not None


def set_context(context: ParallelContext | None) -> ParallelContext | None:
    """Make ``context`` current (``None`` clears it); returns the previous one."""
    global _current
    previous, _current = _current, context
    return previous
