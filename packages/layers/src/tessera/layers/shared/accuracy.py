"""Accuracy on vocab-parallel logits ``[.., C/p]``: a distributed argmax, no gathered logits.

Each rank sends its slice's max and the global index of its first maximum; the winner is the
largest value, ties going to the smallest index, which is exactly ``torch.argmax`` of the full
row. Two all-reduces of ``[N]`` values instead of an all-gather of ``[N, C]``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tessera.context import ParallelContext

from .base import Module1D

__all__ = ["VocabParallelAccuracy1D", "vocab_parallel_argmax"]


def vocab_parallel_argmax(logits: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``argmax(-1)`` of the full logits, from this rank's slice ``[.., C/p]``; ``[..]`` int64."""
    with torch.no_grad():
        local_classes = logits.shape[-1]
        start = dist.get_rank(group) * local_classes
        values, index = logits.max(dim=-1)  # [..], first maximum within the slice
        best = values.clone()
        dist.all_reduce(best, op=dist.ReduceOp.MAX, group=group)
        candidate = torch.where(
            values == best, index + start, torch.full_like(index, torch.iinfo(torch.int64).max)
        )
        dist.all_reduce(candidate, op=dist.ReduceOp.MIN, group=group)
        return candidate


class VocabParallelAccuracy1D(Module1D):
    """The number of correct predictions from vocab-parallel logits ``[.., C/p]``.

    A count, like :class:`SerialAccuracy`, so it adds up over batches and data-parallel ranks.
    """

    def __init__(self, *, context: ParallelContext | None = None) -> None:
        super().__init__(context=context)

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """See the class docstring for shapes."""
        return (vocab_parallel_argmax(logits, self.tp.group) == target).sum()
