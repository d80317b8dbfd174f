"""Who shows what on two data ranks: the progress bar and the rank-aware logger write on the
chosen rank only, and test accuracy is the accuracy of the whole test set."""

from __future__ import annotations

import io
import sys
from typing import Any

import pytest
import torch
from engine_testlib import LogCapture, make_data, make_model, sgd
from torch import nn
from torch.utils.data import TensorDataset

from tessera.context import create_context
from tessera.engine import (
    AccuracyHook,
    LossHook,
    ThroughputHook,
    Trainer,
    get_dataloader,
    get_dist_logger,
    initialize,
)


def _fit_and_capture() -> dict[str, Any]:
    ctx = create_context(dict(parallel={}), timeout=60)
    logger = get_dist_logger("tessera-trainer-ranks")
    cap = LogCapture()
    logger.logger.addHandler(cap)
    stderr = sys.stderr
    try:
        x, y = make_data(16, seed=2)
        tx, ty = make_data(10, seed=3)  # 5 test samples per data rank
        model = make_model()
        train = get_dataloader(TensorDataset(x, y), batch_size=4, context=ctx)
        test = get_dataloader(TensorDataset(tx, ty), batch_size=2, context=ctx)
        engine, train, test, _ = initialize(
            model, sgd(model), nn.CrossEntropyLoss(), train, test, context=ctx
        )
        trainer = Trainer(engine, logger=logger)
        accuracy = AccuracyHook()
        sys.stderr = captured = io.StringIO()  # tqdm writes to sys.stderr when it is created
        try:
            trainer.fit(
                train,
                epochs=1,
                test_dataloader=test,
                hooks=[LossHook(), accuracy, ThroughputHook()],
                display_progress=True,
            )
        finally:
            sys.stderr = stderr
        logger.info("default ranks")
        logger.info("rank one only", ranks=[1])
        logger.warning("every rank", ranks=None)
        with torch.no_grad():
            full_accuracy = int((model(tx).argmax(-1) == ty).sum()) / len(ty)
        return {
            "stderr": captured.getvalue(),
            "messages": cap.messages,
            "test": trainer.states["test_results"],
            "step": dict(trainer.step_metrics),
            "full_accuracy": full_accuracy,
            "local_accuracy": accuracy.test_accuracy.local_value(),
        }
    finally:
        logger.logger.removeHandler(cap)
        ctx.destroy()


def test_progress_bar_logger_and_metrics_across_data_ranks(dist: Any) -> None:
    rank0, rank1 = dist.run(_fit_and_capture, world_size=2, timeout=120)
    # the tqdm bars (train and test) with loss and throughput, on the display rank only
    assert "epoch 0" in rank0["stderr"] and "test 0" in rank0["stderr"]
    assert "loss=" in rank0["stderr"] and "throughput=" in rank0["stderr"]
    assert rank1["stderr"] == ""
    assert rank0["messages"] == ["default ranks", "[rank 0] every rank"]
    assert rank1["messages"] == ["rank one only", "[rank 1] every rank"]
    # the step loss shown is the mean over the data ranks: the same number on both
    assert rank0["step"]["throughput"] > 0 and rank0["step"]["loss"] == rank1["step"]["loss"]
    # test accuracy: this rank's 5 samples differ from the other's, the value shown is the
    # accuracy over all 10 (both ranks hold the same trained model)
    assert rank0["local_accuracy"] != rank1["local_accuracy"]
    assert rank0["full_accuracy"] == rank1["full_accuracy"]
    for r in (rank0, rank1):
        assert r["test"]["accuracy"] == pytest.approx(r["full_accuracy"], rel=1e-9)
    assert rank0["test"] == rank1["test"]
