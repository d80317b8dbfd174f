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


def _pipeline_tied(clip: float) -> dict[str, Any]:
    ctx = create_context(dict(parallel=dict(pipeline=2)), timeout=60)  # dp2 x pp2 on 4 ranks
    try:
        d, p = ctx.get_local_rank(M.DATA), ctx.get_local_rank(M.PIPELINE)
        # the last stage starts from a different copy: the handler must equalize them
        stage: nn.Module = _Stage0(_tied_w(0)) if p == 0 else _Stage1(_tied_w(99))
        mark_pipeline_shared(stage.w, "embedding")
        handlers = [
            DataParallelGradientHandler(stage, context=ctx),
            PipelineSharedModuleGradientHandler(stage, context=ctx),
        ]
        engine = Engine(
            stage,
            torch.optim.SGD(stage.parameters(), lr=0.1),
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


@pytest.mark.parametrize("clip", [0.0, 0.05], ids=["noclip", "clip"])
def test_pipeline_shared_handler_ties_first_and_last_stage(dist: Any, clip: float) -> None:
    results = dist.run(_pipeline_tied, world_size=4, args=(clip,), timeout=120)
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


def _pipeline_schedule_selection() -> str:
    ctx = create_context(dict(parallel=dict(pipeline=2)), timeout=60)
    try:
        stage = nn.Linear(2, 2)
        opt = torch.optim.SGD(stage.parameters(), lr=0.1)
        try:
            initialize(stage, opt, config={}, context=ctx)
        except ConfigError as exc:
            assert "NUM_MICRO_BATCHES" in str(exc)
        else:
            raise AssertionError("a pipeline without NUM_MICRO_BATCHES must raise ConfigError")
        try:
            engine, *_ = initialize(stage, opt, config={"NUM_MICRO_BATCHES": 2}, context=ctx)
        except NotImplementedError as exc:
            return f"no executor: {exc}"
        return type(engine.schedule).__name__
    finally:
        ctx.destroy()


def test_pipeline_schedule_selected_from_config(dist: Any) -> None:
    import tessera.pipeline as pl

    results = dist.run(_pipeline_schedule_selection, world_size=4, timeout=120)
    if callable(getattr(pl.PipelineSchedule, "forward_backward_step", None)):
        assert results == ["PipelineSchedule"] * 4
    else:
        assert all(r.startswith("no executor: PipelineSchedule") for r in results)
