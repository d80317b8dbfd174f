"""2D and 2.5D LayerNorm: the hidden dim is split over the mesh row, so are the statistics.

Xu et al. 2021, section 3.2 (LayerNorm in 2D): each rank holds ``[b/(depth q), ..., h/q]``
and the mean and variance of a row of ``h`` values combine the ROW group's slices. Here each
rank computes its slice's mean and sum of squared deviations and one all-gather of ``[m, 2]``
merges them (Chan, Golub and LeVeque 1979's pairwise update: exact, and as stable as two
passes, where a single all-reduce of sums and sums of squares would cancel catastrophically).
The backward needs the row sums of the gradient and of gradient * normalized input (one
all-reduce of ``[m, 2]``). The affine parameters ``[h/q]`` (block ``j``) are used by every
batch block, so their gradients are summed over the batch group, both in one all-reduce
posted before the input gradient is computed.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tessera.context import ParallelContext

from .collectives import check_divisible
from .comm import apply_function
from .context_access import GroupInfo
from .grid import GridModule
from .inflight import start_all_reduce, start_gather_blocks
from .initializers import Initializer, ones, zeros
from .mesh import MeshModule

__all__ = [
    "GroupLayerNorm",
    "LayerNorm2D",
    "LayerNorm2p5D",
    "MeshLayerNorm",
    "RMSNorm2D",
    "RMSNorm2p5D",
    "check_norm_bias",
    "layer_norm_over_group",
]


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


class GroupLayerNorm(GridModule):
    """Mixin of the LayerNorms whose hidden dim is split over one group (2D, 2.5D, 3D).

    Holds ``normalized_shape``, ``hidden``, ``eps`` and the affine ``weight``/``bias``
    ``[h/q]``; the mode's class says which group splits the hidden dim (the ``split``) and
    which groups replicate the parameters, and passes its batch group to :meth:`normalize`.
    ``RMS = True`` makes it an RMSNorm (no centering, no bias), as the ``RMSNorm*`` classes.
    """

    #: Normalize by the root mean square only (RMSNorm, Zhang and Sennrich 2019).
    RMS = False

    def init_norm(
        self,
        normalized_shape: int | tuple[int, ...],
        eps: float,
        elementwise_affine: bool,
        bias: bool | None,
        dtype: torch.dtype | None,
        q: int,
        split: GroupInfo,
        replicated: tuple[str, ...],
    ) -> None:
        """Check ``normalized_shape`` (``h`` divisible by ``q``) and make the parameters.

        ``bias=None`` means a bias for a LayerNorm and none for an RMSNorm.
        """
        bias = check_norm_bias(bias, self.RMS, self.owner)
        shape = (normalized_shape,) if isinstance(normalized_shape, int) else normalized_shape
        if len(shape) != 1:
            raise ValueError(
                f"{self.owner} normalizes over the hidden dim only; normalized_shape must be an "
                f"int or a 1-tuple, got {normalized_shape!r}"
            )
        self.normalized_shape: tuple[int, ...] = (int(shape[0]),)
        self.hidden, self.eps = int(shape[0]), eps
        check_divisible(self.hidden, q, f"{self.owner} normalized_shape (hidden)")
        h = self.hidden

        def param(name: str, init: Initializer) -> nn.Parameter:
            return self.make_parameter(
                name,
                self.normalized_shape,
                init,
                fan_in=h,
                fan_out=h,
                splits={0: (split.mode,)},
                replicated=replicated,
                dtype=dtype,
            )

        self.weight = param("weight", ones()) if elementwise_affine else None  # [h/q]
        self.bias = param("bias", zeros()) if elementwise_affine and bias else None  # [h/q]

    def normalize(self, x: torch.Tensor, split: GroupInfo, batch: GroupInfo) -> torch.Tensor:
        """LayerNorm of ``x`` ``[.., h/q]`` over ``split``.

        Every batch block uses the parameters, so their gradients are summed over ``batch``
        (one all-reduce for both).
        """
        grid = self.grid
        grid.check_local(
            x, -1, self.hidden // grid.q, f"{self.owner}({self.hidden})", name="normalized_shape"
        )
        return layer_norm_over_group(
            x, self.weight, self.bias, self.hidden, self.eps, split, rms=self.RMS, param_group=batch
        )


class MeshLayerNorm(GroupLayerNorm, MeshModule):
    """LayerNorm over the hidden dim of a 2D/2.5D activation (behind ``LayerNorm2D``/``2p5D``).

    Input and output ``[b/(depth q), ..., h/q]``; ``weight`` and ``bias`` ``[h/q]`` (block
    ``j``, replicated over the batch group), ``[h]`` in full form as torch's.

    Args:
        normalized_shape: ``h`` (or ``(h,)``): 2D/2.5D normalize over the hidden dim only.
        eps: As torch's LayerNorm.
        elementwise_affine: Learn weight (and bias).
        bias: Learn a bias (with ``elementwise_affine``); default yes, none for an RMSNorm.
        dtype: Parameter dtype.
        device: Parameter device (default the context's).
        context: The ParallelContext (default the current one).
    """

    def __init__(
        self,
        normalized_shape: int | tuple[int, ...],
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        bias: bool | None = None,
        dtype: torch.dtype | None = None,
        *,
        device: torch.device | str | None = None,
        context: ParallelContext | None = None,
    ) -> None:
        super().__init__(context, device)
        mesh = self.mesh
        self.init_norm(
            normalized_shape,
            eps,
            elementwise_affine,
            bias,
            dtype,
            mesh.q,
            mesh.row,
            (mesh.col.mode, *mesh.depth_modes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """See the class docstring for shapes."""
        return self.normalize(x, self.mesh.row, self.mesh.batch)

    def extra_repr(self) -> str:
        """The summary shown by ``print(module)``."""
        return f"{self.normalized_shape}, eps={self.eps}, " + super().extra_repr()


class LayerNorm2D(MeshLayerNorm):
    """2D LayerNorm (Xu et al. 2021); see :class:`MeshLayerNorm`."""

    MESH = "2d"


class LayerNorm2p5D(MeshLayerNorm):
    """2.5D LayerNorm (Tesseract, Wang et al. 2021); see :class:`MeshLayerNorm`."""

    MESH = "2.5d"


class RMSNorm2D(LayerNorm2D):
    """2D RMSNorm (Zhang and Sennrich 2019, as Llama's): :class:`LayerNorm2D` without centering."""

    RMS = True


class RMSNorm2p5D(LayerNorm2p5D):
    """2.5D RMSNorm: :class:`LayerNorm2p5D` without centering or bias."""

    RMS = True
