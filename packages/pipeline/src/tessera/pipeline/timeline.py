"""The timeline format shared by the simulator and by recorded runs.

One :class:`TimelineEvent` per action that took time on a rank. The simulator writes its ideal
schedule in this format and the executor records a measured run in the same format, so both can be
drawn by :func:`tessera.pipeline.plot_timeline` and compared side by side.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from tessera.pipeline.actions import Action

__all__ = ["TimelineEvent", "events_of_rank", "timeline_span"]


@dataclass(frozen=True)
class TimelineEvent:
    """One action on one pipeline rank, from ``start`` to ``end``.

    Attributes:
        start: when the action began. The simulator uses its cost units; a recorded run uses
            seconds since the start of the step. Only differences matter.
        end: when the action finished (``end >= start``).
        rank: the pipeline rank (not the global rank) that ran it.
        action: what ran; compute actions (F, B, W) always, communication actions where the
            recorder measured them (the simulator does not emit them: waiting shows as a gap).
    """

    start: float
    end: float
    rank: int
    action: Action

    def __post_init__(self) -> None:
        if self.end < self.start:
            raise ValueError(
                f"timeline event {self.action} on rank {self.rank} ends before it "
                f"starts ({self.end} < {self.start})"
            )

    @property
    def duration(self) -> float:
        """``end - start``."""
        return self.end - self.start


def events_of_rank(events: Iterable[TimelineEvent], rank: int) -> list[TimelineEvent]:
    """The events of one rank, sorted by start time."""
    return sorted((e for e in events if e.rank == rank), key=lambda e: (e.start, e.end))


def timeline_span(events: Iterable[TimelineEvent]) -> tuple[float, float]:
    """``(earliest start, latest end)`` over the events; ``(0.0, 0.0)`` when there are none."""
    starts_ends = [(e.start, e.end) for e in events]
    if not starts_ends:
        return 0.0, 0.0
    return min(s for s, _ in starts_ends), max(e for _, e in starts_ends)
