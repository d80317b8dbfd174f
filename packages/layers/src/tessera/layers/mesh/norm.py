"""2D and 2.5D LayerNorm: the hidden dim is split over the mesh row, so are the statistics.

Xu et al. 2021, section 3.2 (LayerNorm in 2D): each rank holds ``[b/(depth q), ..., h/q]``
and the mean and variance of a row of ``h`` values combine the ROW group's slices
(:mod:`tessera.layers.shared.norm_over_group`: one all-gather of per-slice moments forward,
one all-reduce backward). The affine parameters ``[h/q]`` (block ``j``) are used by every
batch block, so their gradients are summed over the batch group.
"""

from __future__ import annotations

import torch
from torch import nn

from tessera.context import ParallelContext

from ..grid.norm import GroupLayerNorm
from ..shared.context_access import GroupInfo
from .layout import MeshModule

__all__ = [
    "LayerNorm2D",
    "LayerNorm2p5D",
    "MeshLayerNorm",
    "RMSNorm2D",
    "RMSNorm2p5D",
]


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

    def batch_group(self) -> GroupInfo:
        """The batch group: COL in 2D, XZ (COL and DEP) in 2.5D."""
        return self.mesh.batch

    def defer_gradient_sum(self) -> dict[str, list[nn.Parameter]]:
        """See :meth:`GroupLayerNorm.defer_gradient_sum` (the mesh's depth sum is not used)."""
        return GroupLayerNorm.defer_gradient_sum(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """See the class docstring for shapes."""
        return self.normalize(x, self.mesh.row)

    def extra_repr(self) -> str:
        """The summary shown by ``print(module)``."""
        return self.norm_repr() + super().extra_repr()


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
