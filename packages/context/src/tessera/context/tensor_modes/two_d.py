"""Tensor mode ``'2d'``: SUMMA on a q x q mesh of ranks.

Xu et al. 2021, "An Efficient 2D Method for Training Super-Large Deep Learning Models"
(Optimus): activations and weights are split into q x q blocks, a product broadcasts panels
along the mesh's rows and columns (van de Geijn and Watts' SUMMA).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, ClassVar

from tessera.registry import ConfigError

from ..initializers import Tensor2DInitializer
from ..modes import ParallelMode
from .base import TensorMode

__all__ = ["Mode2D", "square_side"]


def square_side(ranks: int) -> int | None:
    """The side ``q`` of a ``q x q`` mesh of ``ranks`` ranks, or ``None`` where there is none.

    Shared by 2D and 2.5D, each of whose layers is such a mesh.
    """
    q = math.isqrt(ranks)
    return q if q * q == ranks else None


class Mode2D(TensorMode):
    """``tensor=dict(size=q*q, mode='2d')``."""

    name: ClassVar[str] = "2d"
    splits_weights = True
    open_arguments = True
    initializer = Tensor2DInitializer
    splits_activations = True
    planned = True
    sizes_in_words = "2d needs q*q ranks (4, 9, 16, ...)"

    def check(self, size: int, args: Mapping[str, Any]) -> None:
        """Refuse a size that is not a perfect square, listing those that are."""
        if square_side(size) is None:
            q = math.isqrt(size)
            valid = ", ".join(str(i * i) for i in range(1, 6))
            raise ConfigError(
                f"parallel.tensor.size: tensor size {size} is not a perfect square; 2d needs q*q "
                f"ranks ({valid}, ...); {q}*{q} = {q * q} and {q + 1}*{q + 1} = {(q + 1) ** 2}"
            )

    def side(self, size: int, args: Mapping[str, Any]) -> int:
        """``q = sqrt(size)``."""
        return math.isqrt(size)

    def row_blocks(self, size: int, args: Mapping[str, Any]) -> int:
        """``q``: the mesh's columns split the batch."""
        return self.side(size, args)

    def weight_blocks(self, size: int, args: Mapping[str, Any]) -> int:
        """``q * q``: a weight is cut over the whole mesh."""
        return self.side(size, args) ** 2

    def mesh_axes(self, size: int, args: Mapping[str, Any]) -> tuple[tuple[str, int], ...]:
        """``tensor_rank = row * q + col``: the row (along a COL group), then the column."""
        q = self.side(size, args)
        return (
            (ParallelMode.PARALLEL_2D_COL.value, q),
            (ParallelMode.PARALLEL_2D_ROW.value, q),
        )
