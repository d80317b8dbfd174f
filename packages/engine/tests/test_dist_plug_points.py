"""The plug points chosen in the config: a user's gradient handler and schedule from the
registries, the bucket size of the data-parallel handler, the tied-weight handler by name, and
the clear errors of a handler that cannot work in the given layout."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as tdist
from engine_testlib import make_data, make_model, reference_params, sgd
from torch import nn

from tessera.context import ConfigError, ParallelContext, ParallelMode, create_context
from tessera.engine import (
    GRADIENT_HANDLERS,
    SCHEDULES,
    BaseGradientHandler,
    Engine,
    NonPipelineSchedule,
    PipelineSharedModuleGradientHandler,
    all_reduce_coalesced,
    bucketize,
    initialize,
    mark_pipeline_shared,
)

M = ParallelMode


class UserAverageHandler(BaseGradientHandler):
    """A user's handler: mean over DATA, one all-reduce per gradient; counts its calls."""

    def __init__(
        self,
        model: Any,
        optimizer: torch.optim.Optimizer | None = None,
        context: ParallelContext | None = None,
        tag: str = "",
    ) -> None:
        super().__init__(model, optimizer, context)
        self.tag = tag
        self.calls = 0

    def handle_gradient(self) -> None:
        self.calls += 1
        assert self.context is not None
        group = self.context.get_group(M.DATA)
        for p in self.parameters():
            assert p.grad is not None
            tdist.all_reduce(p.grad, group=group)
            p.grad.div_(self.context.get_world_size(M.DATA))


class UserCountingSchedule:
    """A user's schedule: the plain one, counting its calls."""

    def __init__(self) -> None:
        self.calls = 0
        self._inner = NonPipelineSchedule()

    def train_step(
        self, stage: Any, data_iter: Iterator[Any], loss_fn: Any, *, keep_outputs: bool = True
    ) -> tuple[Any, Any, torch.Tensor | None]:
        self.calls += 1
        return self._inner.train_step(stage, data_iter, loss_fn, keep_outputs=keep_outputs)

    def eval_step(
        self, stage: Any, data_iter: Iterator[Any], loss_fn: Any, *, keep_outputs: bool = True
    ) -> tuple[Any, Any, torch.Tensor | None]:
        self.calls += 1
        return self._inner.eval_step(stage, data_iter, loss_fn, keep_outputs=keep_outputs)


class OlderInterfaceSchedule:
    """A user's schedule written for the older interface: one call with three flags."""

    def __init__(self) -> None:
        self.calls: list[tuple[bool, bool, bool]] = []
        self._inner = NonPipelineSchedule()

    def forward_backward_step(
        self,
        stage: Any,
        data_iter: Iterator[Any],
        loss_fn: Any,
        forward_only: bool = False,
        return_loss: bool = True,
        return_output_label: bool = True,
    ) -> tuple[Any, Any, torch.Tensor | None]:
        self.calls.append((forward_only, return_loss, return_output_label))
        keep = return_output_label
        if forward_only:
            fn = loss_fn if return_loss else None
            return self._inner.eval_step(stage, data_iter, fn, keep_outputs=keep)
        return self._inner.train_step(stage, data_iter, loss_fn, keep_outputs=keep)


def _register() -> None:
    # the same object again is a no-op, so a reused worker may call this in every test
    GRADIENT_HANDLERS.register(UserAverageHandler, name="TestUserAverageHandler")
    SCHEDULES.register(UserCountingSchedule, name="TestUserCountingSchedule")


def _halves(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = make_data(8, seed=step)
    return x[4 * rank : 4 * rank + 4], y[4 * rank : 4 * rank + 4]


def _user_plugins() -> dict[str, Any]:
    _register()
    ctx = create_context(dict(parallel={}), timeout=60)
    try:
        rank = tdist.get_rank()
        model = make_model(seed=rank)
        config = {
            "gradient_handlers": [{"type": "TestUserAverageHandler", "tag": "mine"}],
            "schedule": {"type": "TestUserCountingSchedule"},
        }
        engine, *_ = initialize(
            model, sgd(model), nn.CrossEntropyLoss(), config=config, context=ctx
        )
        for step in range(3):
            engine.zero_grad()
            engine.execute_schedule(iter([_halves(step, rank)]))
            assert engine.step()
        (handler,) = engine.gradient_handlers
        assert isinstance(handler, UserAverageHandler)
        schedule = engine.schedule
        assert isinstance(schedule, UserCountingSchedule)
        return {
            "model": type(engine.model).__name__,
            "tag": handler.tag,
            "handler_calls": handler.calls,
            "schedule_calls": schedule.calls,
            "params": [p.detach().clone() for p in engine.parameters()],
        }
    finally:
        ctx.destroy()


def test_user_handler_and_schedule_from_the_registries(dist: Any) -> None:
    results = dist.run(_user_plugins, world_size=2, timeout=120)
    expected = reference_params([make_data(8, seed=s) for s in range(3)], sgd)
    for r in results:
        assert r["model"] == "Sequential"  # a configured handler replaces DDP
        assert (r["tag"], r["handler_calls"], r["schedule_calls"]) == ("mine", 3, 3)
        for got, want in zip(r["params"], expected, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_engine_runs_any_object_with_train_and_eval_steps() -> None:
    data = [make_data(8, seed=s) for s in range(2)]
    model = make_model()
    schedule = UserCountingSchedule()
    engine = Engine(model, sgd(model), nn.CrossEntropyLoss(), schedule=schedule)
    assert engine.schedule is schedule
    for batch in data:
        engine.zero_grad()
        _, _, loss = engine.execute_schedule(iter([batch]))
        assert loss is not None
        engine.step()
    assert schedule.calls == 2
    for got, want in zip(engine.parameters(), reference_params(data, sgd), strict=True):
        torch.testing.assert_close(got.detach(), want, rtol=0, atol=0)


def test_a_schedule_of_the_older_interface_still_runs_with_a_deprecation_warning() -> None:
    data = [make_data(8, seed=s) for s in range(2)]
    model = make_model()
    schedule = OlderInterfaceSchedule()
    with pytest.warns(DeprecationWarning, match="train_step"):
        engine = Engine(model, sgd(model), nn.CrossEntropyLoss(), schedule=schedule)
    for batch in data:
        engine.zero_grad()
        engine.execute_schedule(iter([batch]), return_output_label=False)
        engine.step()
    out, _, loss = engine.execute_schedule(iter([data[0]]), forward_only=True, return_loss=False)
    assert loss is None and out is not None
    assert schedule.calls == [(False, True, False)] * 2 + [(True, False, True)]
    for got, want in zip(engine.parameters(), reference_params(data, sgd), strict=True):
        torch.testing.assert_close(got.detach(), want, rtol=0, atol=0)


def test_an_object_that_runs_no_step_is_refused_by_name() -> None:
    model = make_model()
    with pytest.raises(TypeError, match="Linear has neither"):
        Engine(model, sgd(model), nn.CrossEntropyLoss(), schedule=nn.Linear(2, 2))


# ------------------------------------------------------------------ bucketed data parallel

BUCKET_MB = 100 / 2**20  # 100 bytes: 25 float32 values, several buckets for this model


def _small_buckets() -> list[torch.Tensor]:
    ctx = create_context(dict(parallel={}), timeout=60)
    try:
        rank = tdist.get_rank()
        model = make_model(seed=rank)
        config = {
            "gradient_handlers": [
                {"type": "DataParallelGradientHandler", "bucket_size_mb": BUCKET_MB}
            ]
        }
        engine, *_ = initialize(
            model, sgd(model), nn.CrossEntropyLoss(), config=config, context=ctx
        )
        for step in range(3):
            engine.zero_grad()
            xs, ys = _halves(step, rank)
            engine.backward(engine.criterion(engine(xs), ys))
            assert engine.step()
        return [p.detach().clone() for p in engine.parameters()]
    finally:
        ctx.destroy()


def test_data_parallel_handler_with_several_buckets(dist: Any) -> None:
    grads = [torch.zeros_like(p) for p in make_model().parameters()]
    assert len(bucketize(grads, int(BUCKET_MB * 2**20))) >= 3  # really several buckets
    results = dist.run(_small_buckets, world_size=2, timeout=120)
    expected = reference_params([make_data(8, seed=s) for s in range(3)], sgd)
    for params in results:
        for got, want in zip(params, expected, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def _coalesced_mixed_dtypes() -> list[torch.Tensor]:
    rank = tdist.get_rank()
    tensors = [
        torch.full((3,), float(rank + 1)),
        torch.full((2,), float(10 * (rank + 1)), dtype=torch.float64),
        torch.full((5,), float(rank)),
    ]
    all_reduce_coalesced(tensors, tdist.group.WORLD, divisor=2.0, bucket_bytes=8)
    return tensors


def test_all_reduce_coalesced_keeps_dtypes_and_order(dist: Any) -> None:
    for tensors in dist.run(_coalesced_mixed_dtypes, world_size=2, timeout=60):
        assert torch.equal(tensors[0], torch.full((3,), 1.5))
        assert tensors[1].dtype == torch.float64
        assert torch.equal(tensors[1], torch.full((2,), 15.0, dtype=torch.float64))
        assert torch.equal(tensors[2], torch.full((5,), 0.5))


# ------------------------------------------------------------------ tied weights by name


def _tied_from_config(mismatch: bool) -> dict[str, Any]:
    config = {
        "parallel": {"pipeline": 2},
        "NUM_MICRO_BATCHES": 2,
        "gradient_handlers": [{"type": "PipelineSharedModuleGradientHandler"}],
    }
    ctx = create_context(config, timeout=60, heartbeat_interval=0)
    try:
        stage = tdist.get_rank()
        torch.manual_seed(stage)  # the two copies start different
        shape = (4, 5) if (mismatch and stage == 1) else (5, 4)
        model = nn.Module()
        model.w = nn.Parameter(torch.randn(*shape))
        mark_pipeline_shared(model.w, "embedding")
        try:
            engine, *_ = initialize(model, sgd(model), nn.MSELoss(), context=ctx)
        except RuntimeError as exc:
            return {"error": str(exc)}
        (handler,) = engine.gradient_handlers
        assert isinstance(handler, PipelineSharedModuleGradientHandler)
        return {
            "error": None,
            "w": model.w.detach().clone(),
            "dups": handler.duplicate_parameters(),
        }
    finally:
        ctx.destroy()


def test_pipeline_shared_handler_from_config_equalizes_the_copies(dist: Any) -> None:
    first, last = dist.run(_tied_from_config, world_size=2, args=(False,), timeout=120)
    assert first["error"] is None and last["error"] is None
    assert torch.equal(first["w"], last["w"])  # the last stage took the first stage's values
    assert len(first["dups"]) == 0 and len(last["dups"]) == 1  # counted once in the norm


def test_pipeline_shared_handler_mismatch_is_reported_on_both_stages(dist: Any) -> None:
    results = dist.run(_tied_from_config, world_size=2, args=(True,), timeout=120)
    for r in results:
        assert r["error"] is not None
        assert "tied weights differ between the first and last pipeline stage" in r["error"]
        assert "('embedding', (5, 4))" in r["error"] and "('embedding', (4, 5))" in r["error"]


# ------------------------------------------------------------------ handler errors


class NotAHandler:
    def __init__(self, model: Any, optimizer: Any = None, context: Any = None) -> None:
        pass


def _bad_handler(entry: dict[str, Any]) -> dict[str, Any]:
    ctx = create_context(dict(parallel={}), timeout=60, heartbeat_interval=0)
    try:
        model = make_model()
        try:
            initialize(model, sgd(model), config={"gradient_handlers": [entry]}, context=ctx)
        except (ValueError, ConfigError) as exc:
            return {"type": type(exc).__name__, "message": str(exc)}
        return {"type": None, "message": ""}
    finally:
        ctx.destroy()


@pytest.mark.parametrize(
    ("entry", "error", "match"),
    [
        ({"type": "SequenceParallelGradientHandler"}, "ValueError", "tensor mode 'sequence'"),
        ({"type": NotAHandler}, "ConfigError", "built a NotAHandler, not a BaseGradientHandler"),
        ({"kind": "DataParallelGradientHandler"}, "ConfigError", "must be a dict with a 'type'"),
        ({"type": "NoSuchHandler"}, "ConfigError", "NoSuchHandler"),
    ],
    ids=["sequence_without_sequence_mode", "not_a_handler", "no_type", "unknown_name"],
)
def test_a_handler_that_cannot_be_built_is_a_clear_error_on_every_rank(
    dist: Any, entry: dict[str, Any], error: str, match: str
) -> None:
    results = dist.run(_bad_handler, world_size=2, args=(entry,), timeout=120)
    assert results[0] == results[1]  # the same error everywhere, nobody left waiting
    assert results[0]["type"] == error
    assert match in results[0]["message"]
