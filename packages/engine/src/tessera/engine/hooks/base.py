"""``BaseHook``: callbacks around the Trainer's loops.

A hook overrides the callbacks it needs; the Trainer calls every hook in ascending
``priority`` (ties keep the order given). The callbacks receive the Trainer, whose ``states``,
``train_metrics``, ``test_metrics`` and ``step_metrics`` are the shared blackboard of a run.
A user's hook registers in ``HOOKS`` (tessera.engine) and can be named in a config.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from ..trainer import Trainer

__all__ = ["BaseHook"]


class BaseHook:
    """Base class of Trainer hooks; every callback does nothing by default.

    Args:
        priority: Lower runs first.
    """

    def __init__(self, priority: int = 0) -> None:
        self.priority = priority

    def after_hook_is_attached(self, trainer: Trainer) -> None:
        """Once, when ``fit``/``evaluate`` starts with this hook (register metrics here)."""

    def before_train(self, trainer: Trainer) -> None:
        """Before the first epoch."""

    def after_train(self, trainer: Trainer) -> None:
        """After the last epoch (or ``max_steps``)."""

    def before_train_epoch(self, trainer: Trainer) -> None:
        """Before each training epoch."""

    def after_train_epoch(self, trainer: Trainer) -> None:
        """After each training epoch.

        ``trainer.states["epoch_metrics"]`` holds its reduced
        metrics.
        """

    def before_train_iter(self, trainer: Trainer) -> None:
        """Before each training step."""

    def after_train_iter(
        self, trainer: Trainer, output: Any, label: Any, loss: torch.Tensor | None
    ) -> None:
        """After each training step.

        (after the optimizer); ``loss`` is ``None`` on pipeline
        stages that are not the last.
        """

    def before_test(self, trainer: Trainer) -> None:
        """Before an evaluation pass."""

    def after_test(self, trainer: Trainer) -> None:
        """After an evaluation pass; ``trainer.states["test_results"]`` holds its metrics."""

    def before_test_iter(self, trainer: Trainer) -> None:
        """Before each evaluation step."""

    def after_test_iter(
        self, trainer: Trainer, output: Any, label: Any, loss: torch.Tensor | None
    ) -> None:
        """After each evaluation step."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(priority={self.priority})"
