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

from ..comm.collectives import check_divisible
from ..comm.ops import reduce_scatter_along_dim
from ..grid.embedding import GridEmbedding, GridTable
from ..shared.tables import TableLayout
from .layout import LAYOUT_ATTR, CubeModule, ids_in_layout_y

__all__ = ["Embedding3D", "VocabParallelEmbedding3D"]


class Embedding3D(GridEmbedding, CubeModule):
    """Embedding with the embedding dim split over INPUT x WEIGHT: weight ``[V, D/q^2]``.

    Input ids ``[b/q^2, s]`` (``split_batch``; or marked ``"z"``, see :func:`ids_in_layout_y`);
    output ``[b/q^2, s, D/q]`` in layout ``"y"``. Arguments and implementation:
    :class:`~tessera.layers.grid.embedding.GridEmbedding`'s.
    """

    #: A position table converted by ``parallelize``: the model's boundary hands out
    #: per-sample position ids in layout ``"z"``'s rows, marked.
    reads_positions: bool = False
    #: Set by the boundary for the forward it starts: marked ids were handed out. Ids that
    #: then arrive unmarked were changed on the way (a view, an offset), and whose rows they
    #: hold can no longer be told: an error, not a guess.
    expects_marked_ids: bool = False

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """See the class docstring for shapes."""
        expected, self.expects_marked_ids = self.expects_marked_ids, False
        if expected and getattr(ids, LAYOUT_ATTR, None) != "z":
            raise ValueError(
                f"{self.owner}: the model changed the per-sample position_ids on their way "
                "to its position table (a new tensor: a view or an offset), so under tensor "
                "mode '3d' their rows (layout 'z', where attention runs) can no longer be "
                "swapped to the table's layout 'y'; pass one row of position_ids [1, s]"
            )
        return super().forward(ids_in_layout_y(ids, self.cube))


class VocabParallelEmbedding3D(GridTable, CubeModule):
    """Embedding with the vocabulary split over INPUT x WEIGHT: weight ``[V/q^2, D]``.

    Input ids ``[b/q^2, s]`` (``split_batch``, or marked ``"z"``); output ``[b/q^2, s, D/q]`` in
    layout ``"y"``.

    Args: as :class:`Embedding3D`, with V divisible by ``q * q`` and D by q.
    """

    def table_layout(self, num_embeddings: int, embedding_dim: int) -> TableLayout:
        """V over INPUT x WEIGHT: ``[V/q^2, D]``, block ``y * q + x``; replicated over OUTPUT."""
        cube = self.cube
        check_divisible(num_embeddings, cube.q * cube.q, f"{self.owner} num_embeddings (q * q)")
        check_divisible(embedding_dim, cube.q, f"{self.owner} embedding_dim")
        return {0: cube.table_modes}, cube.table_replicated

    def vocab_block(self) -> tuple[int, int]:
        """Vocabulary block ``y`` (the INPUT rank) of ``q``, once gathered over WEIGHT."""
        return self.cube.input.rank, self.cube.q

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """See the class docstring for shapes."""
        ids = ids_in_layout_y(ids, self.cube)
        self.check_batch_block(ids)
        weight = self.gather_table(self.weight, 0)  # [V/q, D]: vocabulary block y
        out = self.lookup_own_rows(ids, weight)  # [b/q^2, s, D], partial
        return reduce_scatter_along_dim(out, -1, self.cube.input.group)  # [b/q^2, s, D/q]
