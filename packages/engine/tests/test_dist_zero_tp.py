"""ZeRO 2/3 (FSDP2 over DATA) combined with 1D tensor parallelism, dp2 x 1D(2) on 4 ranks.

FSDP2 replaces every parameter by a DTensor sharded over DATA; under tensor parallelism that
DTensor is a data shard of a tensor-parallel block, and only the block's ShardInfo says where
the block sits in the full parameter. The global gradient norm must then sum each local
piece over DATA (disjoint FSDP shards) and over the 1D group for a tensor-parallel shard, but
not over the 1D group for the RowLinear bias or the plain last linear (whole on every tensor
rank). Clipping, training and checkpoints are checked against the single-process model.

The model has a column-parallel and a row-parallel linear (Megatron-style, Shoeybi et al.
2019, hand-made in engine_testlib) and a plain linear whose 3 output rows FSDP2 splits
unevenly (2 + 1) over the two data ranks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from engine_testlib import ColumnLinear, Locals, RowLinear, assemble
from torch import nn

from tessera.context import ParallelMode, create_context, get_shard_info
from tessera.engine import (
    CheckpointParts,
    global_grad_norm,
    initialize,
    load_checkpoint,
    save_checkpoint,
)

M = ParallelMode
TP = dict(tensor=dict(size=2, mode="1d"))
CLIP = 0.05
BATCH = 8


def make_full(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4), nn.Tanh(), nn.Linear(4, 3))


def data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(40 + step)
    return torch.randn(BATCH, 4, generator=g), torch.randint(0, 3, (BATCH,), generator=g)


def _split(full: nn.Sequential, ctx: Any) -> nn.Sequential:
    """The 1D tensor-parallel model (the last linear stays whole on every tensor rank)."""
    if ctx.is_initialized(M.PARALLEL_1D) and ctx.get_world_size(M.PARALLEL_1D) > 1:
        full[0] = ColumnLinear(full[0], ctx)
        full[2] = RowLinear(full[2], ctx)
    return full


def _optimizer(name: str, model: nn.Module, lr: float | None = None) -> torch.optim.Optimizer:
    if name == "adam":
        return torch.optim.Adam(model.parameters(), lr=0.01 if lr is None else lr)
    return torch.optim.SGD(model.parameters(), lr=0.1 if lr is None else lr)


def _block(t: Any, p: Any) -> tuple[torch.Tensor, tuple[slice, ...], tuple[int, ...]]:
    """``t``'s local piece (an FSDP2 DTensor's chunk) and its place in the full tensor.

    ``p`` is the parameter whose ShardInfo (if any) places the tensor-parallel block that the
    DTensor is a data shard of; the offsets compose.
    """
    info = get_shard_info(p)
    to_local = getattr(t, "to_local", None)
    if callable(to_local):
        (chunk,) = t.__create_chunk_list__()
        local = to_local().detach().clone()
        inner = [int(o) for o in chunk.offsets]
    else:
        local = t.detach().clone()
        inner = [0] * local.dim()
    outer = list(info.offsets) if info is not None else [0] * local.dim()
    shape = info.global_shape if info is not None else tuple(t.shape)
    where = tuple(
        slice(o + i, o + i + n) for o, i, n in zip(outer, inner, local.shape, strict=True)
    )
    return local, where, tuple(shape)


def _locals(model: nn.Module, optimizer: torch.optim.Optimizer) -> Locals:
    """Every rank-local piece of the parameters and optimizer states, placed in the full model."""
    out: Locals = {}
    names = {}
    for name, p in model.named_parameters():
        names[id(p)] = name
        out[f"model/{name}"] = _block(p, p)
    for p, state in optimizer.state.items():
        for key, value in state.items():
            k = f"optim/{names[id(p)]}/{key}"
            out[k] = (value.clone(), (), ()) if value.dim() == 0 else _block(value, p)
    return out


def _reference(opt_name: str, steps: int) -> tuple[nn.Sequential, list[float]]:
    """The single-process model after ``steps`` clipped steps on full batches, and its norms."""
    model = make_full()
    opt = _optimizer(opt_name, model)
    norms = []
    for step in range(steps):
        x, y = data(step)
        opt.zero_grad()
        nn.CrossEntropyLoss()(model(x), y).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        assert norm > CLIP, f"step {step}: norm {norm} <= {CLIP}, nothing would be clipped"
        norms.append(norm.item())
        opt.step()
    return model, norms


def _train(stage: int, opt_name: str, steps: int) -> dict[str, Any]:
    """dp2 x 1D(2) under ZeRO ``stage``: clipped steps, each data rank on its half batch."""
    config = dict(parallel=TP, zero=dict(stage=stage), clip_grad_norm=CLIP)
    ctx = create_context(config, timeout=120)
    try:
        model = _split(make_full(), ctx)
        engine, *_ = initialize(
            model, _optimizer(opt_name, model), nn.CrossEntropyLoss(), context=ctx
        )
        d, n = ctx.get_local_rank(M.DATA), BATCH // ctx.data_size
        sharded = {
            name: (type(p).__name__, get_shard_info(p) is not None)
            for name, p in engine.module.named_parameters()  # type: ignore[union-attr]
        }
        norms = []
        for step in range(steps):
            x, y = data(step)
            xs, ys = x[d * n : d * n + n], y[d * n : d * n + n]  # this data rank's own samples
            engine.zero_grad()
            engine.backward(engine.criterion(engine(xs), ys))
            norms.append(global_grad_norm(engine.module.parameters(), context=ctx).item())  # type: ignore[union-attr]
            assert engine.step()
        return {
            "sharded": sharded,
            "norms": norms,
            "locals": _locals(engine.module, engine.optimizer),  # type: ignore[arg-type]
        }
    finally:
        ctx.destroy()


CASES = {"zero2_sgd": (2, "sgd"), "zero3_sgd": (3, "sgd"), "zero3_adam": (3, "adam")}


@pytest.mark.parametrize("case", list(CASES))
def test_dp2_1d2_zero_clipped_steps_equal_reference(dist: Any, case: str) -> None:
    stage, opt_name = CASES[case]
    steps = 3
    results = dist.run(_train, world_size=4, args=(stage, opt_name, steps), timeout=240)
    ref, ref_norms = _reference(opt_name, steps)
    for r in results:
        # FSDP2's new parameters still carry the tensor-parallel ShardInfo
        assert r["sharded"] == {
            "0.weight": ("DTensor", True),
            "0.bias": ("DTensor", True),
            "2.weight": ("DTensor", True),
            "2.bias": ("DTensor", True),
            "4.weight": ("DTensor", False),
            "4.bias": ("DTensor", False),
        }
        assert r["norms"] == pytest.approx(ref_norms, rel=1e-5)
    full = assemble([r["locals"] for r in results])
    for name, p in ref.named_parameters():
        torch.testing.assert_close(full[f"model/{name}"], p.detach(), rtol=1e-5, atol=1e-6)
    if opt_name == "adam":
        assert any(k.endswith("exp_avg_sq") for k in full)


def _run_layout(parallel: dict[str, Any], stage: int, path: str, save: bool) -> Locals:
    """Build the model under ``parallel`` (and ZeRO ``stage``, 0: none); train + save, or load.

    Saving trains two Adam steps first. Loading starts from other initial values and another
    learning rate, which the checkpoint must overwrite.
    """
    config: dict[str, Any] = dict(parallel=parallel)
    if stage:
        config["zero"] = dict(stage=stage)
    ctx = create_context(config, timeout=120)
    try:
        model = _split(make_full(seed=0 if save else 7), ctx)
        opt = _optimizer("adam", model, lr=0.01 if save else 0.5)
        engine, *_ = initialize(model, opt, nn.CrossEntropyLoss(), config=config, context=ctx)
        if save:
            d, n = ctx.get_local_rank(M.DATA), BATCH // ctx.data_size
            for step in range(2):
                x, y = data(step)
                engine.zero_grad()
                engine.execute_schedule(iter([(x[d * n : d * n + n], y[d * n : d * n + n])]))
                assert engine.step()
            save_checkpoint(path, engine, step=2)
        else:
            info = load_checkpoint(path, engine)
            assert info.step == 2
            assert engine.optimizer.param_groups[0]["lr"] == 0.01  # settings came back by name
        return _locals(engine.module, engine.optimizer)  # type: ignore[arg-type]
    finally:
        ctx.destroy()


def _single(path: Path, save_to: Path | None = None) -> dict[str, torch.Tensor]:
    """Load into the plain single-process model and Adam (optionally save it again there)."""
    model = make_full(seed=3)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.5)
    load_checkpoint(path, CheckpointParts(model, optimizer))
    if save_to is not None:
        save_checkpoint(save_to, CheckpointParts(model, optimizer), step=2)
    return assemble([_locals(model, optimizer)])


def _assert_bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    assert len([k for k in a if k.startswith("model/")]) == 6
    assert any(k.endswith("exp_avg_sq") for k in a)  # Adam state is there
    for key in a:
        assert torch.equal(a[key], b[key]), key


@pytest.mark.parametrize("stage", [2, 3], ids=["zero2", "zero3"])
def test_zero_1d2_checkpoint_same_layout_and_relayout(
    dist: Any, tmp_path: Path, stage: int
) -> None:
    """dp2 x 1D(2) ZeRO-2/3 -> the same layout, plain 1D(2), dp2 ZeRO-3 and one process."""
    path = tmp_path / "ckpt"
    saved_ranks = dist.run(
        _run_layout, world_size=4, args=(TP, stage, str(path), True), timeout=240
    )
    saved = assemble(saved_ranks)
    # every rank held a strict piece of each tensor-parallel block (FSDP2 split it over DATA)
    for r in saved_ranks:
        local, _, shape = r["model/0.weight"]
        assert local.numel() * 4 == torch.Size(shape).numel(), (local.shape, shape)
    same = assemble(
        dist.run(_run_layout, world_size=4, args=(TP, stage, str(path), False), timeout=240)
    )
    _assert_bitwise(saved, same)
    plain_tp = assemble(
        dist.run(_run_layout, world_size=2, args=(TP, 0, str(path), False), timeout=240)
    )
    _assert_bitwise(saved, plain_tp)
    zero_dp = assemble(
        dist.run(_run_layout, world_size=2, args=({}, 3, str(path), False), timeout=240)
    )
    _assert_bitwise(saved, zero_dp)
    _assert_bitwise(saved, _single(path))


def test_single_process_checkpoint_loads_into_zero3_1d2(dist: Any, tmp_path: Path) -> None:
    """The other direction: saved by one process, loaded into dp2 x 1D(2) ZeRO-3 blocks."""
    trained = tmp_path / "trained"
    saved = assemble(dist.run(_run_layout, world_size=2, args=(TP, 0, str(trained), True)))
    resaved = tmp_path / "single"
    _assert_bitwise(saved, _single(trained, save_to=resaved))
    loaded = assemble(
        dist.run(_run_layout, world_size=4, args=(TP, 3, str(resaved), False), timeout=240)
    )
    _assert_bitwise(saved, loaded)
