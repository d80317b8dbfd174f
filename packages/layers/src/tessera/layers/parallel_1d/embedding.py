"""1D embeddings: split along the embedding dim, or along the vocabulary (Megatron-LM).

``Embedding1D`` keeps columns ``[V, D/p]`` of the table and all-gathers the looked-up vectors;
``VocabParallelEmbedding1D`` keeps rows ``[V/p, D]`` (Shoeybi et al. 2019, section 3: the
vocabulary is the large dim of a language model's table), looks up only the ids it owns and
all-reduces. Both keep torch's ``[num_embeddings, embedding_dim]`` layout.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tessera.context import ParallelContext

from ..comm.collectives import check_divisible
from ..comm.ops import all_to_all, gather_along_dim, reduce_from_group, reduce_scatter_along_dim
from ..shared.base import Module1D
from ..shared.initializers import Initializer
from ..shared.tables import EmbeddingTable, TableLayout, check_padding_idx, zero_row

__all__ = ["Embedding1D", "VocabParallelEmbedding1D", "check_padding_idx", "zero_row"]


class Table1D(EmbeddingTable, Module1D):
    """The constructor :class:`Embedding1D` and :class:`VocabParallelEmbedding1D` share.

    Both take the same arguments and make the table the same way
    (:meth:`~tessera.layers.shared.tables.EmbeddingTable.make_table`); each says in
    ``table_layout`` which dim of ``[V, D]`` the 1D group splits. Arguments: as
    :class:`Embedding1D`.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: int | None = None,
        dtype: torch.dtype | None = None,
        weight_initializer: Initializer | None = None,
        *,
        sequence_parallel: bool = False,
        device: torch.device | str | None = None,
        context: ParallelContext | None = None,
    ) -> None:
        super().__init__(sequence_parallel=sequence_parallel, context=context, device=device)
        self.make_table(num_embeddings, embedding_dim, padding_idx, dtype, weight_initializer)


class Embedding1D(Table1D):
    """Embedding table split along the embedding dim: weight ``[V, D/p]``.

    Input ids ``[b, s]`` replicated; output ``[b, s, D]`` replicated, or ``[b, s/p, D]`` with
    sequence parallelism (one all-to-all turns the hidden split into a sequence split).

    Args:
        num_embeddings: Vocabulary size V.
        embedding_dim: D, divisible by the 1D size.
        padding_idx: Row that gets no gradient (zeroed at init), as in torch.
        dtype: Parameter dtype.
        weight_initializer: Fills the full ``[V, D]`` table (default Normal(0, 1), torch's).
        sequence_parallel: Return the sequence split along dim 1.
        device: Parameter device (default the context's).
        context: The ParallelContext (default the current one).
    """

    def table_layout(self, num_embeddings: int, embedding_dim: int) -> TableLayout:
        """D over the 1D group: ``[V, D/p]``."""
        check_divisible(embedding_dim, self.tp.world_size, "Embedding1D embedding_dim")
        return {1: (self.split_mode,)}, ()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """See the class docstring for shapes."""
        out = F.embedding(ids, self.weight, self.padding_idx)  # [b, s, D/p]
        if self.sequence_parallel:
            return all_to_all(out, self.SEQUENCE_DIM, -1, self.tp.group)  # [b, s/p, D]
        return gather_along_dim(out, -1, self.tp.group)  # [b, s, D]


class VocabParallelEmbedding1D(Table1D):
    """Embedding table split along the vocabulary: weight ``[V/p, D]``.

    Each rank looks up the ids in its range ``[r*V/p, (r+1)*V/p)``, writes zeros for the
    others, and the partial results are summed (all-reduce; reduce-scatter along the sequence
    with sequence parallelism). Input ids ``[b, s]`` replicated; output ``[b, s, D]``.

    Args: as :class:`Embedding1D`, with ``num_embeddings`` divisible by the 1D size.
    """

    def table_layout(self, num_embeddings: int, embedding_dim: int) -> TableLayout:
        """V over the 1D group: ``[V/p, D]``."""
        check_divisible(
            num_embeddings, self.tp.world_size, "VocabParallelEmbedding1D num_embeddings"
        )
        return {0: (self.split_mode,)}, ()

    def vocab_block(self) -> tuple[int, int]:
        """Block ``r`` of ``p``: the rows ``[r*V/p, (r+1)*V/p)``."""
        return self.tp.rank, self.tp.world_size

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """See the class docstring for shapes."""
        out = self.lookup_own_rows(ids, self.weight)  # [b, s, D], partial
        if self.sequence_parallel:
            return reduce_scatter_along_dim(out, self.SEQUENCE_DIM, self.tp.group)  # [b, s/p, D]
        return reduce_from_group(out, self.tp.group)
