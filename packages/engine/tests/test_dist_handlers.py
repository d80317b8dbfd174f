"""Sequence-parallel and pipeline-shared gradient handlers on real gloo ranks."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as tdist
from torch import nn

from tessera.context import ConfigError, ParallelMode, create_context
from tessera.engine import (
    DataParallelGradientHandler,
    Engine,
    PipelineSharedModuleGradientHandler,
    SequenceParallelGradientHandler,
    initialize,
    mark_pipeline_shared,
)
from tessera.pipeline import build_pipeline_model

M = ParallelMode


def _seq_data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return torch.randn(4, 6, 4, generator=g), torch.randn(4, 6, 4, generator=g)  # [b, s, h]


def _seq_model() -> nn.Module:
    torch.manual_seed(3)
    return nn.Linear(4, 4)


def _sequence_parallel(average: str | None) -> list[torch.Tensor]:
    ctx = create_context(dict(parallel=dict(tensor=dict(size=2, mode="sequence"))), timeout=60)
    try:
        d, s = ctx.get_local_rank(M.DATA), ctx.get_local_rank(M.SEQUENCE)
        model = _seq_model()
        config: dict[str, Any] = {}
        if average is not None:
            config["gradient_handlers"] = [
                {"type": "SequenceParallelGradientHandler", "average": average}
            ]
        engine, *_ = initialize(
            model, torch.optim.SGD(model.parameters(), lr=0.5), config=config, context=ctx
        )
        (handler,) = engine.gradient_handlers
        assert isinstance(handler, SequenceParallelGradientHandler)
        x, t = _seq_data()
        xs = x[2 * d : 2 * d + 2, 3 * s : 3 * s + 3]  # [b/2, s/2, h]
        ts = t[2 * d : 2 * d + 2, 3 * s : 3 * s + 3]
        for _ in range(2):
            engine.zero_grad()
            err = (engine(xs) - ts) ** 2
            # "data": a partial sum normalized by the data rank's whole-sequence element count;
            # default: the mean over this rank's sub-sequence
            loss = err.sum() / (2 * 6 * 4) if average == "data" else err.mean()
            engine.backward(loss)
            engine.step()
        return [p.detach().clone() for p in engine.parameters()]
    finally:
        ctx.destroy()


@pytest.mark.parametrize("average", [None, "data"], ids=["default_sequence_dp", "data"])
def test_sequence_parallel_handler_matches_full_sequence(dist: Any, average: str | None) -> None:
    results = dist.run(_sequence_parallel, world_size=4, args=(average,), timeout=120)
    model = _seq_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    x, t = _seq_data()
    for _ in range(2):
        opt.zero_grad()
        ((model(x) - t) ** 2).mean().backward()
        opt.step()
    for params in results:
        for got, want in zip(params, model.parameters(), strict=True):
            torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------- tied weights


class _Stage0(nn.Module):
    def __init__(self, w: torch.Tensor) -> None:
        super().__init__()
        self.w = nn.Parameter(w.clone())  # [5, 4], tied with the last stage
        self.b = nn.Parameter(torch.linspace(-0.5, 0.5, 5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ self.w.t() + self.b)  # [b, 5]


class _Stage1(nn.Module):
    def __init__(self, w: torch.Tensor) -> None:
        super().__init__()
        self.w = nn.Parameter(w.clone())
        self.c = nn.Parameter(torch.linspace(0.2, -0.2, 4))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h @ self.w + self.c  # [b, 4]


def _tied_w(seed: int) -> torch.Tensor:
    return torch.randn(5, 4, generator=torch.Generator().manual_seed(seed))


def _tied_data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(6, 4, generator=g), torch.randn(6, 4, generator=g)


def _pipeline_tied(clip: float, built_by: str) -> dict[str, Any]:
    """Two stages sharing a weight; the handler configured by hand, or added by initialize."""
    ctx = create_context(dict(parallel=dict(pipeline=2)), timeout=60)  # dp2 x pp2 on 4 ranks
    try:
        d, p = ctx.get_local_rank(M.DATA), ctx.get_local_rank(M.PIPELINE)
        # the last stage starts from a different copy: the handler must equalize them
        stage: nn.Module = _Stage0(_tied_w(0)) if p == 0 else _Stage1(_tied_w(99))
        mark_pipeline_shared(stage.w, "embedding")
        optimizer = torch.optim.SGD(stage.parameters(), lr=0.1)
        if built_by == "initialize":  # no handler configured: every pipeline job gets it
            config = dict(num_microbatches=1, clip_grad_norm=clip)  # NUM_MICRO_BATCHES's name
            engine, *_ = initialize(stage, optimizer, nn.MSELoss(), config=config, context=ctx)
            handlers = engine.gradient_handlers
            assert [type(h) for h in handlers] == [
                DataParallelGradientHandler,
                PipelineSharedModuleGradientHandler,
            ]
        else:
            handlers = [
                DataParallelGradientHandler(stage, context=ctx),
                PipelineSharedModuleGradientHandler(stage, context=ctx),
            ]
            engine = Engine(
                stage,
                optimizer,
                nn.MSELoss(),
                gradient_handlers=handlers,
                clip_grad_norm=clip,
                context=ctx,
            )
        peer = ctx.get_next_global_rank(M.PIPELINE)
        for step in range(2):
            x, t = _tied_data(step)
            xs, ts = x[3 * d : 3 * d + 3], t[3 * d : 3 * d + 3]
            engine.zero_grad()
            if p == 0:
                h = engine(xs)
                tdist.send(h.detach(), peer)
                grad = torch.empty_like(h)
                tdist.recv(grad, peer)
                engine.backward_by_grad(h, grad)
            else:
                h = torch.empty(3, 5)
                tdist.recv(h, peer)
                h.requires_grad_(True)
                engine.backward(engine.criterion(engine(h), ts))
                assert h.grad is not None
                tdist.send(h.grad, peer)
            engine.step()
        dups = handlers[1].duplicate_parameters()
        return {
            "stage": p,
            "params": {n: q.detach().clone() for n, q in stage.named_parameters()},
            "n_dups": len(dups),
        }
    finally:
        ctx.destroy()


@pytest.mark.parametrize(
    ("clip", "built_by"),
    [(0.0, "hand"), (0.05, "hand"), (0.0, "initialize")],
    ids=["noclip", "clip", "added-by-initialize"],
)
def test_pipeline_shared_handler_ties_first_and_last_stage(
    dist: Any, clip: float, built_by: str
) -> None:
    results = dist.run(_pipeline_tied, world_size=4, args=(clip, built_by), timeout=120)
    s0, s1 = _Stage0(_tied_w(0)), _Stage1(_tied_w(0))
    s1.w = s0.w  # one tied parameter in the single-process reference
    params = [s0.w, s0.b, s1.c]
    opt = torch.optim.SGD(params, lr=0.1)
    for step in range(2):
        x, t = _tied_data(step)
        opt.zero_grad()
        nn.MSELoss()(s1(s0(x)), t).backward()
        if clip:
            norm = torch.nn.utils.clip_grad_norm_(params, clip)
            assert norm > clip  # the test really clips
        opt.step()
    for r in results:
        got = r["params"]
        torch.testing.assert_close(got["w"], s0.w.detach(), rtol=1e-5, atol=1e-6)
        if r["stage"] == 0:
            torch.testing.assert_close(got["b"], s0.b.detach(), rtol=1e-5, atol=1e-6)
            assert r["n_dups"] == 0
        else:
            torch.testing.assert_close(got["c"], s1.c.detach(), rtol=1e-5, atol=1e-6)
            assert r["n_dups"] == 1


def _schedule_model() -> nn.Sequential:
    torch.manual_seed(7)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 3))


def _schedule_data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(31)
    return torch.randn(8, 4, generator=g), torch.randint(0, 3, (8,), generator=g)  # [8, 4], [8]


def _pipeline_schedule_selection(micro: int, chunks: int) -> dict[str, Any]:
    ctx = create_context(dict(parallel=dict(pipeline=2)), timeout=60)  # dp2 x pp2 on 4 ranks
    try:
        d, p = ctx.get_local_rank(M.DATA), ctx.get_local_rank(M.PIPELINE)
        stage = build_pipeline_model(
            _schedule_model(), num_chunks=chunks, method="uniform", context=ctx
        )
        stages = [stage] if isinstance(stage, nn.Module) else list(stage)
        params = [q for s in stages for q in s.parameters()]
        opt = torch.optim.SGD(params, lr=0.1)
        try:
            initialize(stage, opt, nn.CrossEntropyLoss(), config={}, context=ctx)
        except ConfigError as exc:
            assert "NUM_MICRO_BATCHES" in str(exc)
        else:
            raise AssertionError("a pipeline without NUM_MICRO_BATCHES must raise ConfigError")
        config: dict[str, Any] = {"NUM_MICRO_BATCHES": micro}
        if chunks > 1:
            config["NUM_CHUNKS"] = chunks
        engine, *_ = initialize(stage, opt, nn.CrossEntropyLoss(), config=config, context=ctx)
        schedule: Any = engine.schedule
        ran_before = schedule.last_run
        x, y = _schedule_data()
        xs, ys = x[4 * d : 4 * d + 4], y[4 * d : 4 * d + 4]  # each data rank its own half
        engine.zero_grad()
        _, _, loss = engine.execute_schedule(iter([(xs, ys)]))
        assert engine.step()
        run = schedule.last_run
        return {
            "runner": type(schedule).__name__,
            "schedule": type(schedule.schedule).__name__,
            "num_microbatches": schedule.schedule.num_microbatches,
            "num_chunks": schedule.schedule.num_chunks,
            "ran_before": ran_before is not None,
            "run_rank": None if run is None else run.pipeline_rank,
            "pipeline_rank": p,
            "data_rank": d,
            "loss": None if loss is None else loss.item(),
            "layers": {
                idx: [q.detach().clone() for q in s[i].parameters()]
                for s in stages
                for i, idx in enumerate(s.layer_indices)
            },
        }
    finally:
        ctx.destroy()


@pytest.mark.parametrize(
    ("micro", "chunks", "expected"),
    [(2, 1, "PipelineSchedule"), (4, 2, "InterleavedPipelineSchedule")],
    ids=["1f1b", "interleaved"],
)
def test_pipeline_schedule_selected_from_config(
    dist: Any, micro: int, chunks: int, expected: str
) -> None:
    results = dist.run(
        _pipeline_schedule_selection, world_size=4, args=(micro, chunks), timeout=120
    )
    ref = _schedule_model()
    x, y = _schedule_data()
    with torch.no_grad():
        # the loss each data rank's last stage must report: the mean over its own half
        shard_losses = [
            nn.CrossEntropyLoss()(ref(x[4 * d : 4 * d + 4]), y[4 * d : 4 * d + 4]) for d in range(2)
        ]
    assert not torch.isclose(shard_losses[0], shard_losses[1])  # the halves really differ
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    nn.CrossEntropyLoss()(ref(x), y).backward()
    opt.step()
    seen: set[int] = set()
    for r in results:
        assert r["runner"] == "PipelineRunner"
        assert r["schedule"] == expected
        assert r["num_microbatches"] == micro
        assert r["num_chunks"] == chunks
        # the step ran through the pipeline executor on every rank, not some other path
        assert r["ran_before"] is False
        assert r["run_rank"] == r["pipeline_rank"]
        if r["pipeline_rank"] == 1:
            assert r["loss"] == pytest.approx(shard_losses[r["data_rank"]].item(), rel=1e-5)
        else:
            assert r["loss"] is None
        for idx, got_params in r["layers"].items():
            seen.add(idx)
            for got, want in zip(got_params, ref[idx].parameters(), strict=True):
                torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)
    assert seen == set(range(len(ref)))


# ------------------------------------------------------------ a parameter unused on one rank


class _Branchy(nn.Module):
    """``side`` (in the middle of the parameter order) joins the forward only when asked."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(3, 4)
        self.side = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor, use_side: bool) -> torch.Tensor:
        h = torch.tanh(self.a(x))  # [b, 4]
        if use_side:
            h = h + torch.tanh(self.side(h))
        out: torch.Tensor = self.head(h)  # [b, 2]
        return out


def _branchy_model() -> _Branchy:
    torch.manual_seed(11)
    return _Branchy()


def _branchy_data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(200 + step)
    return torch.randn(4, 3, generator=g), torch.randn(4, 2, generator=g)  # [4, 3], [4, 2]


def _uses_side(step: int, data_rank: int) -> bool:
    """Step 0: data rank 1 leaves ``side`` out; step 1: data rank 0 does; step 2: both do."""
    return step < 2 and data_rank != 1 - step % 2


#: 64 bytes: 16 float32 per bucket, so the zero-filled gradient sits between other buckets.
_TINY_BUCKET_MB = 64 / 2**20


def _unused_on_one_rank() -> dict[str, Any]:
    ctx = create_context(dict(parallel={}), timeout=60)  # dp2
    try:
        d = ctx.get_local_rank(M.DATA)
        model = _branchy_model()
        config = {
            "gradient_handlers": [
                {"type": "DataParallelGradientHandler", "bucket_size_mb": _TINY_BUCKET_MB}
            ]
        }
        engine, *_ = initialize(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
            nn.MSELoss(),
            config=config,
            context=ctx,
        )
        (handler,) = engine.gradient_handlers
        assert isinstance(handler, DataParallelGradientHandler)
        missing: list[bool] = []
        grads: list[list[torch.Tensor]] = []
        for step in range(3):
            x, t = _branchy_data(step)
            xs, ts = x[2 * d : 2 * d + 2], t[2 * d : 2 * d + 2]  # each data rank its own half
            engine.zero_grad()
            engine.backward(engine.criterion(engine(xs, _uses_side(step, d)), ts))
            missing.append(model.side.weight.grad is None)
            assert engine.step()
            grads.append([None if p.grad is None else p.grad.clone() for p in model.parameters()])
        return {
            "missing": missing,
            "grads": grads,
            "params": [p.detach().clone() for p in model.parameters()],
        }
    finally:
        ctx.destroy()


def test_data_parallel_handler_with_a_gradient_missing_on_one_or_every_rank(dist: Any) -> None:
    # a skipped (not zero-filled) gradient would give the ranks different bucket layouts: the
    # coalesced all-reduce would fail or hang (the timeout) instead of matching up
    results = dist.run(_unused_on_one_rank, world_size=2, timeout=60)
    assert results[0]["missing"] == [False, True, True]
    assert results[1]["missing"] == [True, False, True]
    ref = _branchy_model()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    ref_grads = []
    for step in range(3):
        x, t = _branchy_data(step)
        opt.zero_grad()
        # the mean of the two ranks' gradients, the missing one counted as zeros
        losses = [
            nn.MSELoss()(ref(x[2 * d : 2 * d + 2], _uses_side(step, d)), t[2 * d : 2 * d + 2])
            for d in range(2)
        ]
        torch.autograd.backward(torch.stack(losses).mean())
        ref_grads.append([None if p.grad is None else p.grad.clone() for p in ref.parameters()])
        opt.step()
    # step 2: no rank used `side`: its gradient stays None, as in plain PyTorch, so momentum
    # does not move it (zeros would)
    assert ref_grads[2][2] is None and ref_grads[2][3] is None
    for r in results:
        for step in range(3):
            for got, want in zip(r["grads"][step], ref_grads[step], strict=True):
                if want is None:
                    assert got is None
                else:
                    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        for got, want in zip(r["params"], ref.parameters(), strict=True):
            torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)
