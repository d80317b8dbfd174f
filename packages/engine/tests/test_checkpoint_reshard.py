"""Checkpoints saved under one parallel layout load under another, bitwise.

The model is the 7-layer MLP of test_dist_hybrid; under 1D tensor parallelism its linears
become the hand-made column/row splits of engine_testlib (ShardInfo-marked), under pipeline
parallelism tessera.pipeline partitions it keeping the full model's names. Each layout trains
two Adam steps, saves, and every rank returns its local blocks with their place in the full
tensor; another layout loads (from different initial values) and returns its blocks. The
assembled full parameters and Adam states must be equal bit for bit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from engine_testlib import ColumnLinear, Locals, RowLinear, assemble
from torch import nn

from tessera.context import ParallelMode, create_context, get_shard_info
from tessera.engine import (
    CheckpointParts,
    export_torch_state_dict,
    initialize,
    load_checkpoint,
    save_checkpoint,
    zero_redundancy_optimizer,
)
from tessera.pipeline import build_pipeline_model

M = ParallelMode


def make_full(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4), nn.Tanh(),
        nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3),
    )  # fmt: skip


def data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(90 + step)
    return torch.randn(8, 4, generator=g), torch.randint(0, 3, (8,), generator=g)


def _model(ctx: Any, seed: int) -> nn.Module | list[nn.Module]:
    full = make_full(seed)
    if ctx.is_initialized(M.PARALLEL_1D) and ctx.get_world_size(M.PARALLEL_1D) > 1:
        for i in (0, 4):
            full[i] = ColumnLinear(full[i], ctx)
        for i in (2, 6):
            full[i] = RowLinear(full[i], ctx)
    if ctx.pipeline_size > 1:
        stage = build_pipeline_model(full, method="uniform", context=ctx)
        return stage if isinstance(stage, nn.Module) else list(stage)
    return full


def _modules(model: nn.Module | list[nn.Module]) -> list[nn.Module]:
    return [model] if isinstance(model, nn.Module) else model


def _locals(modules: list[nn.Module], optimizer: torch.optim.Optimizer) -> Locals:
    """Every local block of parameters and optimizer states with its place in the full tensor."""
    out: Locals = {}
    names = {}
    for m in modules:
        for name, p in m.named_parameters():
            names[id(p)] = name
            info = get_shard_info(p)
            shape = info.global_shape if info else tuple(p.shape)
            where = info.slices if info else tuple(slice(0, s) for s in p.shape)
            out[f"model/{name}"] = (p.detach().clone(), where, shape)
    holder = getattr(optimizer, "optim", optimizer)
    for p, state in holder.state.items():
        _, where, shape = out[f"model/{names[id(p)]}"]
        for key, value in state.items():
            if value.dim() == 0:
                out[f"optim/{names[id(p)]}/{key}"] = (value.clone(), (), ())
            else:
                out[f"optim/{names[id(p)]}/{key}"] = (value.clone(), where, shape)
    return out


def _train_and_save(parallel: dict[str, Any], path: str, zero: bool = False) -> Locals:
    config: dict[str, Any] = dict(parallel=parallel, NUM_MICRO_BATCHES=2)
    if zero:
        config["zero"] = dict(stage=1)
    ctx = create_context(config, timeout=120)
    try:
        model = _model(ctx, seed=0)
        params = [p for m in _modules(model) for p in m.parameters()]
        engine, *_ = initialize(
            model, torch.optim.Adam(params, lr=0.01), nn.CrossEntropyLoss(), context=ctx
        )
        d, dp = ctx.get_local_rank(M.DATA), ctx.data_size
        n = 8 // dp
        for step in range(2):
            x, y = data(step)
            engine.zero_grad()
            engine.execute_schedule(iter([(x[d * n : d * n + n], y[d * n : d * n + n])]))
            engine.step()
        save_checkpoint(path, engine, step=2, epoch=0)
        return _locals(_modules(engine.module), engine.optimizer)  # type: ignore[arg-type]
    finally:
        ctx.destroy()


def _load(parallel: dict[str, Any], path: str, zero: bool = False) -> Locals:
    ctx = create_context(dict(parallel=parallel), timeout=120)
    try:
        model = _model(ctx, seed=7)  # other initial values: the load must overwrite them all
        modules = _modules(model)
        optimizer: torch.optim.Optimizer = torch.optim.Adam(
            [p for m in modules for p in m.parameters()], lr=0.5
        )
        if zero:
            optimizer = zero_redundancy_optimizer(optimizer, ctx)
        info = load_checkpoint(path, CheckpointParts(model, optimizer, context=ctx))
        assert info.step == 2
        lr = optimizer.param_groups[0]["lr"]
        assert lr == 0.01, lr  # the param-group settings came back by name
        return _locals(modules, optimizer)
    finally:
        ctx.destroy()


def _single_load(path: Path) -> dict[str, torch.Tensor]:
    """Load into the plain single-process model and Adam (no process group)."""
    model = make_full(seed=3)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.5)
    load_checkpoint(path, CheckpointParts(model, optimizer))
    return assemble([_locals([model], optimizer)])


def _assert_bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for key in a:
        assert torch.equal(a[key], b[key]), key
    # Adam ran: states are there and not trivially zero
    assert any(k.endswith("exp_avg_sq") for k in a)
    assert all(bool(a[k].abs().sum() > 0) for k in a if k.endswith("exp_avg"))


def test_dp2_pp2_1d2_to_1d2_to_single_process_and_export(dist: Any, tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    saved = assemble(
        dist.run(
            _train_and_save,
            world_size=8,
            args=(dict(pipeline=2, tensor=dict(size=2, mode="1d")), str(path)),
            timeout=300,
        )
    )
    assert len([k for k in saved if k.startswith("model/")]) == 8
    loaded = assemble(
        dist.run(_load, world_size=2, args=(dict(tensor=dict(size=2, mode="1d")), str(path)))
    )
    _assert_bitwise(saved, loaded)
    _assert_bitwise(saved, _single_load(path))
    # export: the plain model loads it with load_state_dict (strict)
    out = tmp_path / "plain.pt"
    export_torch_state_dict(path, out)
    plain = make_full(seed=11)
    plain.load_state_dict(torch.load(out, weights_only=True))
    for name, p in plain.named_parameters():
        assert torch.equal(p.detach(), saved[f"model/{name}"]), name


def test_pp2_to_pp4_moves_layers_between_ranks(dist: Any, tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    saved = assemble(dist.run(_train_and_save, world_size=2, args=(dict(pipeline=2), path)))
    loaded = assemble(dist.run(_load, world_size=4, args=(dict(pipeline=4), path)))
    _assert_bitwise(saved, loaded)


def test_1d4_to_pp2_1d2_changes_block_sizes(dist: Any, tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    saved = assemble(
        dist.run(_train_and_save, world_size=4, args=(dict(tensor=dict(size=4, mode="1d")), path))
    )
    loaded = assemble(
        dist.run(_load, world_size=4, args=(dict(pipeline=2, tensor=dict(size=2, mode="1d")), path))
    )
    _assert_bitwise(saved, loaded)


def test_zero1_state_round_trip(dist: Any, tmp_path: Path) -> None:
    """ZeRO-1 over dp2 -> one process -> ZeRO-1 over dp2: each rank owns part of the state."""
    path = tmp_path / "zero"
    saved_ranks = dist.run(_train_and_save, world_size=2, args=({}, str(path), True))
    # each data rank wrote only the state of its partition, together everything
    owned = [{k for k in r if k.startswith("optim/")} for r in saved_ranks]
    assert owned[0] and owned[1] and owned[0].isdisjoint(owned[1])
    saved = assemble(saved_ranks)
    single = _single_load(path)
    _assert_bitwise(saved, single)
    # save from the single process, load back into ZeRO-1: partitions filled from names
    model = make_full(seed=3)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.5)
    load_checkpoint(path, CheckpointParts(model, optimizer))
    path2 = tmp_path / "single"
    save_checkpoint(path2, CheckpointParts(model, optimizer), step=2)
    reloaded = assemble(dist.run(_load, world_size=2, args=({}, str(path2), True)))
    _assert_bitwise(saved, reloaded)


def _dtensor_locals(modules: list[nn.Module], optimizer: torch.optim.Optimizer) -> Locals:
    """Like ``_locals`` for FSDP2: the blocks are the DTensors' local chunks."""
    out: Locals = {}
    names = {}

    def block(t: Any) -> tuple[torch.Tensor, tuple[slice, ...], tuple[int, ...]]:
        (chunk,) = t.__create_chunk_list__()
        local = t.to_local().detach().clone()
        where = tuple(slice(o, o + s) for o, s in zip(chunk.offsets, local.shape, strict=True))
        return local, where, tuple(t.shape)

    for m in modules:
        for name, p in m.named_parameters():
            names[id(p)] = name
            out[f"model/{name}"] = block(p)
    for p, state in optimizer.state.items():
        for key, value in state.items():
            k = f"optim/{names[id(p)]}/{key}"
            out[k] = (value.clone(), (), ()) if value.dim() == 0 else block(value)
    return out


def _fsdp(path: str, save: bool) -> Locals:
    """ZeRO-3 (FSDP2) over 2 data ranks: train + save, or load into a fresh sharded model."""
    ctx = create_context(dict(parallel=dict(), zero=dict(stage=3)), timeout=120)
    try:
        model = make_full(seed=0 if save else 7)
        engine, *_ = initialize(
            model, torch.optim.Adam(model.parameters(), lr=0.01 if save else 0.5),
            nn.CrossEntropyLoss(), context=ctx,
        )  # fmt: skip
        if save:
            d = ctx.get_local_rank(M.DATA)
            for step in range(2):
                x, y = data(step)
                engine.zero_grad()
                engine.execute_schedule(iter([(x[4 * d : 4 * d + 4], y[4 * d : 4 * d + 4])]))
                engine.step()
            save_checkpoint(path, engine, step=2)
        else:
            load_checkpoint(path, engine)
            assert engine.optimizer.param_groups[0]["lr"] == 0.01
        return _dtensor_locals([engine.module], engine.optimizer)  # type: ignore[list-item]
    finally:
        ctx.destroy()


def test_zero3_fsdp2_round_trip_uneven_shards(dist: Any, tmp_path: Path) -> None:
    path = tmp_path / "fsdp"
    saved = assemble(dist.run(_fsdp, world_size=2, args=(str(path), True)))
    _assert_bitwise(saved, _single_load(path))
    _assert_bitwise(saved, assemble(dist.run(_fsdp, world_size=2, args=(str(path), False))))
