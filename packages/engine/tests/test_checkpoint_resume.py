"""N steps, save, "kill", resume for M steps == N + M uninterrupted steps, bitwise, on 2 ranks.

Data parallelism over 2 gloo ranks with dropout (drawn from torch's RNG, different on each
rank), a shuffled data loader read from the middle of an epoch, Adam and a per-step lr
schedule, driven by the Trainer with SaveCheckpointHook / LoadCheckpointHook. The resumed
run starts from other initial weights and another RNG state: only the checkpoint can make its
losses equal to the uninterrupted run's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset

from tessera.context import create_context
from tessera.engine import (
    BaseHook,
    LoadCheckpointHook,
    LRSchedulerHook,
    SaveCheckpointHook,
    Trainer,
    get_dataloader,
    initialize,
)


class _Losses(BaseHook):
    def __init__(self) -> None:
        super().__init__(priority=50)
        self.losses: dict[int, float] = {}

    def after_train_iter(self, trainer: Trainer, output: Any, label: Any, loss: Any) -> None:
        self.losses[trainer.global_step] = float(loss.item())


def _fit(directory: str, max_steps: int | None, resume: bool, seed: int) -> dict[int, float]:
    ctx = create_context(dict(parallel=dict()), timeout=120)  # data parallel over 2 ranks
    try:
        torch.manual_seed(seed)
        torch.rand(seed % 7 + 1)  # move the RNG: without restoring it, dropout would differ
        model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Dropout(0.5), nn.Linear(16, 3))
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        g = torch.Generator().manual_seed(4)
        data = TensorDataset(
            torch.randn(24, 4, generator=g), torch.randint(0, 3, (24,), generator=g)
        )
        loader = get_dataloader(data, shuffle=True, batch_size=3, context=ctx)  # 4 per epoch
        engine, loader, _, sched = initialize(
            model, opt, nn.CrossEntropyLoss(), loader, None, sched, context=ctx
        )
        losses = _Losses()
        hooks: list[BaseHook] = [
            LRSchedulerHook(sched, by_epoch=False),
            losses,
            SaveCheckpointHook(directory, interval=3, keep_last=2),
        ]
        if resume:
            hooks.append(LoadCheckpointHook(directory))
        Trainer(engine).fit(
            loader, epochs=3, max_steps=max_steps, hooks=hooks, display_progress=False
        )
        return losses.losses
    finally:
        ctx.destroy()


def test_resume_after_kill_is_bitwise_exact_with_dropout(dist: Any, tmp_path: Path) -> None:
    full = dist.run(_fit, world_size=2, args=(str(tmp_path / "a"), None, False, 0))
    # interrupted after step 7: the newest checkpoint is step 6 (epoch 1, batch 2 of 4)
    dist.run(_fit, world_size=2, args=(str(tmp_path / "b"), 7, False, 0))
    resumed = dist.run(_fit, world_size=2, args=(str(tmp_path / "b"), None, True, 99))
    for rank in range(2):
        assert sorted(full[rank]) == list(range(1, 13))
        assert sorted(resumed[rank]) == list(range(7, 13))
        for step, loss in resumed[rank].items():
            assert loss == full[rank][step], (rank, step, loss, full[rank][step])
    assert full[0] != full[1]  # the ranks saw different data / dropout masks
