"""The Trainer with hooks, progress bar and JSON-lines log."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as tdist
from engine_testlib import LogCapture, make_data, make_model, sgd
from torch import nn
from torch.utils.data import TensorDataset

from tessera.context import create_context
from tessera.engine import (
    HOOKS,
    AccuracyHook,
    BaseHook,
    Engine,
    LogMemoryByEpochHook,
    LogMetricByEpochHook,
    LogMetricByStepHook,
    LogTimingByEpochHook,
    LossHook,
    LRSchedulerHook,
    TensorboardHook,
    ThroughputHook,
    Trainer,
    get_dataloader,
    get_dist_logger,
    initialize,
)


class _Recorder(BaseHook):
    def __init__(self, priority: int = 0) -> None:
        super().__init__(priority)
        self.calls: list[str] = []

    def before_train(self, trainer: Trainer) -> None:
        self.calls.append("before_train")

    def before_train_epoch(self, trainer: Trainer) -> None:
        self.calls.append(f"before_epoch{trainer.epoch}")

    def after_train_iter(self, trainer: Trainer, output: Any, label: Any, loss: Any) -> None:
        self.calls.append("iter")

    def after_train_epoch(self, trainer: Trainer) -> None:
        self.calls.append(f"after_epoch{trainer.epoch}")

    def before_test(self, trainer: Trainer) -> None:
        self.calls.append("test")

    def after_train(self, trainer: Trainer) -> None:
        self.calls.append("after_train")


def _loaders() -> tuple[Any, Any]:
    x, y = make_data(16, seed=2)
    ds = TensorDataset(x, y)
    return get_dataloader(ds, batch_size=4), get_dataloader(ds, batch_size=8)


def test_fit_with_hooks_progress_and_log(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = make_model()
    opt = sgd(model)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    engine = Engine(model, opt, nn.CrossEntropyLoss())
    logger = get_dist_logger("tessera-trainer-test")
    cap = LogCapture()
    logger.logger.addHandler(cap)
    log_file = tmp_path / "metrics.jsonl"
    trainer = Trainer(engine, logger=logger, metrics_log=log_file)
    train, test = _loaders()
    recorder = _Recorder(priority=-1)
    hooks = [
        LossHook(),
        AccuracyHook(),
        ThroughputHook(),
        LRSchedulerHook(sched, by_epoch=True),
        LogMetricByEpochHook(),
        LogMetricByStepHook(),
        LogTimingByEpochHook(),
        LogMemoryByEpochHook(),
        recorder,
    ]
    before = [p.detach().clone() for p in model.parameters()]
    trainer.fit(train, epochs=2, test_dataloader=test, hooks=hooks, display_progress=True)
    assert recorder.calls == (
        ["before_train", "before_epoch0"]
        + ["iter"] * 4
        + ["after_epoch0", "test", "before_epoch1"]
        + ["iter"] * 4
        + ["after_epoch1", "test", "after_train"]
    )
    assert trainer.global_step == 8 and engine.global_step == 8
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert sched.get_last_lr()[0] == pytest.approx(0.025)
    records = [json.loads(line) for line in log_file.read_text().splitlines()]
    phases = [r["phase"] for r in records]
    assert phases.count("train_step") == 8 and phases.count("train_epoch") == 2
    assert phases.count("test") == 2
    test_rec = [r for r in records if r["phase"] == "test"][-1]
    assert 0.0 <= test_rec["accuracy"] <= 1.0 and test_rec["loss"] > 0
    step_rec = records[0]
    assert step_rec["loss"] > 0 and step_rec["throughput"] > 0 and step_rec["lr"] == 0.1
    epoch_losses = [r["loss"] for r in records if r["phase"] == "train_epoch"]
    step_losses = [r["loss"] for r in records if r["phase"] == "train_step"]
    assert epoch_losses[0] == pytest.approx(sum(step_losses[:4]) / 4)
    err = capsys.readouterr().err
    assert "epoch 0" in err and "loss=" in err  # the tqdm bar with its postfix
    assert any(m.startswith("epoch 0 train: loss=") for m in cap.messages)
    assert any("timing: train-epoch" in m for m in cap.messages)
    assert any("memory: " in m and "max_rss_mib" in m for m in cap.messages)


def test_max_steps_and_evaluate(tmp_path: Path) -> None:
    model = make_model()
    engine = Engine(model, sgd(model), nn.CrossEntropyLoss())
    trainer = Trainer(engine)
    train, test = _loaders()
    trainer.fit(train, epochs=5, max_steps=6, hooks=[LossHook()], display_progress=False)
    assert trainer.global_step == 6 and trainer.epoch == 1
    results = trainer.evaluate(test, hooks=[LossHook(), AccuracyHook()], display_progress=False)
    assert set(results) == {"loss", "accuracy"}
    x, y = make_data(16, seed=2)
    with torch.no_grad():
        want = nn.CrossEntropyLoss()(model(x), y).item()
    assert results["loss"] == pytest.approx(want, rel=1e-6)


def test_hooks_are_registered() -> None:
    for name in (
        "LRSchedulerHook",
        "LossHook",
        "AccuracyHook",
        "ThroughputHook",
        "LogMetricByEpochHook",
        "LogMetricByStepHook",
        "LogTimingByEpochHook",
        "LogMemoryByEpochHook",
        "TensorboardHook",
    ):
        assert name in HOOKS
    assert HOOKS.get("TensorboardHook") is TensorboardHook


def _trainer_dp2(log_dir: str) -> dict[str, Any]:
    ctx = create_context(dict(parallel={}), timeout=60)
    try:
        rank = tdist.get_rank()
        model = make_model()
        x, y = make_data(16, seed=2)
        train = get_dataloader(TensorDataset(x, y), batch_size=4, context=ctx)
        engine, train, _, _ = initialize(
            model, sgd(model), nn.CrossEntropyLoss(), train, context=ctx
        )
        loss_hook = LossHook()
        trainer = Trainer(engine, metrics_log=Path(log_dir) / f"rank{rank}.jsonl")
        trainer.fit(train, epochs=1, hooks=[loss_hook], display_progress=True)
        return {
            "display": trainer.is_display_rank,
            "local": loss_hook.train_loss.local_value(),
            "epoch": trainer.states["epoch_metrics"]["loss"],
        }
    finally:
        ctx.destroy()


def test_metrics_are_reduced_over_data_ranks(dist: Any, tmp_path: Path) -> None:
    results = dist.run(_trainer_dp2, world_size=2, args=(str(tmp_path),), timeout=120)
    assert [r["display"] for r in results] == [True, False]
    mean = (results[0]["local"] + results[1]["local"]) / 2
    assert results[0]["local"] != results[1]["local"]
    for r in results:
        assert r["epoch"] == pytest.approx(mean, rel=1e-9)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0.jsonl"]  # one rank writes
