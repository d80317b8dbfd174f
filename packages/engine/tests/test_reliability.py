"""Failures and mismatched ranks in the Engine: clear errors in bounded time, never a hang.

Fault tests build contexts with a 4 s collective timeout and 0.2 s heartbeats; the bodies
catch the expected error on every rank and return what they saw, so one pool serves them all.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
import torch.distributed as tdist
from torch import nn

from tessera.context import RankFailedError, create_context
from tessera.engine import initialize

TIMEOUT = 4.0  # short, yet long enough for a healthy step on two busy cores
BEAT = 0.2
BOUND = TIMEOUT + 3 * BEAT + 8.0  # slack for two shared CPU cores


def _model(width: int = 4) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, width), nn.ReLU(), nn.Linear(width, 2))


def _outcome(fn: Any) -> dict[str, Any]:
    start = time.monotonic()
    try:
        fn()
        return {"outcome": "finished"}
    except RankFailedError as err:
        return {
            "outcome": "RankFailedError",
            "rank": err.rank,
            "where": err.where,
            "message": str(err),
            "seconds": time.monotonic() - start,
        }
    except ValueError as err:
        return {"outcome": "ValueError", "message": str(err)}


# ---------------------------------------------------------------- a rank raises mid-step


class _FailsOnRank(nn.Module):
    def __init__(self, rank: int) -> None:
        super().__init__()
        self.inner = _model()
        self.rank = rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if tdist.get_rank() == self.rank:
            raise ValueError(f"activation overflow on rank {self.rank}")
        return self.inner(x)  # type: ignore[no-any-return]


def _raise_in_forward(handler: bool) -> dict[str, Any]:
    tdist.barrier()
    ctx = create_context({"parallel": {}}, timeout=TIMEOUT, heartbeat_interval=BEAT)
    try:
        model = _FailsOnRank(1)
        config: dict[str, Any] = {}
        if handler:
            config["gradient_handlers"] = [{"type": "DataParallelGradientHandler"}]
        engine, *_ = initialize(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            nn.MSELoss(),
            config=config,
            context=ctx,
        )
        x, y = torch.ones(2, 4), torch.zeros(2, 2)
        tdist.barrier()  # the harness's default group: enter the step together

        def step() -> None:
            engine.zero_grad()
            engine.backward(engine.criterion(engine(x), y))
            engine.step()

        return _outcome(step)
    finally:
        ctx.destroy()


@pytest.mark.parametrize("handler", [False, True], ids=["ddp", "gradient_handler"])
def test_a_rank_raising_in_forward_stops_the_others(dist: Any, handler: bool) -> None:
    results = dist.run(_raise_in_forward, world_size=2, args=(handler,), timeout=90)
    assert results[1] == {"outcome": "ValueError", "message": "activation overflow on rank 1"}
    got = results[0]
    assert got["outcome"] == "RankFailedError", got
    assert (got["rank"], got["where"]) == (1, "engine.forward")
    assert "rank 1 failed in 'engine.forward': ValueError: activation overflow" in got["message"]
    # rank 0 waited in DDP's backward all-reduce, or in the handler's all-reduce in step()
    assert ("engine.backward" if not handler else "engine.step") in got["message"]
    assert got["seconds"] < BOUND


# ---------------------------------------------------------------- mismatched ranks


def _build_differently() -> dict[str, Any]:
    ctx = create_context({"parallel": {}}, timeout=30)
    try:
        model = _model(width=4 if tdist.get_rank() == 0 else 6)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        return _outcome(lambda: initialize(model, opt, nn.MSELoss(), config={}, context=ctx))
    finally:
        ctx.destroy()


def test_a_model_built_differently_on_one_data_rank_is_reported(dist: Any) -> None:
    results = dist.run(_build_differently, world_size=2, timeout=90)
    assert results[0] == results[1]  # the same error everywhere, nobody left waiting
    message = results[0]["message"]
    assert results[0]["outcome"] == "ValueError"
    assert "the data ranks [0, 1] disagree on the model" in message
    assert "0.weight: rank 0 has parameter [4, 4] float32, rank 1 has parameter [6, 4]" in message


def _tensor_ranks_differ() -> dict[str, Any]:
    ctx = create_context(
        {"parallel": {"tensor": {"size": 2, "mode": "1d"}}}, timeout=30, heartbeat_interval=0
    )
    try:
        model = _model()
        if tdist.get_rank() == 1:
            model[0].to(torch.float64)  # type: ignore[operator]
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        return _outcome(lambda: initialize(model, opt, nn.MSELoss(), config={}, context=ctx))
    finally:
        ctx.destroy()


def test_a_dtype_that_differs_between_tensor_ranks_is_reported(dist: Any) -> None:
    results = dist.run(_tensor_ranks_differ, world_size=2, timeout=90)
    assert results[0] == results[1]
    assert "the tensor ranks [0, 1] disagree on the model" in results[0]["message"]
    assert "float32, rank 1 has parameter of full shape [4, 4] float64" in results[0]["message"]


def _config_differs() -> dict[str, Any]:
    parallel = {"pipeline": 2}
    ctx = create_context({"parallel": parallel}, timeout=30, heartbeat_interval=0)
    try:
        shape = [2, 4] if tdist.get_rank() == 0 else [2, 5]
        config = {"parallel": parallel, "NUM_MICRO_BATCHES": 2, "TENSOR_SHAPE": shape}
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        return _outcome(lambda: initialize(model, opt, nn.MSELoss(), config=config, context=ctx))
    finally:
        ctx.destroy()


def test_a_configuration_that_differs_on_one_rank_is_reported(dist: Any) -> None:
    results = dist.run(_config_differs, world_size=2, timeout=90)
    assert results[0] == results[1]
    message = results[0]["message"]
    assert "the global ranks [0, 1] disagree on the configuration" in message
    assert "TENSOR_SHAPE: rank 0 has [2, 4], rank 1 has [2, 5]" in message


# ---------------------------------------------------------------- debug mode


def _unequal_replicas(debug: bool) -> dict[str, Any]:
    ctx = create_context(
        {"parallel": {"tensor": {"size": 2, "mode": "1d"}}}, timeout=30, heartbeat_interval=0
    )
    try:
        model = nn.Linear(4, 2)  # not seeded alike: the harness seeds every rank differently
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        config = {"debug": debug}
        return _outcome(lambda: initialize(model, opt, nn.MSELoss(), config=config, context=ctx))
    finally:
        ctx.destroy()


def test_debug_mode_compares_replicated_parameter_values(dist: Any) -> None:
    assert (
        dist.run(_unequal_replicas, world_size=2, args=(False,), timeout=90)
        == [{"outcome": "finished"}] * 2
    )
    results = dist.run(_unequal_replicas, world_size=2, args=(True,), timeout=90)
    assert results[0] == results[1]
    message = results[0]["message"]
    assert "the tensor ranks [0, 1] disagree on the parameter values" in message
    assert "weight: rank 0 has (" in message


def _batch_sizes_differ(debug: bool) -> dict[str, Any]:
    ctx = create_context({"parallel": {}}, timeout=30, heartbeat_interval=0)
    try:
        model = _model()
        config = {"debug": debug, "gradient_handlers": [{"type": "DataParallelGradientHandler"}]}
        engine, *_ = initialize(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            nn.MSELoss(),
            config=config,
            context=ctx,
        )
        rows = 2 if tdist.get_rank() == 0 else 3
        batch = (torch.ones(rows, 4), torch.zeros(rows, 2))
        return _outcome(lambda: engine.execute_schedule(iter([batch])))
    finally:
        ctx.destroy()


def test_debug_mode_compares_batch_shapes(dist: Any) -> None:
    # Without debug mode, different batch sizes on data ranks go unnoticed (weighted wrongly).
    assert (
        dist.run(_batch_sizes_differ, world_size=2, args=(False,), timeout=90)
        == [{"outcome": "finished"}] * 2
    )
    results = dist.run(_batch_sizes_differ, world_size=2, args=(True,), timeout=90)
    assert results[0] == results[1]
    message = results[0]["message"]
    assert "the global ranks [0, 1] disagree on the batch" in message
    assert "tensor [2, 4] float32" in message and "tensor [3, 4] float32" in message


def test_debug_flag_from_config_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from tessera.engine.consistency import DEBUG_ENV, debug_enabled

    monkeypatch.delenv(DEBUG_ENV, raising=False)
    assert not debug_enabled({})
    assert debug_enabled({"debug": True})
    monkeypatch.setenv(DEBUG_ENV, "1")
    assert debug_enabled({})
    assert not debug_enabled({"debug": False})  # the config wins
    monkeypatch.setenv(DEBUG_ENV, "0")
    assert not debug_enabled(None)
