"""Exceptions of tessera-pipeline."""

from __future__ import annotations

__all__ = ["ScheduleError", "DeadlockError"]


class ScheduleError(ValueError):
    """An action list is inconsistent: a missing, repeated or misordered action."""


class DeadlockError(ScheduleError):
    """No rank can make progress although some still have actions left."""
