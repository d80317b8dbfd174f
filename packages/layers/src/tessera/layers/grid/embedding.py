"""The embeddings 2D, 2.5D and 3D share: a table split along its embedding dim over the grid.

Xu et al. 2021 (2D), Wang et al. 2021 (2.5D) and Bian et al. 2021 (3D) all leave the output
of an embedding in the activation layout between blocks: the batch split over the grid's
batch axis, the embedding dim over its hidden axis (``[b/B, ..., D/q]``). The tables that do
it are split the same way in every mode: the embedding dim in ``q * q`` blocks over the two
:attr:`~tessera.layers.grid.base.Grid.table_modes`, all-gathered over the inner one into the
hidden axis's block in the forward and reduce-scattered in the backward (each block of the
batch saw other tokens), the gradient summed over the groups replicating the table. So
:class:`GridEmbedding` and :class:`GridPatchEmbedding` are written once against
:class:`~tessera.layers.grid.base.Grid`; ``MeshEmbedding`` / ``Embedding3D`` and
``MeshPatchEmbedding`` / ``PatchEmbedding3D`` only pick the grid.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tessera.context import ParallelContext

from ..comm.collectives import check_divisible
from ..comm.ops import copy_to_group
from ..shared.initializers import Initializer
from ..shared.patches import PatchParameters
from ..shared.serial import patch_embed, patch_grid
from ..shared.tables import EmbeddingTable, TableLayout
from .base import GridModule

__all__ = ["GridEmbedding", "GridPatchEmbedding", "GridTable"]


class GridTable(EmbeddingTable, GridModule):
    """The constructor every 2D, 2.5D and 3D embedding shares, whichever dims its table splits.

    They take the same arguments and make the table the same way
    (:meth:`~tessera.layers.shared.tables.EmbeddingTable.make_table`); the subclass says in
    ``table_layout`` how the grid splits ``[V, D]`` (and in ``vocab_block`` which vocabulary
    rows a vocabulary-parallel table looks up). Arguments: as :class:`GridEmbedding`.
    """

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
        self.make_table(num_embeddings, embedding_dim, padding_idx, dtype, weight_initializer)


class GridEmbedding(GridTable):
    """Embedding with the embedding dim split over the grid: weight ``[V, D/q^2]``.

    Input ids ``[b/B, s]`` (``split_batch``); output ``[b/B, s, D/q]``.

    Args:
        num_embeddings: Vocabulary size V.
        embedding_dim: D, divisible by ``q * q``.
        padding_idx: Row that gets no gradient (zeroed at init), as in torch.
        dtype: Parameter dtype.
        weight_initializer: Fills the full ``[V, D]`` table (default Normal(0, 1), torch's).
        device: Parameter device (default the context's).
        context: The ParallelContext (default the current one).
    """

    def table_layout(self, num_embeddings: int, embedding_dim: int) -> TableLayout:
        """D over the two table modes: ``[V, D/q^2]``."""
        grid = self.grid
        check_divisible(embedding_dim, grid.q * grid.q, f"{self.owner} embedding_dim (q * q)")
        return {1: grid.table_modes}, grid.table_replicated

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """See the class docstring for shapes."""
        self.check_batch_block(ids)
        weight = self.grid.gather_table(self.weight, 1)  # [V, D/q]: the hidden axis's block
        return F.embedding(ids, weight, self.padding_idx)  # [b/B, s, D/q]


class GridPatchEmbedding(PatchParameters, GridModule):
    """ViT patch embedding with E split over the grid (``E/q^2`` per rank).

    Parameters (full shapes as :class:`SerialPatchEmbedding`): ``weight [E, C, P, P]``,
    ``bias [E]``, ``cls_token [1, 1, E]``, ``pos_embed [1, N+1, E]``, each split along E like
    :class:`GridEmbedding`'s table. Input ``[b/B, C, H, W]`` (``split_batch``); output
    ``[b/B, N+1, E/q]`` in activation layout. The image feeds every rank of the hidden axis
    (each computes another slice of E), so its gradient is summed over it
    (``copy_to_group``, Megatron's f).

    Args:
        img_size: Image side.
        patch_size: Patch side, dividing ``img_size``.
        in_chans: Image channels C.
        embed_size: E, divisible by ``q * q``.
        dtype: Parameter dtype.
        weight_initializer: Fills the full conv weight (torch's default).
        bias_initializer: Fills the full conv bias (torch's default).
        position_embed_initializer: Fills the full position embedding (default zeros).
        device: Parameter device (default the context's).
        context: The ParallelContext (default the current one).
    """

    def __init__(
        self,
        img_size: int,
        patch_size: int,
        in_chans: int,
        embed_size: int,
        dtype: torch.dtype | None = None,
        weight_initializer: Initializer | None = None,
        bias_initializer: Initializer | None = None,
        position_embed_initializer: Initializer | None = None,
        *,
        device: torch.device | str | None = None,
        context: ParallelContext | None = None,
    ) -> None:
        super().__init__(context, device)
        grid = self.grid
        check_divisible(embed_size, grid.q * grid.q, f"{self.owner} embed_size (q * q)")
        side = patch_grid(img_size, patch_size)
        self.patch_size, self.num_patches, self.embed_size = patch_size, side * side, embed_size
        self.make_patch_parameters(
            in_chans,
            patch_size,
            embed_size,
            self.num_patches,
            dtype,
            weight_initializer,
            bias_initializer,
            position_embed_initializer,
            split=grid.table_modes,
            replicated=grid.table_replicated,
        )  # E/q^2 of each: weight [E/q^2, C, P, P], bias [E/q^2], tokens [1, 1 or N+1, E/q^2]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """See the class docstring for shapes."""
        self.check_batch_block(x)
        grid = self.grid
        x = copy_to_group(x, grid.hidden_axis.group)  # every rank of the hidden axis uses it
        return patch_embed(
            x,
            grid.gather_table(self.weight, 0),  # [E/q, C, P, P]
            grid.gather_table(self.bias, 0),  # [E/q]
            grid.gather_table(self.cls_token, 2),  # [1, 1, E/q]
            grid.gather_table(self.pos_embed, 2),  # [1, N+1, E/q]
        )  # [b/B, N+1, E/q]

    def extra_repr(self) -> str:
        """The summary shown by ``print(module)``."""
        return f"patch_size={self.patch_size}, embed_size={self.embed_size}, " + (
            super().extra_repr()
        )
