"""The LayerNorm of the grid modes: the hidden dim split over one group of the grid.

2D/2.5D (``MeshLayerNorm``) and 3D (``LayerNorm3D``) differ only in which group splits the
hidden dim and which groups replicate the affine parameters; the rest is written once here on
:func:`~tessera.layers.shared.norm_over_group.layer_norm_over_group`.
"""

from __future__ import annotations

import torch

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
