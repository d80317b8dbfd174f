"""Tensor mode '1d' as tessera-layers sees it (``ModeLayers``): its activation maps.

Between blocks 1D keeps activations whole on every rank, so the maps are the identity;
with 1D sequence parallelism (``tensor=dict(mode='1d', sequence_parallel=True)``; Korthikanti
et al. 2022, "Reducing Activation Recomputation in Large Transformer Models") the norms and
dropouts between blocks hold ``[b, s/p, h]``, so they split / gather dim 1.
"""

from __future__ import annotations

import torch

from tessera.context import Mode1D, ParallelContext, ParallelMode

from ..comm.collectives import check_divisible
from ..comm.ops import gather_along_dim, split_along_dim
from ..shared.context_access import sequence_parallel_default
from ..shared.cross_entropy import vocab_parallel_cross_entropy
from ..shared.mode_layers import ModeLayers, check_targets, register_mode_layers
from .classifier import VocabParallelClassifier1D
from .embedding import VocabParallelEmbedding1D
from .norm import LayerNorm1D, RMSNorm1D
from .patch_embedding import PatchEmbedding1D
from .roles import Roles1D

__all__ = ["LAYERS_1D"]


def _sequence_dim(x: torch.Tensor, what: str) -> None:
    if x.dim() < 2:
        raise ValueError(
            f"{what}: 1D sequence parallelism splits dim 1 of [batch, seq, ...], but the "
            f"activation has shape {list(x.shape)}"
        )


def _split(x: torch.Tensor, context: ParallelContext) -> torch.Tensor:
    if not sequence_parallel_default(context):
        return x
    _sequence_dim(x, "split_activation")
    world = context.get_world_size(ParallelMode.PARALLEL_1D)
    check_divisible(
        x.shape[1], world, f"split_activation: dim 1 (sequence) of activation {list(x.shape)}"
    )
    return split_along_dim(x, 1, context.get_group(ParallelMode.PARALLEL_1D))


def _gather(x: torch.Tensor, context: ParallelContext) -> torch.Tensor:
    if not sequence_parallel_default(context):
        return x
    _sequence_dim(x, "gather_activation")
    return gather_along_dim(x, 1, context.get_group(ParallelMode.PARALLEL_1D))


def _whole(x: torch.Tensor, context: ParallelContext) -> torch.Tensor:
    return x


def _activation_cuts(context: ParallelContext, ndim: int) -> dict[int, tuple[str, ...]]:
    """Whole; with sequence parallelism, the sequence (dim 1) cut over the 1D group.

    Tokens flattened into rows (``[b * s/p, h]``, the rows an expert takes) are cut on dim 0.
    """
    if not sequence_parallel_default(context):
        return {}
    return {int(ndim > 2): (ParallelMode.PARALLEL_1D.value,)}


def _features_cut(context: ParallelContext, ndim: int) -> dict[int, tuple[str, ...]]:
    """A column layer's output ``[b, s, F/p]`` and the head's logits ``[b, s, V/p]``."""
    return {ndim - 1: (ParallelMode.PARALLEL_1D.value,)}


def _token_loss(
    logits: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int,
    reduction: str,
    context: ParallelContext,
    vocab_size: int | None,
) -> torch.Tensor:
    """Logits ``[b, s, V/p]`` split by vocabulary, the batch whole: Megatron-LM's loss."""
    check_targets(logits, targets, Mode1D.name)
    return vocab_parallel_cross_entropy(
        logits,
        targets,
        context.get_group(ParallelMode.PARALLEL_1D),
        ignore_index=ignore_index,
        reduction=reduction,
        vocab_size=vocab_size,
    )


def _gather_logits(logits: torch.Tensor, context: ParallelContext) -> torch.Tensor:
    return gather_along_dim(logits, -1, context.get_group(ParallelMode.PARALLEL_1D))


#: 1D's activation maps and loss; its builders are dispatch/layers.py's ``_..._1d``.
LAYERS_1D = ModeLayers(
    name=Mode1D.name,
    split=_split,
    gather=_gather,
    split_batch=_whole,
    token_loss=_token_loss,
    gather_logits=_gather_logits,
    roles=Roles1D(),
    activation_cuts=_activation_cuts,
    column_cuts=_features_cut,
    logits_cuts=_features_cut,
    classes={  # what parallelize builds (the dispatching layers' are dispatch/layers.py's)
        "TokenEmbedding": VocabParallelEmbedding1D,
        "Head": VocabParallelClassifier1D,
        "PatchEmbedding": PatchEmbedding1D,
        "LayerNorm": LayerNorm1D,
        "RMSNorm": RMSNorm1D,
    },
)
register_mode_layers(LAYERS_1D)
