"""Hooks that measure: loss, accuracy and throughput, reduced over data ranks when read."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from ..metrics import AverageMetric, ThroughputMetric
from .base import BaseHook

if TYPE_CHECKING:
    from ..trainer import Trainer

__all__ = ["AccuracyHook", "LossHook", "ThroughputHook"]


class LossHook(BaseHook):
    """Mean loss of each training epoch and of each evaluation (metric ``"loss"``)."""

    def __init__(self, priority: int = 0) -> None:
        super().__init__(priority)
        self.train_loss = AverageMetric("loss")
        self.test_loss = AverageMetric("loss")

    def after_hook_is_attached(self, trainer: Trainer) -> None:
        """Register the two metrics."""
        trainer.train_metrics["loss"] = self.train_loss
        trainer.test_metrics["loss"] = self.test_loss

    def before_train_epoch(self, trainer: Trainer) -> None:
        """Start a new epoch's mean."""
        self.train_loss.reset()

    def after_train_iter(
        self, trainer: Trainer, output: Any, label: Any, loss: torch.Tensor | None
    ) -> None:
        """Add the step's loss (stages without a loss add nothing)."""
        if loss is not None:
            self.train_loss.update(loss)

    def before_test(self, trainer: Trainer) -> None:
        """Start a new evaluation's mean."""
        self.test_loss.reset()

    def after_test_iter(
        self, trainer: Trainer, output: Any, label: Any, loss: torch.Tensor | None
    ) -> None:
        """Add the evaluation step's loss."""
        if loss is not None:
            self.test_loss.update(loss)


def top1_correct(output: torch.Tensor, label: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Number of rows whose arg-max class is the label, and the number of rows."""
    pred = output.argmax(dim=-1)  # [b, ...]
    return (pred == label).sum(), label.numel()


class AccuracyHook(BaseHook):
    """Accuracy of evaluation (and, with ``on_train``, of training) (metric ``"accuracy"``).

    Args:
        accuracy_fn: ``(output, label) -> (number correct, number of items)``; top-1 by default.
        on_train: Also measure on the training batches.
        priority: Hook order.
    """

    def __init__(
        self,
        accuracy_fn: Callable[[Any, Any], tuple[torch.Tensor | float, int | float]] = top1_correct,
        on_train: bool = False,
        priority: int = 0,
    ) -> None:
        super().__init__(priority)
        self.accuracy_fn = accuracy_fn
        self.on_train = on_train
        self.train_accuracy = AverageMetric("accuracy")
        self.test_accuracy = AverageMetric("accuracy")

    def after_hook_is_attached(self, trainer: Trainer) -> None:
        """Register the metrics."""
        trainer.test_metrics["accuracy"] = self.test_accuracy
        if self.on_train:
            trainer.train_metrics["accuracy"] = self.train_accuracy

    def before_train_epoch(self, trainer: Trainer) -> None:
        """Start a new epoch."""
        self.train_accuracy.reset()

    def after_train_iter(
        self, trainer: Trainer, output: Any, label: Any, loss: torch.Tensor | None
    ) -> None:
        """Count correct training predictions (if ``on_train``)."""
        if self.on_train and output is not None and label is not None:
            correct, total = self.accuracy_fn(output, label)
            self.train_accuracy.update(correct, float(total))

    def before_test(self, trainer: Trainer) -> None:
        """Start a new evaluation."""
        self.test_accuracy.reset()

    def after_test_iter(
        self, trainer: Trainer, output: Any, label: Any, loss: torch.Tensor | None
    ) -> None:
        """Count correct predictions."""
        if output is not None and label is not None:
            correct, total = self.accuracy_fn(output, label)
            self.test_accuracy.update(correct, float(total))


def _batch_size(label: Any) -> int | None:
    if isinstance(label, torch.Tensor) and label.dim() > 0:
        return int(label.shape[0])
    return None


class ThroughputHook(BaseHook):
    """Samples per second of training and evaluation (metric ``"throughput"``)."""

    def __init__(self, priority: int = 10) -> None:
        super().__init__(priority)
        self.train_throughput = ThroughputMetric()
        self.test_throughput = ThroughputMetric()
        self._start = 0.0

    def after_hook_is_attached(self, trainer: Trainer) -> None:
        """Register the metrics."""
        trainer.train_metrics["throughput"] = self.train_throughput
        trainer.test_metrics["throughput"] = self.test_throughput

    def before_train_epoch(self, trainer: Trainer) -> None:
        """Start a new epoch."""
        self.train_throughput.reset()

    def before_train_iter(self, trainer: Trainer) -> None:
        """Start the step's clock."""
        self._start = time.perf_counter()

    def after_train_iter(
        self, trainer: Trainer, output: Any, label: Any, loss: torch.Tensor | None
    ) -> None:
        """Add the step's samples and time."""
        n = _batch_size(label)
        if n is not None:
            self.train_throughput.update(n, time.perf_counter() - self._start)

    def before_test(self, trainer: Trainer) -> None:
        """Start a new evaluation."""
        self.test_throughput.reset()

    def before_test_iter(self, trainer: Trainer) -> None:
        """Start the step's clock."""
        self._start = time.perf_counter()

    def after_test_iter(
        self, trainer: Trainer, output: Any, label: Any, loss: torch.Tensor | None
    ) -> None:
        """Add the step's samples and time."""
        n = _batch_size(label)
        if n is not None:
            self.test_throughput.update(n, time.perf_counter() - self._start)
