"""Writing metrics to TensorBoard (optional extra: ``pip install tessera-engine[tensorboard]``)."""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING, Any

import torch

from .base import BaseHook

if TYPE_CHECKING:
    from ..trainer import Trainer

__all__ = ["TensorboardHook"]


class TensorboardHook(BaseHook):
    """Write step metrics, epoch metrics and evaluation results as TensorBoard scalars.

    Only the Trainer's display rank writes. The writer is created when training starts, so
    building the hook never needs the ``tensorboard`` package.

    Args:
        log_dir: Directory of the event files.
        priority: Hook order.
    """

    def __init__(self, log_dir: str | os.PathLike[str], priority: int = 10) -> None:
        super().__init__(priority)
        self.log_dir = os.fspath(log_dir)
        self._writer: Any = None

    def after_hook_is_attached(self, trainer: Trainer) -> None:
        """Create the SummaryWriter on the display rank.

        Raises:
            ImportError: the ``tensorboard`` package is not installed.
        """
        if not trainer.is_display_rank or self._writer is not None:
            return
        try:
            module = importlib.import_module("torch.utils.tensorboard")
        except ImportError as exc:
            raise ImportError(
                "TensorboardHook needs the tensorboard package: "
                "pip install 'tessera-engine[tensorboard]'"
            ) from exc
        self._writer = module.SummaryWriter(log_dir=self.log_dir)

    def _scalars(self, prefix: str, metrics: dict[str, float], step: int) -> None:
        if self._writer is None:
            return
        for name, value in metrics.items():
            self._writer.add_scalar(f"{prefix}/{name}", value, step)

    def after_train_iter(
        self, trainer: Trainer, output: Any, label: Any, loss: torch.Tensor | None
    ) -> None:
        """Write the step metrics."""
        self._scalars("train_step", dict(trainer.step_metrics), trainer.global_step)

    def after_train_epoch(self, trainer: Trainer) -> None:
        """Write the epoch metrics."""
        self._scalars("train_epoch", trainer.states.get("epoch_metrics", {}), trainer.epoch)

    def after_test(self, trainer: Trainer) -> None:
        """Write the evaluation results."""
        self._scalars("test", trainer.states.get("test_results", {}), trainer.epoch)

    def after_train(self, trainer: Trainer) -> None:
        """Flush and close the writer."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
