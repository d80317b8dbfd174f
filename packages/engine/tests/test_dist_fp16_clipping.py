"""fp16 (dynamic loss scaling) with clip_grad_norm on two data ranks.

Clipping must see the *unscaled* gradient: its norm is compared with ``clip_grad_norm`` and the
coefficient applied to what the optimizer uses (torch.amp.GradScaler's rule: unscale, then clip).
An overflow anywhere must skip clipping and the optimizer on every rank.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as tdist
from engine_testlib import make_data, make_model
from torch import nn

from tessera.context import ParallelMode, create_context
from tessera.engine import initialize

M = ParallelMode

CLIP = 0.05
SCALE = 2.0**10
LR = 0.1
#: fp16 autocast against the fp32 reference: the update is off by about 1e-3 relative.
RTOL, ATOL = 1e-2, 2e-5


def _sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)


def _fp16_clip(variant: str) -> dict[str, Any]:
    ctx = create_context(dict(parallel={}), timeout=60)  # dp2
    try:
        d = ctx.get_local_rank(M.DATA)
        model = make_model(seed=d)  # initialize equalizes the replicas
        config: dict[str, Any] = {
            "fp16": {"mode": "torch", "init_scale": SCALE, "growth_interval": 1000},
            "clip_grad_norm": CLIP,
        }
        if variant == "handler":
            config["gradient_handlers"] = [{"type": "DataParallelGradientHandler"}]
        engine, *_ = initialize(
            model, _sgd(model), nn.CrossEntropyLoss(), config=config, context=ctx
        )
        assert engine.loss_scaler is not None
        params = list(engine.parameters())
        initial = [p.detach().clone() for p in params]

        # step 0: rank 1 overflows after backward (after DDP's all-reduce: rank 0 stays finite)
        x, y = make_data(8, seed=0)
        engine.zero_grad()
        engine.backward(engine.criterion(engine(x[4 * d : 4 * d + 4]), y[4 * d : 4 * d + 4]))
        if d == 1:
            params[0].grad[0, 0] = float("inf")  # type: ignore[index]
        pre = [p.grad.detach().clone() for p in params]  # type: ignore[union-attr]
        if variant == "handler":  # what the handler's average will make of them
            for g in pre:
                tdist.all_reduce(g)
                g.div_(2)
        stepped = engine.step()
        # unscaled, but not clipped: the finite entries are exactly the averaged grads / S
        grads_ok = all(
            torch.equal(p.grad, g / SCALE)  # type: ignore[arg-type]
            for p, g in zip(params, pre, strict=True)
        )
        overflow = {
            "stepped": stepped,
            "unchanged": all(torch.equal(p, q) for p, q in zip(params, initial, strict=True)),
            "optimizer_state": len(engine.optimizer.state),
            "grads_unscaled_not_clipped": grads_ok,
            "scale": engine.loss_scaler.scale,
            "skipped": engine.skipped_steps,
            "global_step": engine.global_step,
        }

        # steps 1 and 2: clean, each data rank on its own half of the batch
        stepped_clean = []
        for s in (1, 2):
            x, y = make_data(8, seed=s)
            engine.zero_grad()
            engine.backward(engine.criterion(engine(x[4 * d : 4 * d + 4]), y[4 * d : 4 * d + 4]))
            stepped_clean.append(engine.step())
        return {
            "overflow": overflow,
            "stepped_clean": stepped_clean,
            "scale": engine.loss_scaler.scale,
            "update": [p.detach() - q for p, q in zip(params, initial, strict=True)],
        }
    finally:
        ctx.destroy()


def _reference_update(clip: float) -> list[torch.Tensor]:
    """fp32, one process, full batches of steps 1 and 2 (step 0 was skipped)."""
    model = make_model(seed=0)
    initial = [p.detach().clone() for p in model.parameters()]
    opt = _sgd(model)
    for s in (1, 2):
        x, y = make_data(8, seed=s)
        opt.zero_grad()
        nn.CrossEntropyLoss()(model(x), y).backward()
        if clip:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            assert norm > clip, f"reference norm {norm} does not exceed {clip}: nothing clipped"
            # the scaled norm is S times larger: clipping by it would shrink the update S-fold
            assert norm * SCALE / 2 > clip
        opt.step()
    return [p.detach() - q for p, q in zip(model.parameters(), initial, strict=True)]


@pytest.mark.parametrize("variant", ["ddp", "handler"])
def test_fp16_clipping_uses_unscaled_norm_and_overflow_skips_it(dist: Any, variant: str) -> None:
    results = dist.run(_fp16_clip, world_size=2, args=(variant,), timeout=120)
    expected = _reference_update(CLIP)
    unclipped = _reference_update(0.0)
    for got, want in zip(unclipped, expected, strict=True):
        # the tolerance tells a clipped update from an unclipped one
        assert not torch.allclose(got, want, rtol=RTOL, atol=ATOL)
    for rank, r in enumerate(results):
        o = r["overflow"]
        assert o["stepped"] is False, rank
        assert o["unchanged"] is True, rank
        assert o["optimizer_state"] == 0, rank  # SGD's momentum buffers were never made
        assert o["grads_unscaled_not_clipped"] is True, rank
        assert o["scale"] == SCALE / 2, rank
        assert o["skipped"] == 1 and o["global_step"] == 0, rank
        assert r["stepped_clean"] == [True, True], rank
        assert r["scale"] == SCALE / 2, rank
        for got, want in zip(r["update"], expected, strict=True):
            torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
    for got, want in zip(results[0]["update"], results[1]["update"], strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)  # the replicas stay identical
