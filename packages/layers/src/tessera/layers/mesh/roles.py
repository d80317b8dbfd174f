"""How ``parallelize`` builds the roles of 2D (SUMMA) and 2.5D (Tesseract).

Every linear layer, column, row or dense alike, is the mesh's ``Linear2D`` / ``Linear2p5D``:
activations in and out are blocks of rows and features; a norm normalizes its block's rows
over the mesh row.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from tessera.context import ParallelContext

from .layout import mesh_of

__all__ = ["MeshRoles"]

Dims = tuple[int, int, bool]


class MeshRoles:
    """:class:`~tessera.layers.shared.mode_layers.RoleBuilders` of a mesh mode.

    Args:
        linear_class: ``Linear2D`` or ``Linear2p5D``.
    """

    def __init__(self, linear_class: type[nn.Module]) -> None:
        self.linear_class = linear_class

    def linear(
        self, dims: Dims, *, row: bool, fused: int, sequence_parallel: bool, **made: Any
    ) -> nn.Module:
        """The mesh's linear layer: column and row alike split both dims of the weight."""
        return self.linear_class(*dims, fused=fused, **made)

    def dense(self, dims: Dims, **made: Any) -> nn.Module | None:
        """The mesh's linear layer: it keeps the layout between blocks by itself."""
        return self.linear_class(*dims, fused=1, **made)

    def norm(
        self,
        cls: type[nn.Module],
        args: tuple[Any, ...],
        *,
        inner: bool,
        sequence_parallel: bool,
        **where: Any,
    ) -> nn.Module | None:
        """The mesh's norm, wherever it sits."""
        return cls(*args, **where)

    def head_block(self, context: ParallelContext) -> int:
        """This rank's place in the ROW group (which splits the hidden dim)."""
        return mesh_of(context, str(context.config.tensor_mode)).hidden_axis.rank
