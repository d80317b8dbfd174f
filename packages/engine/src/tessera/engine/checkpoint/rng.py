"""Every random stream of a rank, captured and restored for an exact resume.

Dropout masks come from torch's generators, data order from the sampler's seed and the
loader's generator, augmentations often from python's ``random`` or numpy. Under a
ParallelContext the per-mode streams (``ctx.seed(mode)``: different draws per tensor rank,
equal draws per replica; Megatron-LM, Shoeybi et al. 2019) and python/numpy are captured by
``ParallelContext.get_rng_state``; without one, torch's CPU (and CUDA) generators, python's
and numpy's. All of it is tensors, ints, floats and strings, so it loads with
``weights_only=True``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from tessera.context import ParallelContext, get_host_rng_state, set_host_rng_state

__all__ = ["capture_rng", "restore_rng"]


def capture_rng(context: ParallelContext | None) -> dict[str, Any]:
    """This rank's RNG states."""
    if context is not None:
        return {"context": context.get_rng_state()}
    state: dict[str, Any] = {"torch": torch.get_rng_state(), **get_host_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: Mapping[str, Any], context: ParallelContext | None) -> None:
    """Restore what ``capture_rng`` returned (on the same kind of process)."""
    if "context" in state:
        if context is None:
            raise ValueError("these RNG states were saved under a ParallelContext; pass context=")
        context.set_rng_state(state["context"])
        return
    torch.set_rng_state(state["torch"])
    set_host_rng_state(state)
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
