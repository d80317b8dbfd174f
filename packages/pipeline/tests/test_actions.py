import pytest

from tessera.pipeline import (
    Action,
    ActionKind,
    format_actions,
    parse_actions,
    peer_rank,
    split_steps,
    stage_of,
    virtual_stage,
)


def test_action_str_and_parse_round_trip():
    actions = [
        Action(ActionKind.F, 3),
        Action(ActionKind.B, 3, 1),
        Action(ActionKind.SEND_F, 0, 2),
        Action(ActionKind.W, 12),
    ]
    text = format_actions(actions)
    assert text == "F3 B3:1 SEND_F0:2 W12"
    assert parse_actions(text) == actions
    assert parse_actions(["F3", "B3:1"]) == actions[:2]


def test_action_is_frozen_hashable_and_validated():
    a = Action(ActionKind.F, 1)
    assert a == Action("F", 1, 0)  # a string kind is converted
    assert len({a, Action(ActionKind.F, 1, 0)}) == 1
    with pytest.raises(AttributeError):
        a.microbatch = 2  # type: ignore[misc]
    with pytest.raises(ValueError, match="must both be >= 0"):
        Action(ActionKind.B, -1)


def test_parse_rejects_garbage():
    with pytest.raises(ValueError, match="cannot parse action 'X1'"):
        parse_actions("F0 X1")


def test_kind_properties():
    assert {k for k in ActionKind if k.is_compute} == {ActionKind.F, ActionKind.B, ActionKind.W}
    assert {k for k in ActionKind if k.is_send} == {ActionKind.SEND_F, ActionKind.SEND_B}
    assert {k for k in ActionKind if k.is_recv} == {ActionKind.RECV_F, ActionKind.RECV_B}
    assert all(k.is_comm != k.is_compute for k in ActionKind)


def test_virtual_stages_and_peers():
    # p=4, chunk 1 of rank 3 is virtual stage 7; its next stage wraps to rank 0 (chunk 2).
    assert virtual_stage(3, 1, 4) == 7
    assert stage_of(7, 4) == (3, 1)
    assert all(stage_of(virtual_stage(r, c, 4), 4) == (r, c) for r in range(4) for c in range(3))
    assert peer_rank(Action(ActionKind.SEND_F, 0, 1), 3, 4) == 0
    assert peer_rank(Action(ActionKind.RECV_B, 0), 1, 4) == 2
    assert peer_rank(Action(ActionKind.RECV_F, 0, 1), 0, 4) == 3
    assert peer_rank(Action(ActionKind.SEND_B, 0), 2, 4) == 1
    with pytest.raises(ValueError, match="compute action"):
        peer_rank(Action(ActionKind.F, 0), 0, 4)


def test_split_steps_batches_consecutive_comm():
    actions = parse_actions("RECV_F0 F0 SEND_F0 RECV_B0 B0 SEND_B0")
    steps = split_steps(actions)
    assert [format_actions(s) for s in steps] == [
        "RECV_F0",
        "F0",
        "SEND_F0 RECV_B0",
        "B0",
        "SEND_B0",
    ]
    assert split_steps([]) == []
