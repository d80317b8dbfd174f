"""LayerNorm over a hidden dim split across the ranks of one group: exact, stable, one message.

Each rank holds a slice ``[.., h/q]`` of every row. The mean and variance of a row combine
the group's slices: each rank computes its slice's mean and sum of squared deviations and one
all-gather of ``[m, 2]`` merges them (Chan, Golub and LeVeque 1979's pairwise update: exact,
and as stable as two passes, where a single all-reduce of sums and sums of squares would
cancel catastrophically). The backward needs the row sums of the gradient and of gradient *
normalized input (one all-reduce of ``[m, 2]``). Affine parameters used by several batch
blocks have their gradients summed over the batch group in one all-reduce, posted before
the input gradient is computed.

2D/2.5D (Xu et al. 2021, section 3.2), 3D (Bian et al. 2021) and 1D's norm of a column
layer's split output all normalize this way. They also make their parameters the same way
(:func:`check_norm_bias`, :class:`ParallelNorm`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn

from tessera.context import ModeLike

from ..comm.inflight import start_all_reduce, start_gather_blocks
from ..comm.ops import apply_function
from .base import ParallelModule
from .context_access import GroupInfo
from .initializers import Initializer, ones, zeros

__all__ = ["ParallelNorm", "check_norm_bias", "layer_norm_over_group"]


def _row_sum(x: torch.Tensor, group: GroupInfo) -> torch.Tensor:
    """Sum over the last dim and over the ranks of ``group`` (which split that dim)."""
    out = x.sum(dim=-1, keepdim=True)
    if group.world_size > 1:
        dist.all_reduce(out, group=group.group)
    return out


def _row_moments(
    x: torch.Tensor, hidden: int, group: GroupInfo
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and biased variance ``[.., 1]`` of rows whose ``hidden`` values ``group`` splits.

    Each rank's slice gives its mean and sum of squared deviations; one all-gather brings
    every slice's pair, merged exactly (Chan et al. 1979): the sums of squares add, plus the
    slice size times the squared distance of each slice's mean from the row's.
    """
    mean = x.mean(dim=-1, keepdim=True)  # [.., 1]
    squares = (x - mean).square_().sum(dim=-1, keepdim=True)  # [.., 1]
    if group.world_size == 1:
        return mean, squares / hidden
    pairs = start_gather_blocks(torch.cat((mean, squares), -1), group.group, group.world_size)
    means, squares = pairs.wait().unbind(-1)  # [q, ..] each
    mean = means.mean(0)
    spread = (means - mean).square_().sum(0) * (hidden // group.world_size)
    return mean.unsqueeze(-1), ((squares.sum(0) + spread) / hidden).unsqueeze(-1)


class _LayerNormOverGroup(torch.autograd.Function):
    """LayerNorm (or RMSNorm) of rows whose last dim is split over a group (saves x-hat).

    RMSNorm (Zhang and Sennrich 2019) is the same without centering: ``x_hat = x * rstd``
    with ``rstd = 1 / sqrt(mean(x^2) + eps)``, and its backward lacks the mean-of-``g`` term.
    """

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        hidden: int,
        eps: float,
        group: GroupInfo,
        rms: bool,
        param_group: GroupInfo | None,
    ) -> torch.Tensor:
        x = x.detach()
        if rms:
            centered = x.clone()  # [.., h/q]
            var = _row_sum(centered * centered, group) / hidden  # [.., 1]
        else:
            mean, var = _row_moments(x, hidden, group)  # [.., 1] each, biased as torch's
            centered = x - mean
        rstd = torch.rsqrt(var + eps)
        x_hat = centered.mul_(rstd)
        ctx.hidden, ctx.group, ctx.rms, ctx.param_group = hidden, group, rms, param_group
        ctx.has_bias = bias is not None
        ctx.save_for_backward(x_hat, rstd, weight)
        y = x_hat if weight is None else x_hat * weight
        return y if bias is None else y + bias

    @staticmethod
    def backward(
        ctx: Any, grad: torch.Tensor
    ) -> tuple[
        torch.Tensor, torch.Tensor | None, torch.Tensor | None, None, None, None, None, None
    ]:
        x_hat, rstd, weight = ctx.saved_tensors
        lead = tuple(range(grad.dim() - 1))
        affine = [] if weight is None else [(grad * x_hat).sum(dim=lead)]
        affine += [grad.sum(dim=lead)] if ctx.has_bias else []
        summed = None  # the parameters' gradients, summed over the batch blocks in one call
        if affine and ctx.param_group is not None:
            group = ctx.param_group
            summed = start_all_reduce(torch.cat(affine), group.group, group.world_size)
        g = grad if weight is None else grad * weight  # d loss / d x_hat, [.., h/q]
        sums = torch.cat((g.sum(dim=-1, keepdim=True), (g * x_hat).sum(dim=-1, keepdim=True)), -1)
        if ctx.group.world_size > 1:
            dist.all_reduce(sums, group=ctx.group.group)  # one all-reduce for both: [.., 2]
        means = sums / ctx.hidden
        centered_g = g if ctx.rms else g - means[..., :1]
        grad_x = (centered_g - x_hat * means[..., 1:]) * rstd
        if summed is not None:
            affine = list(summed.wait().chunk(len(affine)))
        grad_weight = affine[0] if weight is not None else None
        grad_bias = affine[-1] if ctx.has_bias else None
        return grad_x, grad_weight, grad_bias, None, None, None, None, None


def layer_norm_over_group(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    hidden: int,
    eps: float,
    group: GroupInfo,
    *,
    rms: bool = False,
    param_group: GroupInfo | None = None,
) -> torch.Tensor:
    """``F.layer_norm`` (``F.rms_norm`` with ``rms``) over ``hidden`` values split over ``group``.

    Args:
        x: ``[.., hidden / group size]``, this rank's slice of every row.
        weight: ``[hidden / group size]`` or ``None``.
        bias: ``[hidden / group size]`` or ``None``.
        hidden: The full size of the normalized dim.
        eps: Added to the variance.
        group: The ranks holding the other slices, in order.
        rms: Normalize by the root mean square only (no centering, ``bias`` is ``None``).
        param_group: The ranks whose gradients of ``weight`` and ``bias`` are summed (the
            batch blocks sharing them), in one all-reduce; ``None``: not summed here.
    """
    return apply_function(
        _LayerNormOverGroup, x, weight, bias, hidden, eps, group, rms, param_group
    )


def check_norm_bias(bias: bool | None, rms: bool, owner: str) -> bool:
    """Whether a norm learns a bias: by default a LayerNorm does and an RMSNorm does not.

    Raises:
        ValueError: an RMSNorm asked for a bias.
    """
    if bias is None:
        return not rms
    if bias and rms:
        raise ValueError(f"{owner} is an RMSNorm, which has no bias; pass bias=False or None")
    return bias


class ParallelNorm(ParallelModule):
    """Mixin of the parallel LayerNorms and RMSNorms (listed before their mode's base class).

    Every mode keeps torch's ``normalized_shape``, ``eps`` and affine parameters: ``weight``
    (ones) and ``bias`` (zeros) of full shape ``normalized_shape``, registered in torch's order;
    the modes differ only in how they split and replicate them (:meth:`make_affine`) and in
    where the statistics come from.

    Attributes (set by the norm): ``normalized_shape`` and ``eps``; :meth:`make_affine` sets
    ``weight`` and ``bias``. ``weight_offset`` (default 0) is added to the weight where it
    scales: ``parallelize`` sets 1 for a norm that scales by ``1 + weight`` (Gemma's RMSNorm,
    whose weight starts at zero; Nemotron's LayerNorm1P).
    """

    #: Normalize by the root mean square only (RMSNorm, Zhang and Sennrich 2019).
    RMS: ClassVar[bool] = False
    #: Added to the weight where it scales the normalized rows.
    weight_offset: float = 0.0

    normalized_shape: tuple[int, ...]
    eps: float
    weight: nn.Parameter | None
    bias: nn.Parameter | None

    def make_affine(
        self,
        elementwise_affine: bool,
        bias: bool,
        dtype: torch.dtype | None,
        *,
        splits: Mapping[int, Sequence[ModeLike]] | None = None,
        replicated: Sequence[ModeLike] = (),
    ) -> None:
        """Set ``weight`` and ``bias`` of ``normalized_shape``; ``None`` for each not learned.

        Call after setting ``normalized_shape``. The fans (the normalized size) are given as
        for any parameter; ones and zeros do not use them.

        Args:
            elementwise_affine: Learn the weight (and the bias).
            bias: Learn a bias, as :func:`check_norm_bias` returned it.
            dtype: Parameter dtype.
            splits: How ``normalized_shape`` is split (``None``: whole).
            replicated: The modes both are replicated over.
        """
        n = math.prod(self.normalized_shape)

        def param(name: str, init: Initializer) -> nn.Parameter:
            return self.make_parameter(
                name,
                self.normalized_shape,
                init,
                fan_in=n,
                fan_out=n,
                splits=splits,
                replicated=replicated,
                dtype=dtype,
            )

        self.weight = param("weight", ones()) if elementwise_affine else None
        self.bias = param("bias", zeros()) if elementwise_affine and bias else None

    def with_offset(
        self, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """The input, weight and bias as the norm computes with them.

        ``weight`` and ``bias`` are this norm's, or the parts the mode routes to this rank.
        Without an offset they are returned as they are. With one, all three in fp32 and the
        offset added to the weight, as Gemma computes ``1 + weight``: in bf16 a weight below
        ``2^-8`` would vanish beside the 1, and its updates never reach the forward. The
        caller casts the result back to ``x``'s dtype.
        """
        if not self.weight_offset:
            return x, weight, bias
        return (
            x.float(),
            None if weight is None else weight.float() + self.weight_offset,
            None if bias is None else bias.float(),
        )

    def norm_repr(self) -> str:
        """``normalized_shape, eps=.., ``: how every such norm's ``print`` opens."""
        offset = f"weight_offset={self.weight_offset}, " if self.weight_offset else ""
        return f"{self.normalized_shape}, eps={self.eps}, {offset}"
