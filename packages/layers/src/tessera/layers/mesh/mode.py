"""Tensor modes '2d' and '2.5d' as tessera-layers sees them (``ModeLayers``).

Both split an activation's batch over the mesh's batch group (``depth * q`` blocks; depth 1
for 2D) and its hidden dim over the mesh row (``q`` blocks), see layout.py; one pair of maps,
parametrized by the mesh, serves both. Their classes differ only in which mesh they read.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from tessera.context import Mode2D, Mode2p5D, ParallelContext

from ..grid.mode_layers import grid_mode_layers
from ..shared.mode_layers import ModeLayers, register_mode_layers
from .classifier import (
    Classifier2D,
    Classifier2p5D,
    VocabParallelClassifier2D,
    VocabParallelClassifier2p5D,
)
from .dropout import Dropout2D, Dropout2p5D
from .embedding import (
    Embedding2D,
    Embedding2p5D,
    VocabParallelEmbedding2D,
    VocabParallelEmbedding2p5D,
)
from .layout import (
    Mesh,
    gather_mesh_activation,
    mesh_of,
    split_mesh_activation,
    split_mesh_batch,
)
from .linear import Linear2D, Linear2p5D
from .loss import (
    Accuracy2D,
    Accuracy2p5D,
    CrossEntropyLoss2D,
    CrossEntropyLoss2p5D,
    VocabParallelAccuracy2D,
    VocabParallelAccuracy2p5D,
    VocabParallelCrossEntropyLoss2D,
    VocabParallelCrossEntropyLoss2p5D,
)
from .norm import LayerNorm2D, LayerNorm2p5D, RMSNorm2D, RMSNorm2p5D
from .patch_embedding import PatchEmbedding2D, PatchEmbedding2p5D
from .roles import MeshRoles

__all__ = ["LAYERS_2D", "LAYERS_2P5D"]


def _mesh(context: ParallelContext) -> Mesh:
    return mesh_of(context, str(context.config.tensor_mode))


def _mesh_layers(name: str, classes: Mapping[str, type[nn.Module]]) -> ModeLayers:
    cut = (split_mesh_activation, gather_mesh_activation, split_mesh_batch)
    return grid_mode_layers(name, _mesh, cut, classes=classes, roles=MeshRoles(classes["Linear"]))


LAYERS_2D = _mesh_layers(
    Mode2D.name,
    {
        "Linear": Linear2D,
        "LayerNorm": LayerNorm2D,
        "RMSNorm": RMSNorm2D,
        "Embedding": Embedding2D,
        "VocabParallelEmbedding": VocabParallelEmbedding2D,
        "PatchEmbedding": PatchEmbedding2D,
        "Classifier": Classifier2D,
        "VocabParallelClassifier": VocabParallelClassifier2D,
        "Dropout": Dropout2D,
        "CrossEntropyLoss": CrossEntropyLoss2D,
        "VocabParallelCrossEntropyLoss": VocabParallelCrossEntropyLoss2D,
        "Accuracy": Accuracy2D,
        "VocabParallelAccuracy": VocabParallelAccuracy2D,
    },
)
LAYERS_2P5D = _mesh_layers(
    Mode2p5D.name,
    {
        "Linear": Linear2p5D,
        "LayerNorm": LayerNorm2p5D,
        "RMSNorm": RMSNorm2p5D,
        "Embedding": Embedding2p5D,
        "VocabParallelEmbedding": VocabParallelEmbedding2p5D,
        "PatchEmbedding": PatchEmbedding2p5D,
        "Classifier": Classifier2p5D,
        "VocabParallelClassifier": VocabParallelClassifier2p5D,
        "Dropout": Dropout2p5D,
        "CrossEntropyLoss": CrossEntropyLoss2p5D,
        "VocabParallelCrossEntropyLoss": VocabParallelCrossEntropyLoss2p5D,
        "Accuracy": Accuracy2p5D,
        "VocabParallelAccuracy": VocabParallelAccuracy2p5D,
    },
)
register_mode_layers(LAYERS_2D)
register_mode_layers(LAYERS_2P5D)
