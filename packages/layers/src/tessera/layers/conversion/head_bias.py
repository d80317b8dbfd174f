"""``HeadColumns``: a table whose columns are attention heads, read at this rank's heads.

T5's relative position bias (``relative_attention_bias``, an ``nn.Embedding(buckets, heads)``
in the first layer's self-attention of each stack) looks up a bias ``[q, k, heads]`` per pair of
positions and adds it to the scores of every layer of its stack (the first layer hands it on as
``position_bias``). Where the heads are split, a rank's attention holds heads ``first ..
first + count - 1`` only, so the bias it adds must be those heads' columns.

The table stays whole on every tensor rank, in the plain module's name (its ``ShardInfo`` says
replicated over TENSOR), so a state dict needs no conversion. At each lookup it is routed
through Megatron's f (``copy_to_group`` over TENSOR) before this rank's columns are taken: a
rank's gradient holds its heads' columns over its block of the batch and zeros elsewhere, and
the sum over TENSOR is each column's whole gradient in every mode, since the ranks holding a
head between them hold every row of the batch (as :mod:`.per_head_norm` sums a weight per
head).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tessera.context import ParallelContext, ParallelMode, set_shard_info

from ..shared.base import ParallelModule
from ..shared.context_access import GroupInfo, group_info
from ..shared.shards import shard_info
from ..shared.tensor_sum import SumsOverTensor

__all__ = ["HeadColumns"]


class HeadColumns(SumsOverTensor, ParallelModule):
    """An ``nn.Embedding`` ``[rows, heads]`` read at this rank's heads' columns.

    Parameters: the plain embedding's ``weight``, whole and equal on every tensor rank.

    Args:
        plain: The plain ``nn.Embedding`` (its weight becomes this module's).
        first: The first of this rank's heads.
        count: This rank's heads.
        context: The ParallelContext (default the current one).
    """

    takes_indices = True
    weight: nn.Parameter

    def __init__(
        self,
        plain: nn.Embedding,
        first: int,
        count: int,
        *,
        context: ParallelContext | None = None,
    ) -> None:
        weight = plain.weight
        assert isinstance(weight, nn.Parameter), "an nn.Embedding holds its table as a Parameter"
        super().__init__(context, None if weight.is_meta else weight.device)
        self.weight = weight
        self.first, self.count = first, count
        self.heads = weight.shape[1]
        self.train(plain.training)
        self.tensor: GroupInfo = group_info(self.context, ParallelMode.TENSOR)
        if weight.is_meta:  # drawn as the plain table would be
            self.to_empty(device=self.device)
            with torch.no_grad():
                nn.init.normal_(self.weight)
        set_shard_info(
            self.weight, shard_info(self.context, self.weight.shape, replicated=(self.mode,))
        )

    @property
    def mode(self) -> str:
        """The mode whose ranks hold the same table and sum its gradient: TENSOR."""
        return self.tensor.mode

    def tensor_summed_parameters(self) -> list[nn.Parameter]:
        """The table, whole on every tensor rank."""
        return [self.weight]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Ids ``[...]`` -> this rank's heads' columns of their rows ``[..., count]``."""
        table = self.summed_over_tensor(self.weight)[:, self.first : self.first + self.count]
        return F.embedding(ids, table)

    def extra_repr(self) -> str:
        """The summary shown by ``print(module)``."""
        return (
            f"{self.weight.shape[0]} rows, heads {self.first}..{self.first + self.count - 1} of "
            f"{self.heads}, summed over {self.tensor.world_size} tensor ranks"
        )
