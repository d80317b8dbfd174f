"""Moving an lr scheduler onto the optimizer that ZeRO put in place of the user's one.

A user builds the lr scheduler on their optimizer before ``initialize``; under ZeRO that
optimizer is replaced (a ``ZeroRedundancyOptimizer`` for stage 1, a new optimizer over FSDP2's
DTensor parameters for stages 2 and 3). A torch scheduler writes the learning rate into
``scheduler.optimizer.param_groups``: left on the old optimizer, it would change a learning
rate nobody reads and training would run at the initial rate throughout, silently. The new
optimizer's param groups carry the old ones' settings (``lr``, ``initial_lr``), so pointing
the scheduler (and the schedulers a ``SequentialLR`` / ``ChainedScheduler`` holds) at it
continues the schedule where it stands.
"""

from __future__ import annotations

import weakref
from functools import wraps
from typing import Any

import torch

__all__ = ["rebind_lr_scheduler"]

#: The marker torch's LRScheduler puts on an optimizer's ``step`` it tracks (its check that
#: ``optimizer.step()`` runs before ``scheduler.step()`` reads it).
_TRACKED = "_wrapped_by_lr_sched"


def _track_step_calls(optimizer: torch.optim.Optimizer) -> None:
    """Wrap ``optimizer.step`` as torch's LRScheduler does, so its order check stays right."""
    step = optimizer.step
    if getattr(step, _TRACKED, False):
        return
    func = step.__func__  # type: ignore[attr-defined]
    owner = weakref.ref(optimizer)  # no cycle optimizer -> wrapper -> optimizer

    @wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        opt = owner()
        opt._opt_called = True  # type: ignore[union-attr]
        return func.__get__(opt, type(opt))(*args, **kwargs)

    setattr(wrapper, _TRACKED, True)
    optimizer.step = wrapper  # type: ignore[method-assign]


def rebind_lr_scheduler(
    scheduler: Any, old: torch.optim.Optimizer, new: torch.optim.Optimizer
) -> bool:
    """Point ``scheduler`` (and the schedulers it chains) from ``old`` to ``new``.

    Returns:
        Whether any scheduler was bound to ``old`` (a scheduler of another optimizer is left
        alone).
    """
    moved = False
    pending = [scheduler]
    seen: set[int] = set()
    while pending:
        current = pending.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        if getattr(current, "optimizer", None) is old:
            current.optimizer = new
            moved = True
        pending.extend(getattr(current, "_schedulers", None) or ())
    if moved:
        _track_step_calls(new)
    return moved
