"""Tensor mode ``'1d'``: Megatron-LM's split of each layer over a line of ranks.

Shoeybi et al. 2019, "Megatron-LM": a column-split linear then a row-split one, one
all-reduce per pair; between the pairs every tensor rank holds the whole activations.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from ..initializers import Tensor1DInitializer
from ..modes import ParallelMode
from .base import TensorMode

__all__ = ["Mode1D"]


class Mode1D(TensorMode):
    """``tensor=dict(size=N, mode='1d', sequence_parallel=False)``: any ``N`` ranks."""

    name: ClassVar[str] = "1d"
    arguments = ("sequence_parallel",)
    splits_weights = True
    open_arguments = True
    initializer = Tensor1DInitializer
    replicated_activations = True
    planned = True
    sizes_in_words = "1d needs 2 or more ranks"

    def mesh_axes(self, size: int, args: Mapping[str, Any]) -> tuple[tuple[str, int], ...]:
        """One line: PARALLEL_1D."""
        return ((ParallelMode.PARALLEL_1D.value, size),)
