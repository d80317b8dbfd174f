"""Tensor mode '3d' as tessera-layers sees it (``ModeLayers``): activation maps and classes.

Between blocks an activation is in layout "y": rank (x, y, z) holds batch block ``z*q + x``
and hidden block ``y``, ``[b/q^2, ..., h/q]``; a batch of ids is split by rows alone (see
layout.py). The builders shared with the mesh modes (dispatch/grid.py) take this folder's
classes from ``LAYERS_3D.classes``.
"""

from __future__ import annotations

import torch

from tessera.context import Mode3D, ParallelContext

from ..comm.collectives import check_divisible
from ..grid.loss import gather_grid_logits, grid_token_loss
from ..shared.mode_layers import ModeLayers, register_mode_layers
from .classifier import Classifier3D, VocabParallelClassifier3D
from .dropout import Dropout3D
from .embedding import Embedding3D, VocabParallelEmbedding3D
from .layout import cube_of, gather_cube_activation, split_cube_activation, split_cube_batch
from .loss import (
    Accuracy3D,
    CrossEntropyLoss3D,
    VocabParallelAccuracy3D,
    VocabParallelCrossEntropyLoss3D,
)
from .norm import LayerNorm3D, RMSNorm3D
from .patch_embedding import PatchEmbedding3D
from .roles import Roles3D

__all__ = ["LAYERS_3D"]


def _split(x: torch.Tensor, context: ParallelContext) -> torch.Tensor:
    return split_cube_activation(x, cube_of(context))


def _gather(x: torch.Tensor, context: ParallelContext) -> torch.Tensor:
    return gather_cube_activation(x, cube_of(context))


def _split_batch(x: torch.Tensor, context: ParallelContext) -> torch.Tensor:
    return split_cube_batch(x, cube_of(context))


def _activation_cuts(context: ParallelContext, ndim: int) -> dict[int, tuple[str, ...]]:
    """Layout "y": rows over OUTPUT x WEIGHT (block ``z * q + x``), features over INPUT."""
    cube = cube_of(context)
    return {0: (cube.batch_axis.mode,), ndim - 1: (cube.hidden_axis.mode,)}


def _token_loss(
    logits: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int,
    reduction: str,
    context: ParallelContext,
    vocab_size: int | None,
) -> torch.Tensor:
    """Logits ``[b/q^2, s, V]`` in layout "y": rows split, every class whole (the grid's)."""
    cube = cube_of(context)
    rows = split_cube_batch(targets, cube)
    return grid_token_loss(
        logits, rows, cube, Mode3D.name, ignore_index=ignore_index, reduction=reduction
    )


def _gather_logits(logits: torch.Tensor, context: ParallelContext) -> torch.Tensor:
    return gather_grid_logits(logits, cube_of(context))


def _attention_rows(x: torch.Tensor, context: ParallelContext) -> torch.Tensor:
    """Layout "z"'s rows: attention runs on a column layer's output, not on layout "y"'s."""
    rows = cube_of(context).batch("z")
    check_divisible(x.shape[0], rows.world_size, f"the rows of {list(x.shape)} under 3d")
    return x.chunk(rows.world_size, 0)[rows.rank]


#: 3D's activation maps and classes (its ``Linear`` needs a layout: dispatch/cube_sequence.py).
LAYERS_3D = ModeLayers(
    name=Mode3D.name,
    split=_split,
    gather=_gather,
    split_batch=_split_batch,
    classes={
        "LayerNorm": LayerNorm3D,
        "RMSNorm": RMSNorm3D,
        "TokenEmbedding": Embedding3D,
        "Head": Classifier3D,
        "Embedding": Embedding3D,
        "VocabParallelEmbedding": VocabParallelEmbedding3D,
        "PatchEmbedding": PatchEmbedding3D,
        "Classifier": Classifier3D,
        "VocabParallelClassifier": VocabParallelClassifier3D,
        "Dropout": Dropout3D,
        "CrossEntropyLoss": CrossEntropyLoss3D,
        "VocabParallelCrossEntropyLoss": VocabParallelCrossEntropyLoss3D,
        "Accuracy": Accuracy3D,
        "VocabParallelAccuracy": VocabParallelAccuracy3D,
    },
    two_layouts=True,
    attention_rows=_attention_rows,
    token_loss=_token_loss,
    gather_logits=_gather_logits,
    roles=Roles3D(),
    activation_cuts=_activation_cuts,
)
register_mode_layers(LAYERS_3D)
