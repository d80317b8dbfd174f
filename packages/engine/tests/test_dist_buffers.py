"""Data-parallel replicas agree on buffers (BatchNorm's running statistics), as under DDP.

pipeline 2 x data 2 on 4 gloo ranks: the engine averages gradients with its
DataParallelGradientHandler (DDP does not fit a pipeline), which also copies the first
replica's buffers to the other at every step unless ``ddp=dict(broadcast_buffers=False)``.
ZeRO-3 on 2 data ranks: FSDP2 syncs no buffers, the engine's BufferBroadcastHandler does.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tessera.context import ParallelMode, create_context
from tessera.engine import initialize
from tessera.pipeline import build_pipeline_model

M = ParallelMode
STEPS, MICRO = 2, 4


def _model() -> nn.Sequential:
    torch.manual_seed(0)  # BN on the inputs (stage 0) and on hidden activations (stage 1)
    return nn.Sequential(
        nn.BatchNorm1d(4), nn.Linear(4, 8), nn.Tanh(), nn.BatchNorm1d(8), nn.Linear(8, 3)
    )


def _replica_batch(step: int, data_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(70 + step)
    x = torch.randn(16, 4, generator=g) * 3 + 1  # [16, 4], far from BN's initial statistics
    y = torch.randint(0, 3, (16,), generator=g)
    rows = slice(8 * data_rank, 8 * data_rank + 8)  # each replica its own half
    return x[rows], y[rows]


def _steps(ctx: Any, config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Train a fresh stage for STEPS steps under ``config``; return its buffers."""
    d = ctx.get_local_rank(M.DATA)
    stage = build_pipeline_model(_model(), method=[0, 3, 5], context=ctx)
    assert isinstance(stage, nn.Module)
    optimizer = torch.optim.SGD(stage.parameters(), lr=0.1)
    engine, *_ = initialize(stage, optimizer, nn.CrossEntropyLoss(), config=config, context=ctx)
    for step in range(STEPS):
        engine.zero_grad()
        engine.execute_schedule(iter([_replica_batch(step, d)]))
        engine.step()
    return {name: b.clone() for name, b in stage.named_buffers()}


def _train() -> dict[str, Any]:
    config: dict[str, Any] = dict(parallel=dict(pipeline=2), NUM_MICRO_BATCHES=MICRO)
    ctx = create_context(config, timeout=60)
    try:
        return {
            "data": ctx.get_local_rank(M.DATA),
            "stage": ctx.get_local_rank(M.PIPELINE),
            "default": _steps(ctx, config),
            "off": _steps(ctx, {**config, "ddp": {"broadcast_buffers": False}}),
        }
    finally:
        ctx.destroy()


def _by_stage(results: list[dict[str, Any]], key: str) -> dict[int, list[dict[str, Any]]]:
    out: dict[int, list[dict[str, Any]]] = {0: [{}, {}], 1: [{}, {}]}
    for r in results:
        out[r["stage"]][r["data"]] = r[key]
    return out


def test_replicas_hold_the_first_replicas_batchnorm_statistics(dist: Any) -> None:
    results = dist.run(_train, world_size=4, timeout=180)
    stages = _by_stage(results, "default")
    for first, second in stages.values():
        assert first.keys() == second.keys() and first
        for name in first:
            torch.testing.assert_close(second[name], first[name], rtol=0, atol=0, msg=name)
    # what the first replica computed: stage 0's BN saw only replica 0's microbatches
    reference = nn.BatchNorm1d(4)
    for step in range(STEPS):
        x, _ = _replica_batch(step, 0)
        for micro in x.chunk(MICRO):
            reference(micro)
    torch.testing.assert_close(stages[0][0]["0.running_mean"], reference.running_mean)
    torch.testing.assert_close(stages[0][0]["0.running_var"], reference.running_var)
    assert int(stages[0][0]["0.num_batches_tracked"]) == STEPS * MICRO
    # ddp=dict(broadcast_buffers=False), DDP's switch: each replica keeps its own statistics
    first, second = _by_stage(results, "off")[0]
    assert not torch.equal(first["0.running_mean"], second["0.running_mean"])


def _zero3(broadcast: bool) -> dict[str, torch.Tensor]:
    config: dict[str, Any] = dict(zero=dict(stage=3), ddp=dict(broadcast_buffers=broadcast))
    ctx = create_context(config, timeout=60)
    try:
        d = ctx.get_local_rank(M.DATA)
        model = _model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        engine, *_ = initialize(model, optimizer, nn.CrossEntropyLoss(), config=config, context=ctx)
        for step in range(STEPS):
            engine.zero_grad()
            x, y = _replica_batch(step, d)
            engine.backward(engine.criterion(engine(x), y))
            engine.step()
        return {name: b.clone() for name, b in model.named_buffers()}
    finally:
        ctx.destroy()


def test_zero3_replicas_hold_the_first_replicas_batchnorm_statistics(dist: Any) -> None:
    synced = dist.run(_zero3, world_size=2, args=(True,), timeout=180)
    assert synced[0].keys() == synced[1].keys() and synced[0]
    for name in synced[0]:
        torch.testing.assert_close(synced[1][name], synced[0][name], rtol=0, atol=0, msg=name)
    reference = nn.BatchNorm1d(4)
    for step in range(STEPS):
        reference(_replica_batch(step, 0)[0])
    torch.testing.assert_close(synced[0]["0.running_mean"], reference.running_mean)
    apart = dist.run(_zero3, world_size=2, args=(False,), timeout=180)
    assert not torch.equal(apart[0]["0.running_mean"], apart[1]["0.running_mean"])
