"""Master-weight mixed precision (``mode="naive"``) under tensor, data, ZeRO-1 and pipeline.

Each layout trains a few steps with the model in float16/bfloat16 and fp32 masters in the
optimizer; the masters, placed in the full model by their ShardInfo, are compared with the
single-process fp32 reference (the parameters' update, by relative norm, as in
test_master_weights.py). The bound is 16 u (u = 2**-11 for float16, 2**-8 for bfloat16):
twice the single-process one, since the gradients are also all-reduced in the low-precision
format. Under 1D tensor parallelism with clipping the masters must carry their parameters'
ShardInfo: without it clipping would count a split weight's partial norm as a whole one, and
checkpoints would place every rank's block at the origin of the full tensor.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from engine_testlib import ColumnLinear, Locals, RowLinear, assemble
from torch import nn

from tessera.context import ParallelMode, create_context, get_shard_info
from tessera.engine import CheckpointParts, initialize, load_checkpoint, save_checkpoint
from tessera.pipeline import build_pipeline_model

M = ParallelMode
UNIT = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
CLIP = 0.05
BATCH = 8
STEPS = 3


def make_full(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))


def data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(70 + step)
    return torch.randn(BATCH, 4, generator=g), torch.randint(0, 3, (BATCH,), generator=g)


def _optimizer(name: str, params: Any) -> torch.optim.Optimizer:
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-2)
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _reference(opt_name: str, clip: float) -> dict[str, torch.Tensor]:
    """The fp32 single-process model after STEPS steps on full batches."""
    model = make_full()
    opt = _optimizer(opt_name, model.parameters())
    for step in range(STEPS):
        x, y = data(step)
        opt.zero_grad()
        nn.CrossEntropyLoss()(model(x), y).backward()
        if clip:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            assert norm > clip, f"step {step}: norm {norm} <= {clip}, nothing would be clipped"
        opt.step()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _placed(name: str, t: torch.Tensor) -> tuple[torch.Tensor, tuple[slice, ...], tuple[int, ...]]:
    info = get_shard_info(t)
    if info is None:
        return t.detach().clone(), tuple(slice(0, n) for n in t.shape), tuple(t.shape)
    return t.detach().clone(), info.slices, info.global_shape


def _masters(engine: Any, names: dict[int, str]) -> Locals:
    """Every master, placed in the full model by its own (copied) ShardInfo."""
    masters = engine.master_weights
    out: Locals = {}
    for p, master in masters.pairs():
        out[names[id(p)]] = _placed(names[id(p)], master)
    return out


def _check_against_reference(
    full: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], dtype: torch.dtype
) -> None:
    start = {name: p.detach() for name, p in make_full().named_parameters()}
    assert sorted(full) == sorted(ref)
    for name, want in ref.items():
        got_update, want_update = full[name] - start[name], want - start[name]
        rel = float((got_update - want_update).norm() / want_update.norm())
        assert rel <= 16 * UNIT[dtype], (name, rel)


def _tp_dp_fp16_clip() -> dict[str, Any]:
    """dp2 x 1D(2): fp16 master weights, clipped SGD; each data rank on its half batch."""
    config = dict(
        parallel=dict(tensor=dict(size=2, mode="1d")),
        fp16=dict(mode="naive", init_scale=2.0**10),
        clip_grad_norm=CLIP,
    )
    ctx = create_context(config, timeout=60)
    try:
        model = make_full()
        model[0] = ColumnLinear(model[0], ctx)
        model[2] = RowLinear(model[2], ctx)
        names = {id(p): n for n, p in model.named_parameters()}
        engine, *_ = initialize(
            model, _optimizer("sgd", model.parameters()), nn.CrossEntropyLoss(), context=ctx
        )
        d, n = ctx.get_local_rank(M.DATA), BATCH // ctx.data_size
        for step in range(STEPS):
            x, y = data(step)
            engine.zero_grad()
            engine.backward(engine.criterion(engine(x[d * n : d * n + n]), y[d * n : d * n + n]))
            assert engine.step()
        return {
            "masters": _masters(engine, names),
            "dtypes": {p.dtype for p in model.parameters()},
            "infos": all(
                get_shard_info(m) == get_shard_info(p) for p, m in engine.master_weights.pairs()
            ),
        }
    finally:
        ctx.destroy()


def test_dp2_1d2_fp16_master_weights_clip_like_fp32(dist: Any) -> None:
    results = dist.run(_tp_dp_fp16_clip, world_size=4, timeout=180)
    for r in results:
        assert r["dtypes"] == {torch.float16} and r["infos"] is True
    full = assemble([r["masters"] for r in results])
    _check_against_reference(full, _reference("sgd", CLIP), torch.float16)


def _zero1_bf16(path: str) -> dict[str, Any]:
    """dp2 with ZeRO-1 over bf16 master weights: AdamW, then a checkpoint."""
    config = dict(parallel=dict(), zero=dict(stage=1), bf16=dict(mode="naive"))
    ctx = create_context(config, timeout=60)
    try:
        model = make_full()
        names = {id(p): n for n, p in model.named_parameters()}
        engine, *_ = initialize(
            model, _optimizer("adamw", model.parameters()), nn.CrossEntropyLoss(), context=ctx
        )
        d, n = ctx.get_local_rank(M.DATA), BATCH // ctx.data_size
        for step in range(STEPS):
            x, y = data(step)
            engine.zero_grad()
            engine.backward(engine.criterion(engine(x[d * n : d * n + n]), y[d * n : d * n + n]))
            assert engine.step()
        save_checkpoint(path, engine, step=STEPS)
        optimizer: Any = engine.optimizer
        masters = engine.master_weights
        assert masters is not None
        return {
            "optimizer": type(optimizer).__name__,
            # ZeRO-1 shards the masters: this rank holds the state of its partition only
            "local_state": [
                (names[id(p)], v.dtype)
                for p, m in masters.pairs()
                if m in optimizer.optim.state
                for v in optimizer.optim.state[m].values()
                if v.dim()
            ],
            "masters": _masters(engine, names),
            "model": {names[id(p)]: p.detach().clone() for p, _ in masters.pairs()},
        }
    finally:
        ctx.destroy()


def test_zero1_dp2_bf16_master_weights_like_fp32_and_checkpoint(dist: Any, tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    results = dist.run(_zero1_bf16, world_size=2, args=(str(path),), timeout=180)
    held = [sorted({name for name, _ in r["local_state"]}) for r in results]
    assert all(r["optimizer"] == "ZeroRedundancyOptimizer" for r in results)
    assert held[0] and held[1] and not set(held[0]) & set(held[1])  # the state is partitioned
    assert all(dtype == torch.float32 for r in results for _, dtype in r["local_state"])
    full = assemble([r["masters"] for r in results])
    _check_against_reference(full, _reference("adamw", 0.0), torch.bfloat16)
    for r in results:
        for name, p in r["model"].items():
            assert p.dtype == torch.bfloat16 and torch.equal(p, full[name].to(torch.bfloat16))
    # the checkpoint holds the fp32 masters: one fp32 process reads them exactly
    single = make_full(seed=3)
    load_checkpoint(path, CheckpointParts(single, torch.optim.AdamW(single.parameters())))
    for name, p in single.named_parameters():
        assert torch.equal(p.detach(), full[name]), name


def _pipeline_fp16(tensor_shape: bool) -> dict[str, Any]:
    """pp2: fp16 master weights through the 1F1B schedule (activations sent in float16)."""
    extra: dict[str, Any] = {"TENSOR_SHAPE": (BATCH // 2, 8)} if tensor_shape else {}
    config = dict(
        parallel=dict(pipeline=2),
        NUM_MICRO_BATCHES=2,
        fp16=dict(mode="naive", init_scale=2.0**10),
        **extra,
    )
    ctx = create_context(config, timeout=60)
    try:
        stage = build_pipeline_model(make_full(), method="uniform", context=ctx)
        assert isinstance(stage, nn.Module)
        names = {id(p): n for n, p in stage.named_parameters()}
        engine, *_ = initialize(
            stage, _optimizer("sgd", stage.parameters()), nn.CrossEntropyLoss(), context=ctx
        )
        losses = []
        for step in range(STEPS):
            engine.zero_grad()
            _, _, loss = engine.execute_schedule(iter([data(step)]))
            assert engine.step()
            losses.append(None if loss is None else loss.item())
        return {
            "masters": _masters(engine, names),  # a stage names its layers as the full model
            "dtypes": {p.dtype for p in stage.parameters()},
            "losses": losses,
        }
    finally:
        ctx.destroy()


@pytest.mark.parametrize("tensor_shape", [False, True], ids=["shapes_sent", "TENSOR_SHAPE"])
def test_pp2_fp16_master_weights_like_fp32(dist: Any, tensor_shape: bool) -> None:
    results = dist.run(_pipeline_fp16, world_size=2, args=(tensor_shape,), timeout=180)
    assert all(r["dtypes"] == {torch.float16} for r in results)
    full = assemble([r["masters"] for r in results])
    _check_against_reference(full, _reference("sgd", 0.0), torch.float16)
    assert sum(all(v is not None for v in r["losses"]) for r in results) == 1
