"""rebind_lr_scheduler: the schedule continues on the optimizer that replaced the user's one."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from tessera.engine.scheduler_binding import rebind_lr_scheduler


def _sgd(model: nn.Module) -> torch.optim.SGD:
    return torch.optim.SGD(model.parameters(), lr=1.0)


def _like(old: torch.optim.Optimizer, model: nn.Module) -> torch.optim.SGD:
    """What ZeRO does: a new optimizer with the old param groups' settings."""
    settings = {k: v for k, v in old.param_groups[0].items() if k != "params"}
    return torch.optim.SGD([{"params": list(model.parameters()), **settings}], lr=1.0)


def test_sequential_scheduler_moves_with_its_children() -> None:
    model = nn.Linear(2, 2)
    old = _sgd(model)
    warm = torch.optim.lr_scheduler.LinearLR(old, start_factor=0.5, total_iters=2)
    decay = torch.optim.lr_scheduler.StepLR(old, step_size=1, gamma=0.1)
    sched = torch.optim.lr_scheduler.SequentialLR(old, [warm, decay], milestones=[2])
    new = _like(old, model)
    assert rebind_lr_scheduler(sched, old, new) is True
    assert sched.optimizer is new and warm.optimizer is new and decay.optimizer is new
    lrs = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's "scheduler before optimizer" check stays quiet
        for _ in range(4):
            model(torch.ones(1, 2)).sum().backward()
            new.step()
            sched.step()
            lrs.append(new.param_groups[0]["lr"])
    # the same numbers as the schedule on an optimizer it was built on
    ref_model = nn.Linear(2, 2)
    ref_opt = _sgd(ref_model)
    ref = torch.optim.lr_scheduler.SequentialLR(
        ref_opt,
        [
            torch.optim.lr_scheduler.LinearLR(ref_opt, start_factor=0.5, total_iters=2),
            torch.optim.lr_scheduler.StepLR(ref_opt, step_size=1, gamma=0.1),
        ],
        milestones=[2],
    )
    want = []
    for _ in range(4):
        ref_opt.step()
        ref.step()
        want.append(ref_opt.param_groups[0]["lr"])
    assert lrs == pytest.approx(want)
    assert old.param_groups[0]["lr"] == pytest.approx(0.5)  # the old one is left behind


def test_a_scheduler_of_another_optimizer_is_left_alone() -> None:
    model = nn.Linear(2, 2)
    mine, other = _sgd(model), _sgd(nn.Linear(2, 2))
    sched = torch.optim.lr_scheduler.StepLR(other, step_size=1)
    assert rebind_lr_scheduler(sched, mine, _like(mine, model)) is False
    assert sched.optimizer is other
