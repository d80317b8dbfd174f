"""The seed's warm-up schedules: each step's rate against its formula, and registration by name."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from tessera.engine import (
    CosineAnnealingWarmupLR,
    LinearWarmupLR,
    MultiStepWarmupLR,
    OneCycleLR,
)
from tessera.registry import LR_SCHEDULERS, build

BASE, W, T = 0.8, 3, 10


def _optimizer() -> torch.optim.Optimizer:
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=BASE, momentum=0.9)


def _rates(scheduler: torch.optim.lr_scheduler.LRScheduler, steps: int) -> list[float]:
    """The rate before each of ``steps`` optimizer steps."""
    rates = []
    for _ in range(steps):
        rates.append(scheduler.optimizer.param_groups[0]["lr"])
        scheduler.optimizer.step()
        scheduler.step()
    return rates


def _warm(t: int) -> float:
    return BASE * (t + 1) / (W + 1)


def _linear(t: int) -> float:
    return _warm(t) if t < W else BASE * max(T - t, 0) / (T - W)


def _cosine(t: int) -> float:
    eta = 0.1
    return (
        _warm(t) if t < W else eta + (BASE - eta) * (1 + math.cos(math.pi * (t - W) / (T - W))) / 2
    )


def _multistep(t: int) -> float:
    return _warm(t) if t < W else BASE * 0.5 ** sum(t >= m for m in (5, 8))


@pytest.mark.parametrize(
    ("make", "formula"),
    [
        (lambda o: LinearWarmupLR(o, T, warmup_steps=W), _linear),
        (lambda o: CosineAnnealingWarmupLR(o, T, warmup_steps=W, eta_min=0.1), _cosine),
        (lambda o: MultiStepWarmupLR(o, T, W, milestones=[5, 8], gamma=0.5), _multistep),
    ],
    ids=["linear", "cosine", "multistep"],
)
def test_warmup_schedules_follow_their_formula(
    make: Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LRScheduler],
    formula: Callable[[int], float],
) -> None:
    steps = T + 2 if formula is not _cosine else T + 1  # cosine rises again past T, as torch's
    assert _rates(make(_optimizer()), steps) == pytest.approx([formula(t) for t in range(steps)])


def test_linear_warmup_without_warmup_and_bad_steps() -> None:
    assert _rates(LinearWarmupLR(_optimizer(), 4), 5) == pytest.approx([BASE, 0.6, 0.4, 0.2, 0.0])
    with pytest.raises(ValueError, match="total_steps 3 must exceed warmup_steps 3"):
        LinearWarmupLR(_optimizer(), 3, warmup_steps=3)
    with pytest.raises(ValueError, match=r"milestones \[2\] are not after warmup_steps 3"):
        MultiStepWarmupLR(_optimizer(), T, W, milestones=[2, 6])


def test_one_cycle_takes_its_peak_from_the_optimizer() -> None:
    ours = OneCycleLR(_optimizer(), T)
    theirs = torch.optim.lr_scheduler.OneCycleLR(_optimizer(), max_lr=BASE, total_steps=T)
    assert _rates(ours, T) == pytest.approx(_rates(theirs, T))
    assert max(_rates(OneCycleLR(_optimizer(), T, pct_start=0.5), T)) == pytest.approx(BASE)


def test_schedules_are_registered_by_name_and_resume_from_state() -> None:
    for cls in (LinearWarmupLR, CosineAnnealingWarmupLR, MultiStepWarmupLR, OneCycleLR):
        assert LR_SCHEDULERS.get(cls.__name__) is cls
    built = build(
        dict(type="LinearWarmupLR", total_steps=T, warmup_steps=W),
        LR_SCHEDULERS,
        optimizer=_optimizer(),
    )
    _rates(built, 4)
    resumed = LinearWarmupLR(_optimizer(), T, warmup_steps=W)
    resumed.optimizer.load_state_dict(built.optimizer.state_dict())  # the rate lives there
    resumed.load_state_dict(built.state_dict())
    assert _rates(resumed, 3) == pytest.approx(_rates(built, 3))
    assert _rates(resumed, 1) == pytest.approx([_linear(7)])
