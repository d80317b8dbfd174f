"""The current ParallelContext: the one piece of module-level mutable state in tessera.

A launcher installs the context it builds here, like torch's default process group; every
tessera component takes an optional ``context=`` that overrides it, so two contexts can live in
one process. :func:`no_context` hides the current context for a ``with`` block, so that what
is built inside it (a plain reference model, say) sees no parallelism at all.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .context import ParallelContext

__all__ = ["get_context", "has_context", "no_context", "set_context"]

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


@contextmanager
def no_context() -> Iterator[None]:
    """Hide the current context for the ``with`` block; the previous one returns at its end.

    A dispatching layer built without ``context=`` follows the current context, so after a
    launcher ran, ``Linear(..., parallel="col")`` is a tensor-parallel layer. Inside this block
    no context is current (``has_context()`` is false): the dispatching layers build plain
    torch modules, which is how to build a single-process reference model, or a model to load
    a full checkpoint into, while a context is current. Nothing is destroyed; the context's
    process groups stay usable, and ``context=ctx`` still reaches it explicitly.

    The pointer is process-wide, like torch's default process group (not per thread). On exit,
    also on an exception, the context that was current before the block is current again,
    whatever was made current inside it.

    Example::

        ctx = launch_from_torch(config)
        with no_context():
            reference = MyModel()  # plain torch layers
        model = MyModel()  # tensor-parallel under ctx
    """
    previous = set_context(None)
    try:
        yield
    finally:
        set_context(previous)
