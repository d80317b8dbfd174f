"""The Engine in one process: the same numbers as a plain PyTorch loop."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from engine_testlib import adam, make_data, make_model, reference_params, sgd
from torch import nn

from tessera.engine import (
    AccumulatedLRScheduler,
    Engine,
    NonPipelineSchedule,
    StepSchedule,
    initialize,
)


def _params(engine: Engine) -> list[torch.Tensor]:
    return [p.detach().clone() for p in engine.parameters()]


def test_engine_steps_equal_plain_loop() -> None:
    data = [make_data(8, seed=s) for s in range(3)]
    model = make_model()
    engine = Engine(model, adam(model), nn.CrossEntropyLoss())
    engine.train()
    for x, y in data:
        engine.zero_grad()
        loss = engine.criterion(engine(x), y)
        engine.backward(loss)
        assert engine.step() is True
    expected = reference_params(data, adam)
    for got, want in zip(_params(engine), expected, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert engine.global_step == 3


def test_execute_schedule_equals_manual_calls() -> None:
    data = [make_data(8, seed=s) for s in range(2)]
    model = make_model()
    engine = Engine(model, sgd(model), nn.CrossEntropyLoss())
    assert isinstance(engine.schedule, NonPipelineSchedule)
    assert isinstance(engine.schedule, StepSchedule)
    losses = []
    for batch in data:
        engine.zero_grad()
        out, label, loss = engine.execute_schedule(iter([batch]))
        assert out.shape == (8, 3) and torch.equal(label, batch[1])
        assert loss is not None and not loss.requires_grad
        losses.append(loss)
        engine.step()
    ref_model = make_model()
    first = nn.CrossEntropyLoss()(ref_model(data[0][0]), data[0][1])
    torch.testing.assert_close(losses[0], first.detach())
    for got, want in zip(_params(engine), reference_params(data, sgd), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_forward_only_touches_no_gradient() -> None:
    model = make_model()
    engine = Engine(model, sgd(model), nn.CrossEntropyLoss())
    engine.eval()
    out, _label, loss = engine.execute_schedule(iter([make_data()]), forward_only=True)
    assert loss is not None and out is not None
    assert all(p.grad is None for p in model.parameters())
    _, _, none_loss = engine.execute_schedule(
        iter([make_data()]), forward_only=True, return_loss=False, return_output_label=False
    )
    assert none_loss is None


def test_gradient_accumulation_4xb_equals_1x4b() -> None:
    x, y = make_data(16, seed=3)
    model = make_model()
    engine = Engine(model, adam(model), nn.CrossEntropyLoss(), gradient_accumulation=4)
    stepped = []
    for i in range(4):
        engine.zero_grad()
        xb, yb = x[4 * i : 4 * i + 4], y[4 * i : 4 * i + 4]
        engine.backward(engine.criterion(engine(xb), yb))
        stepped.append(engine.step())
    assert stepped == [False, False, False, True]
    expected = reference_params([(x, y)], adam)
    for got, want in zip(_params(engine), expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


def test_accumulated_lr_scheduler_steps_once_per_cycle() -> None:
    model = make_model()
    opt = sgd(model)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    opt.step()  # no gradients yet: a no-op that keeps torch's order check quiet
    _, _, _, wrapped = initialize(
        model, opt, nn.CrossEntropyLoss(), lr_scheduler=sched, config={"gradient_accumulation": 3}
    )
    assert isinstance(wrapped, AccumulatedLRScheduler)
    lrs = []
    for _ in range(6):
        wrapped.step()
        lrs.append(wrapped.get_last_lr()[0])
    assert lrs == pytest.approx([0.1, 0.1, 0.05, 0.05, 0.05, 0.025])


@pytest.mark.parametrize("key", ["bf16", "fp16"])
def test_mixed_precision_runs_close_to_fp32(key: str) -> None:
    config: dict[str, Any] = {"bf16": True} if key == "bf16" else {"fp16": {"mode": "torch"}}
    data = [make_data(8, seed=s) for s in range(3)]
    model = make_model()
    engine, *_ = initialize(model, sgd(model), nn.CrossEntropyLoss(), config=config)
    assert engine.autocast_dtype == (torch.bfloat16 if key == "bf16" else torch.float16)
    for x, y in data:
        engine.zero_grad()
        out = engine(x)
        assert out.dtype == engine.autocast_dtype
        loss = engine.criterion(out, y)
        assert loss.dtype == torch.float32
        engine.backward(loss)
        assert engine.step()
    expected = reference_params(data, sgd)
    tol = 2e-2 if key == "bf16" else 2e-3
    for got, want in zip(_params(engine), expected, strict=True):
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def test_fp16_overflow_skips_step_and_backs_off() -> None:
    model = make_model()
    engine, *_ = initialize(
        model, sgd(model), nn.CrossEntropyLoss(), config={"fp16": {"init_scale": 1024.0}}
    )
    before = _params(engine)
    x, y = make_data()
    engine.zero_grad()
    engine.backward(engine.criterion(engine(x), y))
    first = next(engine.parameters())
    assert first.grad is not None
    first.grad[0, 0] = float("inf")
    assert engine.step() is False
    assert engine.skipped_steps == 1 and engine.global_step == 0
    assert engine.loss_scaler is not None and engine.loss_scaler.scale == 512.0
    for got, want in zip(_params(engine), before, strict=True):
        assert torch.equal(got, want)


def test_clip_in_engine_matches_torch() -> None:
    data = [make_data(8, seed=s) for s in range(3)]
    model = make_model()
    engine = Engine(model, sgd(model), nn.CrossEntropyLoss(), clip_grad_norm=0.05)
    for batch in data:
        engine.zero_grad()
        engine.execute_schedule(iter([batch]))
        engine.step()
    expected = reference_params(data, sgd, clip=0.05)
    for got, want in zip(_params(engine), expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


def test_errors_are_clear() -> None:
    model = make_model()
    with pytest.raises(ValueError, match="gradient_accumulation"):
        Engine(model, sgd(model), gradient_accumulation=0)
    engine = Engine(model, sgd(model))
    with pytest.raises(RuntimeError, match="no criterion"):
        engine.criterion(torch.zeros(1), torch.zeros(1))
    chunks = Engine([make_model(), make_model()], sgd(model))
    with pytest.raises(TypeError, match="2 model chunks"):
        chunks(torch.zeros(1, 4))
    with pytest.raises(ValueError, match="label"):
        engine.execute_schedule(iter([{"x": torch.zeros(1)}]))


def test_an_optimizer_reading_a_whole_parameter_is_refused_on_a_split_one() -> None:
    """Adafactor factors a matrix's second moment by its row and column means: on this rank's
    block of a split weight they would be the block's, so ``initialize`` refuses it there
    (and takes it where nothing is split, and Adam on the split weight)."""
    from tessera.context import ParallelMode, ShardInfo, set_shard_info

    model = make_model()
    adafactor = torch.optim.Adafactor(model.parameters())
    initialize(model, adafactor, config={})  # nothing split
    weight = next(model.parameters())
    split = {0: [(ParallelMode.PARALLEL_1D, 0, 2)]}  # rank 0's half of the rows
    full = (weight.shape[0] * 2, *weight.shape[1:])
    set_shard_info(weight, ShardInfo.from_split(full, split))
    initialize(model, adam(model), config={})
    with pytest.raises(
        ValueError, match=r"Adafactor computes each parameter's update from the row"
    ):
        initialize(model, torch.optim.Adafactor(model.parameters()), config={})


@pytest.mark.parametrize(
    ("config", "match"),
    [
        ({"fp16": {"mode": "torch"}, "bf16": True}, "both set"),
        ({"fp16": {}, "bf16": True}, "both set"),  # an empty fp16 block is fp16 on
        ({"fp16": {"mode": "apex"}}, "apex is unmaintained.*fp16=dict\\(mode='torch'\\)"),
        ({"fp16": {"mode": "fancy"}}, "not supported"),
        ({"fp16": {"scale": 1}}, "unknown key 'fp16.scale'"),
        ({"fp16": {"init_scale": math.inf}}, "fp16.init_scale must be a finite number"),
        ({"fp16": {"growth_factor": math.nan}}, "fp16.growth_factor must be a finite number"),
        ({"fp16": True}, "fp16 must be a dict"),
        ({"zero": {"stage": 4}}, "zero.stage"),
        ({"zero": {"stage": 1, "offload": True}}, "offload"),
        ({"zero": {"stage": 2, "ofload": True}}, "did you mean 'zero.offload'"),
        ({"gradient_accumulation": 0}, "gradient_accumulation"),
        ({"clip_grad_norm": -1}, "clip_grad_norm"),
        ({"clip_grad_norm": math.nan}, "clip_grad_norm must be a finite number"),
        ({"clip_grad_norm": math.inf}, "clip_grad_norm must be a finite number"),
        (
            {"gradient_acumulation": 4},
            "'gradient_acumulation': did you mean 'gradient_accumulation'",
        ),
        ({"clip_grad_nrom": 1.0}, "'clip_grad_nrom': did you mean 'clip_grad_norm'"),
        ({"num_micro_batches": 4}, "did you mean 'num_microbatches'"),
        ({"NUM_MICRO_BATCHES": 4, "num_microbatches": 2}, "num_microbatches=2 and its alias"),
        ({"parralel": {}}, "did you mean 'parallel'"),
        ({"sequence_parallel": True}, "'sequence_parallel' is read only inside parallel.tensor"),
        ({"init_scale": 2.0**10}, "'init_scale' is read only inside fp16"),
        ({"nonfinite": "ignore"}, "nonfinite must be one of 'raise', 'skip', 'warn'"),
        ({"check_agreement": 0}, "check_agreement must be True"),
        ({"schedule": {"type": "ZeroBubbleSchedul"}}, "schedule.type: .*ZeroBubbleSchedule"),
        ({"schedule": "ZeroBubbleSchedule"}, "schedule must be a dict with a 'type'"),
        ({"zero": {"stage": 1}}, "ParallelContext"),
        ({"gradient_handlers": [{"type": "DataParallelGradientHandler"}]}, None),
    ],
)
def test_initialize_config_errors(config: dict[str, Any], match: str | None) -> None:
    from tessera.context import ConfigError

    model = make_model()
    if match is None:  # no context: handlers are not built, plain engine
        engine, *_ = initialize(model, sgd(model), config=config)
        assert engine.gradient_handlers == []
        return
    with pytest.raises(ConfigError, match=match):
        initialize(model, sgd(model), config=config)


def test_keys_of_your_own_and_switched_off_precision_are_accepted() -> None:
    model = make_model()
    config = {
        "BATCH_SIZE": 8,  # a user's own keys, not close to any the engine reads
        "lr": 1e-3,
        "NUM_EPOCHS": 2,
        "model": {"type": "Anything"},
        "fp16": {"mode": None},  # AMP off, as the seeds' engine test writes it
        "bf16": False,
    }
    engine, *_ = initialize(model, sgd(model), nn.CrossEntropyLoss(), config=config)
    assert engine.autocast_dtype is None and engine.loss_scaler is None
    assert engine.nonfinite == "raise"
    engine, *_ = initialize(model, sgd(model), config={"fp16": {}})
    assert engine.autocast_dtype is torch.float16 and engine.loss_scaler is not None
    assert engine.nonfinite == "skip"  # the loss scaler's overflow skip


def test_a_nan_loss_raises_before_the_optimizer_touches_a_weight() -> None:
    from tessera.engine import NonFiniteError

    model = make_model()
    engine, *_ = initialize(model, sgd(model), nn.CrossEntropyLoss(), config={})
    before = [p.detach().clone() for p in model.parameters()]
    x, y = make_data()
    x[0, 0] = float("nan")
    engine.zero_grad()
    engine.backward(engine.criterion(engine(x), y))
    with pytest.raises(NonFiniteError, match=r"optimizer step 1: the loss went non-finite first"):
        engine.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert engine.global_step == 0


def test_clipping_inf_norm() -> None:
    from tessera.engine import global_grad_norm

    model = make_model()
    x, y = make_data()
    nn.CrossEntropyLoss()(model(x), y).backward()
    want = max(p.grad.abs().max() for p in model.parameters() if p.grad is not None)
    got = global_grad_norm(model.parameters(), math.inf)
    torch.testing.assert_close(got, want)
