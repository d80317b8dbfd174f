"""Gradient accumulation under ZeRO (DDP's no_sync with ZeroRedundancyOptimizer, FSDP2's
``set_requires_gradient_sync``) and bf16 on two data ranks, against one process."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as tdist
from engine_testlib import adam, make_data, make_model, reference_params, sgd
from torch import nn

from tessera.context import create_context
from tessera.engine import initialize


def _full(p: torch.Tensor) -> torch.Tensor:
    full = getattr(p, "full_tensor", None)
    return (full() if callable(full) else p).detach().clone()


def _accumulate(zero: dict[str, Any]) -> dict[str, Any]:
    ctx = create_context(dict(parallel={}), timeout=60)
    try:
        rank = tdist.get_rank()
        model = make_model(seed=rank)
        opt = adam(model)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        config = {"zero": zero, "gradient_accumulation": 2}
        engine, _, _, sched = initialize(
            model, opt, nn.CrossEntropyLoss(), lr_scheduler=sched, config=config, context=ctx
        )
        stepped, lrs = [], []
        for s in range(2):  # two optimizer steps of 2 micro-steps of 2 samples per rank
            x, y = make_data(8, seed=s)
            xs, ys = x[4 * rank : 4 * rank + 4], y[4 * rank : 4 * rank + 4]
            for i in range(2):
                engine.zero_grad()
                mb = slice(2 * i, 2 * i + 2)
                engine.backward(engine.criterion(engine(xs[mb]), ys[mb]))
                stepped.append(engine.step())
                sched.step()
                lrs.append(engine.optimizer.param_groups[0]["lr"])
        return {
            "stepped": stepped,
            "lrs": lrs,
            "params": [_full(p) for p in engine.parameters()],
        }
    finally:
        ctx.destroy()


def _reference_with_step_lr() -> list[torch.Tensor]:
    """One process, full batches, Adam with the lr halved after each step."""
    model = make_model()
    opt = adam(model)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for s in range(2):
        x, y = make_data(8, seed=s)
        opt.zero_grad()
        nn.CrossEntropyLoss()(model(x), y).backward()
        opt.step()
        sched.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("stage", [1, 2, 3], ids=["zero1", "zero2", "zero3"])
def test_zero_accumulation_2xb_equals_1x2b(dist: Any, stage: int) -> None:
    """Also: the lr scheduler built on the user's optimizer drives the one ZeRO made."""
    results = dist.run(_accumulate, world_size=2, args=({"stage": stage},), timeout=180)
    expected = _reference_with_step_lr()
    for r in results:
        assert r["stepped"] == [False, True, False, True]
        # the lr scheduler steps once per optimizer step (0.01 -> 0.005 -> 0.0025)
        assert r["lrs"] == pytest.approx([0.01, 0.005, 0.005, 0.0025])
        for got, want in zip(r["params"], expected, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def _bf16(use_handler: bool) -> dict[str, Any]:
    ctx = create_context(dict(parallel={}), timeout=60)
    try:
        rank = tdist.get_rank()
        model = make_model(seed=rank)
        config: dict[str, Any] = {"bf16": True}
        if use_handler:
            config["gradient_handlers"] = [{"type": "DataParallelGradientHandler"}]
        engine, *_ = initialize(
            model, sgd(model), nn.CrossEntropyLoss(), config=config, context=ctx
        )
        dtypes = []
        for s in range(3):
            x, y = make_data(8, seed=s)
            engine.zero_grad()
            out = engine(x[4 * rank : 4 * rank + 4])
            dtypes.append(out.dtype)
            engine.backward(engine.criterion(out, y[4 * rank : 4 * rank + 4]))
            assert engine.step()
        return {"dtypes": dtypes, "params": [p.detach().clone() for p in engine.parameters()]}
    finally:
        ctx.destroy()


@pytest.mark.parametrize("use_handler", [False, True], ids=["ddp", "handler"])
def test_bf16_on_two_data_ranks_runs_close_to_fp32(dist: Any, use_handler: bool) -> None:
    results = dist.run(_bf16, world_size=2, args=(use_handler,), timeout=120)
    expected = reference_params([make_data(8, seed=s) for s in range(3)], sgd)
    for r in results:
        assert r["dtypes"] == [torch.bfloat16] * 3
        for got, want in zip(r["params"], expected, strict=True):
            torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    for a, b in zip(results[0]["params"], results[1]["params"], strict=True):
        assert torch.equal(a, b)  # the replicas stay bitwise equal
