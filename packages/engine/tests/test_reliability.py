"""Failures and mismatched ranks in the Engine: clear errors in bounded time, never a hang.

Fault tests build contexts with a 4 s collective timeout and 0.2 s heartbeats; the bodies
catch the expected error on every rank and return what they saw, so one pool serves them all.
"""

from __future__ import annotations

import importlib
import time
import warnings
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


def _raise_in_initialize() -> dict[str, Any]:
    module = importlib.import_module("tessera.engine.initialize")  # not the function
    real = module.check_parameter_checksums

    def broken(*args: Any, **kwargs: Any) -> None:
        raise ValueError("rank 1 could not read its weights")

    ctx = create_context({"parallel": {}}, timeout=TIMEOUT, heartbeat_interval=BEAT)
    try:
        if tdist.get_rank() == 1:
            module.check_parameter_checksums = broken
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        return _outcome(lambda: initialize(model, opt, nn.MSELoss(), context=ctx))
    finally:
        module.check_parameter_checksums = real
        ctx.destroy()


def test_a_rank_failing_in_initialize_is_named(dist: Any) -> None:
    results = dist.run(_raise_in_initialize, world_size=2, timeout=90)
    assert results[1] == {"outcome": "ValueError", "message": "rank 1 could not read its weights"}
    got = results[0]
    assert got["outcome"] == "RankFailedError", got
    assert (got["rank"], got["where"]) == (1, "engine.initialize"), got
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


# ---------------------------------------------------------------- ranks that disagree


def _unequal_replicas() -> dict[str, Any]:
    ctx = create_context(
        {"parallel": {"tensor": {"size": 2, "mode": "1d"}}}, timeout=30, heartbeat_interval=0
    )
    try:
        model = nn.Linear(4, 2)  # not seeded alike: the harness seeds every rank differently
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        return _outcome(lambda: initialize(model, opt, nn.MSELoss(), config={}, context=ctx))
    finally:
        ctx.destroy()


def test_replicated_parameter_values_are_compared_on_every_job(dist: Any) -> None:
    # Seeded differently, the tensor ranks of one replica would each train their own copy.
    results = dist.run(_unequal_replicas, world_size=2, timeout=90)
    assert results[0] == results[1]
    message = results[0]["message"]
    assert "the tensor ranks [0, 1] disagree on the parameter values" in message
    assert "weight: rank 0 has (" in message


def _batch_sizes_differ() -> dict[str, Any]:
    """Data rank 1 reads 3 rows where rank 0 reads 2, in each way a loop can feed the engine."""
    ctx = create_context({"parallel": {}}, timeout=30, heartbeat_interval=0)
    rank = tdist.get_rank()

    def engine_for(config: dict[str, Any]) -> Any:
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        return initialize(model, opt, nn.MSELoss(), config=config, context=ctx)[0]

    def batch(rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.ones(rows, 4), torch.zeros(rows, 2)

    def schedule_step(engine: Any, rows: int) -> None:
        engine.zero_grad()
        engine.execute_schedule(iter([batch(rows)]))
        engine.step()

    def call_step(engine: Any, rows: int) -> None:
        x, y = batch(rows)
        engine.zero_grad()
        engine.backward(engine.criterion(engine(x), y))
        engine.step()

    uneven = 2 if rank == 0 else 3
    handler = {"gradient_handlers": [{"type": "DataParallelGradientHandler"}]}
    try:
        seen: dict[str, Any] = {}
        seen["schedule"] = _outcome(lambda: schedule_step(engine_for(handler), uneven))
        seen["call"] = _outcome(lambda: call_step(engine_for({}), uneven))  # under DDP
        # Switched off, nothing compares (and the handler weighs the ranks' means alike).
        off = engine_for({**handler, "check_agreement": False})
        seen["off"] = _outcome(lambda: schedule_step(off, uneven))

        def drifts_later() -> None:  # equal for two steps, then rank 1 reads more
            engine = engine_for({**handler, "check_agreement": 2})
            for step in range(4):
                schedule_step(engine, uneven if step >= 2 else 2)
                seen["steps_before_error"] = step + 1

        seen["periodic"] = _outcome(drifts_later)
        return seen
    finally:
        ctx.destroy()


def test_ranks_reading_different_batch_sizes_are_reported_on_the_first_step(dist: Any) -> None:
    results = dist.run(_batch_sizes_differ, world_size=2, timeout=90)
    assert results[0] == results[1]
    seen = results[0]
    for way in ("schedule", "periodic"):
        assert seen[way]["outcome"] == "ValueError", seen
        message = seen[way]["message"]
        assert "the global ranks [0, 1] disagree on the batch" in message
        assert "tensor [2, 4] float32" in message and "tensor [3, 4] float32" in message
    assert seen["call"]["outcome"] == "ValueError"
    assert "the data ranks [0, 1] disagree on the model inputs" in seen["call"]["message"]
    assert seen["off"] == {"outcome": "finished"}
    assert seen["steps_before_error"] == 2  # checked again after optimizer step 2


def _drifting_replicas() -> dict[str, Any]:
    """Two data replicas reading different rows: with their gradients summed they stay equal;
    without (no gradient handler) each trains its own model, found after the step."""
    from tessera.engine import DataParallelGradientHandler, Engine

    ctx = create_context({"parallel": {}}, timeout=30, heartbeat_interval=0)
    rank = tdist.get_rank()

    def train(summed: bool) -> None:
        torch.manual_seed(0)  # equal replicas to start from
        model = nn.Linear(4, 2)
        handlers = [DataParallelGradientHandler(model, context=ctx)] if summed else []
        engine = Engine(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            nn.MSELoss(),
            gradient_handlers=handlers,
            check_agreement_every=1,
            context=ctx,
        )
        for _ in range(2):
            x, y = torch.full((2, 4), float(rank + 1)), torch.zeros(2, 2)  # rows per rank
            engine.zero_grad()
            engine.backward(engine.criterion(engine(x), y))
            engine.step()

    try:
        return {
            "summed": _outcome(lambda: train(True)),
            "not summed": _outcome(lambda: train(False)),
        }
    finally:
        ctx.destroy()


def test_replicas_drifting_apart_are_found_after_the_step(dist: Any) -> None:
    results = dist.run(_drifting_replicas, world_size=2, timeout=90)
    assert results[0] == results[1]
    assert results[0]["summed"] == {"outcome": "finished"}
    drifted = results[0]["not summed"]
    assert drifted["outcome"] == "ValueError", drifted
    message = drifted["message"]
    assert "after optimizer step 1 the data ranks [0, 1] hold different values" in message
    assert "weight: rank 0 has (" in message and "bias: rank 0 has (" in message


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


# ---------------------------------------------------------------- non-finite losses and gradients


def _nonfinite_steps() -> dict[str, Any]:
    """Two data ranks (DDP); a NaN enters through one rank's batch or one rank's gradient."""
    from tessera.engine import NonFiniteError

    ctx = create_context({"parallel": {}}, timeout=30, heartbeat_interval=0)
    rank = tdist.get_rank()

    def run(policy: str | None, poison: str, steps: int = 2) -> dict[str, Any]:
        model = _model()
        config = {} if policy is None else {"nonfinite": policy}
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        engine = initialize(model, opt, nn.MSELoss(), config=config, context=ctx)[0]
        start = [p.detach().clone() for p in engine.parameters()]
        seen: dict[str, Any] = {"stepped": []}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(steps):
                x, y = torch.ones(2, 4) * (rank + 1), torch.zeros(2, 2)
                if step == 0 and poison == "loss" and rank == 1:
                    x[0, 0] = float("nan")
                engine.zero_grad()
                engine.backward(engine.criterion(engine(x), y))
                if step == 0 and poison == "grad" and rank == 0:
                    next(engine.parameters()).grad[0, 0] = float("inf")
                try:
                    seen["stepped"].append(engine.step())
                except NonFiniteError as err:
                    seen["error"] = str(err)
                    seen["report"] = (err.report.step, err.report.loss_ranks, err.report.grad_ranks)
                    break
                if step == 0:
                    seen["unchanged"] = all(
                        torch.equal(a, b) for a, b in zip(start, engine.parameters(), strict=True)
                    )
        seen["finite"] = all(bool(torch.isfinite(p).all()) for p in engine.parameters())
        seen["skipped"] = engine.skipped_steps
        seen["warnings"] = [str(w.message) for w in caught if w.category is RuntimeWarning]
        return seen

    try:
        return {
            "raise_loss": run(None, "loss"),
            "raise_grad": run("raise", "grad"),
            "skip": run("skip", "loss"),
            "warn": run("warn", "grad"),
        }
    finally:
        ctx.destroy()


def test_a_nonfinite_loss_or_gradient_is_raised_or_skipped_on_every_rank(dist: Any) -> None:
    results = dist.run(_nonfinite_steps, world_size=2, timeout=90)
    for seen in results:
        # raise (the default): the same error on every rank, naming where it started
        loss = seen["raise_loss"]
        assert loss["report"] == (1, (1,), (0, 1)) and loss["finite"], loss
        assert "the loss went non-finite first, on rank(s) [1]" in loss["error"]
        assert "optimizer step 1" in loss["error"]
        grad = seen["raise_grad"]
        assert grad["report"] == (1, (), (0,)) and grad["finite"], grad
        assert "a gradient went non-finite first (every loss was finite)" in grad["error"]
        # skip / warn: every rank skips that step alone and trains on
        for policy in ("skip", "warn"):
            got = seen[policy]
            assert got["stepped"] == [False, True] and got["unchanged"] and got["finite"], got
            assert got["skipped"] == 1
        assert seen["skip"]["warnings"] == []
        assert len(seen["warn"]["warnings"]) == 1
        assert "rank(s) [0]" in seen["warn"]["warnings"][0]
