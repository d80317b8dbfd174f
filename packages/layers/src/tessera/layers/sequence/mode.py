"""Tensor mode 'sequence' as tessera-layers sees it (``ModeLayers``): its activation maps.

Every activation, token id and target is split along dim 1 (the sequence) over SEQUENCE:
chunk ``r`` of ``[b, s/N, ...]`` on rank ``r`` (Li et al. 2021, "Sequence Parallelism").
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tessera.context import ModeSequence, ParallelContext, ParallelMode

from ..comm.ops import gather_along_dim
from ..shared.mode_layers import ModeLayers, check_targets, register_mode_layers
from .replicated import (
    TOKENS_BEFORE_PADDING,
    gather_sequence_activation,
    split_sequence_activation,
)

__all__ = ["LAYERS_SEQUENCE"]


def _token_loss(
    logits: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int,
    reduction: str,
    context: ParallelContext,
    vocab_size: int | None,
) -> torch.Tensor:
    """The whole batch's mean token loss, from this rank's chunk of the sequence.

    An image classifier's logits ``[b, C]`` are whole on every rank (it read the gathered
    class token): torch's loss of the whole batch. So are logits ``[b, s, V]`` as long as the
    targets, which the boundary did not split (a head run whole after a part converted alone
    gathered its hidden states: ``BertLMHeadModel``'s; a chunk is shorter than the sequence).
    Otherwise the value returned is the global
    mean on every rank; its gradient is ``N`` times this rank's share of it, the convention of
    the engine's sequence-parallel handler (``average="sequence_dp"`` divides the summed
    gradients by N). Only ``"mean"``: the mean already spans the ranks' tokens.
    """
    tokens = getattr(logits, TOKENS_BEFORE_PADDING, None)  # the boundary padded them
    whole = logits.dim() == 2 or (  # one class per sample, or every token's logits
        tokens is None and targets.dim() >= 2 and logits.shape[1] == targets.shape[1]
    )
    padded = logits.shape[1] * context.get_world_size(ParallelMode.SEQUENCE)
    if not whole and targets.dim() == 2 and targets.shape[1] == tokens and tokens < padded:
        # the padding of a sequence the ranks do not divide predicts nothing
        targets = F.pad(targets, (0, padded - tokens), value=ignore_index)
    local = targets if whole else split_sequence_activation(targets, context)
    check_targets(logits, local, ModeSequence.name)
    flat_logits, flat_targets = logits.reshape(-1, logits.shape[-1]), local.reshape(-1)
    if whole:
        return F.cross_entropy(
            flat_logits, flat_targets, ignore_index=ignore_index, reduction=reduction
        )
    group = context.get_group(ParallelMode.SEQUENCE)
    world = context.get_world_size(ParallelMode.SEQUENCE)
    local_sum = F.cross_entropy(
        flat_logits, flat_targets, ignore_index=ignore_index, reduction="sum"
    )
    totals = torch.stack([local_sum.detach(), (local != ignore_index).sum().to(local_sum)])
    dist.all_reduce(totals, group=group)
    share = local_sum * world / totals[1]  # gradient: N x this rank's part of the mean
    return share + (totals[0] / totals[1] - share).detach()  # value: the global mean


def _gather_logits(logits: torch.Tensor, context: ParallelContext) -> torch.Tensor:
    if logits.dim() == 2:
        return logits  # [b, C]: an image classifier's, whole on every rank
    whole = gather_along_dim(logits, 1, context.get_group(ParallelMode.SEQUENCE))
    tokens = getattr(logits, TOKENS_BEFORE_PADDING, None)  # the boundary's padding, stripped
    return whole if tokens is None else whole[:, :tokens]


#: The sequence mode's activation maps and loss; its builders are dispatch/cube_sequence.py's.
LAYERS_SEQUENCE = ModeLayers(
    name=ModeSequence.name,
    split=split_sequence_activation,
    gather=gather_sequence_activation,
    split_batch=split_sequence_activation,
    token_loss=_token_loss,
    gather_logits=_gather_logits,
    # [b, s/p, h]; tokens flattened ([b * s/p, h], experts' rows): their dim 0
    activation_cuts=lambda context, ndim: {int(ndim > 2): (ParallelMode.SEQUENCE.value,)},
    logits_cuts=lambda context, ndim: {1: (ParallelMode.SEQUENCE.value,)} if ndim > 2 else {},
)
register_mode_layers(LAYERS_SEQUENCE)
