"""Tensor mode ``'sequence'``: each rank holds a chunk of every sequence.

Li et al. 2021, "Sequence Parallelism: Long Sequence Training from System Perspective": the
parameters are whole on every rank, attention exchanges keys and values around a ring; a
parameter is therefore replicated over data x sequence ranks, and its gradient summed there.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from ..initializers import SequenceInitializer
from ..modes import ParallelMode
from .base import TensorMode

__all__ = ["ModeSequence"]


class ModeSequence(TensorMode):
    """``tensor=dict(size=N, mode='sequence')``: any ``N`` ranks."""

    name: ClassVar[str] = "sequence"
    open_arguments = True
    splits_sequence = True
    initializer = SequenceInitializer
    replica_group = ParallelMode.SEQUENCE_DP.value
    gradient_handler = "SequenceParallelGradientHandler"
    token_loss_spans_ranks = True

    def mesh_axes(self, size: int, args: Mapping[str, Any]) -> tuple[tuple[str, int], ...]:
        """One line: SEQUENCE (chunks of the tokens)."""
        return ((ParallelMode.SEQUENCE.value, size),)
