"""Tensor mode ``'2.5d'``: Tesseract, ``depth`` stacked q x q SUMMA meshes.

Wang et al. 2021, "2.5-dimensional distributed model training" (Tesseract): the batch is
split over the depth, each layer of the stack multiplies as 2D does (two_d.py's mesh).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, ClassVar

from tessera.registry import ConfigError

from ..initializers import Tensor2p5DInitializer
from ..modes import ParallelMode
from .base import TensorMode, check_positive
from .two_d import square_side

__all__ = ["Mode2p5D"]


class Mode2p5D(TensorMode):
    """``tensor=dict(size=q*q*depth, mode='2.5d', depth=depth)``."""

    name: ClassVar[str] = "2.5d"
    arguments = ("depth",)
    splits_weights = True
    open_arguments = True
    initializer = Tensor2p5DInitializer
    splits_activations = True
    planned = True
    sizes_in_words = "2.5d needs q*q*d ranks with q, d >= 2 (8, 12, 16, 18, ...)"
    combined_axes: ClassVar[Mapping[str, tuple[str, ...]]] = {
        ParallelMode.PARALLEL_2P5D_XZ.value: (
            ParallelMode.PARALLEL_2P5D_DEP.value,
            ParallelMode.PARALLEL_2P5D_COL.value,
        )
    }

    def check(self, size: int, args: Mapping[str, Any]) -> None:
        """Require ``depth`` and refuse a size that is not ``q * q * depth``."""
        if "depth" not in args:
            raise ConfigError(
                f"parallel.tensor.depth is missing; mode '2.5d' splits tensor size {size} into "
                "q * q * depth ranks, e.g. tensor=dict(size=8, mode='2.5d', depth=2)"
            )
        depth = check_positive("parallel.tensor.depth", args["depth"])
        if size % depth or square_side(size // depth) is None:
            valid = ", ".join(str(i * i * depth) for i in range(1, 5))
            raise ConfigError(
                f"parallel.tensor.size: tensor size {size} is not q*q*depth with depth {depth} "
                f"({size} / {depth} = {size / depth:g} is not a perfect square); "
                f"2.5d with depth {depth} needs {valid}, ... ranks"
            )

    def side(self, size: int, args: Mapping[str, Any]) -> int:
        """``q = sqrt(size / depth)``."""
        return math.isqrt(size // int(args.get("depth", 1)))

    def row_blocks(self, size: int, args: Mapping[str, Any]) -> int:
        """``depth * q``: the depth and each layer's columns split the batch."""
        return int(args.get("depth", 1)) * self.side(size, args)

    def weight_blocks(self, size: int, args: Mapping[str, Any]) -> int:
        """``q * q``: a weight is cut over one layer, and kept by each of the ``depth``."""
        return self.side(size, args) ** 2

    def mesh_axes(self, size: int, args: Mapping[str, Any]) -> tuple[tuple[str, int], ...]:
        """``tensor_rank = dep * q * q + row * q + col``: the layer, its row, its column."""
        q = self.side(size, args)
        return (
            (ParallelMode.PARALLEL_2P5D_DEP.value, int(args.get("depth", 1))),
            (ParallelMode.PARALLEL_2P5D_COL.value, q),
            (ParallelMode.PARALLEL_2P5D_ROW.value, q),
        )

    def label(self, size: int, args: Mapping[str, Any]) -> str:
        """``2.5d(8,d=2)``."""
        return f"{self.name}({size},d={args.get('depth', 1)})"
