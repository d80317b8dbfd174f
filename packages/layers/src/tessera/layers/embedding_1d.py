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

from .base import Module1D
from .collectives import check_divisible
from .comm import all_to_all, gather_along_dim, reduce_from_group, reduce_scatter_along_dim
from .initializers import Initializer, normal

__all__ = ["Embedding1D", "VocabParallelEmbedding1D", "check_padding_idx", "zero_row"]


def zero_row(initializer: Initializer, row: int | None) -> Initializer:
    """``initializer`` followed by zeroing ``row`` (torch zeroes the padding row at init)."""
    if row is None:
        return initializer

    def init(t: torch.Tensor, fan_in: int, fan_out: int) -> None:
        initializer(t, fan_in, fan_out)
        t[row].zero_()

    return init


def check_padding_idx(padding_idx: int | None, num_embeddings: int) -> int | None:
    """``padding_idx`` as a non-negative row index (``ValueError`` outside the table)."""
    if padding_idx is None:
        return None
    if not -num_embeddings <= padding_idx < num_embeddings:
        raise ValueError(f"padding_idx {padding_idx} is outside [0, {num_embeddings})")
    return padding_idx % num_embeddings


class Embedding1D(Module1D):
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

    takes_indices = True

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
        check_divisible(embedding_dim, self.tp.world_size, "Embedding1D embedding_dim")
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padding_idx = check_padding_idx(padding_idx, num_embeddings)
        self.weight = self.make_parameter(
            "weight",
            (num_embeddings, embedding_dim),
            zero_row(weight_initializer or normal(), self.padding_idx),
            fan_in=num_embeddings,
            fan_out=embedding_dim,
            splits={1: (self.split_mode,)},
            dtype=dtype,
        )  # [V, D/p]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """See the class docstring for shapes."""
        out = F.embedding(ids, self.weight, self.padding_idx)  # [b, s, D/p]
        if self.sequence_parallel:
            return all_to_all(out, self.SEQUENCE_DIM, -1, self.tp.group)  # [b, s/p, D]
        return gather_along_dim(out, -1, self.tp.group)  # [b, s, D]

    def extra_repr(self) -> str:
        """The summary shown by ``print(module)``."""
        return f"{self.num_embeddings}, {self.embedding_dim}, " + super().extra_repr()


class VocabParallelEmbedding1D(Module1D):
    """Embedding table split along the vocabulary: weight ``[V/p, D]``.

    Each rank looks up the ids in its range ``[r*V/p, (r+1)*V/p)``, writes zeros for the
    others, and the partial results are summed (all-reduce; reduce-scatter along the sequence
    with sequence parallelism). Input ids ``[b, s]`` replicated; output ``[b, s, D]``.

    Args: as :class:`Embedding1D`, with ``num_embeddings`` divisible by the 1D size.
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
        sequence_parallel: bool = False,
        device: torch.device | str | None = None,
        context: ParallelContext | None = None,
    ) -> None:
        super().__init__(sequence_parallel=sequence_parallel, context=context, device=device)
        check_divisible(
            num_embeddings, self.tp.world_size, "VocabParallelEmbedding1D num_embeddings"
        )
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padding_idx = check_padding_idx(padding_idx, num_embeddings)
        per_rank = num_embeddings // self.tp.world_size
        self.vocab_start = self.tp.rank * per_rank
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
            splits={0: (self.split_mode,)},
            dtype=dtype,
        )  # [V/p, D]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """See the class docstring for shapes."""
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)  # [b, s]
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight, self.local_padding_idx)  # [b, s, D]
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_along_dim(out, self.SEQUENCE_DIM, self.tp.group)  # [b, s/p, D]
        return reduce_from_group(out, self.tp.group)

    def extra_repr(self) -> str:
        """The summary shown by ``print(module)``."""
        return f"{self.num_embeddings}, {self.embedding_dim}, " + super().extra_repr()
