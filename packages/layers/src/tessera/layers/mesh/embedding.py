"""2D and 2.5D embeddings: the table split in two dims, the output in activation layout.

Token ids arrive split like the batch of an activation (``[b/(depth q), s]``, use
``split_batch``), the output is ``[b/(depth q), s, D/q]``.

* ``Embedding2D`` splits the embedding dim into ``q * q`` blocks (block ``j * q + i`` on rank
  ``(i, j, k)``: ``[V, D/q^2]``); the forward all-gathers the blocks of the mesh column over
  COL into ``[V, D/q]`` (block ``j``) and looks up the local ids; the backward reduce-scatters
  the table gradient (each row of the mesh saw other tokens).
* ``VocabParallelEmbedding2D`` splits the vocabulary over COL and the embedding dim over ROW
  (``W[V_i, D_j]``, ``[V/q, D/q]``): the ids of the mesh column are all-gathered (integers,
  ``[b/depth, s]``), each rank looks up those in its vocabulary range and the partial vectors
  are reduce-scattered back to the batch blocks over COL (Xu et al. 2021 split the vocabulary
  of the output embedding the same way; Megatron-LM's vocabulary-parallel lookup along one
  axis of the mesh).

In 2.5D both tables are replicated over depth and their gradients summed over DEP.
"""

from __future__ import annotations

import torch

from ..comm.collectives import all_gather_along, check_divisible
from ..comm.ops import reduce_scatter_along_dim
from ..grid.embedding import GridEmbedding, GridTable
from ..shared.tables import TableLayout
from .layout import MeshModule

__all__ = [
    "Embedding2D",
    "Embedding2p5D",
    "MeshEmbedding",
    "MeshVocabParallelEmbedding",
    "VocabParallelEmbedding2D",
    "VocabParallelEmbedding2p5D",
]


class MeshEmbedding(GridEmbedding, MeshModule):
    """Embedding with the embedding dim split over the mesh: weight ``[V, D/q^2]``.

    Input ids ``[b/(depth q), s]``; output ``[b/(depth q), s, D/q]``. Arguments and
    implementation: :class:`~tessera.layers.grid.embedding.GridEmbedding`'s.
    """

    DEPTH_SUMMED = ("weight",)  # gathered through Mesh.over_depth


class MeshVocabParallelEmbedding(GridTable, MeshModule):
    """Embedding with the vocabulary split over COL and the dim over ROW: ``[V/q, D/q]``.

    Input ids ``[b/(depth q), s]``; output ``[b/(depth q), s, D/q]``.

    Args: as :class:`MeshEmbedding`, with V and D divisible by q.
    """

    DEPTH_SUMMED = ("weight",)  # looked up through Mesh.over_depth

    def table_layout(self, num_embeddings: int, embedding_dim: int) -> TableLayout:
        """V over COL, D over ROW: ``[V/q, D/q]``, ``W[V_i, D_j]``; replicated over depth."""
        mesh = self.mesh
        check_divisible(num_embeddings, mesh.q, f"{self.owner} num_embeddings")
        check_divisible(embedding_dim, mesh.q, f"{self.owner} embedding_dim")
        return {0: (mesh.col.mode,), 1: (mesh.row.mode,)}, mesh.depth_modes

    def vocab_block(self) -> tuple[int, int]:
        """Vocabulary block ``i`` (the COL rank) of ``q``."""
        return self.mesh.col.rank, self.mesh.q

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """See the class docstring for shapes."""
        mesh = self.mesh
        if ids.dim() == 0:
            raise ValueError(f"{self.owner}: ids must be [batch, ...], got a scalar")
        self.check_batch_block(ids)
        col = mesh.col
        column_ids = all_gather_along(ids, 0, col.group, col.world_size)  # [b/d, s]
        out = self.lookup_own_rows(column_ids, mesh.over_depth(self.weight))  # [b/d, s, D/q]
        return reduce_scatter_along_dim(out, 0, col.group)  # [b/(dq), s, D/q]


class Embedding2D(MeshEmbedding):
    """2D embedding split along the embedding dim; see :class:`MeshEmbedding`."""

    MESH = "2d"


class Embedding2p5D(MeshEmbedding):
    """2.5D embedding split along the embedding dim; see :class:`MeshEmbedding`."""

    MESH = "2.5d"


class VocabParallelEmbedding2D(MeshVocabParallelEmbedding):
    """2D vocabulary-parallel embedding; see :class:`MeshVocabParallelEmbedding`."""

    MESH = "2d"


class VocabParallelEmbedding2p5D(MeshVocabParallelEmbedding):
    """2.5D vocabulary-parallel embedding; see :class:`MeshVocabParallelEmbedding`."""

    MESH = "2.5d"
