"""First steps (shape exchange) under random timing: no hang, same gradients as the unsplit model.

A first step is where the receivers learn the shapes from metadata messages; whether it
completes must not depend on which rank is faster. Every stage here sleeps a random 0-3 ms
(seeded per rank and case) before its forward, so the ranks reach their batches in many
different orders; each case runs a fresh schedule (a step that exchanges metadata) and then a
second step with the cached shapes.
"""

from __future__ import annotations

import copy
import random
import time
from typing import Any

import torch
import torch.distributed as torch_dist
from torch import nn

from tessera.context import ParallelMode, create_context
from tessera.pipeline import (
    GPipeSchedule,
    InterleavedPipelineSchedule,
    PipelineRunner,
    PipelineSchedule,
    ZeroBubbleSchedule,
    build_pipeline_model,
)


class Jittered(nn.Module):
    """Sleeps a random while, then runs the stage (not a PipelineStage: no position check)."""

    def __init__(self, inner: nn.Module, rng: random.Random) -> None:
        super().__init__()
        self.inner = inner
        self.rng = rng

    def forward(self, payload: Any) -> Any:
        time.sleep(self.rng.uniform(0.0, 0.003))
        return self.inner(payload)


def _mlp() -> nn.Sequential:
    with torch.random.fork_rng():
        torch.manual_seed(11)
        return nn.Sequential(
            nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(),
            nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 6), nn.Linear(6, 3),
        )  # fmt: skip


def _mse(output: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    return ((output - label) ** 2).mean()


def _jittered_first_steps(p: int, rounds: int) -> dict[str, float]:
    ctx = create_context(dict(parallel=dict(pipeline=p)), timeout=60)
    rank = ctx.get_local_rank(ParallelMode.PIPELINE)
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(8, 5, generator=g), torch.randn(8, 3, generator=g)
    model = _mlp()
    ref = copy.deepcopy(model)
    _mse(ref(x), y).backward()
    ref_grads = {n: q.grad for n, q in ref.named_parameters() if q.grad is not None}
    worst: dict[str, float] = {}
    try:
        for trial in range(rounds):
            cases = {
                "gpipe": (GPipeSchedule(4), 1),
                "1f1b": (PipelineSchedule(4), 1),
                "zero_bubble": (ZeroBubbleSchedule(8), 1),
                "interleaved": (InterleavedPipelineSchedule(4, 2), 2),
            }
            for name, (schedule, chunks) in cases.items():
                built = build_pipeline_model(model, chunks, method="uniform", context=ctx)
                inner = [built] if isinstance(built, nn.Module) else list(built)
                rng = random.Random(1000 * trial + 10 * rank + len(name))
                stages = [Jittered(s, rng) for s in inner]
                for s in inner:
                    s.zero_grad(set_to_none=True)
                runner = PipelineRunner(schedule, context=ctx)
                for _ in range(2):  # exchange, then cached shapes
                    runner.train_step(stages if chunks > 1 else stages[0], iter([(x, y)]), _mse)
                diff = 0.0
                for s in inner:
                    for pname, q in s.named_parameters():
                        assert q.grad is not None, (name, pname)
                        diff = max(diff, (q.grad - 2 * ref_grads[pname]).abs().max().item())
                worst[name] = max(worst.get(name, 0.0), diff)
        torch_dist.barrier(group=ctx.get_cpu_group(ParallelMode.PIPELINE))
    finally:
        ctx.destroy()
    return worst


def test_first_steps_with_random_timing_finish_and_match(dist: Any) -> None:
    results = dist.run(_jittered_first_steps, world_size=4, args=(4, 2), timeout=240)
    for rank, worst in enumerate(results):
        assert set(worst) == {"gpipe", "1f1b", "zero_bubble", "interleaved"}
        for name, diff in worst.items():
            assert diff <= 1e-5, (rank, name, diff)


class Wrapper(nn.Module):
    """A new object around the same stage each step, like the engine's autocast wrapper."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, payload: Any) -> Any:
        return self.inner(payload)


def _fresh_wrappers_each_step() -> list[bool]:
    ctx = create_context(dict(parallel=dict(pipeline=2)), timeout=30)
    rank = ctx.get_local_rank(ParallelMode.PIPELINE)
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(8, 5, generator=g), torch.randn(8, 3, generator=g)
    stage = build_pipeline_model(_mlp(), 1, method="uniform", context=ctx)
    runner = PipelineRunner(PipelineSchedule(2), context=ctx)
    kept: list[nn.Module] = []
    exchanged = []
    try:
        for _ in range(4):
            wrapper = Wrapper(stage)
            if rank == 0:
                kept.append(wrapper)  # rank 0's ids never repeat; rank 1's are reused
            runner.train_step(wrapper, iter([(x, y)]), _mse)
            assert runner.last_run is not None
            exchanged.append(runner.last_run.exchanged_metadata)
            del wrapper
    finally:
        ctx.destroy()
    return exchanged


def test_new_stage_objects_each_step_do_not_split_the_ranks(dist: Any) -> None:
    # Regression: the decision to exchange shapes used id() of the stage objects, which is
    # rank-local; one rank announced metadata its peer did not read and both hung in p2p.
    results = dist.run(_fresh_wrappers_each_step, world_size=2, timeout=120)
    assert results == [[True, False, False, False]] * 2
