"""The dataflow run behind the simulator, and the pass that makes action lists deadlock-free.

Each rank's list is cut into steps (:func:`tessera.pipeline.split_steps`); a
:class:`DataflowRun` evaluates them as a max-plus dataflow system, so the order in which ranks
are visited never changes a result. See :mod:`tessera.pipeline.simulator` for the model of time.

Deadlock freedom (:func:`make_deadlock_free`). With NCCL a send may wait until its receive is
posted, and point-to-point operations on one communicator run in order, so a rank blocked in a
batch that sends to a peer blocked in a batch that sends back deadlocks although the data
dependencies are fine. (Under "eager" sends, which never wait, this cannot happen.) The pass runs
the lists with every send waiting for its receive; whenever the ranks get stuck, each blocked
send's receive is moved from later in the receiving rank's list into the batch that rank is
blocked in. A receive posted earlier is always correct (the tensor lands in a buffer until its
consumer runs), and once every blocked send is matched the lists advance exactly as with eager
sends, so the pass ends. Megatron-LM's interleaved schedule fuses its receives into earlier
batches for the same reason (Narayanan et al. 2021).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal

from tessera.pipeline.actions import (
    Action,
    ActionKind,
    peer_rank,
    split_steps,
    stage_of,
    virtual_stage,
)
from tessera.pipeline.errors import DeadlockError, ScheduleError
from tessera.pipeline.timeline import TimelineEvent

__all__ = ["DataflowRun", "SendMode", "make_deadlock_free"]

SendMode = Literal["eager", "rendezvous"]


# A message between ranks: (direction "F" or "B", microbatch, virtual stage that produced it).
_Message = tuple[str, int, int]


class DataflowRun:
    """Runs per-rank action lists on the model of time (one use: call :meth:`run` once).

    Args:
        table: ``table[rank]`` is that rank's ordered action list.
        num_chunks: model chunks per rank.
        splits_backward: whether B and W are separate (else B is the full backward).
        costs: duration of F, B and W on one chunk (already divided by the chunk count; B
            already includes W when the backward is not split).
        comm: duration of one transfer.
        sends: ``"eager"`` or ``"rendezvous"``.
        hold_activations: count activations (False for forward-only lists).
        repair: when stuck, move receives earlier instead of failing (needs rendezvous).
    """

    def __init__(
        self,
        table: Sequence[Sequence[Action]],
        *,
        num_chunks: int,
        splits_backward: bool,
        costs: Mapping[ActionKind, float],
        comm: float,
        sends: SendMode,
        hold_activations: bool = True,
        repair: bool = False,
    ) -> None:
        self.p = len(table)
        self.v = num_chunks
        self.last = self.p * num_chunks - 1
        self.split = splits_backward
        self.hold = hold_activations
        self.cost = dict(costs)
        self.comm = comm
        self.rendezvous = sends == "rendezvous"
        self.repair = repair
        self.steps = [[list(step) for step in split_steps(actions)] for actions in table]
        self.pos = [0] * self.p
        self.clock = [0.0] * self.p
        self.posted_at: list[float | None] = [None] * self.p
        self.done: dict[tuple[int, Action], float] = {}
        # (rank, direction, microbatch, consuming virtual stage) -> when the input is there.
        self.ready: dict[tuple[int, str, int, int], float] = {}
        self.send_post: dict[_Message, tuple[int, float]] = {}
        self.recv_post: dict[_Message, tuple[int, float]] = {}
        self.held = [0] * self.p
        self.peak = [0] * self.p
        self.busy = [0.0] * self.p
        self.events: list[TimelineEvent] = []

    def run(self) -> None:
        """Evaluate every list to its end; raises DeadlockError or ScheduleError."""
        while True:
            self._run_until_stuck()
            stuck = [r for r in range(self.p) if self.pos[r] < len(self.steps[r])]
            if not stuck:
                break
            if not (self.repair and self._hoist_receives(stuck)):
                raise DeadlockError(
                    "the action lists deadlock: " + "; ".join(self._waiting(r) for r in stuck)
                )
        self._check_all_matched()

    def table(self) -> list[list[Action]]:
        """The per-rank lists as they now stand (with any receives moved by the repair)."""
        return [[a for step in steps for a in step] for steps in self.steps]

    def _run_until_stuck(self) -> None:
        progress = True
        while progress:
            progress = False
            for rank in range(self.p):
                while self.pos[rank] < len(self.steps[rank]):
                    moved, finished = self._advance(rank)
                    progress = progress or moved
                    if not finished:
                        break

    # -- one step ---------------------------------------------------------------------------

    def _advance(self, rank: int) -> tuple[bool, bool]:
        """Try the rank's current step: returns (state changed, step finished)."""
        step = self.steps[rank][self.pos[rank]]
        if step[0].kind.is_compute:
            self._compute(rank, step[0])
            self.pos[rank] += 1
            return True, True
        newly_posted = False
        if self.posted_at[rank] is None:
            self._post(rank, step)
            newly_posted = True
        end = self._try_complete(rank, step)
        if end is None:
            return newly_posted, False
        self.clock[rank] = end
        self.posted_at[rank] = None
        self.pos[rank] += 1
        return True, True

    def _stage(self, rank: int, action: Action) -> int:
        if action.chunk >= self.v:
            raise ScheduleError(f"rank {rank}: {action} names chunk {action.chunk} of {self.v}")
        return virtual_stage(rank, action.chunk, self.p)

    def _compute(self, rank: int, action: Action) -> None:
        v = self._stage(rank, action)
        m = action.microbatch
        kind = action.kind
        if kind is ActionKind.F:
            needed = 0.0 if v == 0 else self._input(rank, action, ("F", m, v))
        elif kind is ActionKind.B:
            forward = self.done.get((rank, Action(ActionKind.F, m, action.chunk)))
            if forward is None:
                raise ScheduleError(f"rank {rank}: {action} runs before its forward")
            needed = forward if v == self.last else self._input(rank, action, ("B", m, v))
        else:
            if not self.split:
                raise ScheduleError(f"rank {rank}: {action} in a schedule without split backward")
            backward = self.done.get((rank, Action(ActionKind.B, m, action.chunk)))
            if backward is None:
                raise ScheduleError(f"rank {rank}: {action} runs before its B")
            needed = backward
        if (rank, action) in self.done:
            raise ScheduleError(f"rank {rank}: {action} appears twice")
        start = max(self.clock[rank], needed)
        end = start + self.cost[kind]
        self.done[(rank, action)] = end
        self.clock[rank] = end
        self.busy[rank] += end - start
        self.events.append(TimelineEvent(start, end, rank, action))
        local = self.p == 1  # with one rank every hand-off between chunks stays on the rank
        if kind is ActionKind.F and local and v < self.last:
            self.ready[(rank, "F", m, v + 1)] = end
        if kind is ActionKind.B and local and v > 0:
            self.ready[(rank, "B", m, v - 1)] = end
        if self.hold:
            frees = ActionKind.W if self.split else ActionKind.B
            if kind is ActionKind.F:
                self.held[rank] += 1
                self.peak[rank] = max(self.peak[rank], self.held[rank])
            elif kind is frees:
                self.held[rank] -= 1

    def _input(self, rank: int, action: Action, key: tuple[str, int, int]) -> float:
        direction, m, v = key
        when = self.ready.get((rank, direction, m, v))
        if when is None:
            source = "the local chunk" if self.p == 1 else f"RECV_{direction}{m}"
            raise ScheduleError(
                f"rank {rank}: {action} (virtual stage {v}) runs before its input arrived; "
                f"expected it from {source} earlier in the list"
            )
        return when

    def _message(self, rank: int, action: Action) -> _Message:
        """The message a communication action sends or receives."""
        v = self._stage(rank, action)
        m = action.microbatch
        kind = action.kind
        if self.p == 1:
            raise ScheduleError(
                f"rank {rank}: {action} with one pipeline rank (hand-offs are local)"
            )
        if kind in (ActionKind.SEND_F, ActionKind.RECV_B) and v == self.last:
            raise ScheduleError(f"rank {rank}: {action} on the last virtual stage {v}")
        if kind in (ActionKind.RECV_F, ActionKind.SEND_B) and v == 0:
            raise ScheduleError(f"rank {rank}: {action} on the first virtual stage")
        if kind is ActionKind.SEND_F:
            return ("F", m, v)
        if kind is ActionKind.RECV_F:
            return ("F", m, v - 1)
        if kind is ActionKind.SEND_B:
            return ("B", m, v)
        return ("B", m, v + 1)

    def _post(self, rank: int, step: Sequence[Action]) -> None:
        now = self.clock[rank]
        for action in step:
            self._post_one(rank, action, now)
        self.posted_at[rank] = now

    def _post_one(self, rank: int, action: Action, now: float) -> None:
        message = self._message(rank, action)
        if action.kind.is_send:
            produced_by = Action(
                ActionKind.F if action.kind is ActionKind.SEND_F else ActionKind.B,
                action.microbatch,
                action.chunk,
            )
            if (rank, produced_by) not in self.done:
                raise ScheduleError(f"rank {rank}: {action} comes before {produced_by}")
            book = self.send_post
        else:
            book = self.recv_post
        if message in book:
            raise ScheduleError(f"rank {rank}: {action} appears twice")
        book[message] = (rank, now)

    def _try_complete(self, rank: int, step: Sequence[Action]) -> float | None:
        posted = self.posted_at[rank]
        assert posted is not None
        end = posted
        arrivals: list[tuple[int, str, int, int]] = []
        for action in step:
            message = self._message(rank, action)
            if action.kind.is_recv:
                other = self.send_post.get(message)
                if other is None:
                    return None
                if self.rendezvous:
                    finish = max(posted, other[1]) + self.comm
                else:
                    finish = max(posted, other[1] + self.comm)
                direction, m, producer = message
                consumer_stage = producer + 1 if direction == "F" else producer - 1
                arrivals.append((rank, direction, m, consumer_stage))
            elif self.rendezvous:
                other = self.recv_post.get(message)
                if other is None:
                    return None
                finish = max(posted, other[1]) + self.comm
            else:
                finish = posted
            end = max(end, finish)
        for key in arrivals:
            self.ready[key] = end  # a batch is waited on as a whole
        return end

    # -- repair and diagnostics -------------------------------------------------------------

    def _hoist_receives(self, stuck: Sequence[int]) -> bool:
        """Move the receive of every blocked send into the receiver's current batch."""
        moved = False
        for rank in stuck:
            step = self.steps[rank][self.pos[rank]]
            for action in step:
                if not action.kind.is_send or self._message(rank, action) in self.recv_post:
                    continue
                peer = peer_rank(action, rank, self.p)
                if self.posted_at[peer] is None:
                    continue  # the peer is finished: nothing to move, reported as a deadlock
                direction, m, producer = self._message(rank, action)
                consumer = producer + 1 if direction == "F" else producer - 1
                kind = ActionKind.RECV_F if direction == "F" else ActionKind.RECV_B
                wanted = Action(kind, m, stage_of(consumer, self.p)[1])
                if self._take_later(peer, wanted):
                    self.steps[peer][self.pos[peer]].append(wanted)
                    posted = self.posted_at[peer]
                    assert posted is not None
                    self._post_one(peer, wanted, posted)
                    moved = True
        return moved

    def _take_later(self, rank: int, wanted: Action) -> bool:
        """Remove ``wanted`` from the steps after the current one; drop a batch left empty."""
        for index in range(self.pos[rank] + 1, len(self.steps[rank])):
            step = self.steps[rank][index]
            if wanted in step:
                step.remove(wanted)
                if not step:
                    del self.steps[rank][index]
                return True
        return False

    def _waiting(self, rank: int) -> str:
        step = self.steps[rank][self.pos[rank]]
        missing = []
        for action in step:
            message = self._message(rank, action)
            peer = peer_rank(action, rank, self.p)
            if action.kind.is_recv and message not in self.send_post:
                wanted = "SEND_F" if message[0] == "F" else "SEND_B"
                missing.append(f"{action} needs {wanted} from rank {peer}")
            if action.kind.is_send and self.rendezvous and message not in self.recv_post:
                wanted = "RECV_F" if message[0] == "F" else "RECV_B"
                missing.append(f"{action} needs {wanted} posted by rank {peer}")
        batch = " ".join(str(a) for a in step)
        return f"rank {rank} blocked at [{batch}]: " + ", ".join(missing)

    def _check_all_matched(self) -> None:
        for message, (rank, _) in self.send_post.items():
            if message not in self.recv_post:
                direction, m, v = message
                raise ScheduleError(
                    f"rank {rank}: SEND_{direction} of microbatch {m} from virtual stage {v} is "
                    "never received"
                )


def make_deadlock_free(
    table: Sequence[Sequence[Action]], *, num_chunks: int, splits_backward: bool
) -> list[list[Action]]:
    """Return ``table`` with receives moved earlier wherever rendezvous sends would deadlock.

    Raises:
        DeadlockError: the lists deadlock even with every receive posted as early as needed
            (their data dependencies are circular).
    """
    unit = {ActionKind.F: 1.0, ActionKind.B: 1.0, ActionKind.W: 1.0}
    run = DataflowRun(
        table,
        num_chunks=num_chunks,
        splits_backward=splits_backward,
        costs=unit,
        comm=0.0,
        sends="rendezvous",
        repair=True,
    )
    run.run()
    return run.table()
