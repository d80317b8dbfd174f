"""Tensor mode ``'3d'``: a q x q x q cube of ranks.

Bian et al. 2021, "Maximizing Parallelism in Distributed Training for Huge Neural Networks":
inputs, weights and outputs each split over two of the cube's three axes, a product gathers
along one axis and reduce-scatters along another.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, ClassVar

from tessera.registry import ConfigError

from ..initializers import Tensor3DInitializer
from ..modes import ParallelMode
from .base import TensorMode

__all__ = ["Mode3D", "cube_root"]


def cube_root(n: int) -> int:
    """The integer cube root of ``n``, rounded down."""
    root = round(math.pow(n, 1 / 3))
    while root**3 > n:
        root -= 1
    while (root + 1) ** 3 <= n:
        root += 1
    return root


class Mode3D(TensorMode):
    """``tensor=dict(size=q*q*q, mode='3d')``."""

    name: ClassVar[str] = "3d"
    splits_weights = True
    open_arguments = True
    initializer = Tensor3DInitializer
    splits_activations = True
    keeps_gathered = True
    planned = True
    sizes_in_words = "3d needs q*q*q ranks (8, 27, 64, ...)"
    combined_axes: ClassVar[Mapping[str, tuple[str, ...]]] = {
        ParallelMode.PARALLEL_3D_INPUT_X_WEIGHT.value: (
            ParallelMode.PARALLEL_3D_INPUT.value,
            ParallelMode.PARALLEL_3D_WEIGHT.value,
        ),
        ParallelMode.PARALLEL_3D_OUTPUT_X_WEIGHT.value: (
            ParallelMode.PARALLEL_3D_OUTPUT.value,
            ParallelMode.PARALLEL_3D_WEIGHT.value,
        ),
    }

    def check(self, size: int, args: Mapping[str, Any]) -> None:
        """Refuse a size that is not a perfect cube, listing those that are."""
        q = cube_root(size)
        if q**3 != size:
            valid = ", ".join(str(i**3) for i in range(1, 5))
            raise ConfigError(
                f"parallel.tensor.size: tensor size {size} is not a perfect cube; 3d needs "
                f"q*q*q ranks ({valid}, ...); {q}^3 = {q**3} and {q + 1}^3 = {(q + 1) ** 3}"
            )

    def side(self, size: int, args: Mapping[str, Any]) -> int:
        """``q = cbrt(size)``."""
        return cube_root(size)

    def row_blocks(self, size: int, args: Mapping[str, Any]) -> int:
        """``q * q``: the output and weight axes split the batch."""
        return self.side(size, args) ** 2

    def hidden_blocks(self, size: int, args: Mapping[str, Any]) -> int:
        """``q * q``: a weight is ``[out/q^2, in/q]``."""
        return self.side(size, args) ** 2

    def mesh_axes(self, size: int, args: Mapping[str, Any]) -> tuple[tuple[str, int], ...]:
        """``tensor_rank = z * q * q + y * q + x``: the output, input and weight axes."""
        q = self.side(size, args)
        return (
            (ParallelMode.PARALLEL_3D_OUTPUT.value, q),
            (ParallelMode.PARALLEL_3D_INPUT.value, q),
            (ParallelMode.PARALLEL_3D_WEIGHT.value, q),
        )
