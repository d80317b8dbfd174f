import dataclasses
import itertools

import pytest

from tessera.pipeline import (
    Action,
    ActionKind,
    ActionTable,
    GPipeSchedule,
    InterleavedPipelineSchedule,
    PipelineSchedule,
    Schedule,
    ScheduleError,
    ZeroBubbleSchedule,
    add_communication,
    check_actions,
    format_actions,
    parse_actions,
)


def table(schedule, p, *, compute=False):
    get = schedule.compute_actions if compute else schedule.actions
    return [format_actions(get(r, p)) for r in range(p)]


# ---- hand-worked tables ---------------------------------------------------------------------


def test_gpipe_p2_m4_by_hand():
    assert table(GPipeSchedule(4), 2) == [
        "F0 SEND_F0 F1 SEND_F1 F2 SEND_F2 F3 SEND_F3 RECV_B0 B0 RECV_B1 B1 RECV_B2 B2 RECV_B3 B3",
        "RECV_F0 F0 RECV_F1 F1 RECV_F2 F2 RECV_F3 F3 B0 SEND_B0 B1 SEND_B1 B2 SEND_B2 B3 SEND_B3",
    ]


def test_one_f_one_b_p2_m4_by_hand():
    s = PipelineSchedule(4)
    assert table(s, 2, compute=True) == [
        "F0 F1 B0 F2 B1 F3 B2 B3",  # warm-up of p - 0 - 1 = 1 forward
        "F0 B0 F1 B1 F2 B2 F3 B3",  # last stage: no warm-up
    ]
    # Sends follow their compute, receives precede theirs; adjacent ones are fused batches:
    # "SEND_F1 RECV_B0" is Megatron's send_forward_recv_backward.
    assert table(s, 2) == [
        "F0 SEND_F0 F1 SEND_F1 RECV_B0 B0 F2 SEND_F2 RECV_B1 B1 F3 SEND_F3 RECV_B2 B2 RECV_B3 B3",
        "RECV_F0 F0 B0 SEND_B0 RECV_F1 F1 B1 SEND_B1 RECV_F2 F2 B2 SEND_B2 RECV_F3 F3 B3 SEND_B3",
    ]


def test_one_f_one_b_p4_warmup_is_capped_by_microbatches():
    s = PipelineSchedule(2)
    assert table(s, 4, compute=True) == [
        "F0 F1 B0 B1",  # warm-up min(3, 2) = 2
        "F0 F1 B0 B1",  # warm-up 2
        "F0 F1 B0 B1",  # warm-up 1: F0, then F1 B0, then B1
        "F0 B0 F1 B1",  # warm-up 0
    ]


def test_interleaved_p2_v2_m4_by_hand():
    s = InterleavedPipelineSchedule(4, 2)
    # rank 0 warms up with (2-0-1)*2 + (2-1)*2 = 4 forwards, rank 1 with 0*2 + 2 = 2. Forwards go
    # in groups of p=2 microbatches: chunk 0 of (0, 1), chunk 1 of (0, 1), chunk 0 of (2, 3), ...
    # backwards in the same groups with the chunks reversed.
    assert table(s, 2, compute=True) == [
        "F0 F1 F0:1 F1:1 F2 B0:1 F3 B1:1 F2:1 B0 F3:1 B1 B2:1 B3:1 B2 B3",
        "F0 F1 F0:1 B0:1 F1:1 B1:1 F2 B0 F3 B1 F2:1 B2:1 F3:1 B3:1 B2 B3",
    ]


def test_interleaved_full_list_rank1_by_hand():
    # Rank 1 (virtual stages 1 and 3): chunk 1 is the last virtual stage (no SEND_F / RECV_B),
    # chunk 0 talks to rank 0 both ways. Some receives sit in an earlier batch than the plain
    # placement rule puts them (RECV_F2 RECV_B0 after SEND_B1:1): that is the deadlock-free pass.
    assert InterleavedPipelineSchedule(4, 2).actions(1, 2) == parse_actions(
        "RECV_F0 F0 SEND_F0 RECV_F1 F1 SEND_F1 RECV_F0:1 F0:1 B0:1 SEND_B0:1 RECV_F1:1 F1:1 B1:1 "
        "SEND_B1:1 RECV_F2 RECV_B0 F2 SEND_F2 RECV_F3 B0 SEND_B0 RECV_B1 F3 SEND_F3 RECV_F2:1 B1 "
        "SEND_B1 F2:1 B2:1 SEND_B2:1 RECV_F3:1 F3:1 B3:1 SEND_B3:1 RECV_B2 B2 SEND_B2 RECV_B3 B3 "
        "SEND_B3"
    )


def test_zero_bubble_p2_m3_by_hand():
    s = ZeroBubbleSchedule(3)
    assert s.splits_backward
    assert table(s, 2, compute=True) == [
        "F0 F1 B0 W0 F2 B1 W1 B2 W2",  # rank 0 defers no W
        "F0 B0 F1 B1 W0 F2 B2 W1 W2",  # rank 1 keeps one W deferred
    ]
    assert table(s, 2)[1] == (
        "RECV_F0 F0 B0 SEND_B0 RECV_F1 F1 B1 SEND_B1 W0 RECV_F2 F2 B2 SEND_B2 W1 W2"
    )


def test_zero_bubble_p4_m8_defers_rank_many_w():
    s = ZeroBubbleSchedule(8)
    for rank in range(4):
        order = s.compute_actions(rank, 4)
        pending = max_pending = 0
        for a in order:
            if a.kind is ActionKind.B:
                pending += 1
            elif a.kind is ActionKind.W:
                pending -= 1
            max_pending = max(max_pending, pending)
        # r deferred plus the one just made; rank 0 never defers.
        assert max_pending == rank + 1


# ---- properties of every schedule -----------------------------------------------------------

CASES = [
    (GPipeSchedule, {}),
    (PipelineSchedule, {}),
    (ZeroBubbleSchedule, {}),
    (InterleavedPipelineSchedule, {"num_model_chunks": 2}),
    (InterleavedPipelineSchedule, {"num_model_chunks": 3}),
]


@pytest.mark.parametrize(("cls", "kwargs"), CASES)
@pytest.mark.parametrize(("p", "m"), [(1, 1), (1, 3), (2, 2), (2, 6), (3, 3), (3, 9), (4, 8)])
def test_every_unit_has_exactly_one_f_b_w_and_its_transfers(cls, kwargs, p, m):
    s = cls(m, **kwargs)
    for rank, actions in enumerate(s.action_table(p)):
        check_actions(
            actions,
            pipeline_rank=rank,
            num_stages=p,
            num_microbatches=m,
            num_chunks=s.num_chunks,
            splits_backward=s.splits_backward,
        )
        counts = {k: sum(a.kind is k for a in actions) for k in ActionKind}
        units = m * s.num_chunks
        assert counts[ActionKind.F] == counts[ActionKind.B] == units
        assert counts[ActionKind.W] == (units if s.splits_backward else 0)
        fo = s.actions(rank, p, forward_only=True)
        assert all(a.kind in (ActionKind.F, ActionKind.SEND_F, ActionKind.RECV_F) for a in fo)
        assert sum(a.kind is ActionKind.F for a in fo) == units


def test_single_stage_lists_have_no_communication():
    for s in (PipelineSchedule(3), InterleavedPipelineSchedule(2, 2), ZeroBubbleSchedule(2)):
        assert all(a.kind.is_compute for a in s.actions(0, 1))


# ---- errors ---------------------------------------------------------------------------------


def test_interleaved_needs_microbatches_multiple_of_stages():
    s = InterleavedPipelineSchedule(6, 2)
    assert len(s.actions(0, 3)) > 0
    with pytest.raises(ValueError, match=r"6 % 4 = 2"):
        s.actions(0, 4)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_bad_microbatch_counts(bad):
    with pytest.raises(ValueError, match="num_microbatches must be a positive int"):
        PipelineSchedule(bad)


def test_bad_rank_and_chunks():
    with pytest.raises(ValueError, match=r"pipeline_rank 2 is outside \[0, 2\)"):
        GPipeSchedule(2).actions(2, 2)
    with pytest.raises(ValueError, match="num_chunks must be a positive int"):
        InterleavedPipelineSchedule(2, 0)


def test_tensor_shape_is_kept():
    assert PipelineSchedule(4, tensor_shape=[2, 3]).tensor_shape == (2, 3)
    assert PipelineSchedule(4).tensor_shape is None
    assert InterleavedPipelineSchedule(4, 2).num_model_chunks == 2


def test_check_actions_reports_missing_and_misordered():
    kw = dict(pipeline_rank=0, num_stages=1, num_microbatches=2)
    with pytest.raises(ScheduleError, match="B0 comes before its forward"):
        check_actions(parse_actions("B0 F0 F1 B1"), **kw)
    with pytest.raises(ScheduleError, match="F1 appears 0 times, expected 1"):
        check_actions(parse_actions("F0 B0"), **kw)
    with pytest.raises(ScheduleError, match="does not split backward"):
        check_actions(parse_actions("F0 B0 W0 F1 B1"), **kw)
    with pytest.raises(ScheduleError, match="W0 comes before its backward"):
        check_actions(parse_actions("F0 W0 B0 F1 B1 W1"), splits_backward=True, **kw)
    with pytest.raises(ScheduleError, match="out of range"):
        check_actions(parse_actions("F0 B0 F1 B1 F2"), **kw)
    with pytest.raises(ScheduleError, match="RECV_F0 appears 0 times"):
        check_actions(
            parse_actions("F0 B0 SEND_B0"),
            pipeline_rank=1,
            num_stages=2,
            num_microbatches=1,
        )


def test_add_communication_rules():
    compute = parse_actions("F0 F0:1 B0:1 B0")
    # p=2, v=2, rank 1: chunk 0 is virtual stage 1, chunk 1 the last one (3).
    assert format_actions(add_communication(compute, 1, 2, 2)) == (
        "RECV_F0 F0 SEND_F0 RECV_F0:1 F0:1 B0:1 SEND_B0:1 RECV_B0 B0 SEND_B0"
    )
    assert add_communication(compute, 0, 1, 2) == compute


class Reversed1F1B(Schedule):
    """A user schedule: plugs in by implementing compute_actions only."""

    def compute_actions(self, pipeline_rank, num_stages):
        return [Action(ActionKind.F, i) for i in range(self.num_microbatches)] + [
            Action(ActionKind.B, i) for i in reversed(range(self.num_microbatches))
        ]


def test_user_schedule_gets_communication_for_free():
    s = Reversed1F1B(3)
    assert format_actions(s.actions(1, 2)) == (
        "RECV_F0 F0 RECV_F1 F1 RECV_F2 F2 B2 SEND_B2 B1 SEND_B1 B0 SEND_B0"
    )


def test_action_table_is_cached_but_returns_copies():
    s = PipelineSchedule(4)
    first = s.actions(0, 2)
    first.clear()
    assert s.actions(0, 2) != []
    assert s.table(2) is s.table(2)


def test_a_schedule_and_its_table_are_immutable():
    s = PipelineSchedule(4)
    with pytest.raises(AttributeError):
        s.num_microbatches = 2  # type: ignore[misc]
    with pytest.raises(
        AttributeError, match=r"PipelineRunner\(schedule, fuse_weight_grad=\.\.\.\)"
    ):
        s.fuse_weight_grad = False  # the runner's now: on a plan it would be ignored
    table = s.table(2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        table.rows = ()  # type: ignore[misc]
    assert isinstance(table.rows, tuple) and all(isinstance(row, tuple) for row in table.rows)


def test_action_table_reads_as_text_and_checks_itself():
    table = PipelineSchedule(2).table(2)
    assert table.format() == (
        "rank 0: F0 SEND_F0 F1 SEND_F1 RECV_B0 B0 RECV_B1 B1\n"
        "rank 1: RECV_F0 F0 B0 SEND_B0 RECV_F1 F1 B1 SEND_B1"
    )
    assert table.num_stages == 2 and table.steps_of(1)[0] == (Action(ActionKind.RECV_F, 0),)
    table.check()
    with pytest.raises(ValueError, match=r"pipeline_rank 2 is outside \[0, 2\)"):
        table.row(2)
    broken = ActionTable(
        (table.rows[0], parse_actions("RECV_F0 F0 B0 SEND_B0")), num_microbatches=2
    )
    with pytest.raises(ScheduleError, match="rank 1 of 2: F1 appears 0 times"):
        broken.check()
    evaluation = PipelineSchedule(2).table(2, forward_only=True)
    assert evaluation.forward_only and "B" not in {a.kind.value for r in evaluation.rows for a in r}


def test_schedules_are_registered_as_entry_points():
    from importlib.metadata import entry_points

    names = {ep.name for ep in entry_points(group="tessera.schedules")}
    assert {
        "GPipeSchedule",
        "PipelineSchedule",
        "InterleavedPipelineSchedule",
        "ZeroBubbleSchedule",
    } <= names


def test_every_schedule_table_small_grid_deterministic():
    for (cls, kwargs), p in itertools.product(CASES, (2, 3)):
        a = cls(2 * p, **kwargs).action_table(p)
        b = cls(2 * p, **kwargs).action_table(p)
        assert a == b
