"""Activation checkpointing that replays every RNG stream of the context.

torch's checkpoint restores only torch's global generator state. Tensor-parallel dropout
draws from per-mode streams (``ctx.seed(ParallelMode.TENSOR)``) that the context swaps in and
out, so the recomputation must start from the states *all* streams had when the forward ran,
and leave them as they were before the recomputation (Megatron-LM's CheckpointFunction does
the same with its CUDA RNG tracker).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.utils.checkpoint as torch_checkpoint

from tessera.context import ParallelContext

from .context_access import current_or_none

__all__ = ["checkpoint"]


def checkpoint(
    fn: Callable[..., Any],
    *args: Any,
    context: ParallelContext | None = None,
    **kwargs: Any,
) -> Any:
    """Run ``fn(*args, **kwargs)`` without keeping its activations; recompute them in backward.

    The recomputation draws the same random numbers (dropout masks) as the forward did, in
    every RNG stream of the context, and afterwards restores the streams to where they were.

    Args:
        fn: The function or module to run.
        *args: Its positional arguments (tensors or anything else).
        context: The ParallelContext whose streams to replay; default the current one, or
            none (only torch's generator is replayed).
        **kwargs: Its keyword arguments.
    """
    ctx = current_or_none(context)
    if ctx is None:
        return torch_checkpoint.checkpoint(
            fn, *args, use_reentrant=False, preserve_rng_state=True, **kwargs
        )
    forward_state = ctx.get_rng_state()
    calls = 0

    def run(*a: Any, **kw: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 1:  # the forward itself
            return fn(*a, **kw)
        before = ctx.get_rng_state()
        ctx.set_rng_state(forward_state)
        try:
            return fn(*a, **kw)
        finally:  # also when torch stops the recomputation early
            ctx.set_rng_state(before)

    # The context's state covers torch's generators (CPU and the context's CUDA device).
    return torch_checkpoint.checkpoint(
        run, *args, use_reentrant=False, preserve_rng_state=False, **kwargs
    )
