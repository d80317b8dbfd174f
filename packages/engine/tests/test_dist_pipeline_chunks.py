"""NUM_CHUNKS given only to build_pipeline_model: initialize takes it from the chunks."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tessera.context import ConfigError, create_context
from tessera.engine import initialize
from tessera.pipeline import build_pipeline_model


def _chunks_from_the_model() -> dict[str, Any]:
    config: dict[str, Any] = dict(parallel=dict(pipeline=2), NUM_MICRO_BATCHES=2)
    ctx = create_context(config, timeout=60)
    try:
        torch.manual_seed(0)
        full = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Linear(8, 3))
        model = build_pipeline_model(full, num_chunks=2, method="uniform", context=ctx)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)  # the seed's next line
        engine, *_ = initialize(model, optimizer, nn.CrossEntropyLoss(), context=ctx)
        engine.zero_grad()
        x, y = torch.randn(4, 4), torch.randint(0, 3, (4,))
        engine.execute_schedule(iter([(x, y)]))
        engine.step()
        try:
            initialize(model, optimizer, config={**config, "NUM_CHUNKS": 1}, context=ctx)
            error = ""
        except ConfigError as err:
            error = str(err)
        return {"schedule": type(engine.schedule.schedule).__name__, "error": error}  # type: ignore[attr-defined]
    finally:
        ctx.destroy()


def test_num_chunks_comes_from_the_model_and_a_disagreeing_key_is_named(dist: Any) -> None:
    for result in dist.run(_chunks_from_the_model, world_size=2, timeout=120):
        assert result["schedule"] == "InterleavedPipelineSchedule"
        assert "config key NUM_CHUNKS=1 but the model holds 2 chunk(s)" in result["error"]
