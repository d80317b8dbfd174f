"""The LayerNorm of the grid modes: the hidden dim split over one group of the grid.

2D/2.5D (``MeshLayerNorm``) and 3D (``LayerNorm3D``) differ only in which group splits the
hidden dim and which groups replicate the affine parameters; the rest is written once here on
:func:`~tessera.layers.shared.norm_over_group.layer_norm_over_group`.
"""

from __future__ import annotations

import torch
from torch import nn

from ..comm.collectives import check_divisible
from ..shared.context_access import GroupInfo
from ..shared.norm_over_group import ParallelNorm, check_norm_bias, layer_norm_over_group
from .base import GridModule

__all__ = ["GroupLayerNorm"]


class GroupLayerNorm(ParallelNorm, GridModule):
    """Mixin of the LayerNorms whose hidden dim is split over one group (2D, 2.5D, 3D).

    Holds ``normalized_shape``, ``hidden``, ``eps`` and the affine ``weight``/``bias``
    ``[h/q]``; the mode's class says which group splits the hidden dim (the ``split``) and
    which groups replicate the parameters, and passes its batch group to :meth:`normalize`.
    ``RMS = True`` makes it an RMSNorm (no centering, no bias), as the ``RMSNorm*`` classes.
    """

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
        self.normalized_shape = (int(shape[0]),)
        self.hidden, self.eps = int(shape[0]), eps
        check_divisible(self.hidden, q, f"{self.owner} normalized_shape (hidden)")
        self.make_affine(
            elementwise_affine, bias, dtype, splits={0: (split.mode,)}, replicated=replicated
        )  # weight, bias [h/q]

    #: Set by :meth:`defer_gradient_sum`: the affine gradients stay this rank's part.
    affine_sum_deferred = False

    def batch_group(self) -> GroupInfo:
        """The ranks whose batch blocks share the parameters (their gradients are summed)."""
        raise NotImplementedError

    def defer_gradient_sum(self) -> dict[str, list[nn.Parameter]]:
        """Leave the sum of the affine gradients over the batch group to the training loop.

        Every batch block uses the parameters, so their gradient is the sum of the blocks'
        parts; done in autograd that is one all-reduce per norm and backward. Afterwards
        ``weight.grad`` and ``bias.grad`` hold this rank's part until the caller sums them
        over the returned mode (see :class:`tessera.context.DefersGradientSum`).
        """
        batch = self.batch_group()
        params = [p for p in (self.weight, self.bias) if isinstance(p, nn.Parameter)]
        if batch.world_size == 1 or not params:
            return {}
        self.affine_sum_deferred = True
        return {batch.mode: params}

    def normalize(self, x: torch.Tensor, split: GroupInfo) -> torch.Tensor:
        """LayerNorm of ``x`` ``[.., h/q]`` over ``split``.

        Every batch block uses the parameters, so their gradients are summed over the batch
        group (one all-reduce for both), unless that sum was deferred.
        """
        grid = self.grid
        grid.check_local(
            x, -1, self.hidden // grid.q, f"{self.owner}({self.hidden})", name="normalized_shape"
        )
        rows, weight, bias = self.with_offset(x, self.weight, self.bias)
        y = layer_norm_over_group(
            rows,
            weight,
            bias,
            self.hidden,
            self.eps,
            split,
            rms=self.RMS,
            param_group=None if self.affine_sum_deferred else self.batch_group(),
        )
        return y.to(x.dtype)
