"""Shared helpers of the engine tests: a tiny model, data, and a plain-PyTorch reference."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))


def make_data(n: int = 8, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)  # [n, 4]
    y = torch.randint(0, 3, (n,), generator=g)  # [n]
    return x, y


def reference_params(
    steps: list[tuple[torch.Tensor, torch.Tensor]],
    make_opt: Callable[[nn.Module], torch.optim.Optimizer],
    clip: float = 0.0,
    seed: int = 0,
) -> list[torch.Tensor]:
    """Train the model in one process on full batches; return its final parameters."""
    model = make_model(seed)
    opt = make_opt(model)
    loss_fn = nn.CrossEntropyLoss()
    for x, y in steps:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        if clip:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            assert norm > clip, f"reference norm {norm} does not exceed {clip}: nothing clipped"
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1)


def adam(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=0.01)
