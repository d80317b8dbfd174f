"""Sequence parallelism's building blocks: replicated parameters with partial gradients.

Under ``tensor=dict(size=N, mode="sequence")`` (Li et al. 2021, "Sequence Parallelism: Long
Sequence Training from System Perspective") every rank holds the whole model and the
sub-sequence ``[b, s/N, ...]`` (chunk ``r`` on SEQUENCE rank ``r``). Everything but attention
is token-wise (MLP, LayerNorm, embeddings, the head), so it runs unchanged on the local tokens:
the dispatching layers build plain torch modules. The price is the one documented exception
to the "no extra reduction" rule: a parameter's gradient on a rank covers only that rank's
tokens. :func:`mark_sequence_replicated` records it in each parameter's ``ShardInfo``
(``replicated_modes == partial_grad_modes == ("sequence",)``) and the engine's
sequence-parallel gradient handler all-reduces those gradients over SEQUENCE (x DATA).

``split_activation`` / ``gather_activation`` split / gather dim 1 (the sequence) over
SEQUENCE; ``split_batch`` splits token ids and targets ``[b, s, ...]`` the same way.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from tessera.context import ParallelContext, ParallelMode, get_shard_info, set_shard_info

from ..comm.collectives import check_divisible
from ..comm.ops import gather_along_dim, split_along_dim
from ..shared.base import ParallelModule
from ..shared.shards import shard_info

__all__ = [
    "TOKENS_BEFORE_PADDING",
    "SequenceAccuracy",
    "gather_sequence_activation",
    "mark_sequence_replicated",
    "split_sequence_activation",
]

_SEQUENCE = (ParallelMode.SEQUENCE,)


def mark_sequence_replicated(module: nn.Module, context: ParallelContext) -> nn.Module:
    """Mark every parameter of ``module`` replicated over SEQUENCE with partial gradients.

    Parameters that already carry a ``ShardInfo`` (e.g. a weight shared with an embedding)
    are left alone. Returns ``module``.
    """
    for param in module.parameters():
        if get_shard_info(param) is None:
            info = shard_info(
                context,
                tuple(param.shape),
                None,
                replicated=_SEQUENCE,
                partial_grad=_SEQUENCE,
                owner=type(module).__name__,
            )
            set_shard_info(param, info)
    return module


#: On logits of a sequence the boundary padded to a multiple of the ranks: its length before.
TOKENS_BEFORE_PADDING = "_tessera_tokens_before_padding"


def _check(x: torch.Tensor, context: ParallelContext, what: str) -> int:
    if x.dim() < 2:
        raise ValueError(
            f"{what}: sequence parallelism splits dim 1 of [batch, seq, ...], but the tensor "
            f"has shape {list(x.shape)}"
        )
    return context.get_world_size(ParallelMode.SEQUENCE)


def split_sequence_activation(x: torch.Tensor, context: ParallelContext) -> torch.Tensor:
    """``[b, s, ...]`` -> ``[b, s/N, ...]`` (chunk ``r``); the backward all-gathers."""
    world = _check(x, context, "split_activation")
    check_divisible(x.shape[1], world, f"dim 1 (sequence) of {list(x.shape)}")
    return split_along_dim(x, 1, context.get_group(ParallelMode.SEQUENCE))


def gather_sequence_activation(x: torch.Tensor, context: ParallelContext) -> torch.Tensor:
    """``[b, s/N, ...]`` -> ``[b, s, ...]`` on every rank; the backward keeps chunk ``r``."""
    _check(x, context, "gather_activation")
    return gather_along_dim(x, 1, context.get_group(ParallelMode.SEQUENCE))


class SequenceAccuracy(ParallelModule):
    """The number of correct predictions over the whole sequence from local logits.

    Logits ``[b, s/N, C]``, targets ``[b, s/N]`` (``split_batch``); the local count is summed
    over SEQUENCE, so every rank returns the count of the whole batch (like ``SerialAccuracy``).
    """

    def __init__(self, *, context: ParallelContext | None = None) -> None:
        super().__init__(context)
        self.group = self.context.get_group(ParallelMode.SEQUENCE)
        self.world = self.context.get_world_size(ParallelMode.SEQUENCE)

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """See the class docstring for shapes."""
        with torch.no_grad():
            count = (logits.argmax(dim=-1) == target).sum()
            if self.world > 1:
                dist.all_reduce(count, group=self.group)
            return count
