"""Preemption: on SIGTERM, finish the step, save a checkpoint on every rank, exit 75.

A scheduler that takes the machines back (SLURM's preemption, a spot instance reclaimed, a
job's time limit) sends SIGTERM and waits a grace period before SIGKILL. Without a handler
every rank dies at once and all work since the last periodic checkpoint is redone. With
``PreemptionHook`` the first signal only sets a flag; at the end of the next optimizer step
(a checkpoint between micro-steps of gradient accumulation would lose their gradients) the
ranks agree whether any of them was signalled (one all-reduce of one number, only at those
boundaries), and if one was, every rank saves a checkpoint through the run's
``SaveCheckpointHook`` and exits with ``PREEMPTED_EXIT_CODE`` (75, ``EX_TEMPFAIL``: "try again
later"), which a requeue script can tell from a failure. Agreeing matters: SLURM may signal
one node before another, and a rank that saved alone would wait forever in the save's
collectives. A second signal exits at once with status ``128 + signal``: the save in flight
leaves only its temporary folder (swept at the next start), never a damaged checkpoint, since
a checkpoint takes its name by one atomic rename.

With SLURM, ask for the signal ahead of the kill: ``#SBATCH --signal=TERM@120`` (SIGTERM 120 s
before the end), or ``--signal=B:USR1@120`` and ``signals=(signal.SIGUSR1,)``.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Sequence
from types import FrameType
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from tessera.context import ParallelMode

from .base import BaseHook
from .checkpoint_hooks import SaveCheckpointHook

if TYPE_CHECKING:
    from ..trainer import Trainer

__all__ = ["PREEMPTED_EXIT_CODE", "PreemptionHook"]

#: The exit status of a rank that saved and stopped on a preemption signal (``EX_TEMPFAIL``).
PREEMPTED_EXIT_CODE = 75


class PreemptionHook(BaseHook):
    """Save and exit on a preemption signal, every rank at the same optimizer step.

    Args:
        save_hook: The run's ``SaveCheckpointHook``: where and how the checkpoint is saved
            (with ``LoadCheckpointHook`` on the same directory, the requeued job resumes
            exactly).
        signals: The signals that mean preemption (default SIGTERM).
        exit_code: The status every rank exits with after saving.
        priority: Default 110: after ``SaveCheckpointHook`` (100), so a periodic save at the
            same step is not repeated.
    """

    def __init__(
        self,
        save_hook: SaveCheckpointHook,
        signals: Sequence[int] = (signal.SIGTERM,),
        exit_code: int = PREEMPTED_EXIT_CODE,
        priority: int = 110,
    ) -> None:
        super().__init__(priority)
        if not signals:
            raise ValueError("PreemptionHook needs at least one signal")
        self.save_hook = save_hook
        self.signals = tuple(signal.Signals(s) for s in signals)
        self.exit_code = exit_code
        self.received: signal.Signals | None = None
        self._previous: dict[signal.Signals, Any] = {}

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.received is not None:  # the second signal: no more time to save
            os._exit(128 + signum)
        self.received = signal.Signals(signum)

    def after_hook_is_attached(self, trainer: Trainer) -> None:
        """Install the handlers (in the main thread, where Python runs signal handlers)."""
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError(
                "PreemptionHook installs signal handlers, which Python allows only in the main "
                "thread: call Trainer.fit from the main thread"
            )
        for sig in self.signals:
            if sig not in self._previous:
                self._previous[sig] = signal.signal(sig, self._on_signal)

    def after_train(self, trainer: Trainer) -> None:
        """Put the previous handlers back."""
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def after_train_iter(
        self, trainer: Trainer, output: Any, label: Any, loss: torch.Tensor | None
    ) -> None:
        """At an optimizer-step boundary: if any rank was signalled, save and exit."""
        engine = trainer.engine
        if engine.micro_step % engine.gradient_accumulation != 0:
            return  # inside an optimizer step: its gradients would be lost
        if not self._any_rank_signalled(trainer):
            return
        if self.save_hook.last_step != trainer.global_step:
            path = self.save_hook.save(trainer, epoch_done=False)
        else:
            path = self.save_hook.saved[-1]
        self.after_train(trainer)  # the process is leaving: the previous handlers are back
        what = self.received.name if self.received is not None else "another rank's signal"
        trainer.logger.warning(
            f"preempted ({what}): saved {path} at step {trainer.global_step}; exiting with "
            f"status {self.exit_code}"
        )
        raise SystemExit(self.exit_code)

    def _any_rank_signalled(self, trainer: Trainer) -> bool:
        """Every rank's flag, maximum over all ranks (a collective at each boundary)."""
        mine = self.received is not None
        ctx = trainer.engine.context
        group: dist.ProcessGroup | None
        if ctx is not None:
            if ctx.world_size < 2:
                return mine
            group = ctx.get_cpu_group(ParallelMode.GLOBAL)
        elif dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            group = dist.group.WORLD
        else:
            return mine
        flag = torch.tensor([1 if mine else 0], dtype=torch.int32)
        if dist.get_backend(group) == "nccl":
            flag = flag.cuda()
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return bool(flag.item())
