"""A schedule as plain, immutable data: every pipeline rank's ordered actions for one step.

An :class:`ActionTable` is the whole of what a schedule decides. It is built from each rank's
compute order (F, B and W) by two rules that every schedule shares:

1. :func:`add_communication`: a receive goes right before the compute action that consumes it,
   a send right after the one that produces it. The send of one compute action and the receive
   of the next are then adjacent and form one batch: in the 1F1B steady state this yields
   exactly Megatron-LM's fused ``send_forward_recv_backward`` / ``send_backward_recv_forward``
   pairs (Narayanan et al. 2021).
2. :func:`tessera.pipeline.make_deadlock_free`: where that placement could deadlock on a backend
   whose sends wait for their receive (interleaved 1F1B), the receives that are needed move
   into earlier batches.

The table knows nothing of processes, tensors or time: the runner
(:class:`tessera.pipeline.PipelineRunner`) executes one rank's row, the simulator
(:func:`tessera.pipeline.simulate`) all rows on a model of time, and a test reads it as text.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from tessera.pipeline.actions import (
    Action,
    ActionKind,
    format_actions,
    split_steps,
    virtual_stage,
)
from tessera.pipeline.dataflow import make_deadlock_free
from tessera.pipeline.errors import ScheduleError

__all__ = ["ActionTable", "add_communication", "check_actions"]

#: One rank's actions cut into executor steps: a compute action alone, or a batch of transfers.
Steps = tuple[tuple[Action, ...], ...]


@dataclass(frozen=True)
class ActionTable:
    """Every pipeline rank's ordered action list for one step, communication included.

    Build one with :meth:`from_compute` (what every :class:`tessera.pipeline.Schedule` does) or
    directly from hand-written rows (checked with :meth:`check` when wanted).

    Attributes:
        rows: ``rows[rank]``, that rank's actions in order.
        num_microbatches: microbatches per step (m).
        num_chunks: model chunks per rank (1 unless interleaved).
        splits_backward: whether B is only the input gradient and W the weight gradient.
        forward_only: an evaluation table: forwards and their transfers only.
        steps: ``steps[rank]``, ``split_steps(rows[rank])``, computed once.
    """

    rows: tuple[tuple[Action, ...], ...]
    num_microbatches: int
    num_chunks: int = 1
    splits_backward: bool = False
    forward_only: bool = False
    steps: tuple[Steps, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        rows = tuple(tuple(row) for row in self.rows)
        if not rows:
            raise ValueError("an action table needs at least one rank's row")
        object.__setattr__(self, "rows", rows)
        object.__setattr__(self, "steps", tuple(tuple(split_steps(row)) for row in rows))

    @classmethod
    def from_compute(
        cls,
        compute: Sequence[Sequence[Action]],
        *,
        num_microbatches: int,
        num_chunks: int = 1,
        splits_backward: bool = False,
        forward_only: bool = False,
    ) -> ActionTable:
        """The table whose compute order on rank ``r`` is ``compute[r]``.

        Adds the transfers (:func:`add_communication`) and makes the rows deadlock-free for
        backends whose sends wait for their receive (:func:`make_deadlock_free`); with
        ``forward_only`` only the forwards of ``compute`` are kept.
        """
        num_stages = len(compute)
        rows = []
        for rank, order in enumerate(compute):
            if forward_only:
                order = [action for action in order if action.kind is ActionKind.F]
            rows.append(add_communication(order, rank, num_stages, num_chunks))
        free = make_deadlock_free(rows, num_chunks=num_chunks, splits_backward=splits_backward)
        return cls(
            tuple(tuple(row) for row in free),
            num_microbatches=num_microbatches,
            num_chunks=num_chunks,
            splits_backward=splits_backward,
            forward_only=forward_only,
        )

    @property
    def num_stages(self) -> int:
        """Pipeline ranks (p): the number of rows."""
        return len(self.rows)

    def row(self, pipeline_rank: int) -> tuple[Action, ...]:
        """The actions of ``pipeline_rank``.

        Raises:
            ValueError: the rank is outside ``[0, num_stages)``.
        """
        self._check_rank(pipeline_rank)
        return self.rows[pipeline_rank]

    def steps_of(self, pipeline_rank: int) -> Steps:
        """The actions of ``pipeline_rank`` cut into executor steps (see :func:`split_steps`)."""
        self._check_rank(pipeline_rank)
        return self.steps[pipeline_rank]

    def check(self) -> None:
        """Check every row with :func:`check_actions` (cross-rank deadlocks: ``simulate``).

        Raises:
            ScheduleError: naming the rank and the offending action.
        """
        for rank, row in enumerate(self.rows):
            check_actions(
                row,
                pipeline_rank=rank,
                num_stages=self.num_stages,
                num_microbatches=self.num_microbatches,
                num_chunks=self.num_chunks,
                splits_backward=self.splits_backward,
                forward_only=self.forward_only,
            )

    def format(self) -> str:
        """One line per rank, ``rank r: F0 SEND_F0 ...`` (see :func:`format_actions`)."""
        return "\n".join(f"rank {r}: {format_actions(row)}" for r, row in enumerate(self.rows))

    def _check_rank(self, pipeline_rank: int) -> None:
        if not 0 <= pipeline_rank < self.num_stages:
            raise ValueError(f"pipeline_rank {pipeline_rank} is outside [0, {self.num_stages})")


def add_communication(
    compute: Sequence[Action], pipeline_rank: int, num_stages: int, num_chunks: int = 1
) -> list[Action]:
    """Insert the sends and receives that a list of compute actions needs.

    ``RECV_F`` goes right before an F whose input comes from another rank, ``SEND_F`` right after
    an F whose output goes to another rank; ``RECV_B`` / ``SEND_B`` likewise around B. W moves no
    data. With one pipeline rank every hand-off is local and nothing is inserted.
    """
    last = num_stages * num_chunks - 1
    remote = num_stages > 1
    out: list[Action] = []
    for action in compute:
        v = virtual_stage(pipeline_rank, action.chunk, num_stages)
        m, c = action.microbatch, action.chunk
        if remote and action.kind is ActionKind.F and v > 0:
            out.append(Action(ActionKind.RECV_F, m, c))
        if remote and action.kind is ActionKind.B and v < last:
            out.append(Action(ActionKind.RECV_B, m, c))
        out.append(action)
        if remote and action.kind is ActionKind.F and v < last:
            out.append(Action(ActionKind.SEND_F, m, c))
        if remote and action.kind is ActionKind.B and v > 0:
            out.append(Action(ActionKind.SEND_B, m, c))
    return out


def check_actions(
    actions: Sequence[Action],
    *,
    pipeline_rank: int,
    num_stages: int,
    num_microbatches: int,
    num_chunks: int = 1,
    splits_backward: bool = False,
    forward_only: bool = False,
) -> None:
    """Check one rank's list: every (microbatch, chunk) has exactly one F, B (and W), in order.

    Also checks that each transfer crossing ranks has exactly one send or receive on this rank,
    and that no action names a microbatch or chunk out of range. Cross-rank consistency (a
    receive without its matching send, deadlocks) is what :func:`tessera.pipeline.simulate` finds.

    Raises:
        ScheduleError: naming the rank and the offending action.
    """
    where = f"rank {pipeline_rank} of {num_stages}"
    last = num_stages * num_chunks - 1
    seen: Counter[Action] = Counter()
    for action in actions:
        if action.microbatch >= num_microbatches or action.chunk >= num_chunks:
            raise ScheduleError(
                f"{where}: {action} is out of range (num_microbatches={num_microbatches}, "
                f"num_chunks={num_chunks})"
            )
        if action.kind is ActionKind.W and not splits_backward:
            raise ScheduleError(f"{where}: {action} in a schedule that does not split backward")
        if action.kind is ActionKind.B and seen[Action(ActionKind.F, *_key(action))] == 0:
            raise ScheduleError(f"{where}: {action} comes before its forward")
        if action.kind is ActionKind.W and seen[Action(ActionKind.B, *_key(action))] == 0:
            raise ScheduleError(f"{where}: {action} comes before its backward B")
        seen[action] += 1
    kinds = [ActionKind.F] if forward_only else [ActionKind.F, ActionKind.B]
    if splits_backward and not forward_only:
        kinds.append(ActionKind.W)
    for m in range(num_microbatches):
        for c in range(num_chunks):
            v = virtual_stage(pipeline_rank, c, num_stages)
            wanted = list(kinds)
            if num_stages > 1:
                if v > 0:
                    wanted.append(ActionKind.RECV_F)
                if v < last:
                    wanted.append(ActionKind.SEND_F)
                if not forward_only and v > 0:
                    wanted.append(ActionKind.SEND_B)
                if not forward_only and v < last:
                    wanted.append(ActionKind.RECV_B)
            for kind in ActionKind:
                count = seen[Action(kind, m, c)]
                expected = 1 if kind in wanted else 0
                if count != expected:
                    raise ScheduleError(
                        f"{where}: {Action(kind, m, c)} appears {count} times, expected "
                        f"{expected} (virtual stage {v} of {last + 1})"
                    )


def _key(action: Action) -> tuple[int, int]:
    return action.microbatch, action.chunk
