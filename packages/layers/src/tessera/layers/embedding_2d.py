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
import torch.nn.functional as F

from tessera.context import ParallelContext

from .collectives import all_gather_along, check_divisible
from .comm import gather_along_dim, reduce_scatter_along_dim
from .embedding_1d import check_padding_idx, zero_row
from .initializers import Initializer, normal
from .mesh import MeshModule

__all__ = [
    "Embedding2D",
    "Embedding2p5D",
    "MeshEmbedding",
    "MeshVocabParallelEmbedding",
    "VocabParallelEmbedding2D",
    "VocabParallelEmbedding2p5D",
]


class MeshEmbedding(MeshModule):
    """Embedding with the embedding dim split over the mesh: weight ``[V, D/q^2]``.

    Input ids ``[b/(depth q), s]``; output ``[b/(depth q), s, D/q]``.

    Args:
        num_embeddings: Vocabulary size V.
        embedding_dim: D, divisible by ``q * q``.
        padding_idx: Row that gets no gradient (zeroed at init), as in torch.
        dtype: Parameter dtype.
        weight_initializer: Fills the full ``[V, D]`` table (default Normal(0, 1), torch's).
        device: Parameter device (default the context's).
        context: The ParallelContext (default the current one).
    """

    takes_indices = True

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: int | None = None,
        dtype: torch.dtype | None = None,
        weight_initializer: Initializer | None = None,
        *,
        device: torch.device | str | None = None,
        context: ParallelContext | None = None,
    ) -> None:
        super().__init__(context, device)
        mesh = self.mesh
        check_divisible(embedding_dim, mesh.q * mesh.q, f"{self.owner} embedding_dim (q * q)")
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padding_idx = check_padding_idx(padding_idx, num_embeddings)
        self.weight = self.make_parameter(
            "weight",
            (num_embeddings, embedding_dim),
            zero_row(weight_initializer or normal(), self.padding_idx),
            fan_in=num_embeddings,
            fan_out=embedding_dim,
            splits={1: (mesh.row.mode, mesh.col.mode)},
            replicated=mesh.depth_modes,
            dtype=dtype,
        )  # [V, D/q^2]: block j * q + i

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """See the class docstring for shapes."""
        mesh = self.mesh
        weight = mesh.over_depth(self.weight)
        weight = gather_along_dim(weight, 1, mesh.col.group, partial_grad=True)  # [V, D/q]
        return F.embedding(ids, weight, self.padding_idx)  # [b/(dq), s, D/q]

    def extra_repr(self) -> str:
        """The summary shown by ``print(module)``."""
        return f"{self.num_embeddings}, {self.embedding_dim}, " + super().extra_repr()


class MeshVocabParallelEmbedding(MeshModule):
    """Embedding with the vocabulary split over COL and the dim over ROW: ``[V/q, D/q]``.

    Input ids ``[b/(depth q), s]``; output ``[b/(depth q), s, D/q]``.

    Args: as :class:`MeshEmbedding`, with V and D divisible by q.
    """

    takes_indices = True

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: int | None = None,
        dtype: torch.dtype | None = None,
        weight_initializer: Initializer | None = None,
        *,
        device: torch.device | str | None = None,
        context: ParallelContext | None = None,
    ) -> None:
        super().__init__(context, device)
        mesh = self.mesh
        check_divisible(num_embeddings, mesh.q, f"{self.owner} num_embeddings")
        check_divisible(embedding_dim, mesh.q, f"{self.owner} embedding_dim")
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padding_idx = check_padding_idx(padding_idx, num_embeddings)
        per_rank = num_embeddings // mesh.q
        self.vocab_start = mesh.col.rank * per_rank
        self.vocab_end = self.vocab_start + per_rank
        self.local_padding_idx = (
            self.padding_idx - self.vocab_start
            if self.padding_idx is not None
            and self.vocab_start <= self.padding_idx < self.vocab_end
            else None
        )
        self.weight = self.make_parameter(
            "weight",
            (num_embeddings, embedding_dim),
            zero_row(weight_initializer or normal(), self.padding_idx),
            fan_in=num_embeddings,
            fan_out=embedding_dim,
            splits={0: (mesh.col.mode,), 1: (mesh.row.mode,)},
            replicated=mesh.depth_modes,
            dtype=dtype,
        )  # [V/q, D/q]: W[V_i, D_j]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """See the class docstring for shapes."""
        mesh = self.mesh
        if ids.dim() == 0:
            raise ValueError(f"{self.owner}: ids must be [batch, ...], got a scalar")
        col = mesh.col
        column_ids = all_gather_along(ids, 0, col.group, col.world_size)  # [b/d, s]
        outside = (column_ids < self.vocab_start) | (column_ids >= self.vocab_end)
        local = (column_ids - self.vocab_start).masked_fill(outside, 0)
        weight = mesh.over_depth(self.weight)
        out = F.embedding(local, weight, self.local_padding_idx)  # [b/d, s, D/q], partial
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_scatter_along_dim(out, 0, col.group)  # [b/(dq), s, D/q]

    def extra_repr(self) -> str:
        """The summary shown by ``print(module)``."""
        return f"{self.num_embeddings}, {self.embedding_dim}, " + super().extra_repr()


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
