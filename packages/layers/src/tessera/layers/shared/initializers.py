"""Parameter initializers: functions that fill the *full* tensor in place.

A sharded layer draws its full parameter once and keeps its block (see ``shared/shards.py``), so a
tensor-parallel model starts from exactly the values the single-process model would draw with
the same RNG state, whatever the split. An initializer gets the fans of the full layer because
some (a Linear bias) depend on the weight's fan-in rather than on the tensor they fill.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

__all__ = [
    "Initializer",
    "fan_in_uniform",
    "kaiming_uniform",
    "normal",
    "ones",
    "uniform",
    "xavier_uniform",
    "zeros",
]

#: ``init(full_tensor, fan_in, fan_out)`` fills ``full_tensor`` in place (under no_grad).
Initializer = Callable[[torch.Tensor, int, int], object]


def zeros() -> Initializer:
    """All zeros."""
    return lambda t, fan_in, fan_out: nn.init.zeros_(t)


def ones() -> Initializer:
    """All ones (LayerNorm's weight)."""
    return lambda t, fan_in, fan_out: nn.init.ones_(t)


def normal(mean: float = 0.0, std: float = 1.0) -> Initializer:
    """Normal(mean, std) (torch.nn.Embedding's default with std=1)."""
    return lambda t, fan_in, fan_out: nn.init.normal_(t, mean, std)


def uniform(a: float = 0.0, b: float = 1.0) -> Initializer:
    """Uniform(a, b)."""
    return lambda t, fan_in, fan_out: nn.init.uniform_(t, a, b)


def kaiming_uniform(a: float = math.sqrt(5)) -> Initializer:
    """torch.nn.Linear's default weight init (He uniform with ``a=sqrt(5)``) over ``fan_in``."""

    def init(t: torch.Tensor, fan_in: int, fan_out: int) -> None:
        gain = math.sqrt(2.0 / (1 + a * a))
        bound = gain * math.sqrt(3.0 / fan_in) if fan_in > 0 else 0.0
        nn.init.uniform_(t, -bound, bound)

    return init


def fan_in_uniform() -> Initializer:
    """torch.nn.Linear's default bias init: Uniform(-1/sqrt(fan_in), 1/sqrt(fan_in))."""

    def init(t: torch.Tensor, fan_in: int, fan_out: int) -> None:
        bound = 1.0 / math.sqrt(fan_in) if fan_in > 0 else 0.0
        nn.init.uniform_(t, -bound, bound)

    return init


def xavier_uniform(gain: float = 1.0) -> Initializer:
    """Glorot uniform over ``fan_in + fan_out``."""

    def init(t: torch.Tensor, fan_in: int, fan_out: int) -> None:
        bound = gain * math.sqrt(6.0 / (fan_in + fan_out)) if fan_in + fan_out > 0 else 0.0
        nn.init.uniform_(t, -bound, bound)

    return init
