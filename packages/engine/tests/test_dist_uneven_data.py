"""Uneven data through the Trainer on two data ranks: a clear error on every rank, never a gloo
abort; and a loader without len() (an IterableDataset) ends its epochs without a failure."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as tdist
from engine_testlib import make_data, make_model, sgd
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from tessera.context import create_context
from tessera.engine import Trainer, initialize


class _Stream(IterableDataset[tuple[torch.Tensor, torch.Tensor]]):
    """``rows`` samples, no len(): the loader's epoch ends by StopIteration."""

    def __init__(self, rows: int) -> None:
        self.x, self.y = make_data(rows, seed=tdist.get_rank())

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return iter(zip(self.x, self.y, strict=True))


def _fit_uneven() -> dict[str, Any]:
    ctx = create_context({"parallel": {}}, timeout=30, heartbeat_interval=0)
    rank = tdist.get_rank()

    def fit(loader: Any, epochs: int = 1) -> dict[str, Any]:
        model = make_model()
        config = {"gradient_handlers": [{"type": "DataParallelGradientHandler"}]}
        engine = initialize(model, sgd(model), nn.CrossEntropyLoss(), config=config, context=ctx)[0]
        trainer = Trainer(engine)
        try:
            trainer.fit(loader, epochs=epochs, display_progress=False)
            return {"outcome": "finished", "steps": trainer.global_step}
        except ValueError as err:
            return {"outcome": "ValueError", "message": str(err)}

    try:
        seen: dict[str, Any] = {}
        # even streams: two epochs of 3 steps end by StopIteration, posted as no failure
        seen["stream"] = fit(DataLoader(_Stream(6), batch_size=2), epochs=2)
        ctx.check_failures("after fit")  # raises RankFailedError if anything was posted
        x, y = make_data(8 if rank == 0 else 6)
        seen["lengths"] = fit(DataLoader(TensorDataset(x, y), batch_size=2))  # 4 vs 3 batches
        seen["uneven_stream"] = fit(DataLoader(_Stream(6 if rank == 0 else 4), batch_size=2))
        return seen
    finally:
        ctx.destroy()


def test_uneven_loaders_are_named_on_every_rank(dist: Any) -> None:
    results = dist.run(_fit_uneven, world_size=2, timeout=90)
    assert results[0] == results[1]  # the same outcome everywhere, nobody left waiting
    seen = results[0]
    assert seen["stream"] == {"outcome": "finished", "steps": 6}
    assert seen["lengths"]["outcome"] == "ValueError"
    assert (
        "uneven data: the ranks' train loaders differ in length "
        "(ranks [0]: 4 batches; ranks [1]: 3 batches)" in seen["lengths"]["message"]
    )
    assert seen["uneven_stream"]["outcome"] == "ValueError"
    assert (
        "uneven data: after 2 batches ranks [1] have no batch left, while ranks [0] read one "
        "more" in seen["uneven_stream"]["message"]
    )
