"""Fail fast across ranks: the Engine's steps run inside ``ParallelContext.guard``.

When one rank raises in a step, its error is posted to the context's failure board and the
other ranks, whose collectives then time out or lose their peer, raise
``tessera.context.RankFailedError`` naming that rank and the step it was in, instead of
hanging or reporting a bare gloo/NCCL timeout (see tessera-context's "Failures and
debugging"). Without a context (one process) the methods run unguarded.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

__all__ = ["guarded"]

F = TypeVar("F", bound=Callable[..., Any])


class _HasContext(Protocol):
    @property
    def context(self) -> Any: ...


def guarded(where: str) -> Callable[[F], F]:
    """Run a method of an object with a ``context`` property inside ``context.guard(where)``."""

    def decorate(method: F) -> F:
        @functools.wraps(method)
        def wrapper(self: _HasContext, *args: Any, **kwargs: Any) -> Any:
            context = self.context
            guard = getattr(context, "guard", None)
            if guard is None:
                return method(self, *args, **kwargs)
            with guard(where):
                return method(self, *args, **kwargs)

        return wrapper  # type: ignore[return-value]

    return decorate
