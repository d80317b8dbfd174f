"""3D patch embedding: ViT's patchify, every parameter split along E like ``Embedding3D``.

Images arrive split like the batch of layout ``"y"`` (``[b/q^2, C, H, W]``, use
``split_batch``); every parameter's embedding dim ``E`` is split into ``q^2`` blocks over
INPUT x WEIGHT and all-gathered over WEIGHT into block ``y`` (backward: reduce-scatter over
WEIGHT, and a sum over OUTPUT, whose ranks saw other images), so the output is
``[b/q^2, N+1, E/q]`` in layout ``"y"``. The images are replicated over INPUT, so their
gradient (each rank's covers its embedding block) is summed over INPUT. The implementation
is shared with 2D (:mod:`tessera.layers.grid.embedding`).
"""

from __future__ import annotations

from ..grid.embedding import GridPatchEmbedding
from .layout import CubeModule

__all__ = ["PatchEmbedding3D"]


class PatchEmbedding3D(GridPatchEmbedding, CubeModule):
    """Patch embedding with E split over INPUT x WEIGHT (``E/q^2`` per rank).

    Parameters (full shapes as :class:`SerialPatchEmbedding`): ``weight [E, C, P, P]``,
    ``bias [E]``, ``cls_token [1, 1, E]``, ``pos_embed [1, N+1, E]``. Input
    ``[b/q^2, C, H, W]``; output ``[b/q^2, N+1, E/q]``. Arguments and implementation:
    :class:`~tessera.layers.grid.embedding.GridPatchEmbedding`'s.
    """
