"""initialize() with pipeline parallelism: the schedule from the config, end to end."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as tdist
from torch import nn

from tessera.context import ParallelMode, create_context
from tessera.engine import initialize
from tessera.pipeline import build_pipeline_model

M = ParallelMode


def make_pipe_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))


def pipe_data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(50 + step)
    return torch.randn(8, 4, generator=g), torch.randint(0, 3, (8,), generator=g)


def _pipeline_train(parallel: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    ctx = create_context(dict(parallel=parallel, NUM_MICRO_BATCHES=2, **extra), timeout=60)
    try:
        d, dp = ctx.get_local_rank(M.DATA), ctx.data_size
        chunks = int(extra.get("NUM_CHUNKS", 1))
        full = make_pipe_model()
        stage = build_pipeline_model(full, num_chunks=chunks, method="uniform", context=ctx)
        stages = [stage] if isinstance(stage, nn.Module) else list(stage)
        params = [p for s in stages for p in s.parameters()]
        engine, *_ = initialize(
            stage, torch.optim.SGD(params, lr=0.1), nn.CrossEntropyLoss(), context=ctx
        )
        losses = []
        n = 8 // dp
        for step in range(3):
            x, y = pipe_data(step)
            engine.zero_grad()
            _, _, loss = engine.execute_schedule(
                iter([(x[d * n : d * n + n], y[d * n : d * n + n])])
            )
            engine.step()
            losses.append(None if loss is None else loss.item())
        layers = {
            idx: [p.detach().clone() for p in s[i].parameters()]
            for s in stages
            for i, idx in enumerate(s.layer_indices)
        }
        return {
            "layers": layers,
            "losses": losses,
            "schedule": type(engine.schedule.schedule).__name__,  # type: ignore[attr-defined]
            "handlers": [type(h).__name__ for h in engine.gradient_handlers],
            "rank": tdist.get_rank(),
        }
    finally:
        ctx.destroy()


CASES = {
    "pp2_1f1b": (2, {}, {}, "PipelineSchedule"),
    "pp2_interleaved": (2, {}, {"NUM_CHUNKS": 2}, "InterleavedPipelineSchedule"),
    "dp2_pp2_clip": (4, {}, {"clip_grad_norm": 0.05}, "PipelineSchedule"),
    "pp2_fp16": (2, {}, {"fp16": {"mode": "torch"}}, "PipelineSchedule"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_pipeline_engine_equals_single_process(dist: Any, case: str) -> None:
    world, parallel, extra, schedule = CASES[case]
    parallel = dict(parallel, pipeline=2)
    results = dist.run(_pipeline_train, world_size=world, args=(parallel, extra), timeout=180)
    ref = make_pipe_model()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ref_losses = []
    clip = extra.get("clip_grad_norm", 0.0)
    for step in range(3):
        x, y = pipe_data(step)
        opt.zero_grad()
        loss = nn.CrossEntropyLoss()(ref(x), y)
        loss.backward()
        if clip:
            assert torch.nn.utils.clip_grad_norm_(ref.parameters(), clip) > clip
        opt.step()
        ref_losses.append(loss.item())
    tol = 3e-3 if "fp16" in extra else 1e-5
    seen: set[int] = set()
    for r in results:
        assert r["schedule"] == schedule
        data = ["DataParallelGradientHandler"] if world == 4 else []
        assert r["handlers"] == [*data, "PipelineSharedModuleGradientHandler"]
        for idx, params in r["layers"].items():
            seen.add(idx)
            for got, want in zip(params, ref[idx].parameters(), strict=True):
                torch.testing.assert_close(got, want.detach(), rtol=tol, atol=tol)
        if all(v is not None for v in r["losses"]) and world == 2:
            assert r["losses"] == pytest.approx(ref_losses, rel=tol)
    assert seen == set(range(len(ref)))
    assert sum(all(v is not None for v in r["losses"]) for r in results) == world // 2
