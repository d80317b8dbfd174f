"""Master-weight mixed precision in one process: fp16/bf16 models with fp32 masters.

``fp16=dict(mode="naive")`` / ``bf16=dict(mode="naive")`` hold the model in the low-precision
format and the optimizer on fp32 copies. Checked here: the numbers against fp32 training, the
loss-scale sequence against ``torch.amp.GradScaler``, and checkpoints that hold the masters.

Tolerance: training compares the *update* of each parameter (master after the steps minus the
common start) with the fp32 reference's, by relative norm. The forward and backward run in the
low-precision format, so each gradient carries a few rounding errors of relative size u
(unit roundoff: 2**-11 for float16's 11 significant bits, 2**-8 for bfloat16's 8); the masters
add no error of their own. Measured: about 1.3 u for both formats on this model; the bound
is 8 u. An optimizer stepping the low-precision weights themselves loses every update below
half their spacing: at a small learning rate that is the whole update (checked below).
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_testlib import make_data, make_model
from torch import nn

from tessera.context import ConfigError
from tessera.engine import (
    Engine,
    MasterWeights,
    initialize,
    load_checkpoint,
    save_checkpoint,
)

#: Unit roundoff of each format: half the spacing of its numbers relative to their size.
UNIT = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
CONFIGS = {
    torch.float16: {"fp16": {"mode": "naive", "init_scale": 2.0**10}},
    torch.bfloat16: {"bf16": {"mode": "naive"}},
}
OPTIMIZERS = {
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2),
    # lr * |g| is mostly below half the float16 spacing of these weights (~1e-4); smaller
    # rates would make the fp32 reference's own rounding (2**-24 of the weight) count
    "sgd_tiny_lr": lambda ps: torch.optim.SGD(ps, lr=1e-4),
}


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm())


@pytest.mark.parametrize("opt", list(OPTIMIZERS))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_master_weights_train_like_fp32(dtype: torch.dtype, opt: str) -> None:
    make_opt = OPTIMIZERS[opt]
    model, ref = make_model(), make_model()
    start = [p.detach().clone() for p in ref.parameters()]
    engine, *_ = initialize(
        model, make_opt(model.parameters()), nn.CrossEntropyLoss(), config=CONFIGS[dtype]
    )
    ref_opt = make_opt(ref.parameters())
    masters = engine.master_weights
    assert masters is not None and engine.autocast_dtype is None
    assert [m.dtype for m in masters.masters] == [torch.float32] * 4
    assert all(p.dtype == dtype for p in model.parameters())
    # the optimizer was rebuilt over the masters, with the same settings
    assert [p for g in engine.optimizer.param_groups for p in g["params"]] == masters.masters
    assert type(engine.optimizer) is type(ref_opt)
    for step in range(4):
        x, y = make_data(8, seed=step)
        engine.zero_grad()
        out = engine(x)  # the fp32 batch is cast to the model's format
        assert out.dtype == dtype
        loss = engine.criterion(out, y)
        assert loss.dtype == torch.float32
        engine.backward(loss)
        assert engine.step() is True
        ref_opt.zero_grad()
        nn.CrossEntropyLoss()(ref(x), y).backward()
        ref_opt.step()
    assert all(p.grad is None for p in model.parameters())  # moved into the masters
    pieces = zip(model.parameters(), masters.masters, ref.parameters(), start, strict=True)
    for p, m, q, s in pieces:
        assert p.dtype == dtype and m.dtype == torch.float32
        assert torch.equal(p, m.to(dtype))  # the model is its masters, rounded
        assert _rel(m.detach() - s, q.detach() - s) <= 8 * UNIT[dtype]
    for state in engine.optimizer.state.values():
        assert all(v.dtype == torch.float32 for v in state.values())
    if opt == "sgd_tiny_lr":  # each step's update is below half the weights' spacing
        x, y = make_data(8, seed=0)
        low = make_model().to(dtype)
        nn.CrossEntropyLoss()(low(x.to(dtype)).float(), y).backward()
        with torch.no_grad():
            lost = sum(int((p - 1e-4 * p.grad == p).sum()) for p in low.parameters())  # type: ignore[operator]
        # stepping the low-precision weights themselves would leave most of them where they are
        assert lost >= 0.9 * sum(p.numel() for p in low.parameters())


def test_masters_carry_marks_and_tied_parameters_share_one() -> None:
    from tessera.context import ParallelMode, ShardInfo, get_shard_info, set_shard_info

    model = make_model()
    info = ShardInfo.from_split((8, 4), {}, replicated_modes=[ParallelMode.DATA])
    set_shard_info(model[0].weight, info)
    model[0].weight._tessera_custom = "kept"  # type: ignore[attr-defined]
    model.register_buffer("offset", torch.ones(3))
    model.register_buffer("count", torch.zeros(1, dtype=torch.int64))
    tied = nn.ModuleList([model, nn.Linear(4, 8)])
    tied[1].weight = model[0].weight
    masters = MasterWeights(tied, torch.bfloat16)
    assert len(masters.masters) == 5  # 4 of the model + the second linear's bias
    master = masters.master_of(model[0].weight)
    assert master is not None and get_shard_info(master) == info
    assert master._tessera_custom == "kept"  # type: ignore[attr-defined]
    assert model.offset.dtype == torch.bfloat16 and model.count.dtype == torch.int64
    with pytest.raises(ValueError, match="not a floating-point parameter of the model"):
        masters.rebuild_optimizer(torch.optim.SGD([nn.Parameter(torch.ones(2))], lr=0.1))
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        MasterWeights(make_model(), torch.float32)
    with pytest.raises(ValueError, match="two mixed-precision modes"):
        Engine(model, masters.rebuild_optimizer(torch.optim.SGD(tied.parameters(), lr=0.1)),
               autocast_dtype=torch.float16, master_weights=masters)  # fmt: skip


def test_gradient_accumulation_and_zero_grad_clear_the_model_gradients() -> None:
    """Two micro-steps of half batches equal one step of the full batch (up to fp16 rounding)."""
    config: dict[str, Any] = {"fp16": {"mode": "naive"}, "gradient_accumulation": 2}
    runs = []
    for accumulation in (2, 1):
        model = make_model()
        config["gradient_accumulation"] = accumulation
        engine, *_ = initialize(
            model, torch.optim.SGD(model.parameters(), lr=0.5), nn.CrossEntropyLoss(),
            config=config,
        )  # fmt: skip
        # a stray backward whose gradient zero_grad must clear (the optimizer clears masters)
        engine.backward(engine.criterion(engine(make_data(8, seed=9)[0]), make_data(8)[1]))
        for step in range(2):
            x, y = make_data(8, seed=step)
            engine.zero_grad()
            for part in range(accumulation):
                n = 8 // accumulation
                xs, ys = x[part * n : part * n + n], y[part * n : part * n + n]
                engine.backward(engine.criterion(engine(xs), ys))
                engine.step()
        assert engine.master_weights is not None
        runs.append([m.detach().clone() for m in engine.master_weights.masters])
    for got, want in zip(*runs, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=2e-3)


def _scale_sequence_tessera(overflow_at: set[int], steps: int) -> list[tuple[bool, float]]:
    """(stepped, scale after the step) of an fp16 master-weight job, overflowing for real."""
    model = make_model()
    config = {"fp16": {"mode": "naive", "init_scale": 2.0**8, "growth_interval": 2}}
    engine, *_ = initialize(
        model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(), config=config
    )
    assert engine.loss_scaler is not None and engine.master_weights is not None
    seen = []
    for step in range(steps):
        x, y = make_data(8, seed=step)
        engine.zero_grad()
        loss = engine.criterion(engine(x), y)
        if step in overflow_at:  # 1e6 * scale * grad is far above float16's max, 65504
            loss = loss * 1e6
        before = [m.detach().clone() for m in engine.master_weights.masters]
        engine.backward(loss)
        stepped = engine.step()
        changed = any(
            not torch.equal(m, b)
            for m, b in zip(engine.master_weights.masters, before, strict=True)
        )
        assert changed == stepped
        seen.append((stepped, engine.loss_scaler.scale))
    assert engine.skipped_steps == len(overflow_at)
    return seen


def _scale_sequence_grad_scaler(overflow_at: set[int], steps: int) -> list[tuple[bool, float]]:
    """The same with torch.amp.GradScaler on an fp32 model (its overflow is injected)."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2)
    seen = []
    for step in range(steps):
        x, y = make_data(8, seed=step)
        opt.zero_grad()
        scaler.scale(nn.CrossEntropyLoss()(model(x), y)).backward()
        if step in overflow_at:
            model[0].weight.grad[0, 0] = math.inf  # type: ignore[index]
        before = [p.detach().clone() for p in model.parameters()]
        scaler.step(opt)
        scaler.update()
        stepped = any(
            not torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True)
        )
        seen.append((stepped, float(scaler.get_scale())))
    return seen


def test_loss_scale_and_skips_follow_grad_scaler() -> None:
    overflow_at, steps = {1, 2, 5}, 9
    got = _scale_sequence_tessera(overflow_at, steps)
    want = _scale_sequence_grad_scaler(overflow_at, steps)
    assert got == want
    scales = [2.0**8] + [s for _, s in want]
    ratios = {b / a for a, b in itertools.pairwise(scales)}
    assert ratios == {0.5, 1.0, 2.0}  # back-offs, waits and growths: the pattern has them all
    assert [stepped for stepped, _ in want].count(False) == len(overflow_at)


def _train(engine: Engine, steps: range) -> list[float]:
    losses = []
    for step in steps:
        x, y = make_data(8, seed=step)
        engine.zero_grad()
        loss = engine.criterion(engine(x), y)
        engine.backward(loss)
        assert engine.step()
        losses.append(loss.item())
    return losses


def _engine(config: dict[str, Any], seed: int = 0, lr: float = 1e-2) -> Engine:
    model = make_model(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    engine, *_ = initialize(model, opt, nn.CrossEntropyLoss(), config=config)
    return engine


def _weights(engine: Engine) -> list[torch.Tensor]:
    """What the optimizer steps: the masters, or the fp32 parameters."""
    if engine.master_weights is not None:
        return [m.detach().clone() for m in engine.master_weights.masters]
    return [p.detach().clone() for p in engine.parameters()]


def _states(engine: Engine) -> list[dict[str, torch.Tensor]]:
    opt = engine.optimizer
    return [
        {k: v.clone() for k, v in opt.state[p].items()}
        for g in opt.param_groups
        for p in g["params"]
    ]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_checkpoint_holds_the_masters_and_loads_into_any_precision(
    tmp_path: Path, dtype: torch.dtype
) -> None:
    config = CONFIGS[dtype]
    saved = _engine(config)
    _train(saved, range(2))
    save_checkpoint(tmp_path / "ckpt", saved, step=2)
    at_save, states_at_save = _weights(saved), _states(saved)
    scaler_at_save = saved.loss_scaler.state_dict() if saved.loss_scaler is not None else None
    uninterrupted = _train(saved, range(2, 4))

    # a fresh master-weight job (other weights, other lr): continues bit for bit
    resumed = _engine(config, seed=5, lr=0.5)
    load_checkpoint(tmp_path / "ckpt", resumed)
    assert resumed.optimizer.param_groups[0]["lr"] == 1e-2
    assert resumed.master_weights is not None
    for p, m in resumed.master_weights.pairs():  # the model holds its masters, rounded
        assert p.dtype == dtype and torch.equal(p, m.to(dtype))
    if resumed.loss_scaler is not None:
        assert resumed.loss_scaler.state_dict() == scaler_at_save
    assert _train(resumed, range(2, 4)) == uninterrupted
    for got, want in zip(_weights(resumed), _weights(saved), strict=True):
        assert torch.equal(got, want)

    # an fp32 job reads the masters and their fp32 optimizer state exactly
    full = _engine({}, seed=5, lr=0.5)
    load_checkpoint(tmp_path / "ckpt", full)
    for got, want in zip(_weights(full), at_save, strict=True):
        assert got.dtype == torch.float32 and torch.equal(got, want)
    for got_state, want_state in zip(_states(full), states_at_save, strict=True):
        assert got_state.keys() == want_state.keys()
        assert all(torch.equal(got_state[k], want_state[k]) for k in want_state)
    fp32_losses = _train(full, range(2, 4))
    assert fp32_losses == pytest.approx(uninterrupted, rel=16 * UNIT[dtype])

    # and an fp32 checkpoint loads into a master-weight job exactly
    save_checkpoint(tmp_path / "fp32", full, step=4)
    back = _engine(config, seed=6)
    load_checkpoint(tmp_path / "fp32", back)
    for got, want in zip(_weights(back), _weights(full), strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize(
    ("config", "match"),
    [
        ({"fp16": {"mode": "fancy"}}, "fp16.mode 'fancy' is not supported.*mode='naive'"),
        ({"bf16": {"mode": "fancy"}}, "bf16.mode 'fancy' is not supported"),
        ({"bf16": {"init_scale": 2.0}}, "bf16.init_scale is a loss-scaling key"),
        ({"bf16": {"mdoe": "naive"}}, "unknown key 'bf16.mdoe'.*did you mean 'bf16.mode'"),
        ({"bf16": "naive"}, "bf16 must be True, False, absent or a dict"),
        ({"fp16": {"mode": "naive"}, "bf16": {"mode": "naive"}}, "both set"),
        ({"bf16": {"mode": "naive"}, "zero": {"stage": 2}}, "not supported with zero.stage 2"),
        ({"fp16": {"mode": "naive"}, "zero": {"stage": 3}}, "not supported with zero.stage 3"),
    ],
)
def test_master_weight_config_errors(config: dict[str, Any], match: str) -> None:
    model = make_model()
    with pytest.raises(ConfigError, match=match):
        initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), config=config)


def test_master_weight_modes_switch_off_and_on() -> None:
    for config, autocast, master in [
        ({"bf16": {"mode": "torch"}}, torch.bfloat16, None),
        ({"bf16": {"mode": None}}, None, None),
        ({"bf16": {"mode": "naive"}}, None, torch.bfloat16),
        ({"fp16": {"mode": "naive"}}, None, torch.float16),
    ]:
        model = make_model()
        engine, *_ = initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), config=config)
        assert engine.autocast_dtype == autocast
        got = engine.master_weights.dtype if engine.master_weights is not None else None
        assert got == master, config
        assert (engine.loss_scaler is not None) == ("fp16" in config)
        assert engine.nonfinite == ("skip" if "fp16" in config else "raise")
