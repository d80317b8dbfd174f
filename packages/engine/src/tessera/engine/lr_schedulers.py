"""Learning-rate schedules with a warm-up, as Colossal-AI's programs name them.

Colossal-AI's tutorials build ``LinearWarmupLR(optimizer, total_steps, warmup_steps=5)`` and its
cosine, multi-step and one-cycle relatives. These are those names as thin compositions of
torch's own schedulers (``LinearLR``, ``CosineAnnealingLR``, ``MultiStepLR`` chained by
``SequentialLR``; ``OneCycleLR``), so ``step()``, ``get_last_lr()``, ``state_dict()`` and
checkpoints behave exactly as torch's do, and ``LRSchedulerHook`` drives them like any other.

With ``t`` the number of ``step()`` calls so far (``last_epoch``), ``w`` the warm-up steps, ``T``
the total steps and ``base`` a param group's starting ``lr``, the learning rate is:

=========================  ================================================================
scheduler                  lr at step t
=========================  ================================================================
warm-up (all three below)  ``base * (t + 1) / (w + 1)`` for ``t < w``: the first step already
                           trains, and the rate reaches ``base`` at ``t = w``
``LinearWarmupLR``         then ``base * (T - t) / (T - w)``, down to 0 at ``t = T`` (and 0
                           after)
``CosineAnnealingWarmupLR`` then ``eta_min + (base - eta_min) * (1 + cos(pi (t - w) / (T - w)))
                           / 2``: torch's ``CosineAnnealingLR`` with ``T_max = T - w``, which
                           rises again past ``T`` as torch's does
``MultiStepWarmupLR``      then ``base * gamma ** k``, ``k`` the milestones ``<= t`` (milestones
                           count from step 0, warm-up included)
``OneCycleLR``             torch's ``OneCycleLR`` with ``max_lr`` defaulting to each group's
                           ``lr`` (Colossal-AI's signature: ``total_steps`` second)
=========================  ================================================================

They are registered in ``tessera.registry.LR_SCHEDULERS`` through the entry-point group
``tessera.lr_schedulers``, so a config's ``lr_scheduler=dict(type="LinearWarmupLR", ...)`` builds
them; ``OneCycleLR`` takes precedence over torch's class of that name and accepts all its keywords.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.optim.lr_scheduler import (
    CosineAnnealingLR,
    LinearLR,
    LRScheduler,
    MultiStepLR,
    SequentialLR,
)
from torch.optim.lr_scheduler import OneCycleLR as _TorchOneCycleLR

__all__ = [
    "CosineAnnealingWarmupLR",
    "LinearWarmupLR",
    "MultiStepWarmupLR",
    "OneCycleLR",
]


def _check_steps(name: str, total_steps: int, warmup_steps: int) -> None:
    """Refuse step counts the schedules cannot divide by, naming both."""
    if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
        raise ValueError(f"{name}: warmup_steps must be an int >= 0, got {warmup_steps!r}")
    if isinstance(total_steps, bool) or not isinstance(total_steps, int):
        raise ValueError(f"{name}: total_steps must be an int, got {total_steps!r}")
    if total_steps <= warmup_steps:
        raise ValueError(
            f"{name}: total_steps {total_steps} must exceed warmup_steps {warmup_steps} "
            f"(the decay would last total_steps - warmup_steps = {total_steps - warmup_steps} "
            "steps)"
        )


def _with_warmup(
    optimizer: torch.optim.Optimizer, warmup_steps: int, after: LRScheduler
) -> tuple[list[LRScheduler], list[int]]:
    """The schedulers and milestones of ``SequentialLR``: a linear warm-up, then ``after``."""
    if warmup_steps == 0:
        return [after], []
    # LinearLR's factor at step t is start + (1 - start) * t / w = (t + 1) / (w + 1)
    warmup = LinearLR(
        optimizer, start_factor=1.0 / (warmup_steps + 1), end_factor=1.0, total_iters=warmup_steps
    )
    return [warmup, after], [warmup_steps]


class LinearWarmupLR(SequentialLR):
    """Linear warm-up over ``warmup_steps``, then linear decay to 0 at ``total_steps``.

    Args:
        optimizer: The optimizer whose param groups' ``lr`` it sets.
        total_steps: Steps (``step()`` calls) until the rate reaches 0.
        warmup_steps: Steps of linear warm-up (0: none).
        last_epoch: torch's resume index (-1: a new schedule).

    Raises:
        ValueError: ``total_steps <= warmup_steps`` or a negative ``warmup_steps``.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        total_steps: int,
        warmup_steps: int = 0,
        last_epoch: int = -1,
    ) -> None:
        _check_steps("LinearWarmupLR", total_steps, warmup_steps)
        self.total_steps, self.warmup_steps = total_steps, warmup_steps
        decay = LinearLR(
            optimizer, start_factor=1.0, end_factor=0.0, total_iters=total_steps - warmup_steps
        )
        schedulers, milestones = _with_warmup(optimizer, warmup_steps, decay)
        super().__init__(optimizer, schedulers, milestones, last_epoch=last_epoch)


class CosineAnnealingWarmupLR(SequentialLR):
    """Linear warm-up over ``warmup_steps``, then a cosine down to ``eta_min`` at ``total_steps``.

    Args:
        optimizer: The optimizer whose param groups' ``lr`` it sets.
        total_steps: Steps until the rate reaches ``eta_min``.
        warmup_steps: Steps of linear warm-up (0: none).
        eta_min: The lowest rate.
        last_epoch: torch's resume index (-1: a new schedule).

    Raises:
        ValueError: ``total_steps <= warmup_steps`` or a negative ``warmup_steps``.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        total_steps: int,
        warmup_steps: int = 0,
        eta_min: float = 0.0,
        last_epoch: int = -1,
    ) -> None:
        _check_steps("CosineAnnealingWarmupLR", total_steps, warmup_steps)
        self.total_steps, self.warmup_steps, self.eta_min = total_steps, warmup_steps, eta_min
        cosine = CosineAnnealingLR(optimizer, T_max=total_steps - warmup_steps, eta_min=eta_min)
        schedulers, milestones = _with_warmup(optimizer, warmup_steps, cosine)
        super().__init__(optimizer, schedulers, milestones, last_epoch=last_epoch)


class MultiStepWarmupLR(SequentialLR):
    """Linear warm-up over ``warmup_steps``, then the rate times ``gamma`` at each milestone.

    Args:
        optimizer: The optimizer whose param groups' ``lr`` it sets.
        total_steps: The schedule's length (checked against the warm-up; the rate stays after
            the last milestone).
        warmup_steps: Steps of linear warm-up (0: none).
        milestones: Steps, counted from 0 like ``t``, at which the rate is multiplied by
            ``gamma``; each must come after the warm-up.
        gamma: The factor at each milestone.
        last_epoch: torch's resume index (-1: a new schedule).

    Raises:
        ValueError: a milestone inside the warm-up, or bad step counts.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        total_steps: int,
        warmup_steps: int = 0,
        milestones: Sequence[int] = (),
        gamma: float = 0.1,
        last_epoch: int = -1,
    ) -> None:
        _check_steps("MultiStepWarmupLR", total_steps, warmup_steps)
        early = [m for m in milestones if m <= warmup_steps]
        if early:
            raise ValueError(
                f"MultiStepWarmupLR: milestones {early} are not after warmup_steps "
                f"{warmup_steps}; milestones count from step 0, warm-up included"
            )
        self.total_steps, self.warmup_steps = total_steps, warmup_steps
        # after SequentialLR's milestone the second scheduler counts from 0 again
        steps = MultiStepLR(optimizer, [m - warmup_steps for m in milestones], gamma=gamma)
        schedulers, seq_milestones = _with_warmup(optimizer, warmup_steps, steps)
        super().__init__(optimizer, schedulers, seq_milestones, last_epoch=last_epoch)


class OneCycleLR(_TorchOneCycleLR):
    """torch's one-cycle policy (Smith & Topin 2017) with Colossal-AI's signature.

    Colossal-AI passes ``total_steps`` second and takes the peak rate from the optimizer; torch
    needs ``max_lr``. Here ``max_lr`` defaults to each param group's ``lr`` (its
    ``initial_lr`` when resuming), and every keyword of torch's class is accepted.

    Args:
        optimizer: The optimizer whose param groups' ``lr`` (and momentum) it sets.
        total_steps: Steps in the cycle (or give ``epochs`` and ``steps_per_epoch``).
        max_lr: The peak rate, one or one per group (default: each group's rate).
        **kwargs: torch's ``OneCycleLR`` keywords (``pct_start``, ``anneal_strategy``,
            ``div_factor``, ``final_div_factor``, ``three_phase``, ``last_epoch``...).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        total_steps: int | None = None,
        max_lr: float | list[float] | None = None,
        **kwargs: Any,
    ) -> None:
        if max_lr is None:
            max_lr = [float(g.get("initial_lr", g["lr"])) for g in optimizer.param_groups]
        super().__init__(optimizer, max_lr=max_lr, total_steps=total_steps, **kwargs)
