"""What a real pipeline step measured: its timeline and its activation memory.

The executor fills a :class:`RunRecord` on every step a :class:`tessera.pipeline.PipelineRunner`
runs (kept in ``runner.last_run``). Its timeline uses the simulator's format
(:class:`tessera.pipeline.TimelineEvent`, seconds since the start of the step), so the measured
schedule can be drawn with :func:`tessera.pipeline.plot_timeline` next to
``simulate(...).timeline``. Each rank records only its own events; :func:`gather_timeline`
collects every pipeline rank's on every rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from tessera.context import ParallelMode
from tessera.pipeline.timeline import TimelineEvent

__all__ = ["RunRecord", "gather_timeline"]


@dataclass(frozen=True)
class RunRecord:
    """One pipeline rank's measurements of one step.

    Attributes:
        pipeline_rank: the rank that ran the step.
        timeline: one event per compute action, and one per communication action (the whole
            batch's duration, i.e. waiting included); empty unless the step was run with
            ``record_timeline=True``. Times are seconds since the step started; with more than
            one rank the ranks pass a barrier first, so their clocks start together.
        peak_live: the most (microbatch, chunk) activations held at once: from the start of F
            to the end of the last backward piece (B, or W when the backward is split).
        peak_activations: ``peak_live / num_chunks``, in whole-rank microbatches, the unit of
            ``simulate(...).peak_activations``.
        peak_activation_bytes: the most bytes of tensors saved for backward (parameters
            excluded, each storage counted once) held at once; 0 unless the step was run with
            ``track_memory=True``.
        exchanged_metadata: whether this step exchanged shapes (first step of an input shape).
    """

    pipeline_rank: int
    timeline: tuple[TimelineEvent, ...]
    peak_live: int
    peak_activations: float
    peak_activation_bytes: int
    exchanged_metadata: bool


def gather_timeline(record: RunRecord, context: Any, *, group: Any = None) -> list[TimelineEvent]:
    """Every pipeline rank's events, on every rank (an all-gather on the CPU group).

    Args:
        record: this rank's record (``runner.last_run``).
        context: the parallel context whose PIPELINE CPU group to use.
        group: a process group to use instead of the context's (then ``context`` may be None).

    Returns:
        All events, sorted by rank then start time.
    """
    pg = group if group is not None else context.get_cpu_group(ParallelMode.PIPELINE)
    size = dist.get_world_size(pg)
    gathered: list[Sequence[TimelineEvent] | None] = [None] * size
    dist.all_gather_object(gathered, list(record.timeline), group=pg)
    events = [event for part in gathered if part is not None for event in part]
    return sorted(events, key=lambda e: (e.rank, e.start, e.end))
