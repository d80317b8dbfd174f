"""A tensor_shape that fits full batches fails on a short last batch, and the error says so."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tessera.context import RankFailedError, create_context
from tessera.pipeline import PipelineRunner, PipelineSchedule, build_pipeline_model


def _short_last_batch() -> str:
    ctx = create_context({"parallel": {"pipeline": 2}}, timeout=20.0)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))
        stage = build_pipeline_model(model, method=[0, 2, 3], context=ctx)
        runner = PipelineRunner(PipelineSchedule(2, tensor_shape=(2, 8)), context=ctx)

        def mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return ((out - y) ** 2).mean()

        runner.train_step(stage, iter([(torch.ones(4, 5), torch.zeros(4, 3))]), mse)  # fits
        try:  # a last batch of 2: microbatches of 1 where tensor_shape says 2
            runner.train_step(stage, iter([(torch.ones(2, 5), torch.zeros(2, 3))]), mse)
        except (ValueError, RankFailedError) as err:
            return str(err)
        return "finished"
    finally:
        ctx.destroy()


def test_short_last_batch_is_named_as_the_cause(dist: Any) -> None:
    sender, _ = dist.run(_short_last_batch, world_size=2, timeout=90)
    assert "virtual stage 0 outputs [([1, 8], torch.float32)]" in sender
    assert "microbatches hold 1 samples where tensor_shape's first dimension says 2" in sender
    assert "drop_last=True" in sender
