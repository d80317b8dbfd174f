"""``RepeatedHeads``: key/value heads fewer than the ranks splitting heads, each repeated.

Grouped-query attention (Ainslie et al. 2023, "GQA") lets each key/value head serve a group of
query heads; multi-query attention (Shazeer 2019) lets one serve all of them. A tensor mode
splits the heads over ``share`` ranks (p in 1D, q on the 2D/2.5D mesh and the 3D cube). With
``kv`` key/value heads and ``share`` a multiple of ``kv``, a rank's query heads all belong to one
group, so the rank needs exactly one key/value head, and ``share / kv`` ranks need the same one.

The module computes the model in which every key/value head is repeated ``share / kv`` times
and the repeats are tied: one column layer of the mode whose output block on rank ``t`` (of
the ranks splitting heads) is that rank's *segment*, and whose weight block on each rank is
cut, at every forward, from the whole weight held on every tensor rank (vLLM replicates these
heads the same way for inference). The segment is, for

* a key or value projection alone: the one head of group ``g(t) = t // (share / kv)``;
* q, k and v fused in one projection (GPTBigCode's and Falcon-7B's multi-query ``c_attn`` /
  ``query_key_value``, Phi-3's ``qkv_proj`` with few key/value heads): rank ``t``'s
  ``heads / share`` query heads, then key head ``g(t)``, then value head ``g(t)`` -- what the
  unconverted module returns for those heads, with its head counts divided.

:class:`HeadRepeats` says where each segment's rows are in the whole weight. The mode's own
product and its collectives run unchanged, so the input's gradient is the mode's; the repeats'
weight gradients are the tied copies' parts, summed over the TENSOR group by Megatron's f
(``copy_to_group``) around the whole weight, or once per optimizer step by the training loop
(:class:`~tessera.layers.shared.tensor_sum.SumsOverTensor`). A fused projection's query rows
appear in one segment only: their sum adds the parts of the ranks that computed them to zeros.

That sum is exact because, in every mode, the ranks' output blocks partition the output and
their weight blocks' gradients partition the weight gradient: 1D and 2D hold each weight
element once; 3D holds a distinct ``1/P`` of it; 2.5D holds each block once per depth layer,
each with its own share of the batch (the layer's own sum over depth is turned off, the TENSOR
group includes depth). The bias is added here to the layer's output block, not inside the
layer, since the layer would sum its gradient over the ranks of its batch group itself.

Each rank holds the whole weight: ``kv * head_dim * in`` for a key or value projection where a
split would hold ``head_dim * in``, small next to the query and output projections. A fused one
holds all its query rows too, ``share`` times a split's share of them: separate q, k and v
projections keep the query heads split.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tessera.context import ParallelContext, ParallelMode, ShardInfo, get_shard_info, grouped

from ..mesh.layout import MeshModule
from ..shared.base import ParallelModule
from ..shared.context_access import GroupInfo, group_info
from ..shared.initializers import Initializer, fan_in_uniform, kaiming_uniform
from ..shared.tensor_sum import SumsOverTensor
from .lent import lent

__all__ = ["HeadRepeats", "RepeatedHeads"]


@dataclass(frozen=True)
class HeadRepeats:
    """Which heads of the whole weight make each rank's segment (see the module docstring).

    Attributes:
        key_value: Key/value heads: fewer than ``share``, and dividing it.
        head_dim: Features of a head.
        share: Ranks splitting heads.
        query: Query heads fused in the same weight (0: a key or value projection alone).
        by_group: A fused weight's rows are ``[kv, query / kv + 2, head_dim]``, each group's
            query heads then its key and its value head (Falcon's ``query_key_value``,
            GPTBigCode's ``c_attn``); otherwise ``[query + 2 kv, head_dim]``: every query head,
            then the keys, then the values (Phi-3's ``qkv_proj``).

    Raises:
        ValueError: the counts do not give each rank whole query heads of one group.
    """

    key_value: int
    head_dim: int
    share: int
    query: int = 0
    by_group: bool = False

    def __post_init__(self) -> None:
        kv, share, query = self.key_value, self.share, self.query
        if not 0 < kv < share or share % kv:
            raise ValueError(
                f"HeadRepeats: {kv} key/value heads are not a divisor of the {share} ranks "
                f"splitting heads, fewer than them ({share} % {kv} = {share % kv if kv else '-'})"
            )
        if query % share or query % kv:
            raise ValueError(
                f"HeadRepeats: {query} query heads do not split into whole groups of the {kv} "
                f"key/value heads over {share} ranks ({query} % {share} = {query % share}, "
                f"{query} % {kv} = {query % kv})"
            )

    @property
    def whole_rows(self) -> int:
        """Rows of the whole weight."""
        heads = self.query + 2 * self.key_value if self.query else self.key_value
        return heads * self.head_dim

    @property
    def segment(self) -> int:
        """Rows (output features) of one rank's segment."""
        heads = self.query // self.share + 2 if self.query else 1
        return heads * self.head_dim

    def heads_of(self, rank: int) -> list[int]:
        """The whole weight's heads (blocks of ``head_dim`` rows) in ``rank``'s segment."""
        group = rank // (self.share // self.key_value)
        if not self.query:
            return [group]
        per_rank = self.query // self.share
        queries = range(rank * per_rank, (rank + 1) * per_rank)
        if not self.by_group:  # [q heads; k heads; v heads]
            return [*queries, self.query + group, self.query + self.key_value + group]
        size = self.query // self.key_value  # query heads of a group: [kv, size + 2, d]
        first = group * (size + 2)
        return [(h // size) * (size + 2) + h % size for h in queries] + [
            first + size,
            first + size + 1,
        ]

    def rows(self) -> torch.Tensor:
        """``[share * segment]``: the whole weight's row behind each row of the repeated one."""
        heads = torch.tensor([h for rank in range(self.share) for h in self.heads_of(rank)])
        return (heads[:, None] * self.head_dim + torch.arange(self.head_dim)).flatten()

    def describe(self) -> str:
        """The segment in words (for ``print(module)`` and errors)."""
        kv = f"{self.key_value} key/value heads of {self.head_dim} repeated "
        kv += f"{self.share // self.key_value} times"
        if not self.query:
            return kv
        order = "by group" if self.by_group else "q, k, v in turn"
        return f"{self.query // self.share} of {self.query} query heads beside {kv} ({order})"


class RepeatedHeads(SumsOverTensor, ParallelModule):
    """``y = x W^T + b`` for this rank's segment of repeated heads (see the module docstring).

    Parameters ``weight`` ``[rows, in]`` and ``bias`` ``[rows]``, whole and equal on every tensor
    rank (their ``ShardInfo`` says replicated over TENSOR), as the plain module's (``rows`` is
    ``repeats.whole_rows``). Input and output are the layer's: ``layer`` is the mode's column
    layer with ``share * segment`` outputs, whose own parameters are dropped.

    Args:
        layer: The mode's column layer of the repeated heads, built with a bias (its block tells
            which output features this rank computes).
        repeats: The heads and where each rank's segment is in the whole weight.
        bias: Whether to learn a bias.
        dtype: Parameter dtype.
        weight_initializer: Fills the whole weight (torch's default).
        bias_initializer: Fills the whole bias (torch's default).
        sections: The weight is held in tessera's form of parts of these sizes, interleaved by
            group (``FullForm.sections``: a fused q/k/v of unequal parts), not as the original.
        device: Parameter device (default the context's).
        context: The ParallelContext (default the current one).

    Raises:
        ValueError: ``layer``'s outputs are not ``share`` segments.
    """

    rows: torch.Tensor  # [rows of the layer's block]: the whole weight's row behind each
    bias_rows: torch.Tensor  # [the layer's output block]: the whole bias's entry behind each

    def __init__(
        self,
        layer: nn.Module,
        repeats: HeadRepeats,
        bias: bool,
        dtype: torch.dtype | None = None,
        weight_initializer: Initializer | None = None,
        bias_initializer: Initializer | None = None,
        *,
        sections: tuple[int, ...] = (),
        device: torch.device | str | None = None,
        context: ParallelContext | None = None,
    ) -> None:
        super().__init__(context, device)
        weight_info, bias_info = _info(layer, "weight"), _info(layer, "bias")
        repeated, in_features = weight_info.global_shape
        if repeated != repeats.share * repeats.segment:
            raise ValueError(
                f"RepeatedHeads: the layer's {repeated} outputs are not {repeats.share} "
                f"segments of {repeats.segment} ({repeats.describe()})"
            )
        behind = _held_rows(repeats.rows(), repeats.whole_rows, sections)
        rows, self.columns = weight_info.slices
        self.register_buffer("rows", behind[rows].to(self.device), persistent=False)
        bias_rows = behind[bias_info.slices[0]].to(self.device)
        self.register_buffer("bias_rows", bias_rows, persistent=False)
        self.repeats = repeats
        if isinstance(layer, MeshModule):  # the TENSOR sum below covers depth
            layer.defer_gradient_sum()
        del layer.weight  # lent this rank's block at every forward
        layer.register_parameter("bias", None)  # added here, to the layer's output block
        # A submodule without parameters, lent its block of the whole weight at every forward:
        # walks over the model (keep_gathered_operands, .to(), train()) reach it.
        self.layer = layer
        self.tensor: GroupInfo = group_info(self.context, ParallelMode.TENSOR)
        self.in_features, self.out_features = int(in_features), repeats.whole_rows
        shape = (self.out_features, self.in_features)
        self.weight = self._whole("weight", shape, weight_initializer or kaiming_uniform(), dtype)
        bias_init = bias_initializer or fan_in_uniform()
        self.bias = self._whole("bias", shape[:1], bias_init, dtype) if bias else None

    def _whole(
        self, name: str, shape: tuple[int, ...], init: Initializer, dtype: torch.dtype | None
    ) -> nn.Parameter:
        """A parameter whole on every tensor rank, drawn as ``nn.Linear`` draws its own."""
        return self.make_parameter(
            name,
            shape,
            init,
            fan_in=self.in_features,
            fan_out=self.out_features,
            replicated=(ParallelMode.TENSOR,),
            dtype=dtype,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The layer's input -> the layer's output block of this rank's repeated head."""
        layer = self.layer
        weight = self.summed_over_tensor(self.weight)  # [kv * d, in]: the repeats' parts summed
        block = weight.index_select(0, self.rows)[:, self.columns]  # the layer's block
        with lent(layer, {"weight": block}):
            y = layer(x)
        if self.bias is None:
            return y  # type: ignore[no-any-return]
        bias = self.summed_over_tensor(self.bias).index_select(0, self.bias_rows)
        return y + bias  # type: ignore[no-any-return]

    def extra_repr(self) -> str:
        """The summary shown by ``print(module)``."""
        layer = self.layer
        return (
            f"{self.in_features}, {self.out_features}, bias={self.bias is not None}, "
            f"{self.repeats.describe()}, computed by {type(layer).__name__}"
        )


def _held_rows(rows: torch.Tensor, whole: int, sections: tuple[int, ...]) -> torch.Tensor:
    """``rows`` of the original weight as rows of the weight held (tessera's form).

    Held in parts interleaved by group (``sections``), held row ``i`` is original row
    ``order[i]``; the inverse permutation finds where each original row went.
    """
    if not sections:
        return rows
    order = grouped(torch.arange(whole)[:, None], sections, dim=0).flatten()  # held -> original
    where = torch.empty_like(order)
    where[order] = torch.arange(whole)  # original -> held
    return where[rows]


def _info(layer: nn.Module, name: str) -> ShardInfo:
    info = get_shard_info(getattr(layer, name))
    assert info is not None, f"{type(layer).__name__}.{name} has no ShardInfo"
    return info
