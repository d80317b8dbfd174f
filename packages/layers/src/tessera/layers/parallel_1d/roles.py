"""How ``parallelize`` builds 1D's roles (Megatron-LM, Shoeybi et al. 2019).

A column layer splits its output features and a row layer its input features, one all-reduce
per pair; between the pairs activations are whole, so a dense layer and a norm there stay the
plain modules (inside a sequence-parallel span a norm holds ``[b, s/p, h]`` instead).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from tessera.context import ParallelContext, ParallelMode

from .linear import Linear1DCol, Linear1DRow

__all__ = ["Roles1D"]

Dims = tuple[int, int, bool]


class Roles1D:
    """:class:`~tessera.layers.shared.mode_layers.RoleBuilders` of tensor mode '1d'."""

    def linear(
        self, dims: Dims, *, row: bool, fused: int, sequence_parallel: bool, **made: Any
    ) -> nn.Module:
        """``Linear1DRow``, or ``Linear1DCol`` holding ``fused`` parts side by side."""
        if row:
            return Linear1DRow(*dims, sequence_parallel=sequence_parallel, **made)
        return Linear1DCol(*dims, sequence_parallel=sequence_parallel, fused=fused, **made)

    def dense(self, dims: Dims, **made: Any) -> nn.Module | None:
        """Whole: replicated activations in, replicated out."""
        return None

    def norm(
        self,
        cls: type[nn.Module],
        args: tuple[Any, ...],
        *,
        inner: bool,
        sequence_parallel: bool,
        **where: Any,
    ) -> nn.Module | None:
        """Whole between the pairs; split inside the span or between a column and row layer.

        An inner norm sees the whole sequence (its column layer gathered it).
        """
        if not sequence_parallel and not inner:
            return None  # replicated activations: the plain norm is already right
        return cls(*args, sequence_parallel=sequence_parallel and not inner, **where)

    def head_block(self, context: ParallelContext) -> int:
        """This rank's 1D rank."""
        return context.get_local_rank(ParallelMode.PARALLEL_1D)
