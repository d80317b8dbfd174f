import pytest

from tessera.pipeline import (
    DeadlockError,
    GPipeSchedule,
    InterleavedPipelineSchedule,
    PipelineSchedule,
    ScheduleError,
    TimelineEvent,
    ZeroBubbleSchedule,
    add_communication,
    format_actions,
    make_deadlock_free,
    parse_actions,
    simulate,
    simulate_table,
)

GRID = [(p, m) for p in (2, 3, 4, 6) for m in (p, p + 1, 2 * p, 3 * p)]


def close(a, b):
    return a == pytest.approx(b, abs=1e-9)


# ---- closed forms -------------------------------------------------------------------------
# Exact with comm=0 and costs equal on every rank, for any F and B (W=0 here): the tests use
# the issue's default F=1, B=2 and also F=B=1 and F=1, B=3.

COSTS = [None, {"F": 1, "B": 1}, {"F": 1, "B": 3}]


@pytest.mark.parametrize("costs", COSTS)
@pytest.mark.parametrize(("p", "m"), GRID)
def test_gpipe_and_1f1b_bubble(p, m, costs):
    for s in (GPipeSchedule(m), PipelineSchedule(m)):
        r = simulate(s, p, costs)
        assert close(r.bubble_fraction, (p - 1) / (m + p - 1)), (s, p, m)
        f, b = (costs or {"F": 1, "B": 2})["F"], (costs or {"F": 1, "B": 2})["B"]
        assert close(r.makespan, (m + p - 1) * (f + b))


@pytest.mark.parametrize("costs", COSTS)
@pytest.mark.parametrize("v", [2, 3])
@pytest.mark.parametrize(("p", "m"), [(p, m) for p, m in GRID if m % p == 0])
def test_interleaved_bubble(p, m, v, costs):
    r = simulate(InterleavedPipelineSchedule(m, v), p, costs)
    assert close(r.bubble_fraction, (p - 1) / (v * m + p - 1))


@pytest.mark.parametrize(("p", "m"), [(p, m) for p, m in GRID])
def test_zero_bubble_idles_at_most_a_third_of_1f1b(p, m):
    equal = {"F": 1, "B": 1, "W": 1}
    zb = simulate(ZeroBubbleSchedule(m), p, equal)
    one_f_one_b = simulate(PipelineSchedule(m), p, equal)  # pays B + W = 2 for its backward
    assert sum(zb.idle_time) <= sum(one_f_one_b.idle_time) / 3 + 1e-9
    # per rank: (p-1)(F+B-W) against (p-1)(F+B+W)
    assert all(close(idle, p - 1) for idle in zb.idle_time)
    assert all(close(idle, 3 * (p - 1)) for idle in one_f_one_b.idle_time)


def test_zero_bubble_with_w_zero_is_1f1b():
    assert close(
        simulate(ZeroBubbleSchedule(8), 4).makespan, simulate(PipelineSchedule(8), 4).makespan
    )


# ---- memory ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("p", "m"), GRID)
def test_peak_activations(p, m):
    assert simulate(PipelineSchedule(m), p).peak_activations == tuple(
        min(p - r, m) for r in range(p)
    )
    assert simulate(GPipeSchedule(m), p).peak_activations == (m,) * p
    zb = simulate(ZeroBubbleSchedule(m), p).peak_activations
    # ZB-H1: held until W; no rank above p, rank 0 exactly 1F1B's p.
    assert zb[0] == min(p, m)
    assert max(zb) <= p


def test_interleaved_peak_counts_chunks_as_fractions():
    # Rank 0 of p=2, v=2, m=4 holds F0 F1 F0:1 F1:1 F2 before its first B: 5 chunk units = 2.5.
    r = simulate(InterleavedPipelineSchedule(4, 2), 2)
    assert r.peak_activations == (2.5, 1.5)


def test_forward_only_holds_nothing():
    r = simulate(PipelineSchedule(4), 2, forward_only=True)
    assert r.peak_activations == (0, 0)
    assert close(r.makespan, 5)  # m + p - 1 forwards of cost 1


# ---- the timeline -----------------------------------------------------------------------


def test_1f1b_p2_m4_timeline_by_hand():
    r = simulate(PipelineSchedule(4), 2)  # F=1, B=2
    got = [(e.start, e.end, str(e.action)) for e in r.events(0)]
    assert got == [
        (0, 1, "F0"),
        (1, 2, "F1"),
        (4, 6, "B0"),  # waits for rank 1's F0 [1,2] and B0 [2,4]
        (6, 7, "F2"),
        (7, 9, "B1"),
        (9, 10, "F3"),
        (10, 12, "B2"),
        (13, 15, "B3"),
    ]
    assert r.makespan == 15
    assert r.idle_time == (3, 3)
    assert all(isinstance(e, TimelineEvent) and e.rank in (0, 1) for e in r.timeline)
    assert [e.rank for e in r.timeline] == sorted(e.rank for e in r.timeline)


def test_zero_bubble_p2_m3_timeline_by_hand():
    r = simulate(ZeroBubbleSchedule(3), 2, {"F": 1, "B": 1, "W": 1})
    assert [(e.start, str(e.action)) for e in r.events(1)] == [
        (1, "F0"), (2, "B0"), (3, "F1"), (4, "B1"), (5, "W0"),
        (6, "F2"), (7, "B2"), (8, "W1"), (9, "W2"),
    ]  # fmt: skip
    assert r.makespan == 10
    assert r.idle_time == (1, 1)


def test_comm_delays_each_hop():
    r = simulate(PipelineSchedule(1), 3, {"F": 1, "B": 1}, comm=0.5)
    starts = {(e.rank, str(e.action)): e.start for e in r.timeline}
    assert starts[(1, "F0")] == 1.5
    assert starts[(2, "F0")] == 3.0
    assert starts[(2, "B0")] == 4.0  # last stage: right after its own F
    assert starts[(1, "B0")] == 5.5
    assert starts[(0, "B0")] == 7.0
    assert r.makespan == 8.0


def test_chunk_costs_are_a_fraction_of_the_rank_cost():
    r = simulate(InterleavedPipelineSchedule(2, 4), 1, {"F": 2, "B": 4})
    assert {e.duration for e in r.timeline} == {0.5, 1.0}
    assert close(r.makespan, 2 * 6)
    assert r.bubble_fraction == 0


def test_unsplit_schedule_pays_b_plus_w():
    r = simulate(PipelineSchedule(2), 1, {"F": 1, "B": 1, "W": 2})
    assert {str(e.action): e.duration for e in r.timeline}["B0"] == 3


# ---- deadlocks and broken tables --------------------------------------------------------


@pytest.mark.parametrize(
    "schedule",
    [
        GPipeSchedule(8),
        PipelineSchedule(8),
        ZeroBubbleSchedule(8),
        InterleavedPipelineSchedule(8, 2),
        InterleavedPipelineSchedule(8, 4),
    ],
)
@pytest.mark.parametrize("p", [2, 4, 8])
@pytest.mark.parametrize("forward_only", [False, True])
def test_every_schedule_is_deadlock_free_with_rendezvous_sends(schedule, p, forward_only):
    eager = simulate(schedule, p, forward_only=forward_only)
    strict = simulate(schedule, p, sends="rendezvous", forward_only=forward_only)
    assert strict.makespan >= eager.makespan > 0


def test_plain_placement_of_interleaved_deadlocks_until_repaired():
    s = InterleavedPipelineSchedule(4, 2)
    plain = [add_communication(s.compute_actions(r, 2), r, 2, 2) for r in range(2)]
    simulate_table(plain, num_chunks=2)  # fine when sends never wait
    with pytest.raises(DeadlockError, match=r"rank 0 blocked at .*needs RECV_B posted by rank 1"):
        simulate_table(plain, num_chunks=2, sends="rendezvous")
    fixed = make_deadlock_free(plain, num_chunks=2, splits_backward=False)
    simulate_table(fixed, num_chunks=2, sends="rendezvous")
    assert [format_actions(a) for a in fixed] == [format_actions(a) for a in s.action_table(2)]


def test_detects_a_circular_wait():
    # Both ranks want the other's gradient first: B1 on rank 0 waits for rank 1's B1, which
    # comes after rank 1's B0, which needs... rank 0 never sent F1 before blocking.
    table = [
        parse_actions("F0 SEND_F0 RECV_B0 B0 F1 SEND_F1"),
        parse_actions("RECV_F1 F1 B1 SEND_B1 RECV_F0 F0 B0 SEND_B0"),
    ]
    with pytest.raises(DeadlockError, match=r"rank 1 blocked at \[RECV_F1\]"):
        simulate_table(table)


def test_reports_inconsistent_tables():
    with pytest.raises(ScheduleError, match="runs before its input arrived"):
        simulate_table([parse_actions("F0 SEND_F0 RECV_B0 B0"), parse_actions("F0 B0 SEND_B0")])
    with pytest.raises(ScheduleError, match="never received"):
        simulate_table([parse_actions("F0 SEND_F0"), parse_actions("")], forward_only=True)
    with pytest.raises(ScheduleError, match="SEND_F0 comes before F0"):
        simulate_table([parse_actions("SEND_F0 F0 RECV_B0 B0"), parse_actions("RECV_F0 F0 B0")])
    with pytest.raises(ScheduleError, match="with one pipeline rank"):
        simulate_table([parse_actions("F0 SEND_F0 B0")])


def test_argument_errors():
    with pytest.raises(ValueError, match="unknown cost key 'X'"):
        simulate(PipelineSchedule(2), 2, {"X": 1})
    with pytest.raises(ValueError, match="must be finite and >= 0"):
        simulate(PipelineSchedule(2), 2, {"F": -1})
    with pytest.raises(ValueError, match="comm"):
        simulate(PipelineSchedule(2), 2, comm=-1)
    with pytest.raises(ValueError, match="sends must be"):
        simulate(PipelineSchedule(2), 2, sends="later")  # type: ignore[arg-type]
