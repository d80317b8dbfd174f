"""A model of time for schedules: makespan, bubble, peak activations, and a timeline.

Each rank runs its list in order, one step at a time (:func:`tessera.pipeline.split_steps`):

- a compute action starts when the rank is free and its input is there, and lasts its cost.
  Costs are given per microbatch for a whole pipeline rank; an action on one of v chunks costs
  1/v of that, and a schedule that does not split the backward pays ``B + W`` for its B;
- a batch of sends and receives is posted when the rank reaches it and ends when all of its
  transfers have; a transfer takes ``comm`` once both ends are ready. With ``sends="eager"``
  (the default, the usual idealisation) a send never waits: the data leaves when the send is
  posted and arrives ``comm`` later. With ``sends="rendezvous"`` a send also waits for the
  matching receive to be posted, as a large NCCL send does.

So F of microbatch m on virtual stage s starts no earlier than F of m on s-1 ended plus ``comm``;
B of m on s no earlier than B of m on s+1 (or F of m, on the last virtual stage) plus ``comm``; W
after B of the same microbatch and chunk. If no rank can move while some still have work, the lists
deadlock and :class:`DeadlockError` names what each stuck rank waits for.

Closed forms (exact here with ``comm=0`` and any F, B, W costs that are equal on all ranks):
GPipe and 1F1B idle (p-1)/(m+p-1) of ``p * makespan``; interleaved (p-1)/(v*m+p-1); ZB-H1 idles
(p-1)(F+B-W) per rank where 1F1B idles (p-1)(F+B+W) (a third when F=B=W).

Activation memory: a microbatch's activations on a chunk are held from the start of its F until
its last backward piece ends: B when the backward is not split, W when it is (W still needs the
stage inputs; this is the ZB-H1 accounting of Qi et al. 2023). ``peak_activations`` counts them in
whole-rank microbatches, so one chunk of v counts 1/v. Forward-only lists hold nothing.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tessera.pipeline.actions import Action, ActionKind
from tessera.pipeline.dataflow import DataflowRun, SendMode
from tessera.pipeline.schedule import Schedule
from tessera.pipeline.timeline import TimelineEvent, events_of_rank

__all__ = ["DEFAULT_COSTS", "SimulationResult", "simulate", "simulate_table"]

DEFAULT_COSTS: Mapping[str, float] = {"F": 1.0, "B": 2.0, "W": 0.0}


@dataclass(frozen=True)
class SimulationResult:
    """What :func:`simulate` found.

    Attributes:
        num_stages: pipeline ranks simulated.
        makespan: time from the start until the last rank finishes.
        bubble_fraction: ``sum(idle_time) / (num_stages * makespan)``.
        idle_time: per rank, ``makespan`` minus the time spent computing (waits for data included).
        peak_activations: per rank, the most microbatches' activations held at once (a chunk of
            an interleaved schedule counts ``1 / num_chunks``).
        timeline: one :class:`TimelineEvent` per compute action, sorted by rank then start.
    """

    num_stages: int
    makespan: float
    bubble_fraction: float
    idle_time: tuple[float, ...]
    peak_activations: tuple[float, ...]
    timeline: tuple[TimelineEvent, ...]

    def events(self, rank: int) -> list[TimelineEvent]:
        """The timeline of one rank, in time order."""
        return events_of_rank(self.timeline, rank)


def _resolve_costs(costs: Mapping[str, float] | None) -> dict[str, float]:
    resolved = dict(DEFAULT_COSTS)
    for key, value in (costs or {}).items():
        if key not in resolved:
            raise ValueError(f"unknown cost key {key!r}; expected some of F, B, W")
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"cost {key}={value!r} must be finite and >= 0")
        resolved[key] = float(value)
    return resolved


def simulate(
    schedule: Schedule,
    num_stages: int,
    costs: Mapping[str, float] | None = None,
    comm: float = 0.0,
    *,
    sends: SendMode = "eager",
    forward_only: bool = False,
) -> SimulationResult:
    """Run ``schedule``'s action lists for all ``num_stages`` ranks on the model of time.

    Args:
        schedule: any :class:`Schedule`.
        num_stages: pipeline ranks.
        costs: per microbatch and whole rank, keys ``F``, ``B``, ``W``; missing keys default to
            ``F=1, B=2, W=0``.
        comm: time of one point-to-point transfer.
        sends: ``"eager"`` or ``"rendezvous"`` (see the module docstring).
        forward_only: simulate the evaluation lists (forwards only; nothing is held).

    Raises:
        ScheduleError: a rank's list is inconsistent; DeadlockError if the lists deadlock.
    """
    table = schedule.table(num_stages, forward_only=forward_only)
    table.check()
    return simulate_table(
        table.rows,
        num_chunks=schedule.num_chunks,
        splits_backward=schedule.splits_backward,
        costs=costs,
        comm=comm,
        sends=sends,
        forward_only=forward_only,
    )


def simulate_table(
    table: Sequence[Sequence[Action]],
    *,
    num_chunks: int = 1,
    splits_backward: bool = False,
    costs: Mapping[str, float] | None = None,
    comm: float = 0.0,
    sends: SendMode = "eager",
    forward_only: bool = False,
) -> SimulationResult:
    """Like :func:`simulate`, for explicit per-rank action lists (``table[rank]``).

    The lists are not checked with :func:`check_actions` first (so that hand-made tables can be
    studied); inconsistencies that stop the simulation still raise ``ScheduleError``.
    """
    if sends not in ("eager", "rendezvous"):
        raise ValueError(f"sends must be 'eager' or 'rendezvous', got {sends!r}")
    if not math.isfinite(comm) or comm < 0:
        raise ValueError(f"comm={comm!r} must be finite and >= 0")
    if not table:
        raise ValueError("the action table has no ranks")
    cost = _resolve_costs(costs)
    backward = cost["B"] if splits_backward else cost["B"] + cost["W"]
    run = DataflowRun(
        table,
        num_chunks=num_chunks,
        splits_backward=splits_backward,
        costs={
            ActionKind.F: cost["F"] / num_chunks,
            ActionKind.B: backward / num_chunks,
            ActionKind.W: cost["W"] / num_chunks,
        },
        comm=comm,
        sends=sends,
        hold_activations=not forward_only,
    )
    run.run()
    p = len(table)
    makespan = max(run.clock)
    idle = tuple(makespan - busy for busy in run.busy)
    bubble = sum(idle) / (p * makespan) if makespan > 0 else 0.0
    return SimulationResult(
        num_stages=p,
        makespan=makespan,
        bubble_fraction=bubble,
        idle_time=idle,
        peak_activations=tuple(n / num_chunks for n in run.peak),
        timeline=tuple(sorted(run.events, key=lambda e: (e.rank, e.start, e.end))),
    )
