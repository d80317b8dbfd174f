"""Per-rank seeding of every random number generator a test body may touch."""

from __future__ import annotations

import random

import torch

__all__ = ["seed_all"]


def seed_all(seed: int) -> None:
    """Seed Python's ``random``, NumPy's global RNG (when installed) and torch with ``seed``.

    The harness calls this with ``base_seed + rank`` before every call, so ranks draw
    *different* numbers. A parallel layer whose ranks must agree on data has to make that
    agreement explicit (broadcast, or a ``torch.Generator`` seeded identically on all ranks);
    a bug that relies on ranks accidentally sharing RNG state then fails instead of passing.
    """
    random.seed(seed)
    try:
        import numpy
    except ImportError:  # numpy is optional
        pass
    else:
        numpy.random.seed(seed % 2**32)
    torch.manual_seed(seed)
