"""Preemption: SIGTERM to one rank of a 2-rank job; every rank saves at the same step, exits 75.

Rank 1 receives a real SIGTERM (sent to its own process) inside an optimizer step of two
micro-steps; both ranks finish that optimizer step, agree, save, and leave with status 75.
The requeued job resumes exactly. A second signal during the save exits at once (in a
process of its own: it ends the process) and leaves the last complete checkpoint intact.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import torch
import torch.distributed as tdist
from torch import nn
from torch.utils.data import TensorDataset

from tessera.context import create_context
from tessera.engine import (
    PREEMPTED_EXIT_CODE,
    BaseHook,
    LoadCheckpointHook,
    PreemptionHook,
    SaveCheckpointHook,
    Trainer,
    get_dataloader,
    initialize,
    latest_checkpoint,
)


class _Record(BaseHook):
    """Records the losses; on ``signal_rank`` sends SIGTERM to itself after ``signal_at``."""

    def __init__(self, signal_at: int | None) -> None:
        super().__init__(priority=50)
        self.signal_at = signal_at
        self.losses: dict[int, float] = {}

    def after_train_iter(self, trainer: Trainer, output: Any, label: Any, loss: Any) -> None:
        self.losses[trainer.global_step] = float(loss.item())
        if trainer.global_step == self.signal_at and tdist.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGTERM)


def _job(directory: str, max_steps: int, signal_at: int | None, resume: bool) -> dict[str, Any]:
    ctx = create_context(dict(parallel=dict()), timeout=60)  # data parallel over 2 ranks
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Dropout(0.5), nn.Linear(16, 3))
        g = torch.Generator().manual_seed(4)
        data = TensorDataset(
            torch.randn(24, 4, generator=g), torch.randint(0, 3, (24,), generator=g)
        )
        loader = get_dataloader(data, shuffle=True, batch_size=3, context=ctx)  # 4 per epoch
        engine, loader, _, _ = initialize(
            model,
            torch.optim.Adam(model.parameters(), lr=0.01),
            nn.CrossEntropyLoss(),
            loader,
            config={"gradient_accumulation": 2},
            context=ctx,
        )
        record = _Record(signal_at)
        save = SaveCheckpointHook(directory, interval=1000)
        hooks: list[BaseHook] = [record, save, PreemptionHook(save)]
        if resume:
            hooks.append(LoadCheckpointHook(directory))
        try:
            Trainer(engine).fit(loader, epochs=5, max_steps=max_steps, hooks=hooks,
                                display_progress=False)  # fmt: skip
            status = 0
        except SystemExit as exc:
            status = int(exc.code or 0)
        handler = signal.getsignal(signal.SIGTERM)
        return {
            "status": status,
            "losses": record.losses,
            "handler_restored": handler == signal.SIG_DFL,
        }
    finally:
        ctx.destroy()


def test_sigterm_on_one_rank_saves_on_every_rank_and_resumes_exactly(
    dist: Any, tmp_path: Path
) -> None:
    full = dist.run(_job, world_size=2, args=(str(tmp_path / "a"), 10, None, False))
    # SIGTERM on rank 1 after batch 3, inside the optimizer step of batches 3 and 4
    preempted = dist.run(_job, world_size=2, args=(str(tmp_path / "b"), 10, 3, False))
    for got in preempted:
        assert got["status"] == PREEMPTED_EXIT_CODE, got
        assert sorted(got["losses"]) == [1, 2, 3, 4], got  # finished the optimizer step
        assert got["handler_restored"], got
    assert latest_checkpoint(tmp_path / "b") == tmp_path / "b" / "step_00000004"
    resumed = dist.run(_job, world_size=2, args=(str(tmp_path / "b"), 10, None, True))
    for rank in range(2):
        assert resumed[rank]["status"] == 0
        assert sorted(resumed[rank]["losses"]) == list(range(5, 11))
        for step, loss in resumed[rank]["losses"].items():
            assert loss == full[rank]["losses"][step], (rank, step)  # bitwise


_SECOND_SIGNAL = """
import os, signal, sys
import torch
from torch import nn
from torch.utils.data import TensorDataset
from tessera.engine import (BaseHook, Engine, PreemptionHook, SaveCheckpointHook, Trainer,
                            get_dataloader)
from tessera.engine.checkpoint import api

class Signal(BaseHook):
    def after_train_iter(self, trainer, *args):
        if trainer.global_step == 3:
            os.kill(os.getpid(), signal.SIGTERM)

real = api.write_bytes
def write_then_signal(path, data):  # the second signal arrives in the middle of the save
    real(path, data)
    if "step_00000003" in str(path):
        os.kill(os.getpid(), signal.SIGTERM)
        print("the second signal did not end the process", flush=True)
api.write_bytes = write_then_signal

torch.manual_seed(0)
model = nn.Linear(4, 3)
engine = Engine(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss())
data = TensorDataset(torch.randn(40, 4), torch.randint(0, 3, (40,)))
save = SaveCheckpointHook(sys.argv[1], interval=2)
Trainer(engine).fit(get_dataloader(data, batch_size=4), epochs=1,
                    hooks=[Signal(), save, PreemptionHook(save)], display_progress=False)
"""


def test_a_second_signal_during_the_save_exits_at_once(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(_SECOND_SIGNAL))
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "ckpt")],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 128 + signal.SIGTERM, done.stdout + done.stderr
    assert "did not end the process" not in done.stdout
    # the periodic checkpoint of step 2 is intact; step 3's save left only its temporary folder
    assert latest_checkpoint(tmp_path / "ckpt") == tmp_path / "ckpt" / "step_00000002"
    names = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert names[1:] == ["step_00000002"] and names[0].startswith(".step_00000003.tmp-"), names
