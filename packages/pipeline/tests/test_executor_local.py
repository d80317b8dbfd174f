"""The executor, the split backward, payloads and message order, in one process."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from torch import nn

from tessera.pipeline import (
    Action,
    ActionKind,
    GPipeSchedule,
    InterleavedPipelineSchedule,
    PayloadMeta,
    PipelineRunner,
    PipelineSchedule,
    ScheduleError,
    TensorMeta,
    ZeroBubbleSchedule,
    backward_input,
    backward_weight,
    check_message_order,
    concat_microbatches,
    flatten_payload,
    parse_actions,
    payload_signature,
    select_stage_layers,
    split_microbatches,
    unflatten_payload,
)


def make_mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6), nn.Linear(6, 2)
    )


def mse(output: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    return ((output - label) ** 2).mean()


def data(batch: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randn(batch, 4, generator=g), torch.randn(batch, 2, generator=g)


# --------------------------------------------------------------------------- one pipeline rank


@pytest.mark.parametrize(
    "schedule",
    [
        GPipeSchedule(4),
        PipelineSchedule(4),
        ZeroBubbleSchedule(4),
        InterleavedPipelineSchedule(4, 2),
        InterleavedPipelineSchedule(2, 3),
    ],
    ids=repr,
)
def test_one_rank_matches_the_model_chunks_hand_off_locally(schedule):
    model = make_mlp()
    ref = copy.deepcopy(model)
    x, y = data()
    ref_out = ref(x)
    ref_loss = mse(ref_out, y)
    ref_loss.backward()
    stages = select_stage_layers(model, 0, 1, schedule.num_chunks, method="uniform")
    stage = stages[0] if schedule.num_chunks == 1 else stages
    runner = PipelineRunner(schedule)
    out, label, loss = runner.train_step(stage, iter([(x, y)]), mse, record_timeline=True)
    assert torch.allclose(loss, ref_loss, atol=1e-6)
    assert torch.allclose(out, ref_out, atol=1e-6) and label is y
    ref_grads = dict(ref.named_parameters())
    for name, param in model.named_parameters():
        assert torch.allclose(param.grad, ref_grads[name].grad, atol=1e-6, rtol=1e-5), name
    record = runner.last_run
    assert record is not None and record.exchanged_metadata is False
    assert len(record.timeline) == len(schedule.actions(0, 1))
    assert [e.action for e in record.timeline] == schedule.actions(0, 1)
    assert all(b.start >= a.end for a, b in itertools.pairwise(record.timeline))


def test_peak_live_microbatches_and_forward_only_keeps_nothing():
    model = make_mlp()
    x, y = data()
    stage = select_stage_layers(model, 0, 1, method="uniform")[0]
    for schedule, live in ((GPipeSchedule(8), 8), (PipelineSchedule(8), 1)):
        runner = PipelineRunner(schedule)
        runner.train_step(stage, iter([(x, y)]), mse, track_memory=True)
        assert runner.last_run is not None
        assert runner.last_run.peak_live == live
        assert runner.last_run.peak_activation_bytes > 0
    stage.zero_grad(set_to_none=True)
    runner = PipelineRunner(GPipeSchedule(8))
    out, _, loss = runner.eval_step(stage, iter([(x, y)]), mse)
    assert runner.last_run is not None and runner.last_run.peak_live == 0
    assert all(p.grad is None for p in stage.parameters())
    assert torch.allclose(out, model(x), atol=1e-6) and not out.requires_grad
    assert loss is not None and not loss.requires_grad


def test_argument_errors_are_raised_before_anything_runs():
    model = make_mlp()
    x, y = data()
    stage = select_stage_layers(model, 0, 1, method="uniform")[0]
    with pytest.raises(ValueError, match=r"\(8\) is not divisible by num_microbatches \(3\)"):
        PipelineRunner(PipelineSchedule(3)).train_step(stage, iter([(x, y)]), mse)
    with pytest.raises(ValueError, match="needs a loss_fn"):
        PipelineRunner(PipelineSchedule(4)).train_step(stage, iter([(x, y)]), None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="2 model chunk"):
        PipelineRunner(InterleavedPipelineSchedule(4, 2)).train_step(stage, iter([(x, y)]), mse)
    with pytest.raises(TypeError, match=r"\(inputs, labels\)"):
        PipelineRunner(PipelineSchedule(4)).train_step(stage, iter([x]), mse)
    wrong = select_stage_layers(model, 1, 2, method="uniform")[0]
    with pytest.raises(ValueError, match="was built for"):
        PipelineRunner(PipelineSchedule(4)).train_step(wrong, iter([(x, y)]), mse)
    assert all(p.grad is None for p in model.parameters())


# --------------------------------------------------------------------------- split backward


def _compare_split(model_factory, make_inputs, with_input=True):
    a, b = model_factory(), model_factory()
    x = make_inputs()
    g = torch.randn_like(a(x))
    xa = x.clone().requires_grad_(with_input)
    a(xa).backward(g)
    xb = x.clone().requires_grad_(with_input)
    out = b(xb)
    input_grads, work = backward_input([out], [g], [xb] if with_input else [])
    assert all(p.grad is None for p in b.parameters())  # B touched no weight
    backward_weight(work)
    if with_input:
        assert torch.equal(input_grads[0], xa.grad)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(pa.grad, pb.grad), name  # same kernels: bitwise equal
    return work


def test_split_backward_starts_w_at_the_split_nodes():
    def factory():
        torch.manual_seed(0)
        return nn.Sequential(
            nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 6), nn.LayerNorm(6), nn.Linear(6, 3)
        )

    torch.manual_seed(1)
    work = _compare_split(factory, lambda: torch.randn(5, 4))
    assert work.split and work.fallback is None and not work.groups  # consumed by W


def test_split_backward_groups_one_per_layer():
    def factory():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))

    model = factory()
    x = torch.randn(5, 4, requires_grad=True)
    out = model(x)
    _, work = backward_input([out], [torch.ones_like(out)], [x])
    assert work.split and len(work.groups) == 2  # one engine call per Linear
    assert [len(weights) for _, _, weights in work.groups] == [2, 2]
    backward_weight(work)


def test_split_backward_falls_back_for_a_weight_used_at_two_depths_and_first_stage():
    def shared():
        torch.manual_seed(0)
        inner = nn.Linear(6, 6)
        return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), inner, nn.Tanh(), inner)

    torch.manual_seed(2)
    work = _compare_split(shared, lambda: torch.randn(3, 4))
    assert not work.split
    torch.manual_seed(2)
    _compare_split(shared, lambda: torch.randn(3, 4), with_input=False)


# --------------------------------------------------------------------------- payloads


def test_payload_flatten_round_trip_and_errors():
    t = [torch.zeros(2, 1), torch.ones(2, 3), torch.arange(2)]
    payload = {"a": (t[0], [t[1]]), "b": t[2]}
    tensors, spec = flatten_payload(payload)
    assert [x is y for x, y in zip(tensors, t, strict=True)] == [True] * 3
    rebuilt = unflatten_payload(tensors, spec)
    assert rebuilt["a"][0] is t[0] and rebuilt["a"][1][0] is t[1] and rebuilt["b"] is t[2]
    assert isinstance(rebuilt["a"], tuple) and isinstance(rebuilt["a"][1], list)
    with pytest.raises(TypeError, match=r"payload\['a'\]\[1\] is a str"):
        flatten_payload({"a": (t[0], "no")})
    with pytest.raises(ValueError, match="spec holds 3 tensors, got 4"):
        unflatten_payload([*tensors, t[0]], spec)


def test_split_and_concat_microbatches():
    batch = {"x": torch.arange(12).reshape(6, 2), "mask": (torch.ones(6), None)}
    parts = split_microbatches(batch, 3)
    assert [p["x"].shape[0] for p in parts] == [2, 2, 2]
    assert parts[1]["mask"][1] is None
    back = concat_microbatches(parts)
    assert torch.equal(back["x"], batch["x"]) and torch.equal(back["mask"][0], batch["mask"][0])
    with pytest.raises(
        ValueError, match=r"\(6\) is not divisible by num_microbatches \(4\): 6 % 4 = 2"
    ):
        split_microbatches(batch, 4)
    with pytest.raises(ValueError, match="disagree on the batch size"):
        split_microbatches((torch.zeros(4), torch.zeros(6)), 2)
    assert split_microbatches(None, 2) == [None, None]
    assert payload_signature(parts[0]) == payload_signature(parts[2])
    assert payload_signature(parts[0]) != payload_signature(split_microbatches(batch, 2)[0])


def test_payload_meta_encodes_and_answers_with_gradient_meta():
    tensors, spec = flatten_payload(
        (torch.zeros(2, 3), torch.arange(2), torch.ones(2, dtype=torch.float16))
    )
    meta = PayloadMeta(
        spec, tuple(TensorMeta.of(t, g) for t, g in zip(tensors, (True, False, True), strict=True))
    )
    assert PayloadMeta.decode(meta.encode()) == meta
    grad = meta.gradient_meta()
    assert [t.shape for t in grad.tensors] == [(2, 3), (2,)]
    assert [t.dtype for t in grad.tensors] == [torch.float32, torch.float16]
    assert "[2, 3]:float32*" in meta.describe()


# --------------------------------------------------------------------------- message order


def test_every_schedule_posts_messages_in_the_order_they_are_received():
    for p in range(2, 9):
        for m in (1, 3, p, 2 * p):
            schedules = [GPipeSchedule(m), PipelineSchedule(m), ZeroBubbleSchedule(m)]
            if m % p == 0:
                schedules += [InterleavedPipelineSchedule(m, 2), InterleavedPipelineSchedule(m, 3)]
            for schedule in schedules:
                for forward_only in (False, True):
                    check_message_order(schedule.action_table(p, forward_only=forward_only))


def test_message_order_violation_is_reported():
    table = [
        parse_actions("F0 F1 SEND_F1 SEND_F0"),
        parse_actions("RECV_F0 RECV_F1 F0 F1"),
    ]
    with pytest.raises(ScheduleError, match="from rank 0 to rank 1"):
        check_message_order(table)
    assert Action(ActionKind.SEND_F, 1) in table[0]
