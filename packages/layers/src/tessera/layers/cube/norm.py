"""3D LayerNorm: the hidden dim of an activation is split over one cube axis.

In layout ``"y"`` (``"z"``) rank ``(x, y, z)`` holds ``[b/q^2, ..., h/q]`` with hidden block
``y`` (``z``); a row's mean and variance are sums over that axis's group (Bian et al. 2021
normalize the same way; the reductions are :func:`layer_norm_over_group`'s, shared with 2D).
The affine parameters ``[h/q]`` are used by every batch block, so their gradients are summed
over the layout's batch group (one all-reduce inside the norm's backward).
"""

from __future__ import annotations

import torch

from tessera.context import ParallelContext

from ..grid.norm import GroupLayerNorm
from ..shared.context_access import GroupInfo
from .layout import CubeModule, Layout3D, check_layout, check_marked_layout, mark_layout

__all__ = ["LayerNorm3D", "RMSNorm3D"]


class LayerNorm3D(GroupLayerNorm, CubeModule):
    """LayerNorm over the hidden dim of a 3D activation.

    Input and output ``[b/q^2, ..., h/q]`` in ``layout``; ``weight`` and ``bias`` ``[h/q]``
    (``[h]`` in full form, as torch's).

    Args:
        normalized_shape: ``h`` (or ``(h,)``): only the hidden dim is normalized.
        eps: As torch's LayerNorm.
        elementwise_affine: Learn weight (and bias).
        bias: Learn a bias (with ``elementwise_affine``); default yes, none for an RMSNorm.
        dtype: Parameter dtype.
        layout: The input's layout, ``"y"`` (between blocks, the default) or ``"z"``.
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
        layout: Layout3D = "y",
        device: torch.device | str | None = None,
        context: ParallelContext | None = None,
    ) -> None:
        super().__init__(context, device)
        self.layout: Layout3D = check_layout(layout, self.owner)
        cube = self.cube
        self.init_norm(
            normalized_shape,
            eps,
            elementwise_affine,
            bias,
            dtype,
            cube.q,
            cube.hidden(self.layout),
            (cube.across(self.layout).mode, cube.weight.mode),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """See the class docstring for shapes."""
        cube = self.cube
        check_marked_layout(
            x,
            self.layout,
            f"{self.owner}({self.hidden}, layout={self.layout!r})",
            "a LayerNorm after a parallel='col' Linear is built with "
            "LayerNorm(..., parallel_input=True) (LayerNorm3D(..., layout='z'))",
        )
        y = self.normalize(x, cube.hidden(self.layout))
        return mark_layout(y, self.layout)

    def batch_group(self) -> GroupInfo:
        """The ranks holding the other batch blocks of this layout (a plane of the cube)."""
        return self.cube.batch(self.layout)

    def extra_repr(self) -> str:
        """The summary shown by ``print(module)``."""
        return f"{self.norm_repr()}layout={self.layout!r}, " + super().extra_repr()


class RMSNorm3D(LayerNorm3D):
    """3D RMSNorm (Zhang and Sennrich 2019): :class:`LayerNorm3D` without centering or bias."""

    RMS = True
