"""2D and 2.5D dropout: every rank holds a different block of every activation.

Between 2D/2.5D layers no two tensor ranks hold the same elements (batch split over the batch
group, hidden over the row; attention probabilities of a rank's batch and heads likewise), so
every mask is drawn from the TENSOR stream, which differs per tensor rank.
"""

from __future__ import annotations

from tessera.context import ParallelContext

from ..shared.dropout import ParallelDropout
from .layout import MeshModule

__all__ = ["Dropout2D", "Dropout2p5D", "MeshDropout"]


class MeshDropout(ParallelDropout, MeshModule):
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
        self.init_dropout(p, inplace)


class Dropout2D(MeshDropout):
    """2D dropout; see :class:`MeshDropout`."""

    MESH = "2d"


class Dropout2p5D(MeshDropout):
    """2.5D dropout; see :class:`MeshDropout`."""

    MESH = "2.5d"
