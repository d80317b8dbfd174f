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
from ..grid.mode_layers import grid_mode_layers
from ..shared.mode_layers import register_mode_layers
from .classifier import Classifier3D, VocabParallelClassifier3D
from .dropout import Dropout3D
from .embedding import Embedding3D, VocabParallelEmbedding3D
from .layout import (
    cube_of,
    gather_cube_activation,
    split_cube_activation,
    split_cube_batch,
    switch_cube_layout,
)
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


def _attention_rows(x: torch.Tensor, context: ParallelContext) -> torch.Tensor:
    """Layout "z"'s rows: attention runs on a column layer's output, not on layout "y"'s."""
    rows = cube_of(context).batch("z")
    check_divisible(x.shape[0], rows.world_size, f"the rows of {list(x.shape)} under 3d")
    return x.chunk(rows.world_size, 0)[rows.rank]


def _rows_to_attention(x: torch.Tensor, context: ParallelContext) -> torch.Tensor:
    """Layout "y"'s rows of a per-sample tensor ``[b/q^2, ...]`` to layout "z"'s (a mirror swap).

    A mask the model's own code made beside its hidden states holds their rows; attention
    runs on a column layer's output, whose rows are other samples off the cube's diagonal.
    A bool mask travels as bytes.
    """
    cube = cube_of(context)
    if x.dtype == torch.bool:
        return switch_cube_layout(x.to(torch.uint8), cube, "y").bool()
    return switch_cube_layout(x, cube, "y")


def _layout_z_cuts(context: ParallelContext, ndim: int) -> dict[int, tuple[str, ...]]:
    """A column layer's output, in layout "z": rows over its batch group, features over z."""
    cube = cube_of(context)
    return {0: (cube.batch("z").mode,), ndim - 1: (cube.hidden("z").mode,)}


#: 3D's activation maps and classes (its ``Linear`` needs a layout: dispatch/cube_sequence.py).
LAYERS_3D = grid_mode_layers(
    Mode3D.name,
    cube_of,
    (split_cube_activation, gather_cube_activation, split_cube_batch),
    classes={
        "LayerNorm": LayerNorm3D,
        "RMSNorm": RMSNorm3D,
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
    roles=Roles3D(),
    attention_rows=_attention_rows,
    rows_to_attention=_rows_to_attention,
    two_layouts=True,
    column_cuts=_layout_z_cuts,
)
register_mode_layers(LAYERS_3D)
