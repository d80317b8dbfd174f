"""dp2 x pp2 x 1D(2) on 8 ranks with clipping: handlers, schedule and global norm together.

The 1D tensor-parallel layers here are written in the test (Megatron-style column and row
linears with their conjugate copy / all-reduce ops, Shoeybi et al. 2019), marking their shards
with ShardInfo: tessera-engine does not depend on tessera-layers, and what it must get right
(DATA averaging, the pipeline schedule, a norm summed over 1D and PIPELINE but not over DATA
or the replicated bias) only depends on the ShardInfo.
"""

from __future__ import annotations

from typing import Any

import torch
from engine_testlib import ColumnLinear, RowLinear
from torch import nn

from tessera.context import ParallelMode, create_context
from tessera.engine import initialize

M = ParallelMode


def make_full() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4), nn.Tanh(),
        nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3),
    )  # fmt: skip


def hybrid_data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(70 + step)
    return torch.randn(8, 4, generator=g), torch.randint(0, 3, (8,), generator=g)


CLIP = 0.05


def _hybrid() -> dict[str, Any]:
    parallel = dict(pipeline=2, tensor=dict(size=2, mode="1d"))
    ctx = create_context(
        dict(parallel=parallel, NUM_MICRO_BATCHES=2, clip_grad_norm=CLIP), timeout=120
    )
    try:
        d, p = ctx.get_local_rank(M.DATA), ctx.get_local_rank(M.PIPELINE)
        full = make_full()
        if p == 0:
            idx = [0, 2]
            stage = nn.Sequential(
                ColumnLinear(full[0], ctx), nn.Tanh(), RowLinear(full[2], ctx), nn.Tanh()
            )
        else:
            idx = [4, 6]
            stage = nn.Sequential(ColumnLinear(full[4], ctx), nn.Tanh(), RowLinear(full[6], ctx))
        engine, *_ = initialize(
            stage, torch.optim.SGD(stage.parameters(), lr=0.1), nn.CrossEntropyLoss(), context=ctx
        )
        for step in range(3):
            x, y = hybrid_data(step)
            engine.zero_grad()
            engine.execute_schedule(iter([(x[4 * d : 4 * d + 4], y[4 * d : 4 * d + 4])]))
            engine.step()
        out = {}
        for layer_index, module in zip(idx, (stage[0], stage[2]), strict=True):
            for name in ("weight", "bias"):
                param = getattr(module, name)
                info = param._tessera_shard_info
                out[(layer_index, name)] = (param.detach().clone(), info.slices)
        plan = engine.schedule.schedule  # type: ignore[attr-defined]  # the runner's plan
        return {"params": out, "schedule": type(plan).__name__}
    finally:
        ctx.destroy()


def test_dp2_pp2_1d2_three_clipped_steps_equal_reference(dist: Any) -> None:
    results = dist.run(_hybrid, world_size=8, timeout=300)
    ref = make_full()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(3):
        x, y = hybrid_data(step)
        opt.zero_grad()
        nn.CrossEntropyLoss()(ref(x), y).backward()
        assert torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP) > CLIP  # really clips
        opt.step()
    covered = set()
    for r in results:
        assert r["schedule"] == "PipelineSchedule"
        for (layer, name), (local, slices) in r["params"].items():
            want = getattr(ref[layer], name).detach()[slices]
            torch.testing.assert_close(local, want, rtol=1e-5, atol=1e-6)
            covered.add((layer, name))
    assert len(covered) == 8  # every parameter of the model was checked
