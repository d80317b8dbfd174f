"""Stepping a learning-rate scheduler from the Trainer."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from .base import BaseHook

if TYPE_CHECKING:
    from ..trainer import Trainer

__all__ = ["LRSchedulerHook"]


class LRSchedulerHook(BaseHook):
    """Call ``lr_scheduler.step()`` after every epoch (``by_epoch``) or every iteration.

    Under gradient accumulation pass the scheduler ``initialize`` returned: it advances the
    wrapped scheduler once per optimizer step although it is called every micro-step.

    Args:
        lr_scheduler: Anything with ``step()`` and ``get_last_lr()``.
        by_epoch: Step per epoch instead of per iteration.
        store_lr_in_state: Show the learning rate among the step metrics (``"lr"``).
        priority: Hook order (default 1: after the metric hooks read the step).
    """

    def __init__(
        self,
        lr_scheduler: Any,
        by_epoch: bool = True,
        store_lr_in_state: bool = True,
        priority: int = 1,
    ) -> None:
        super().__init__(priority)
        self.lr_scheduler = lr_scheduler
        self.by_epoch = by_epoch
        self.store_lr_in_state = store_lr_in_state

    def _store(self, trainer: Trainer) -> None:
        if self.store_lr_in_state:
            trainer.step_metrics["lr"] = float(self.lr_scheduler.get_last_lr()[0])

    def before_train(self, trainer: Trainer) -> None:
        """Show the starting learning rate."""
        self._store(trainer)

    def after_train_epoch(self, trainer: Trainer) -> None:
        """Step a per-epoch scheduler."""
        if self.by_epoch:
            self.lr_scheduler.step()
            self._store(trainer)

    def after_train_iter(
        self, trainer: Trainer, output: Any, label: Any, loss: torch.Tensor | None
    ) -> None:
        """Step a per-iteration scheduler."""
        if not self.by_epoch:
            self.lr_scheduler.step()
            self._store(trainer)
