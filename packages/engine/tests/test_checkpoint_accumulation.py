"""Checkpoints under gradient accumulation: taken only at optimizer-step boundaries.

The Trainer counts batches (micro-steps); with ``gradient_accumulation=2`` and a checkpoint
every 3 of them, a save at batch 3 would hold the optimizer one micro-step into its step,
without the gradient of that micro-step: the resumed run's next optimizer step would lack it,
and every loss from then on would differ, silently.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from engine_testlib import make_data, make_model
from torch import nn
from torch.utils.data import TensorDataset

from tessera.engine import (
    BaseHook,
    CheckpointError,
    Engine,
    LoadCheckpointHook,
    SaveCheckpointHook,
    Trainer,
    get_dataloader,
    save_checkpoint,
)


class _Losses(BaseHook):
    def __init__(self) -> None:
        super().__init__(priority=50)
        self.losses: dict[int, float] = {}

    def after_train_iter(self, trainer: Trainer, output: Any, label: Any, loss: Any) -> None:
        self.losses[trainer.global_step] = float(loss.item())


def _fit(directory: Path, max_steps: int | None, resume: bool, seed: int) -> dict[int, float]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Dropout(0.5), nn.Linear(16, 3))
    engine = Engine(
        model,
        torch.optim.Adam(model.parameters(), lr=0.01),
        nn.CrossEntropyLoss(),
        gradient_accumulation=2,
    )
    x, y = make_data(n=20, seed=4)
    loader = get_dataloader(TensorDataset(x, y), shuffle=True, batch_size=3)  # 7 per epoch
    losses = _Losses()
    hooks: list[BaseHook] = [losses, SaveCheckpointHook(directory, interval=3)]
    if resume:
        hooks.append(LoadCheckpointHook(directory))
    Trainer(engine).fit(loader, epochs=2, max_steps=max_steps, hooks=hooks,
                        display_progress=False)  # fmt: skip
    return losses.losses


def test_a_resume_under_accumulation_is_bitwise_exact(tmp_path: Path) -> None:
    full = _fit(tmp_path / "a", None, resume=False, seed=0)
    assert len(full) == 14
    # Due at batches 3, 6, 9, 12; 3 and 9 fall inside an optimizer step: taken one batch later.
    saved = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert saved == ["step_00000004", "step_00000006", "step_00000010", "step_00000012"]
    _fit(tmp_path / "b", 5, resume=False, seed=0)  # "killed" after batch 5, saved at 4
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == ["step_00000004"]
    resumed = _fit(tmp_path / "b", None, resume=True, seed=123)  # other init, other RNG
    assert sorted(resumed) == list(range(5, 15))
    assert all(resumed[s] == full[s] for s in resumed), (resumed, full)  # bitwise


def test_an_explicit_save_inside_an_optimizer_step_is_refused(tmp_path: Path) -> None:
    model = make_model(0)
    engine = Engine(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        nn.CrossEntropyLoss(),
        gradient_accumulation=3,
    )
    x, y = make_data()
    for _ in range(4):
        engine.zero_grad()
        engine.backward(engine.criterion(engine(x), y))
        engine.step()
    with pytest.raises(CheckpointError, match=r"micro-step 4 is 1 of the 3 .* \(4 % 3 = 1\)"):
        save_checkpoint(tmp_path / "mid", engine)
    assert list(tmp_path.iterdir()) == []  # nothing left behind
    for _ in range(2):  # complete the optimizer step: now it saves
        engine.zero_grad()
        engine.backward(engine.criterion(engine(x), y))
        engine.step()
    save_checkpoint(tmp_path / "boundary", engine)
