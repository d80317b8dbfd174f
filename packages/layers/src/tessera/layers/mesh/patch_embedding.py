"""2D and 2.5D patch embedding (ViT): the embedding dim split into ``q * q`` blocks.

Images arrive split along the batch (``[b/(depth q), C, H, W]``, use ``split_batch``). Every
parameter is split along E into ``q * q`` blocks (block ``j * q + i`` on rank ``(i, j, k)``),
all-gathered over COL into block ``j`` of E (``[E/q, ...]``) in the forward and
reduce-scattered in the backward, as :class:`MeshEmbedding` does with its table; the output
``[b/(depth q), N+1, E/q]`` is in activation layout. The image feeds every rank of a mesh row
(each computes another slice of E), so its gradient is summed over ROW (``copy_to_group``).
The implementation is shared with 3D (:mod:`tessera.layers.grid.embedding`).
"""

from __future__ import annotations

from ..grid.embedding import GridPatchEmbedding
from .layout import MeshModule

__all__ = ["MeshPatchEmbedding", "PatchEmbedding2D", "PatchEmbedding2p5D"]


class MeshPatchEmbedding(GridPatchEmbedding, MeshModule):
    """Patch embedding with E split over the whole q x q mesh.

    Parameters (full shapes as :class:`SerialPatchEmbedding`): ``weight [E, C, P, P]``,
    ``bias [E]``, ``cls_token [1, 1, E]``, ``pos_embed [1, N+1, E]``, each ``E/q^2`` locally.
    Input ``[b/(depth q), C, H, W]``; output ``[b/(depth q), N+1, E/q]``. Arguments and
    implementation: :class:`~tessera.layers.grid.embedding.GridPatchEmbedding`'s.
    """

    DEPTH_SUMMED = ("weight", "bias", "cls_token", "pos_embed")  # all through over_depth


class PatchEmbedding2D(MeshPatchEmbedding):
    """2D ViT patch embedding; see :class:`MeshPatchEmbedding`."""

    MESH = "2d"


class PatchEmbedding2p5D(MeshPatchEmbedding):
    """2.5D ViT patch embedding; see :class:`MeshPatchEmbedding`."""

    MESH = "2.5d"
