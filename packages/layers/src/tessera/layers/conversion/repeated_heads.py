"""``RepeatedHeads``: a key or value projection with fewer heads than the ranks splitting heads.

Grouped-query attention (Ainslie et al. 2023, "GQA") lets each key/value head serve a group of
query heads; multi-query attention (Shazeer 2019) lets one serve all of them. A tensor mode
splits the heads over ``share`` ranks (p in 1D, q on the 2D/2.5D mesh and the 3D cube). With
``kv`` key/value heads and ``share`` a multiple of ``kv``, a rank's query heads all belong to one
group, so the rank needs exactly one key/value head, and ``share / kv`` ranks need the same one.

The module computes the model in which every key/value head is repeated ``share / kv`` times
and the repeats are tied: one column layer of the mode with ``share`` heads of outputs, whose
weight block on each rank is cut, at every forward, from the whole ``[kv * head_dim, in]``
weight held on every tensor rank (vLLM replicates these heads the same way for inference). The
mode's own product and its collectives run unchanged, so the input's gradient is the mode's;
the repeats' weight gradients are the tied copies' parts, summed over the TENSOR group by
Megatron's f (``copy_to_group``) around the whole weight, or once per optimizer step by the
training loop (:class:`~tessera.layers.shared.tensor_sum.SumsOverTensor`).

That sum is exact because, in every mode, the ranks' output blocks partition the output and
their weight blocks' gradients partition the weight gradient: 1D and 2D hold each weight
element once; 3D holds a distinct ``1/P`` of it; 2.5D holds each block once per depth layer,
each with its own share of the batch (the layer's own sum over depth is turned off, the TENSOR
group includes depth). The bias is added here to the layer's output block, not inside the
layer, since the layer would sum its gradient over the ranks of its batch group itself.

Each rank holds ``kv * head_dim * in`` parameters for each of the two projections where a split
would hold ``head_dim * in``; with the few key/value heads that need it, that is small next to
the query and output projections.
"""

from __future__ import annotations

import torch
from torch import nn

from tessera.context import ParallelContext, ParallelMode, ShardInfo, get_shard_info

from ..mesh.layout import MeshModule
from ..shared.base import ParallelModule
from ..shared.context_access import GroupInfo, group_info
from ..shared.initializers import Initializer, fan_in_uniform, kaiming_uniform
from ..shared.tensor_sum import SumsOverTensor
from .lent import lent

__all__ = ["RepeatedHeads"]


def _repeated_rows(rows: slice, head_dim: int, repeats: int, device: torch.device) -> torch.Tensor:
    """The rows of the whole weight behind ``rows`` of the weight with every head repeated.

    Row ``e`` of the repeated weight is row ``e % head_dim`` of repeated head ``e // head_dim``,
    a repeat of head ``e // head_dim // repeats``.
    """
    index = torch.arange(rows.start, rows.stop, device=device)
    return (index // head_dim // repeats) * head_dim + index % head_dim


class RepeatedHeads(SumsOverTensor, ParallelModule):
    """``y = x W^T + b`` for this rank's repeat of one key/value head (see the module docstring).

    Parameters ``weight`` ``[kv * head_dim, in]`` and ``bias`` ``[kv * head_dim]``, whole and
    equal on every tensor rank (their ``ShardInfo`` says replicated over TENSOR), as the plain
    module's. Input and output are the layer's: ``layer`` is the mode's column layer with
    ``share * head_dim`` outputs, whose own parameters are dropped.

    Args:
        layer: The mode's column layer of the repeated heads, built with a bias (its block tells
            which output features this rank computes).
        heads: Key/value heads (``kv``), fewer than the ranks splitting heads.
        head_dim: Features of a head.
        bias: Whether to learn a bias.
        dtype: Parameter dtype.
        weight_initializer: Fills the whole ``[kv * head_dim, in]`` weight (torch's default).
        bias_initializer: Fills the whole bias (torch's default).
        device: Parameter device (default the context's).
        context: The ParallelContext (default the current one).

    Raises:
        ValueError: ``layer``'s outputs are not a multiple of ``heads`` heads.
    """

    rows: torch.Tensor  # [rows of the layer's block]: the whole weight's row behind each
    bias_rows: torch.Tensor  # [the layer's output block]: the whole bias's entry behind each

    def __init__(
        self,
        layer: nn.Module,
        heads: int,
        head_dim: int,
        bias: bool,
        dtype: torch.dtype | None = None,
        weight_initializer: Initializer | None = None,
        bias_initializer: Initializer | None = None,
        *,
        device: torch.device | str | None = None,
        context: ParallelContext | None = None,
    ) -> None:
        super().__init__(context, device)
        weight_info, bias_info = _info(layer, "weight"), _info(layer, "bias")
        repeated, in_features = weight_info.global_shape
        if repeated % (heads * head_dim) != 0:
            raise ValueError(
                f"RepeatedHeads: the layer's {repeated} outputs are not repeats of {heads} "
                f"heads of {head_dim} ({repeated} % {heads * head_dim} != 0)"
            )
        repeats = repeated // (heads * head_dim)
        rows, self.columns = weight_info.slices
        at = self.device
        self.register_buffer("rows", _repeated_rows(rows, head_dim, repeats, at), persistent=False)
        bias_rows = _repeated_rows(bias_info.slices[0], head_dim, repeats, at)
        self.register_buffer("bias_rows", bias_rows, persistent=False)
        self.heads, self.head_dim, self.repeats = heads, head_dim, repeats
        if isinstance(layer, MeshModule):  # the TENSOR sum below covers depth
            layer.defer_gradient_sum()
        del layer.weight  # lent this rank's block at every forward
        layer.register_parameter("bias", None)  # added here, to the layer's output block
        # A submodule without parameters, lent its block of the whole weight at every forward:
        # walks over the model (keep_gathered_operands, .to(), train()) reach it.
        self.layer = layer
        self.tensor: GroupInfo = group_info(self.context, ParallelMode.TENSOR)
        self.in_features, self.out_features = int(in_features), heads * head_dim
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
            f"{self.heads} heads of {self.head_dim} each repeated {self.repeats} times, "
            f"computed by {type(layer).__name__}"
        )


def _info(layer: nn.Module, name: str) -> ShardInfo:
    info = get_shard_info(getattr(layer, name))
    assert info is not None, f"{type(layer).__name__}.{name} has no ShardInfo"
    return info
