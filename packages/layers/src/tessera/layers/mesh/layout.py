"""The q x q (x depth) mesh shared by 2D (SUMMA) and 2.5D (Tesseract) tensor parallelism.

2D (Xu et al. 2021, "An Efficient 2D Method for Training Super-Large Deep Learning Models")
runs SUMMA on a q x q mesh; 2.5D (Wang et al. 2021, "Tesseract") stacks ``depth`` such meshes,
splits the batch once more across them and keeps every weight's q x q blocks in each layer.
So 2D *is* 2.5D with depth 1, and every 2D/2.5D layer is written once against :class:`Mesh`:

* rank ``(i, j, k)`` = (row, col, depth); the ROW group (same ``i``, ``k``) is ordered by
  ``j``, the COL group (same ``j``, ``k``) by ``i``, the DEP group (same ``i``, ``j``) by
  ``k``;
* an activation ``[b, ..., h]`` is split along the batch into ``depth * q`` blocks, block
  ``k * q + i`` on rank ``(i, j, k)``, and along the hidden dim into ``q`` blocks, block
  ``j``: rank ``(i, j, k)`` holds ``[b / (depth q), ..., h / q]``. The ranks sharing ``j``
  (the COL group in 2D, the XZ group in 2.5D) are the *batch group*;
* a weight is split in two dims over ROW and COL; in 2.5D every depth layer holds the same
  blocks (replicated over DEP), and the depth layers' partial gradients are summed inside
  autograd, so ``.grad`` is complete after backward (Tesseract's all-reduce of weight
  gradients across depth): a ``Linear``'s product does it in one all-reduce with its bias
  (:mod:`tessera.layers.mesh.matmul`), tables go through :meth:`Mesh.over_depth`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import ClassVar

import torch
import torch.distributed as dist
from torch import nn

from tessera.context import ParallelContext, ParallelMode

from ..comm.collectives import check_divisible
from ..comm.ops import copy_to_group, gather_along_dim, split_along_dim
from ..grid.base import GridModule
from ..shared.context_access import GroupInfo, group_info
from ..shared.input_checks import check_block_dim

__all__ = [
    "MESH_MODES",
    "Mesh",
    "MeshModule",
    "MeshRanks",
    "gather_mesh_activation",
    "mesh_of",
    "split_mesh_activation",
    "split_mesh_batch",
]

#: The tensor modes whose layers run on a :class:`Mesh`.
MESH_MODES = ("2d", "2.5d")


@dataclass(frozen=True)
class MeshRanks:
    """The global ranks of this rank's q x q layer of the mesh, for sends between any two.

    SUMMA needs only the ROW and COL groups; the variant that keeps the weights in place
    (:mod:`tessera.layers.mesh.matmul`) also sends blocks to transposed positions.

    Attributes:
        group: The TENSOR group (every send of the mesh goes through it).
        grid: ``grid[i][j]`` is the global rank of mesh position ``(i, j)`` of this layer.
    """

    group: dist.ProcessGroup
    grid: tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class Mesh:
    """This rank's view of a 2D or 2.5D mesh.

    Attributes:
        kind: ``"2d"`` or ``"2.5d"``.
        row: The ROW group (same row and depth; local rank = col ``j``; size q).
        col: The COL group (same col and depth; local rank = row ``i``; size q).
        dep: The DEP group (same row and col; local rank = depth ``k``), ``None`` for 2D.
        batch: The ranks sharing ``j`` (local rank ``k * q + i``; size ``depth * q``): COL
            in 2D, XZ in 2.5D. An activation's batch is split over it.
        ranks: Every position's global rank in this layer, or ``None`` when the context's
            groups do not follow tessera's layout (then only SUMMA runs).
        sums_depth: Whether the layer sums its depth-replicated gradients over DEP inside
            autograd (``False`` once :meth:`MeshModule.defer_gradient_sum` handed the sum to
            the training loop).
    """

    kind: str
    row: GroupInfo
    col: GroupInfo
    dep: GroupInfo | None
    batch: GroupInfo
    ranks: MeshRanks | None = None
    sums_depth: bool = True

    @property
    def q(self) -> int:
        """The side of the mesh."""
        return self.row.world_size

    @property
    def depth(self) -> int:
        """The number of stacked q x q layers (1 in 2D)."""
        return 1 if self.dep is None else self.dep.world_size

    @property
    def suffix(self) -> str:
        """The class-name suffix of the mode's layers: ``2D`` or ``2p5D``."""
        return "2D" if self.kind == "2d" else "2p5D"

    @property
    def depth_modes(self) -> tuple[str, ...]:
        """The modes a weight is replicated over besides its split ones: ``(DEP,)`` or ``()``."""
        return () if self.dep is None else (self.dep.mode,)

    @property
    def batch_modes(self) -> tuple[str, ...]:
        """The modes the batch is split over, outermost first (``ShardInfo`` style)."""
        return (*self.depth_modes, self.col.mode)

    @property
    def depth_sum(self) -> GroupInfo | None:
        """The group autograd sums depth-replicated gradients over.

        DEP, or ``None`` in 2D and once the sum is deferred to the training loop.
        """
        return self.dep if self.sums_depth else None

    def over_depth(self, weight: torch.Tensor) -> torch.Tensor:
        """Route a depth-replicated parameter: identity forward, sum over DEP backward."""
        group = self.depth_sum
        return weight if group is None else copy_to_group(weight, group.group)

    @property
    def hidden_axis(self) -> GroupInfo:
        """:class:`~tessera.layers.grid.base.Grid`: ROW splits the hidden dim (and the classes)."""
        return self.row

    @property
    def batch_axis(self) -> GroupInfo:
        """:class:`~tessera.layers.grid.base.Grid`: the batch group (COL in 2D, XZ in 2.5D)."""
        return self.batch

    @property
    def table_modes(self) -> tuple[str, str]:
        """:class:`~tessera.layers.grid.base.Grid`: a table's dim in ``q * q`` blocks (ROW, COL)."""
        return (self.row.mode, self.col.mode)

    @property
    def table_replicated(self) -> tuple[str, ...]:
        """:class:`~tessera.layers.grid.base.Grid`: tables are replicated over depth only."""
        return self.depth_modes

    def gather_table(self, param: torch.Tensor, dim: int) -> torch.Tensor:
        """Blocks ``j * q + i`` of ``dim`` -> block ``j``: all-gather over COL.

        The backward reduce-scatters (the mesh rows saw other batch blocks) and, in 2.5D,
        sums over DEP.
        """
        return gather_along_dim(self.over_depth(param), dim, self.col.group, partial_grad=True)

    def over_batch(self, param: torch.Tensor) -> torch.Tensor:
        """Route a parameter used by every batch block (a bias): sum its gradient over them."""
        return copy_to_group(param, self.batch.group)

    def check_local(
        self, x: torch.Tensor, dim: int, expected: int, what: str, *, name: str = "size"
    ) -> None:
        """``ValueError`` (before any collective) unless ``x.shape[dim] == expected``.

        ``expected`` is the local block ``full / q`` of a dim split over the mesh; the message
        names ``what`` (the layer), ``name`` (what ``full`` is, e.g. ``in_features``) and the
        arithmetic (:func:`~tessera.layers.shared.input_checks.check_block_dim`).
        """
        block = (
            f"a {self.kind} activation, q={self.q}, depth={self.depth}: split the input with "
            "split_activation"
        )
        check_block_dim(x, dim, expected, what, name, self.q, block)


def mesh_of(context: ParallelContext, kind: str) -> Mesh:
    """The mesh of ``context`` for tensor mode ``kind`` (``"2d"`` or ``"2.5d"``).

    Raises:
        ValueError: ``kind`` is not a mesh mode, or the context's tensor mode differs.
    """
    if kind not in MESH_MODES:
        raise ValueError(f"mesh mode must be one of {MESH_MODES}, got {kind!r}")
    if context.config.tensor_mode != kind:
        raise ValueError(
            f"{kind} layers need a context with tensor mode {kind!r}, but its tensor mode is "
            f"{context.config.tensor_mode!r}"
        )
    if kind == "2d":
        row = group_info(context, ParallelMode.PARALLEL_2D_ROW)
        col = group_info(context, ParallelMode.PARALLEL_2D_COL)
        return Mesh(kind, row, col, None, col, _mesh_ranks(context, row, col, None))
    row = group_info(context, ParallelMode.PARALLEL_2P5D_ROW)
    col = group_info(context, ParallelMode.PARALLEL_2P5D_COL)
    dep = group_info(context, ParallelMode.PARALLEL_2P5D_DEP)
    depth = dep if dep.world_size > 1 else None
    batch = group_info(context, ParallelMode.PARALLEL_2P5D_XZ)
    return Mesh(kind, row, col, depth, batch, _mesh_ranks(context, row, col, dep))


def _mesh_ranks(
    context: ParallelContext, row: GroupInfo, col: GroupInfo, dep: GroupInfo | None
) -> MeshRanks | None:
    """This layer's rank grid, from the TENSOR group (ordered ``(k, i, j)``, see the layouts).

    Checked against the ROW and COL groups; ``None`` if they disagree (a custom layout).
    """
    if not context.is_initialized(ParallelMode.TENSOR):
        return None
    q = row.world_size
    tensor = context.get_ranks_in_group(ParallelMode.TENSOR)
    layer = (0 if dep is None else dep.rank) * q * q
    if len(tensor) < layer + q * q:
        return None
    grid = tuple(tuple(tensor[layer + i * q + j] for j in range(q)) for i in range(q))
    same_row = dist.get_process_group_ranks(row.group) == list(grid[col.rank])
    same_col = dist.get_process_group_ranks(col.group) == [line[row.rank] for line in grid]
    if not (same_row and same_col):
        return None
    return MeshRanks(context.get_group(ParallelMode.TENSOR), grid)


class MeshModule(GridModule):
    """Base of the 2D and 2.5D layers: one implementation, the mode set by ``MESH``.

    A layer is written once as a ``MeshModule`` subclass; ``Linear2D`` and ``Linear2p5D`` are
    that class with ``MESH = "2d"`` and ``MESH = "2.5d"``.

    Args:
        context: The ParallelContext (default the current one).
        device: Where parameters live (default the context's device).
    """

    #: The tensor mode: ``"2d"`` or ``"2.5d"``.
    MESH: ClassVar[str] = "2d"
    #: The parameters whose gradients autograd sums over DEP (through :meth:`Mesh.over_depth`
    #: or the product's depth all-reduce): what :meth:`defer_gradient_sum` leaves partial.
    DEPTH_SUMMED: ClassVar[tuple[str, ...]] = ()

    def __init__(
        self,
        context: ParallelContext | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__(context, device)
        self.mesh = mesh_of(self.context, self.MESH)

    def depth_summed(self) -> tuple[str, ...]:
        """The names of :attr:`DEPTH_SUMMED` that this instance sums over DEP in autograd."""
        return self.DEPTH_SUMMED

    def defer_gradient_sum(self) -> dict[str, list[nn.Parameter]]:
        """Leave the sum over DEP of the depth-replicated gradients to the training loop.

        Tesseract sums the depth layers' partial weight gradients (Wang et al. 2021); done in
        autograd that is one all-reduce per layer and backward. After this call ``.grad`` of
        the returned parameters holds this depth layer's part until the caller sums it over
        DEP, once per optimizer step and bucketed (tessera.engine does). Nothing to defer in
        2D (no depth) or for a layer whose sums run over the batch group (LayerNorm, biases
        added to the output).

        Returns:
            ``{DEP mode: parameters}`` (see :class:`tessera.context.DefersGradientSum`).
        """
        dep = self.mesh.dep
        params = [
            p for n in self.depth_summed() if isinstance(p := getattr(self, n, None), nn.Parameter)
        ]
        if dep is None or not params:
            return {}
        self.mesh = replace(self.mesh, sums_depth=False)
        return {dep.mode: params}

    @property
    def grid(self) -> Mesh:
        """The mesh, as the :class:`~tessera.layers.grid.base.Grid` of the shared layers."""
        return self.mesh

    def extra_repr(self) -> str:
        """The summary shown by ``print(module)``."""
        return f"q={self.mesh.q}, depth={self.mesh.depth}"


# ---------------------------------------------------------------------------- activations


def _check_activation(x: torch.Tensor, mesh: Mesh, dims: Sequence[int], what: str) -> None:
    if x.dim() < len(dims):
        raise ValueError(
            f"{what}: {mesh.kind} splits the batch (dim 0) and the hidden dim (last) of "
            f"[batch, ..., hidden], but the activation has shape {list(x.shape)}"
        )
    names = {0: "batch", -1: "hidden"}
    for dim in dims:
        divisor = mesh.batch.world_size if dim == 0 else mesh.q
        check_divisible(
            x.shape[dim],
            divisor,
            f"{what}: dim {dim % x.dim()} ({names[dim]}) of activation {list(x.shape)} "
            f"under {mesh.kind} (q={mesh.q}, depth={mesh.depth})",
        )


def split_mesh_activation(x: torch.Tensor, mesh: Mesh) -> torch.Tensor:
    """``[b, ..., h]`` -> ``[b/(depth q), ..., h/q]``; the backward all-gathers."""
    _check_activation(x, mesh, (0, -1), "split_activation")
    x = split_along_dim(x, 0, mesh.batch.group)  # [b/(dq), ..., h]
    return split_along_dim(x, -1, mesh.row.group)  # [b/(dq), ..., h/q]


def gather_mesh_activation(x: torch.Tensor, mesh: Mesh) -> torch.Tensor:
    """``[b/(depth q), ..., h/q]`` -> ``[b, ..., h]`` on every rank; the backward splits."""
    if x.dim() < 2:
        raise ValueError(
            f"gather_activation: {mesh.kind} activations are [batch, ..., hidden], got shape "
            f"{list(x.shape)}"
        )
    x = gather_along_dim(x, -1, mesh.row.group)  # [b/(dq), ..., h]
    return gather_along_dim(x, 0, mesh.batch.group)  # [b, ..., h]


def split_mesh_batch(x: torch.Tensor, mesh: Mesh) -> torch.Tensor:
    """``[b, ...]`` -> ``[b/(depth q), ...]`` (token ids, targets, images); backward gathers."""
    _check_activation(x, mesh, (0,), "split_batch")
    return split_along_dim(x, 0, mesh.batch.group)
