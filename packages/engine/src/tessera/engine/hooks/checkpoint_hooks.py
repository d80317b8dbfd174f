"""Saving checkpoints during training and resuming from the newest good one.

With both hooks a run restarted by ``torchrun --max-restarts`` (or by hand) continues by
itself: ``LoadCheckpointHook`` finds the newest intact ``step_*`` checkpoint in the directory
(skipping corrupt and unfinished ones), restores everything ``save_checkpoint`` saved, and
positions the Trainer at the saved epoch and batch, so the losses that follow are those of an
uninterrupted run.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..checkpoint.api import load_checkpoint, save_checkpoint
from ..checkpoint.discovery import latest_checkpoint, prune_checkpoints, step_dir
from ..checkpoint.storage import prepare_checkpoint_dir
from .base import BaseHook

if TYPE_CHECKING:
    from ..trainer import Trainer

__all__ = ["LoadCheckpointHook", "SaveCheckpointHook"]

#: The key of ``extra`` under which the hooks keep the Trainer's position.
TRAINER_KEY = "tessera_trainer"


def _scheduler(trainer: Trainer, given: Any) -> Any:
    """The scheduler given, else the one of an ``LRSchedulerHook`` of this run."""
    if given is not None:
        return given
    for hook in trainer.states.get("hooks", ()):
        scheduler = getattr(hook, "lr_scheduler", None)
        if scheduler is not None and callable(getattr(scheduler, "state_dict", None)):
            return scheduler
    return None


def _loader(trainer: Trainer) -> Any:
    loader = trainer.states.get("train_dataloader")
    return loader if callable(getattr(loader, "state_dict", None)) else None


class SaveCheckpointHook(BaseHook):
    """Save ``directory/step_<global step>`` every ``interval`` steps (or epochs).

    Checkpoints are taken only at optimizer-step boundaries: under gradient accumulation a save
    that falls due between micro-steps (``interval`` counts the Trainer's steps, one batch
    each) is taken at the step that completes the optimizer step, since the gradients
    accumulated so far are not saved and a resume from there would silently lose them.

    When attached (the start of ``fit``) every rank checks that it can write in ``directory``
    and rank 0 removes what earlier crashed saves left there (``prepare_checkpoint_dir``): a
    read-only or uncreatable folder is refused then, not at the first save hours later.

    Args:
        directory: Where the run's checkpoints live (shared by every rank).
        interval: Steps (``by_epoch``: epochs) between checkpoints.
        keep_last: Keep only this many newest checkpoints (``None``: all).
        by_epoch: Save after every ``interval``-th epoch instead.
        save_final: Also save when training ends.
        lr_scheduler: Saved too (default: the scheduler of the run's ``LRSchedulerHook``).
        priority: Default 100: after the other hooks updated the state of the step.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        interval: int = 1000,
        keep_last: int | None = None,
        *,
        by_epoch: bool = False,
        save_final: bool = False,
        lr_scheduler: Any = None,
        priority: int = 100,
    ) -> None:
        super().__init__(priority)
        if interval < 1:
            raise ValueError(f"interval must be >= 1, got {interval}")
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"keep_last must be >= 1 or None, got {keep_last}")
        self.directory = Path(directory)
        self.interval = interval
        self.keep_last = keep_last
        self.by_epoch = by_epoch
        self.save_final = save_final
        self.lr_scheduler = lr_scheduler
        self.saved: list[Path] = []
        self._last_step: int | None = None
        self._prepared = False
        self._due = False  # a save fell due between micro-steps: taken at the next boundary

    @property
    def last_step(self) -> int | None:
        """The Trainer step of this hook's last save (``None``: none yet)."""
        return self._last_step

    def after_hook_is_attached(self, trainer: Trainer) -> None:
        """Refuse an unwritable folder and sweep leftovers, once (every rank: collective)."""
        if not self._prepared:
            prepare_checkpoint_dir(self.directory, trainer.engine.context)
            self._prepared = True

    def save(self, trainer: Trainer, epoch_done: bool) -> Path:
        """Save now (every rank calls it)."""
        path = save_checkpoint(
            step_dir(self.directory, trainer.global_step),
            trainer.engine,
            step=trainer.global_step,
            epoch=trainer.epoch,
            extra={TRAINER_KEY: {"epoch_done": epoch_done}},
            lr_scheduler=_scheduler(trainer, self.lr_scheduler),
            dataloader=_loader(trainer),
        )
        self.saved.append(path)
        self._last_step = trainer.global_step
        if self.keep_last is not None and _is_rank_zero(trainer):
            prune_checkpoints(self.directory, self.keep_last)
        return path

    def after_train_iter(
        self, trainer: Trainer, output: Any, label: Any, loss: torch.Tensor | None
    ) -> None:
        """Save every ``interval`` steps, at the optimizer step that completes it."""
        if not self.by_epoch and trainer.global_step % self.interval == 0:
            self._due = True
        if self._due and _at_step_boundary(trainer):
            self._due = False
            self.save(trainer, epoch_done=False)

    def after_train_epoch(self, trainer: Trainer) -> None:
        """Save every ``interval`` epochs (at the next optimizer step if one is unfinished)."""
        if self.by_epoch and (trainer.epoch + 1) % self.interval == 0:
            if _at_step_boundary(trainer):
                self._due = False
                self.save(trainer, epoch_done=True)
            else:
                self._due = True

    def after_train(self, trainer: Trainer) -> None:
        """Save the final state (``save_final``) unless this step was just saved."""
        if not (self._due or self.save_final) or self._last_step == trainer.global_step:
            return
        if _at_step_boundary(trainer):
            self.save(trainer, epoch_done=True)
            return
        engine = trainer.engine
        trainer.logger.warning(
            f"training ended at micro-step {engine.micro_step}, inside an optimizer step of "
            f"{engine.gradient_accumulation} micro-steps: no checkpoint of this point (its "
            f"accumulated gradients were never applied); the last one is step {self._last_step}"
        )


def _at_step_boundary(trainer: Trainer) -> bool:
    """Whether the engine has no accumulated gradients pending (the last step() stepped)."""
    engine = trainer.engine
    return engine.micro_step % engine.gradient_accumulation == 0


def _is_rank_zero(trainer: Trainer) -> bool:
    ctx = trainer.engine.context
    if ctx is not None:
        return ctx.global_rank == 0
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


class LoadCheckpointHook(BaseHook):
    """Before training, resume from the newest intact checkpoint in ``directory`` (if any).

    Args:
        directory: The directory ``SaveCheckpointHook`` writes to.
        path: Load this checkpoint instead of searching (it must be intact).
        strict: See ``load_checkpoint``.
        lr_scheduler: Restored too (default: the scheduler of the run's ``LRSchedulerHook``).
        priority: Default -100: before the other hooks' ``before_train``.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str] | None = None,
        path: str | os.PathLike[str] | None = None,
        strict: bool = True,
        lr_scheduler: Any = None,
        priority: int = -100,
    ) -> None:
        super().__init__(priority)
        if directory is None and path is None:
            raise ValueError("LoadCheckpointHook needs directory= or path=")
        self.directory = Path(directory) if directory is not None else None
        self.path = Path(path) if path is not None else None
        self.strict = strict
        self.lr_scheduler = lr_scheduler
        self.loaded: Path | None = None

    def before_train(self, trainer: Trainer) -> None:
        """Load the checkpoint and position the Trainer after its last step."""
        path, verified = self.path, False
        if path is None:
            assert self.directory is not None
            path = latest_checkpoint(self.directory, trainer.engine.context)
            verified = True
            if path is None:
                trainer.logger.info(f"no checkpoint in {self.directory}: starting from scratch")
                return
        loader = _loader(trainer)
        info = load_checkpoint(
            path,
            trainer.engine,
            self.strict,
            lr_scheduler=_scheduler(trainer, self.lr_scheduler),
            dataloader=loader,
            verify=not verified,
        )
        position = info.extra.get(TRAINER_KEY, {}) if isinstance(info.extra, dict) else {}
        trainer.global_step = info.step
        if position.get("epoch_done", False):
            trainer.start_epoch, trainer.start_step_in_epoch = info.epoch + 1, 0
        else:
            consumed = getattr(loader, "batches_consumed", 0) if loader is not None else 0
            trainer.start_epoch, trainer.start_step_in_epoch = info.epoch, int(consumed)
        trainer.epoch = trainer.start_epoch
        self.loaded = info.path
        trainer.logger.info(
            f"resumed from {info.path}: step {info.step}, epoch {trainer.start_epoch}, "
            f"batch {trainer.start_step_in_epoch}"
        )
