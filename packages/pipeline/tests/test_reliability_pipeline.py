"""A wrong or disagreeing tensor_shape, and a failing stage: clear errors, never a hang.

Fault tests use a 4 s collective timeout; every body catches the error it expects and returns
what it saw, so the pool survives for the next test.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as torch_dist
from torch import nn

from tessera.context import ParallelMode, RankFailedError, create_context
from tessera.pipeline import PipelineRunner, PipelineSchedule, build_pipeline_model

TIMEOUT = 4.0  # short, yet long enough for a healthy step on two busy cores
BOUND = TIMEOUT + 3 * 0.2 + 8.0  # slack for two shared CPU cores


def _mlp() -> nn.Sequential:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 8), nn.Linear(8, 3))


def _mse(output: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    return ((output - label) ** 2).mean()


def _step(schedule: PipelineSchedule, ctx: Any) -> dict[str, Any]:
    stage = build_pipeline_model(_mlp(), 1, method=[0, 2, 4], context=ctx)
    x, y = torch.ones(4, 5), torch.zeros(4, 3)
    torch_dist.barrier()  # the harness's default group: enter the step together
    start = time.monotonic()
    try:
        PipelineRunner(schedule, context=ctx).train_step(stage, iter([(x, y)]), _mse)
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


def _wrong_tensor_shape() -> dict[str, Any]:
    # Stage 0 outputs [2, 8] per microbatch; every rank declares [2, 7].
    ctx = create_context(
        {"parallel": {"pipeline": 2}, "TENSOR_SHAPE": [2, 7]}, timeout=TIMEOUT,
        heartbeat_interval=0.2,
    )  # fmt: skip
    try:
        return _step(PipelineSchedule(2), ctx)
    finally:
        ctx.destroy()


def test_a_wrong_tensor_shape_fails_the_sender_and_names_it_on_the_receiver(dist: Any) -> None:
    sender, receiver = dist.run(_wrong_tensor_shape, world_size=2, timeout=90)
    assert sender["outcome"] == "ValueError"
    assert "virtual stage 0 outputs [([2, 8], torch.float32)]" in sender["message"]
    assert "tensor_shape" in sender["message"]
    assert receiver["outcome"] == "RankFailedError", receiver
    assert (receiver["rank"], receiver["where"]) == (0, "pipeline rank 0 of 2")
    assert (
        "rank 0 failed in 'pipeline rank 0 of 2': ValueError: pipeline rank 0"
        in (receiver["message"])
    )
    assert "Rank 1 stopped in 'pipeline rank 1 of 2'" in receiver["message"]
    assert receiver["seconds"] < BOUND


def _disagreeing_tensor_shape() -> dict[str, Any]:
    ctx = create_context({"parallel": {"pipeline": 2}}, timeout=60, heartbeat_interval=0)
    try:
        rank = ctx.get_local_rank(ParallelMode.PIPELINE)
        # Rank 1 declares a wider shape: gloo would receive the short message into the longer
        # buffer without complaint and train on garbage.
        schedule = PipelineSchedule(2, tensor_shape=(2, 8) if rank == 0 else (2, 9))
        result = _step(schedule, ctx)
        # Agreed declarations are checked once per schedule, then cost nothing.
        same = PipelineSchedule(2, tensor_shape=(2, 8))
        result["agreed"] = _step(same, ctx)["outcome"]
        return result
    finally:
        ctx.destroy()


def test_tensor_shapes_that_differ_between_pipeline_ranks_are_reported(dist: Any) -> None:
    results = dist.run(_disagreeing_tensor_shape, world_size=2, timeout=90)
    assert results[0] == results[1]  # the same error on both ranks, before any message
    assert results[0]["outcome"] == "ValueError"
    assert "declare different tensor_shape" in results[0]["message"]
    assert "pipeline rank 0: ([2, 8]:float32*)" in results[0]["message"]
    assert "pipeline rank 1: ([2, 9]:float32*)" in results[0]["message"]
    assert results[0]["agreed"] == "finished"
