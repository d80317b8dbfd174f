"""Per-token loss: every token of the global step weighs the same, however the batch is cut.

A loss averaged over each piece of the step (a data rank's batch, a pipeline microbatch, an
accumulation step) and then averaged over the pieces weighs a token by one over the tokens of
its piece. With uneven padding, or a masked language model's ignored labels, the pieces hold
different numbers of tokens, and that is not the single process's mean over the global batch:
training differs, without an error. (Hugging Face fixed the same defect for gradient
accumulation in 2024 with ``num_items_in_batch``; Megatron-Core offers
``calculate_per_token_loss``.)

With ``per_token_loss=True`` the criterion returns ``(loss_sum, num_tokens)`` instead of a mean
(:func:`tessera.layers.token_loss` does with ``reduction="sum_and_count"``). The engine
backpropagates the sums, counts the tokens, and at the optimizer step multiplies the
gradients by ``data_ranks * microbatches / global_tokens``: the handlers' average over data
ranks and the pipeline's ``1 / microbatches`` undone, the global count in their place. The count
is summed over the accumulation steps, sent from the pipeline's last stage (the only one that
computes the loss) to every stage, and summed over the data ranks: two scalar all-reduces per
optimizer step.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from tessera.context import ParallelContext, ParallelMode

from .context_lookup import group_if_parallel

__all__ = ["TokenCounter", "split_sum_and_count"]


def split_sum_and_count(value: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss_sum, num_tokens)`` of what a per-token criterion returned.

    Raises:
        TypeError: ``value`` is not a pair of a scalar loss sum and a token count.
    """
    if (
        isinstance(value, tuple | list)
        and len(value) == 2
        and all(isinstance(v, torch.Tensor) and v.numel() == 1 for v in value)
    ):
        return value[0].reshape(()), value[1].reshape(())
    got = type(value).__name__
    if isinstance(value, torch.Tensor):
        got = f"a tensor of shape {list(value.shape)}"
    raise TypeError(
        "with per_token_loss=True the criterion must return (loss_sum, num_tokens), two scalar "
        f"tensors (tessera.layers.token_loss(..., reduction='sum_and_count') does); got {got}"
    )


class TokenCounter:
    """The tokens the criterion counted since the last optimizer step, made global there.

    Args:
        context: The job's context (None: one process).
        device: Where the count lives (the model's device: NCCL reduces device tensors).
    """

    def __init__(self, context: ParallelContext | None, device: torch.device) -> None:
        self._context = context
        self._count = torch.zeros((), dtype=torch.float64, device=device)

    def reset(self) -> None:
        """Forget the tokens counted so far (their gradients were cleared)."""
        self._count = torch.zeros_like(self._count)

    def add(self, count: torch.Tensor) -> None:
        """Count the tokens of one microbatch's loss."""
        self._count += count.detach().to(self._count)

    def gradient_factor(self, microbatches: int) -> float:
        """``data ranks * microbatches / global tokens``, then reset.

        Every rank calls it at the same optimizer step: it all-reduces over PIPELINE (only
        the last stage counted) and over DATA. A step without a single token is NaN, as one
        process's mean over no token: the engine's non-finite policy then raises or skips.
        """
        count, self._count = self._count, torch.zeros_like(self._count)
        data_ranks = 1
        for mode in (ParallelMode.PIPELINE, ParallelMode.DATA):
            group = group_if_parallel(self._context, mode)
            if group is not None:
                dist.all_reduce(count, group=group)
                if mode is ParallelMode.DATA:
                    data_ranks = dist.get_world_size(group)
        tokens = float(count)
        return math.nan if tokens == 0 else data_ranks * microbatches / tokens
