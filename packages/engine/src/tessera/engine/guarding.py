"""Fail fast across ranks: the Engine's steps run inside ``ParallelContext.guard``.

When one rank raises in a step, its error is posted to the context's failure board and the
other ranks, whose collectives then time out or lose their peer, raise
``tessera.context.RankFailedError`` naming that rank and the step it was in, instead of
hanging or reporting a bare gloo/NCCL timeout (see tessera-context's "Failures and
debugging"). Without a context (one process) the methods run unguarded.

Guards also mark progress (entering and leaving), and :func:`marking_reads` marks every batch
the engine reads, so a rank whose training thread is blocked (a read hung on a dead file
server, whose heartbeat still beats) is named by the others after the context's
``progress_timeout`` (see tessera-context's ``FailureMonitor``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any, Protocol, TypeVar

__all__ = ["guarded", "marking_reads"]

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


class _MarkingReads:
    """``data_iter``, marking one unit of progress after each batch it yields."""

    def __init__(self, data_iter: Iterator[Any], mark: Callable[[], None]) -> None:
        self._inner = data_iter
        self._mark = mark

    def __iter__(self) -> _MarkingReads:
        return self

    def __next__(self) -> Any:
        batch = next(self._inner)
        self._mark()  # past the read: a rank still in it is now behind this one
        return batch


def marking_reads(data_iter: Iterator[Any], context: Any) -> Iterator[Any]:
    """``data_iter`` whose reads count as progress marks of ``context`` (if it marks)."""
    mark = getattr(context, "mark_progress", None)
    return data_iter if mark is None else _MarkingReads(data_iter, mark)
