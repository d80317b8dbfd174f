"""TensorboardHook against a real tensorboard install (the ``tensorboard`` extra).

The event files are read back with tensorboard's own reader and compared with the JSON-lines
metrics log the Trainer writes from the same numbers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as tdist
from engine_testlib import make_data, make_model, sgd
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn
from torch.utils.data import TensorDataset

from tessera.context import create_context
from tessera.engine import (
    AccuracyHook,
    Engine,
    LossHook,
    TensorboardHook,
    Trainer,
    get_dataloader,
    initialize,
)


def _scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    events = EventAccumulator(str(log_dir))
    events.Reload()
    return {
        tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]
    }


def test_event_files_hold_the_logged_metrics(tmp_path: Path) -> None:
    model = make_model()
    engine = Engine(model, sgd(model), nn.CrossEntropyLoss())
    log_file = tmp_path / "metrics.jsonl"
    trainer = Trainer(engine, metrics_log=log_file)
    x, y = make_data(16, seed=2)
    train = get_dataloader(TensorDataset(x, y), batch_size=4)
    test = get_dataloader(TensorDataset(x, y), batch_size=8)
    board = tmp_path / "board"
    hooks = [LossHook(), AccuracyHook(), TensorboardHook(board)]
    trainer.fit(train, epochs=2, test_dataloader=test, hooks=hooks, display_progress=False)

    scalars = _scalars(board)
    assert {"train_step/loss", "train_epoch/loss", "test/loss", "test/accuracy"} <= set(scalars)
    records = [json.loads(line) for line in log_file.read_text().splitlines()]
    step_losses = [r["loss"] for r in records if r["phase"] == "train_step"]
    assert [s for s, _ in scalars["train_step/loss"]] == list(range(1, 9))
    # event files store float32
    assert [v for _, v in scalars["train_step/loss"]] == pytest.approx(step_losses, rel=1e-6)
    epoch_losses = [r["loss"] for r in records if r["phase"] == "train_epoch"]
    assert [v for _, v in scalars["train_epoch/loss"]] == pytest.approx(epoch_losses, rel=1e-6)
    test_acc = [r["accuracy"] for r in records if r["phase"] == "test"]
    assert [v for _, v in scalars["test/accuracy"]] == pytest.approx(test_acc, rel=1e-6)


def _board_dp2(log_dir: str) -> float:
    ctx = create_context(dict(parallel={}), timeout=60)
    try:
        model = make_model()
        x, y = make_data(16, seed=2)
        train = get_dataloader(TensorDataset(x, y), batch_size=4, context=ctx)
        engine, train, _, _ = initialize(
            model, sgd(model), nn.CrossEntropyLoss(), train, context=ctx
        )
        hook = LossHook()
        trainer = Trainer(engine)
        trainer.fit(
            train,
            epochs=1,
            hooks=[hook, TensorboardHook(Path(log_dir) / f"rank{tdist.get_rank()}")],
            display_progress=False,
        )
        return float(trainer.states["epoch_metrics"]["loss"])
    finally:
        ctx.destroy()


def test_only_the_display_rank_writes_the_reduced_loss(dist: Any, tmp_path: Path) -> None:
    results = dist.run(_board_dp2, world_size=2, args=(str(tmp_path),), timeout=120)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0"]
    (epoch,) = _scalars(tmp_path / "rank0")["train_epoch/loss"]
    assert epoch[1] == pytest.approx(results[0], rel=1e-6)
    assert results[0] == pytest.approx(results[1], rel=1e-9)
