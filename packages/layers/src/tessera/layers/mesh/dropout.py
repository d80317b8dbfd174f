"""2D and 2.5D dropout: every rank holds a different block of every activation.

Between 2D/2.5D layers no two tensor ranks hold the same elements (batch split over the batch
group, hidden over the row; attention probabilities of a rank's batch and heads likewise), so
every mask is drawn from the TENSOR stream, which differs per tensor rank.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tessera.context import ParallelContext, ParallelMode

from .layout import MeshModule

__all__ = ["Dropout2D", "Dropout2p5D", "MeshDropout"]


class MeshDropout(MeshModule):
    """``torch.nn.Dropout`` drawing from ``ctx.seed(ParallelMode.TENSOR)``.

    Args:
        p: Drop probability.
        inplace: As torch's Dropout.
        context: The ParallelContext (default the current one).
    """

    def __init__(
        self, p: float = 0.5, inplace: bool = False, *, context: ParallelContext | None = None
    ) -> None:
        super().__init__(context)
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
        self.p, self.inplace = p, inplace

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """See the class docstring for shapes."""
        if not self.training or self.p == 0.0:
            return x
        with self.context.seed(ParallelMode.TENSOR):
            return F.dropout(x, self.p, True, self.inplace)

    def extra_repr(self) -> str:
        """The summary shown by ``print(module)``."""
        return f"p={self.p}, " + super().extra_repr()


class Dropout2D(MeshDropout):
    """2D dropout; see :class:`MeshDropout`."""

    MESH = "2d"


class Dropout2p5D(MeshDropout):
    """2.5D dropout; see :class:`MeshDropout`."""

    MESH = "2.5d"
