"""What every parallel embedding table shares: its padding row, vocabulary range and lookup.

The 1D, 2D, 2.5D and 3D embeddings differ only in how the ``[V, D]`` table is split and how
the looked-up vectors are combined; the argument checks, torch's padding-row convention, the
range of vocabulary rows a rank owns and the masked lookup of a vocabulary-parallel table
(Shoeybi et al. 2019, section 3: zeros for the ids another rank owns, summed afterwards) are
written once here, in :class:`EmbeddingTable`, and so is the body of their constructors
(:meth:`EmbeddingTable.make_table`): a mode's table only says how it is split.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F

from tessera.context import ModeLike

from .base import ParallelModule
from .initializers import Initializer, normal

__all__ = ["EmbeddingTable", "TableLayout", "check_padding_idx", "zero_row"]

#: ``(splits, replicated)`` of a ``[V, D]`` table, as ``make_parameter`` takes them.
TableLayout = tuple[Mapping[int, Sequence[ModeLike]], Sequence[ModeLike]]


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


class EmbeddingTable(ParallelModule):
    """Mixin of the parallel embeddings (listed before their mode's base class).

    Attributes (set by :meth:`make_table`): ``num_embeddings``, ``embedding_dim``,
    ``padding_idx`` and ``weight``; vocabulary-parallel tables also ``vocab_start``,
    ``vocab_end`` and ``local_padding_idx`` (:meth:`own_vocab_rows`).
    """

    takes_indices = True

    def make_table(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: int | None,
        dtype: torch.dtype | None,
        weight_initializer: Initializer | None,
    ) -> None:
        """Check the sizes and ``padding_idx``, create ``weight``, take this rank's vocabulary.

        What every parallel embedding's constructor does once its mode's base is set up. The
        modes make the table alike (torch's Normal(0, 1) default, the padding row zeroed) and
        differ only in the split, so the mode's class answers two questions:
        :meth:`table_layout` (which sizes the split takes, and how the table is split and
        replicated) and :meth:`vocab_block` (which vocabulary rows this rank looks up).
        """
        splits, replicated = self.table_layout(num_embeddings, embedding_dim)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padding_idx = check_padding_idx(padding_idx, num_embeddings)
        self.weight = self.make_parameter(
            "weight",
            (num_embeddings, embedding_dim),
            zero_row(weight_initializer or normal(), self.padding_idx),
            fan_in=num_embeddings,
            fan_out=embedding_dim,
            splits=splits,
            replicated=replicated,
            dtype=dtype,
        )
        block = self.vocab_block()
        if block is not None:
            index, blocks = block
            self.own_vocab_rows(index, num_embeddings // blocks)

    def table_layout(self, num_embeddings: int, embedding_dim: int) -> TableLayout:
        """Check the sizes against the split (``ValueError``); the table's splits, replicas."""
        raise NotImplementedError(f"{type(self).__name__} does not say how its table is split")

    def vocab_block(self) -> tuple[int, int] | None:
        """``(block, blocks)``: this rank looks up vocabulary block ``block`` of ``blocks``.

        ``None`` (the default): the rank's table holds every row of the vocabulary.
        """
        return None

    def own_vocab_rows(self, block: int, rows: int) -> None:
        """This rank looks up vocabulary rows ``[block * rows, (block + 1) * rows)``.

        :meth:`make_table` calls it; the padding row counts only where it is owned.
        """
        self.vocab_start = block * rows
        self.vocab_end = self.vocab_start + rows
        self.local_padding_idx = (
            self.padding_idx - self.vocab_start
            if self.padding_idx is not None
            and self.vocab_start <= self.padding_idx < self.vocab_end
            else None
        )

    def lookup_own_rows(self, ids: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """``[.., D']`` vectors of the ids in this rank's range ``rows``, zeros for the others."""
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)  # [..]
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local, rows, self.local_padding_idx)  # [.., D'], partial
        return out.masked_fill(outside.unsqueeze(-1), 0.0)

    def extra_repr(self) -> str:
        """The summary shown by ``print(module)``."""
        return f"{self.num_embeddings}, {self.embedding_dim}, " + super().extra_repr()
