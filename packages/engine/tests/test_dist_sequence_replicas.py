"""Sequence parallelism dp2 x seq2 on 4 ranks: ``initialize`` makes the replicas equal over
SEQUENCE_DP (every rank built its model from another seed), picks the sequence-parallel
handler by itself, and clipping counts each replicated parameter once."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as tdist
from torch import nn

from tessera.context import ParallelMode, create_context
from tessera.engine import SequenceParallelGradientHandler, global_grad_norm, initialize

M = ParallelMode
CLIP = 0.05


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 4))  # token-wise: [b, s, h]


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(30 + step)
    return torch.randn(4, 6, 4, generator=g), torch.randn(4, 6, 4, generator=g)  # [b, s, h]


def _train(clip: float) -> dict[str, Any]:
    config = dict(parallel=dict(tensor=dict(size=2, mode="sequence")), clip_grad_norm=clip)
    ctx = create_context(config, timeout=60)
    try:
        d, s = ctx.get_local_rank(M.DATA), ctx.get_local_rank(M.SEQUENCE)
        model = _model(seed=100 + tdist.get_rank())  # different on every rank on purpose
        engine, *_ = initialize(
            model, torch.optim.SGD(model.parameters(), lr=0.5), nn.MSELoss(), context=ctx
        )
        start = [p.detach().clone() for p in engine.parameters()]
        handlers = [type(h).__name__ for h in engine.gradient_handlers]
        norms = []
        for step in range(2):
            x, t = _data(step)
            xs = x[2 * d : 2 * d + 2, 3 * s : 3 * s + 3]  # [b/2, s/2, h]
            ts = t[2 * d : 2 * d + 2, 3 * s : 3 * s + 3]
            engine.zero_grad()
            engine.backward(engine.criterion(engine(xs), ts))  # mean over own sub-sequence
            # the norm the engine clips with, after the handler (which is idempotent here:
            # run it on a copy of the gradients so the step below sees the raw ones)
            saved = [p.grad.clone() for p in engine.parameters()]  # type: ignore[union-attr]
            (handler,) = engine.gradient_handlers
            assert isinstance(handler, SequenceParallelGradientHandler)
            handler.handle_gradient()
            norms.append(global_grad_norm(engine.parameters(), context=ctx).item())
            for p, g in zip(engine.parameters(), saved, strict=True):
                p.grad = g
            assert engine.step()
        return {
            "start": start,
            "handlers": handlers,
            "norms": norms,
            "params": [p.detach().clone() for p in engine.parameters()],
        }
    finally:
        ctx.destroy()


@pytest.mark.parametrize("clip", [0.0, CLIP], ids=["noclip", "clip"])
def test_sequence_replicas_start_equal_and_clip_like_one_process(dist: Any, clip: float) -> None:
    results = dist.run(_train, world_size=4, args=(clip,), timeout=120)
    first = results[0]["start"]
    for r in results:
        assert r["handlers"] == ["SequenceParallelGradientHandler"]
        for a, b in zip(r["start"], first, strict=True):
            assert torch.equal(a, b)  # equalized over SEQUENCE_DP (data x sequence)
    ref = _model(seed=100)  # global rank 0's model is the one broadcast
    for a, b in zip(ref.parameters(), first, strict=True):
        assert torch.equal(a.detach(), b)
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    ref_norms = []
    for step in range(2):
        x, t = _data(step)
        opt.zero_grad()
        nn.MSELoss()(ref(x), t).backward()
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), clip if clip else float("inf"))
        if clip:
            assert norm > clip  # the test really clips
        ref_norms.append(norm.item())
        opt.step()
    for r in results:
        assert r["norms"] == pytest.approx(ref_norms, rel=1e-5)
        for got, want in zip(r["params"], ref.parameters(), strict=True):
            torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)
