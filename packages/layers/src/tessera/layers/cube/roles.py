"""How ``parallelize`` builds 3D's roles (Bian et al. 2021).

A column layer takes layout "y" (between blocks) and returns "z"; a row layer takes "z" back
to "y"; a dense layer computes in "z" and swaps its output back to "y" with the mirror rank.
A norm inside a column-to-row pair takes "z", any other "y".
"""

from __future__ import annotations

from typing import Any

from torch import nn

from tessera.context import ParallelContext

from .layout import Layout3D, cube_of
from .linear import Linear3D

__all__ = ["Roles3D"]

Dims = tuple[int, int, bool]


class Roles3D:
    """:class:`~tessera.layers.shared.mode_layers.RoleBuilders` of tensor mode '3d'."""

    def linear(
        self, dims: Dims, *, row: bool, fused: int, sequence_parallel: bool, **made: Any
    ) -> nn.Module:
        """``Linear3D`` from layout "y" (a column layer) or "z" (a row layer)."""
        layout: Layout3D = "z" if row else "y"
        return Linear3D(*dims, input_layout=layout, fused=fused, **made)

    def dense(self, dims: Dims, **made: Any) -> nn.Module | None:
        """``Linear3D`` from layout "y" back to "y"."""
        return Linear3D(*dims, input_layout="y", output_layout="y", **made)

    def norm(
        self,
        cls: type[nn.Module],
        args: tuple[Any, ...],
        *,
        inner: bool,
        sequence_parallel: bool,
        **where: Any,
    ) -> nn.Module | None:
        """The cube's norm in the layout it reads."""
        layout: Layout3D = "z" if inner else "y"
        return cls(*args, layout=layout, **where)

    def head_block(self, context: ParallelContext) -> int:
        """This rank's place on the axis splitting layout "z" (a column layer's output)."""
        return cube_of(context).hidden("z").rank
