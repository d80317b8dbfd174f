"""Wall-clock timers for the phases of a training step (forward, step, an epoch...).

On CUDA a kernel is only queued when Python returns, so a timer that should measure the work
rather than the launch synchronizes the device at start and stop (``synchronize=True``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

__all__ = ["MultiTimer", "Timer"]


def _cuda_in_use() -> bool:
    """Whether this process has initialized CUDA (so there may be queued work or memory)."""
    is_initialized: Any = torch.cuda.is_initialized
    return bool(torch.cuda.is_available() and is_initialized())


def _sync() -> None:
    if _cuda_in_use():
        torch.cuda.synchronize()


class Timer:
    """One stopwatch that accumulates the time between ``start`` and ``stop`` calls.

    Args:
        synchronize: Wait for queued CUDA work at start and stop, so the interval measures it.
    """

    def __init__(self, synchronize: bool = True) -> None:
        self._synchronize = synchronize
        self._started: float | None = None
        self._elapsed = 0.0
        self._last = 0.0
        self._count = 0

    @property
    def is_running(self) -> bool:
        """Whether ``start`` was called without a matching ``stop``."""
        return self._started is not None

    @property
    def count(self) -> int:
        """How many intervals were measured since the last reset."""
        return self._count

    @property
    def last(self) -> float:
        """Seconds of the last finished interval."""
        return self._last

    def start(self) -> None:
        """Start an interval.

        Raises:
            RuntimeError: the timer is already running.
        """
        if self._started is not None:
            raise RuntimeError("Timer.start() called twice without stop()")
        if self._synchronize:
            _sync()
        self._started = time.perf_counter()

    def stop(self) -> float:
        """Finish the interval and return its length in seconds.

        Raises:
            RuntimeError: the timer is not running.
        """
        if self._started is None:
            raise RuntimeError("Timer.stop() called without start()")
        if self._synchronize:
            _sync()
        self._last = time.perf_counter() - self._started
        self._started = None
        self._elapsed += self._last
        self._count += 1
        return self._last

    def elapsed(self, reset: bool = False) -> float:
        """Total seconds over every finished interval (and the running one, so far)."""
        total = self._elapsed
        if self._started is not None:
            total += time.perf_counter() - self._started
        if reset:
            self.reset()
        return total

    def mean(self) -> float:
        """Mean seconds per finished interval (0.0 before the first)."""
        return self._elapsed / self._count if self._count else 0.0

    def reset(self) -> None:
        """Forget every interval (a running one is stopped and dropped)."""
        self._started = None
        self._elapsed = 0.0
        self._last = 0.0
        self._count = 0


class MultiTimer:
    """A set of named ``Timer`` objects, created on first use.

    ``with timers.time("forward"): ...`` measures one interval. A disabled MultiTimer
    (``enabled=False``) measures nothing and costs one attribute lookup per call, so a training
    loop can keep its timing code in place.

    Args:
        enabled: Measure at all.
        synchronize: Passed to every Timer.
    """

    def __init__(self, enabled: bool = True, synchronize: bool = True) -> None:
        self.enabled = enabled
        self._synchronize = synchronize
        self._timers: dict[str, Timer] = {}

    def get(self, name: str) -> Timer:
        """The timer called ``name`` (created if new)."""
        timer = self._timers.get(name)
        if timer is None:
            timer = self._timers[name] = Timer(self._synchronize)
        return timer

    def __contains__(self, name: object) -> bool:
        return name in self._timers

    def names(self) -> list[str]:
        """Names of the timers created so far, sorted."""
        return sorted(self._timers)

    def start(self, name: str) -> None:
        """Start the timer ``name`` (if enabled)."""
        if self.enabled:
            self.get(name).start()

    def stop(self, name: str) -> float:
        """Stop the timer ``name`` and return the interval (0.0 when disabled)."""
        if not self.enabled:
            return 0.0
        return self.get(name).stop()

    @contextmanager
    def time(self, name: str) -> Iterator[None]:
        """Measure the body of a ``with`` block with the timer ``name``."""
        self.start(name)
        try:
            yield
        finally:
            if self.enabled and self.get(name).is_running:
                self.stop(name)

    def reset(self, name: str | None = None) -> None:
        """Reset one timer, or all of them."""
        targets = [self._timers[name]] if name in self._timers else []
        if name is None:
            targets = list(self._timers.values())
        for timer in targets:
            timer.reset()

    def summary(self) -> dict[str, float]:
        """``{name: total seconds}`` of every timer."""
        return {name: timer.elapsed() for name, timer in sorted(self._timers.items())}
