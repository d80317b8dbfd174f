"""3D embeddings: the table split over the INPUT x WEIGHT face, the output in layout ``"y"``.

Token ids arrive split like the batch of layout ``"y"`` (``[b/q^2, s]``, block ``z q + x``,
use ``split_batch``); the output is ``[b/q^2, s, D/q]`` with embedding block ``y``. Both
tables are replicated over the OUTPUT axis (whose ranks hold other batch blocks), so their
gradients are summed over it (``copy_to_group``). Bian et al. 2021 keep every weight on one
face of the cube in the same way.

* ``Embedding3D`` splits the embedding dim into ``q^2`` blocks (block ``y q + x``:
  ``[V, D/q^2]``); the forward all-gathers them over WEIGHT into ``[V, D/q]`` (block ``y``)
  and looks up the local ids; the backward reduce-scatters the table gradient over WEIGHT.
* ``VocabParallelEmbedding3D`` splits the vocabulary into ``q^2`` blocks (``[V/q^2, D]``),
  all-gathers them over WEIGHT into vocabulary block ``y`` ``[V/q, D]``, looks up the local
  ids it owns and reduce-scatters the partial vectors over INPUT along the embedding dim
  (Megatron-LM's vocabulary-parallel lookup along the INPUT axis): each rank gets the sum
  over vocabulary blocks, for its embedding block ``y``.

The two tables are split exactly like the weights of ``Classifier3D`` and
``VocabParallelClassifier3D``, so a language-model head can share them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tessera.context import ParallelContext

from .collectives import check_divisible
from .comm import reduce_scatter_along_dim
from .cube import CubeModule
from .embedding_1d import check_padding_idx, zero_row
from .initializers import Initializer, normal

__all__ = ["Embedding3D", "VocabParallelEmbedding3D"]


class Embedding3D(CubeModule):
    """Embedding with the embedding dim split over INPUT x WEIGHT: weight ``[V, D/q^2]``.

    Input ids ``[b/q^2, s]`` (``split_batch``); output ``[b/q^2, s, D/q]`` in layout ``"y"``.

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
        cube = self.cube
        check_divisible(embedding_dim, cube.q * cube.q, f"{self.owner} embedding_dim (q * q)")
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padding_idx = check_padding_idx(padding_idx, num_embeddings)
        self.weight = self.make_parameter(
            "weight",
            (num_embeddings, embedding_dim),
            zero_row(weight_initializer or normal(), self.padding_idx),
            fan_in=num_embeddings,
            fan_out=embedding_dim,
            splits={1: (cube.input.mode, cube.weight.mode)},
            replicated=(cube.output.mode,),
            dtype=dtype,
        )  # [V, D/q^2]: block y * q + x

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """See the class docstring for shapes."""
        weight = self.gather_table(self.weight, 1)  # [V, D/q]: block y
        return F.embedding(ids, weight, self.padding_idx)  # [b/q^2, s, D/q]

    def extra_repr(self) -> str:
        """The summary shown by ``print(module)``."""
        return f"{self.num_embeddings}, {self.embedding_dim}, " + super().extra_repr()


class VocabParallelEmbedding3D(CubeModule):
    """Embedding with the vocabulary split over INPUT x WEIGHT: weight ``[V/q^2, D]``.

    Input ids ``[b/q^2, s]`` (``split_batch``); output ``[b/q^2, s, D/q]`` in layout ``"y"``.

    Args: as :class:`Embedding3D`, with V divisible by ``q * q`` and D by q.
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
        cube = self.cube
        check_divisible(num_embeddings, cube.q * cube.q, f"{self.owner} num_embeddings (q * q)")
        check_divisible(embedding_dim, cube.q, f"{self.owner} embedding_dim")
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padding_idx = check_padding_idx(padding_idx, num_embeddings)
        per_block = num_embeddings // cube.q
        self.vocab_start = cube.input.rank * per_block
        self.vocab_end = self.vocab_start + per_block
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
            splits={0: (cube.input.mode, cube.weight.mode)},
            replicated=(cube.output.mode,),
            dtype=dtype,
        )  # [V/q^2, D]: block y * q + x

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """See the class docstring for shapes."""
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        weight = self.gather_table(self.weight, 0)  # [V/q, D]: vocabulary block y
        out = F.embedding(local, weight, self.local_padding_idx)  # [b/q^2, s, D], partial
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_scatter_along_dim(out, -1, self.cube.input.group)  # [b/q^2, s, D/q]

    def extra_repr(self) -> str:
        """The summary shown by ``print(module)``."""
        return f"{self.num_embeddings}, {self.embedding_dim}, " + super().extra_repr()
