"""The engine with a pipeline, beyond the plain schedules: TENSOR_SHAPE from the config, an fp16
overflow on one stage only, ZeRO-1 per stage, and the Trainer on dp2 x pp2 (who shows what)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as tdist
from torch import nn
from torch.utils.data import TensorDataset

from tessera.context import ParallelMode, create_context
from tessera.engine import AccuracyHook, LossHook, Trainer, get_dataloader, initialize
from tessera.pipeline import build_pipeline_model

M = ParallelMode


def make_pipe_model() -> nn.Sequential:
    torch.manual_seed(0)
    # every stage boundary of a uniform split carries a [b, 8] activation
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))


def pipe_data(step: int, n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(60 + step)
    return torch.randn(n, 4, generator=g), torch.randint(0, 3, (n,), generator=g)


def _layers(stage: Any) -> dict[int, list[torch.Tensor]]:
    return {
        idx: [p.detach().clone() for p in stage[i].parameters()]
        for i, idx in enumerate(stage.layer_indices)
    }


def _reference(
    opt_name: str, steps: int, batches: list[tuple[torch.Tensor, torch.Tensor]] | None = None
) -> tuple[nn.Sequential, list[float]]:
    ref = make_pipe_model()
    opt: torch.optim.Optimizer = (
        torch.optim.Adam(ref.parameters(), lr=0.01)
        if opt_name == "adam"
        else torch.optim.SGD(ref.parameters(), lr=0.1)
    )
    losses = []
    for step in range(steps):
        x, y = batches[step] if batches is not None else pipe_data(step)
        opt.zero_grad()
        loss = nn.CrossEntropyLoss()(ref(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return ref, losses


def _check_layers(results: list[dict[str, Any]], ref: nn.Sequential, tol: float) -> None:
    seen: set[int] = set()
    for r in results:
        for idx, params in r["layers"].items():
            seen.add(idx)
            for got, want in zip(params, ref[idx].parameters(), strict=True):
                torch.testing.assert_close(got, want.detach(), rtol=tol, atol=tol)
    assert seen == set(range(len(ref)))


# ------------------------------------------------------------------ TENSOR_SHAPE


def _tensor_shape() -> dict[str, Any]:
    config = dict(parallel=dict(pipeline=2), NUM_MICRO_BATCHES=2, TENSOR_SHAPE=[4, 8])
    ctx = create_context(config, timeout=60)
    try:
        stage = build_pipeline_model(make_pipe_model(), method="uniform", context=ctx)
        assert isinstance(stage, nn.Module)
        engine, *_ = initialize(
            stage, torch.optim.SGD(stage.parameters(), lr=0.1), nn.CrossEntropyLoss(), context=ctx
        )
        for step in range(2):
            engine.zero_grad()
            engine.execute_schedule(iter([pipe_data(step)]))
            assert engine.step()
        schedule: Any = engine.schedule.schedule  # type: ignore[attr-defined]  # the runner's plan
        return {
            "schedule": type(schedule).__name__,
            "shape": getattr(schedule, "tensor_shape", None),
            "micro": getattr(schedule, "num_microbatches", None),
            "layers": _layers(stage),
        }
    finally:
        ctx.destroy()


def test_tensor_shape_and_micro_batches_reach_the_schedule(dist: Any) -> None:
    results = dist.run(_tensor_shape, world_size=2, timeout=120)
    for r in results:
        assert (r["schedule"], r["shape"], r["micro"]) == ("PipelineSchedule", (4, 8), 2)
    _check_layers(results, _reference("sgd", 2)[0], 1e-5)


# ------------------------------------------------------------------ fp16 overflow on one stage


def _fp16_inf_on_first_stage() -> dict[str, Any]:
    config = dict(parallel=dict(pipeline=2), NUM_MICRO_BATCHES=2, fp16=dict(mode="torch"))
    ctx = create_context(config, timeout=60)
    try:
        p = ctx.get_local_rank(M.PIPELINE)
        stage = build_pipeline_model(make_pipe_model(), method="uniform", context=ctx)
        assert isinstance(stage, nn.Module)
        engine, *_ = initialize(
            stage, torch.optim.SGD(stage.parameters(), lr=0.1), nn.CrossEntropyLoss(), context=ctx
        )
        before = [q.detach().clone() for q in engine.parameters()]
        stepped, unchanged = [], None
        for step in range(2):
            engine.zero_grad()
            engine.execute_schedule(iter([pipe_data(step)]))
            if step == 0 and p == 0:
                grad = next(engine.parameters()).grad
                assert grad is not None
                grad[0, 0] = float("inf")  # the last stage's gradients are all finite
            stepped.append(engine.step())
            if step == 0:
                unchanged = all(
                    torch.equal(a, b) for a, b in zip(before, engine.parameters(), strict=True)
                )
        assert engine.loss_scaler is not None
        return {
            "stepped": stepped,
            "unchanged": unchanged,
            "scale": engine.loss_scaler.scale,
            "skipped": engine.skipped_steps,
            "global_step": engine.global_step,
        }
    finally:
        ctx.destroy()


def test_fp16_inf_on_one_stage_skips_the_step_on_every_stage(dist: Any) -> None:
    results = dist.run(_fp16_inf_on_first_stage, world_size=2, timeout=120)
    for r in results:
        assert r["stepped"] == [False, True]
        assert r["unchanged"] is True
        assert (r["skipped"], r["global_step"]) == (1, 1)
        assert r["scale"] == 2.0**15  # backed off once from 2**16, everywhere


# ------------------------------------------------------------------ ZeRO-1 per pipeline stage


def _zero1_pipeline() -> dict[str, Any]:
    config = dict(parallel=dict(pipeline=2), NUM_MICRO_BATCHES=2, zero=dict(stage=1))
    ctx = create_context(config, timeout=60)
    try:
        d = ctx.get_local_rank(M.DATA)
        stage = build_pipeline_model(make_pipe_model(), method="uniform", context=ctx)
        assert isinstance(stage, nn.Module)
        engine, *_ = initialize(
            stage,
            torch.optim.Adam(stage.parameters(), lr=0.01),
            nn.CrossEntropyLoss(),
            context=ctx,
        )
        for step in range(3):
            x, y = pipe_data(step)
            engine.zero_grad()
            engine.execute_schedule(iter([(x[4 * d : 4 * d + 4], y[4 * d : 4 * d + 4])]))
            assert engine.step()
        local = getattr(engine.optimizer, "optim", None)
        assert local is not None, type(engine.optimizer).__name__
        state_numel = sum(st["exp_avg"].numel() for st in local.state.values())
        return {
            "stage": ctx.get_local_rank(M.PIPELINE),
            "optimizer": type(engine.optimizer).__name__,
            "handlers": [type(h).__name__ for h in engine.gradient_handlers],
            "state_numel": state_numel,
            "stage_numel": sum(q.numel() for q in stage.parameters()),
            "layers": _layers(stage),
        }
    finally:
        ctx.destroy()


def test_zero1_with_pipeline_equals_reference_and_splits_state(dist: Any) -> None:
    results = dist.run(_zero1_pipeline, world_size=4, timeout=180)
    _check_layers(results, _reference("adam", 3)[0], 1e-5)
    for r in results:
        assert r["optimizer"] == "ZeroRedundancyOptimizer"
        assert r["handlers"] == [
            "DataParallelGradientHandler",
            "PipelineSharedModuleGradientHandler",
        ]
    for stage in (0, 1):
        held = [r for r in results if r["stage"] == stage]
        # the two data ranks of a stage split that stage's Adam state between them
        assert sum(r["state_numel"] for r in held) == held[0]["stage_numel"]
        assert all(0 < r["state_numel"] < r["stage_numel"] for r in held), held


# ------------------------------------------------------------------ Trainer on dp2 x pp2

N_SAMPLES = 16


def _dataset() -> TensorDataset:
    x, y = pipe_data(99, N_SAMPLES)
    return TensorDataset(x, y)


def _trainer_pipeline(log_dir: str) -> dict[str, Any]:
    config = dict(parallel=dict(pipeline=2), NUM_MICRO_BATCHES=2)
    ctx = create_context(config, timeout=60)
    try:
        stage = build_pipeline_model(make_pipe_model(), method="uniform", context=ctx)
        assert isinstance(stage, nn.Module)
        train = get_dataloader(_dataset(), batch_size=4, context=ctx)
        test = get_dataloader(_dataset(), batch_size=4, context=ctx)
        engine, train, test, _ = initialize(
            stage,
            torch.optim.SGD(stage.parameters(), lr=0.1),
            nn.CrossEntropyLoss(),
            train,
            test,
            context=ctx,
        )
        log = Path(log_dir) / f"rank{tdist.get_rank()}.jsonl"
        trainer = Trainer(engine, metrics_log=log)
        trainer.fit(
            train,
            epochs=1,
            test_dataloader=test,
            hooks=[LossHook(), AccuracyHook()],
            display_progress=False,
        )
        return {
            "display": trainer.is_display_rank,
            "epoch": trainer.states["epoch_metrics"]["loss"],
            "test": trainer.states["test_results"],
            "layers": _layers(stage),
        }
    finally:
        ctx.destroy()


def test_trainer_on_dp2_pp2_shows_reduced_metrics_from_one_rank(dist: Any, tmp_path: Path) -> None:
    results = dist.run(_trainer_pipeline, world_size=4, args=(str(tmp_path),), timeout=180)
    # the display rank is data rank 0 of the last stage: global rank 0 * 2 + 1
    assert [r["display"] for r in results] == [False, True, False, False]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank1.jsonl"]
    x, y = _dataset().tensors
    # step s: data rank d reads samples 8s + d, 8s + d + 2, ... (DistributedSampler, 2 ranks),
    # so the global batch of step s is samples 8s .. 8s + 7
    batches = [(x[8 * s : 8 * s + 8], y[8 * s : 8 * s + 8]) for s in range(2)]
    ref, ref_losses = _reference("sgd", 2, batches)
    _check_layers(results, ref, 1e-5)
    with torch.no_grad():
        out = ref(x)
        test_loss = nn.CrossEntropyLoss()(out, y).item()
        accuracy = (out.argmax(-1) == y).float().mean().item()
    records = [json.loads(line) for line in (tmp_path / "rank1.jsonl").read_text().splitlines()]
    step_losses = [r["loss"] for r in records if r["phase"] == "train_step"]
    assert step_losses == pytest.approx(ref_losses, rel=1e-5)
    last_stage, first_stage = results[1::2], results[0::2]
    for r in last_stage:  # the stage that holds the loss, on both data ranks alike
        assert r["epoch"] == pytest.approx(sum(ref_losses) / 2, rel=1e-5)
        assert r["test"]["loss"] == pytest.approx(test_loss, rel=1e-5)
        assert r["test"]["accuracy"] == pytest.approx(accuracy, rel=1e-6)
    for r in first_stage:  # no loss, no output there
        assert math.isnan(r["epoch"]) and math.isnan(r["test"]["loss"])
