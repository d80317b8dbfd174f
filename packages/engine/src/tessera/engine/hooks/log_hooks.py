"""Hooks that report: metrics per epoch or per step, timings and memory per epoch.

They write through the Trainer's rank-aware logger, on the Trainer's display rank only (the
rank that holds the loss: data rank 0, last pipeline stage, tensor rank 0), so an N-rank job
prints each line once.
"""

from __future__ import annotations

import resource
import sys
from typing import TYPE_CHECKING, Any

import torch

from ..dist_logger import DistributedLogger
from ..timer import MultiTimer
from .base import BaseHook

if TYPE_CHECKING:
    from ..trainer import Trainer

__all__ = [
    "LogMemoryByEpochHook",
    "LogMetricByEpochHook",
    "LogMetricByStepHook",
    "LogTimingByEpochHook",
]


def _cuda_in_use() -> bool:
    """Whether this process has initialized CUDA (so there may be queued work or memory)."""
    is_initialized: Any = torch.cuda.is_initialized
    return bool(torch.cuda.is_available() and is_initialized())


def _format(metrics: dict[str, float]) -> str:
    return ", ".join(f"{k}={v:.6g}" for k, v in metrics.items())


class _LoggingHook(BaseHook):
    def __init__(self, logger: DistributedLogger | None, interval: int, priority: int) -> None:
        super().__init__(priority)
        if interval < 1:
            raise ValueError(f"interval must be >= 1, got {interval}")
        self._logger = logger
        self.interval = interval

    def _write(self, trainer: Trainer, message: str) -> None:
        if trainer.is_display_rank:
            # Already filtered to the display rank, which need not be global rank 0.
            (self._logger or trainer.logger).logger.info(message)


class LogMetricByEpochHook(_LoggingHook):
    """Log the reduced training metrics every ``interval`` epochs, and every evaluation."""

    def __init__(
        self, logger: DistributedLogger | None = None, interval: int = 1, priority: int = 10
    ) -> None:
        super().__init__(logger, interval, priority)

    def after_train_epoch(self, trainer: Trainer) -> None:
        """Log ``trainer.states["epoch_metrics"]``."""
        if (trainer.epoch + 1) % self.interval == 0:
            metrics = trainer.states.get("epoch_metrics", {})
            self._write(trainer, f"epoch {trainer.epoch} train: {_format(metrics)}")

    def after_test(self, trainer: Trainer) -> None:
        """Log ``trainer.states["test_results"]``."""
        metrics = trainer.states.get("test_results", {})
        self._write(trainer, f"epoch {trainer.epoch} test: {_format(metrics)}")


class LogMetricByStepHook(BaseHook):
    """Put every training metric's latest local value among the step metrics.

    The progress bar shows them and the JSON-lines log records them per step.
    """

    def __init__(self, priority: int = 10) -> None:
        super().__init__(priority)

    def after_train_iter(
        self, trainer: Trainer, output: Any, label: Any, loss: torch.Tensor | None
    ) -> None:
        """Copy the metrics' last values."""
        for name, metric in trainer.train_metrics.items():
            if name not in ("loss",):
                trainer.step_metrics[name] = metric.last


class LogTimingByEpochHook(_LoggingHook):
    """Log the Trainer's timers (total and mean per interval) every ``interval`` epochs.

    Args:
        timer: The MultiTimer to report (default: the Trainer's).
        logger: Default: the Trainer's.
        interval: Epochs between two reports.
        reset: Reset the timers after each report.
        priority: Hook order.
    """

    def __init__(
        self,
        timer: MultiTimer | None = None,
        logger: DistributedLogger | None = None,
        interval: int = 1,
        reset: bool = True,
        priority: int = 10,
    ) -> None:
        super().__init__(logger, interval, priority)
        self._timer = timer
        self.reset = reset

    def after_train_epoch(self, trainer: Trainer) -> None:
        """Log and optionally reset the timers."""
        if (trainer.epoch + 1) % self.interval != 0:
            return
        timer = self._timer or trainer.timer
        parts = [
            f"{name}: total {timer.get(name).elapsed():.4f}s, mean {timer.get(name).mean():.4f}s"
            for name in timer.names()
        ]
        self._write(trainer, f"epoch {trainer.epoch} timing: " + "; ".join(parts))
        if self.reset:
            timer.reset()


def memory_usage() -> dict[str, float]:
    """Peak memory in MiB: CUDA allocated (if CUDA is in use) and the process's peak RSS."""
    usage: dict[str, float] = {}
    if _cuda_in_use():
        usage["cuda_max_allocated_mib"] = torch.cuda.max_memory_allocated() / 2**20
    rss = float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    # ru_maxrss is in KiB on Linux and in bytes on macOS.
    usage["max_rss_mib"] = rss / 2**20 if sys.platform == "darwin" else rss / 2**10
    return usage


class LogMemoryByEpochHook(_LoggingHook):
    """Log peak memory every ``interval`` epochs."""

    def __init__(
        self, logger: DistributedLogger | None = None, interval: int = 1, priority: int = 10
    ) -> None:
        super().__init__(logger, interval, priority)

    def after_train_epoch(self, trainer: Trainer) -> None:
        """Log ``memory_usage()``."""
        if (trainer.epoch + 1) % self.interval == 0:
            self._write(trainer, f"epoch {trainer.epoch} memory: {_format(memory_usage())}")
