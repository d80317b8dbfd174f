"""The metadata protocol of a first step, run on a model of the messages: it never deadlocks.

On a step that learns shapes, the first activation of each link carries a metadata message
that the receiver reads (blocking) before posting that receive (tessera.pipeline.p2p). The
model below runs every rank's batches with the strictest semantics (a send completes only once
its receive is posted, a batch waits for all of its ops) plus that blocking read, for every
built-in schedule up to 8 stages, and checks every rank finishes. It also checks that both
ends of every message compute the same tag (stream), in the same order.
"""

from __future__ import annotations

from collections import Counter

import pytest

from tessera.pipeline import (
    Action,
    ActionKind,
    GPipeSchedule,
    InterleavedPipelineSchedule,
    PipelineSchedule,
    ZeroBubbleSchedule,
    link_of,
    message_tag,
    peer_rank,
    split_steps,
)

Op = tuple[str, int, int, int]  # ("send" | "recv", peer, tag, index on the stream)


def _batches(actions: list[Action], rank: int, p: int) -> list[list[tuple[Op, str]]]:
    """Per step, its ops and how a receive gets its metadata: known, read or shared."""
    out: list[list[tuple[Op, str]]] = []
    counts: Counter[tuple[str, int, int]] = Counter()
    learned: set[int] = set()  # in-links whose metadata arrived (by chunk)
    for step in split_steps(actions):
        if step[0].kind.is_compute:
            out.append([])
            continue
        batch: list[tuple[Op, str]] = []
        read_here: set[int] = set()
        for action in step:
            peer = peer_rank(action, rank, p)
            tag = message_tag(action, rank, p)
            op = "send" if action.kind.is_send else "recv"
            index = counts[(op, peer, tag)]
            counts[(op, peer, tag)] += 1
            how = "known"
            if action.kind is ActionKind.RECV_F and action.chunk not in learned:
                how = "shared" if action.chunk in read_here else "read"
                read_here.add(action.chunk)
            batch.append(((op, peer, tag, index), how))
        learned |= read_here
        out.append(batch)
    return out


def _runs_to_completion(table: list[list[Action]]) -> bool:
    p = len(table)
    plans = [_batches(actions, rank, p) for rank, actions in enumerate(table)]
    position = [0] * p
    posted: list[set[Op]] = [set() for _ in range(p)]
    started = [False] * p
    progress = True
    while progress:
        progress = False
        for rank in range(p):
            while position[rank] < len(plans[rank]):
                batch = plans[rank][position[rank]]
                mine = posted[rank]
                if not started[rank]:
                    started[rank] = True
                    progress = True
                    # Sends (with their metadata), then receives with known metadata; a stream
                    # with an earlier receive still waiting keeps its later ones back.
                    blocked: set[tuple[int, int]] = set()
                    for op, how in batch:
                        known = how == "known" and (op[1], op[2]) not in blocked
                        if op[0] == "send" or known:
                            mine.add(op)
                        else:
                            blocked.add((op[1], op[2]))
                # Blocking reads, in batch order: a read completes once the sender posted.
                for op, _ in batch:
                    if op in mine:
                        continue
                    _, peer, tag, index = op
                    if ("send", rank, tag, index) not in posted[peer]:
                        break  # reading this one's metadata (or waiting for it)
                    mine.add(op)
                    progress = True
                if not all(op in mine for op, _ in batch):
                    break
                done = all(
                    ("recv" if op[0] == "send" else "send", rank, op[2], op[3]) in posted[op[1]]
                    for op, _ in batch
                )
                if not done:
                    break
                position[rank] += 1
                started[rank] = False
                progress = True
    return all(position[r] == len(plans[r]) for r in range(p))


def _schedules(p: int, m: int) -> list[object]:
    out: list[object] = [GPipeSchedule(m), PipelineSchedule(m), ZeroBubbleSchedule(m)]
    if m % p == 0:
        out += [InterleavedPipelineSchedule(m, 2), InterleavedPipelineSchedule(m, 3)]
    return out


@pytest.mark.parametrize("p", [2, 3, 4, 6, 8])
def test_first_step_metadata_reads_never_deadlock(p: int) -> None:
    for m in (3, 2 * p) if p <= 4 else (2 * p,):
        for schedule in _schedules(p, m):
            for forward_only in (False, True):
                table = schedule.action_table(p, forward_only=forward_only)  # type: ignore[attr-defined]
                assert _runs_to_completion(table), (schedule, p, m, forward_only)


def test_the_model_does_find_a_deadlock() -> None:
    ok = [
        [Action(ActionKind.F, 0), Action(ActionKind.SEND_F, 0), Action(ActionKind.RECV_B, 0)],
        [Action(ActionKind.RECV_F, 0), Action(ActionKind.F, 0), Action(ActionKind.SEND_B, 0)],
    ]
    assert _runs_to_completion(ok)
    # Rank 0 waits for B0 before sending F0; rank 1 answers only after F0 arrived.
    stuck = [
        [Action(ActionKind.RECV_B, 0), Action(ActionKind.F, 0), Action(ActionKind.SEND_F, 0)],
        [Action(ActionKind.RECV_F, 0), Action(ActionKind.F, 0), Action(ActionKind.SEND_B, 0)],
    ]
    assert not _runs_to_completion(stuck)


@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_both_ends_of_every_message_use_the_same_stream(p: int) -> None:
    for schedule in _schedules(p, 2 * p):
        table = schedule.action_table(p)  # type: ignore[attr-defined]
        sent: dict[tuple[int, int, int], list[int]] = {}
        got: dict[tuple[int, int, int], list[int]] = {}
        for rank, actions in enumerate(table):
            for action in actions:
                if action.kind.is_compute:
                    continue
                peer = peer_rank(action, rank, p)
                tag = message_tag(action, rank, p)
                assert tag == 16 + 2 * link_of(action, rank, p) + (action.kind.value[-1] == "B")
                if action.kind.is_send:
                    sent.setdefault((rank, peer, tag), []).append(action.microbatch)
                else:
                    got.setdefault((peer, rank, tag), []).append(action.microbatch)
        assert sent == got, schedule
