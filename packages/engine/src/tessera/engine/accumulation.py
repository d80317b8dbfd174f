"""A learning-rate scheduler that advances once per optimizer step under accumulation.

With ``gradient_accumulation=N`` the optimizer steps once every N micro-steps, but a loop (or
``LRSchedulerHook(by_epoch=False)``) calls ``lr_scheduler.step()`` once per micro-step. This
wrapper counts the calls and forwards every N-th, so the schedule is the one the user wrote
for optimizer steps.
"""

from __future__ import annotations

from typing import Any

__all__ = ["AccumulatedLRScheduler"]


class AccumulatedLRScheduler:
    """Forward every ``accumulation``-th ``step()`` to ``scheduler``.

    Args:
        scheduler: The wrapped scheduler (a ``torch.optim.lr_scheduler.LRScheduler``).
        accumulation: Micro-steps per optimizer step.
    """

    def __init__(self, scheduler: Any, accumulation: int) -> None:
        if accumulation < 1:
            raise ValueError(f"accumulation must be >= 1, got {accumulation}")
        self.scheduler = scheduler
        self.accumulation = accumulation
        self._calls = 0

    def step(self) -> None:
        """Count a micro-step; step the scheduler at the end of each accumulation cycle."""
        self._calls += 1
        if self._calls % self.accumulation == 0:
            self.scheduler.step()

    def get_last_lr(self) -> list[float]:
        """The wrapped scheduler's last learning rates."""
        return list(self.scheduler.get_last_lr())

    def state_dict(self) -> dict[str, Any]:
        """The wrapped scheduler's state and the micro-step count."""
        return {"scheduler": self.scheduler.state_dict(), "calls": self._calls}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned."""
        self.scheduler.load_state_dict(state["scheduler"])
        self._calls = int(state["calls"])

    def __getattr__(self, name: str) -> Any:
        # Only reached for names this class lacks: behave like the wrapped scheduler.
        if name == "scheduler":
            raise AttributeError(name)
        return getattr(self.scheduler, name)
