"""The q x q x q cube of 3D tensor parallelism: its groups, activation layouts and matmul.

Bian et al. 2021, "Maximizing Parallelism in Distributed Training for Huge Neural Networks"
(after Agarwal et al. 1995's 3D matrix multiplication): ``P = q^3`` ranks, tensor rank
``t = z q^2 + y q + x`` with x the *weight* axis, y the *input* axis and z the *output* axis
(``tessera.context``'s layout). ``C = A B`` with ``C_ij = sum_l A_il B_lj`` puts the product
``A_il B_lj`` on rank ``(i, l, j)`` of the cube: every rank does ``1/P`` of the flops and each
operand moves along one axis only, ``O(P^(1/3))`` communication per rank.

Activation layouts (``Layout3D``). An activation ``[b, ..., h]`` is split in two dims:

* layout ``"y"`` (between blocks; what ``split_activation`` returns): the hidden dim in ``q``
  blocks over the INPUT axis (block ``y``), the batch in ``q^2`` blocks over
  ``PARALLEL_3D_OUTPUT_X_WEIGHT`` (block ``z q + x``). Rank ``(x, y, z)`` holds
  ``[b/q^2, ..., h/q]``;
* layout ``"z"``: the roles of y and z swapped: hidden block ``z``, batch block ``y q + x``
  (over ``PARALLEL_3D_INPUT_X_WEIGHT``).

No two ranks hold the same elements. A linear layer maps one layout to the other
(:mod:`tessera.layers.cube.matmul`): its input features lie on the input layout's hidden axis
``A``, its output features on the other axis ``B``, so consecutive layers alternate ``"y" ->
"z" -> "y"``.
Each layer says which layout it takes (``Linear3D(..., input_layout=...)``); nothing is
flipped behind the user's back, so two models built in one process cannot interfere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist

from tessera.context import ParallelContext, ParallelMode

from ..comm.collectives import check_divisible
from ..comm.inflight import start_transfers
from ..comm.ops import apply_function, copy_to_group, gather_along_dim, split_along_dim
from ..grid.base import GridModule
from ..shared.context_access import GroupInfo, group_info
from ..shared.input_checks import check_block_dim

__all__ = [
    "LAYOUTS_3D",
    "Cube",
    "CubeModule",
    "Layout3D",
    "check_marked_layout",
    "cube_of",
    "mark_layout",
    "gather_cube_activation",
    "ids_in_layout_y",
    "split_cube_activation",
    "split_cube_batch",
    "switch_cube_layout",
]

#: The cube axis that splits an activation's hidden dim.
Layout3D = Literal["y", "z"]
LAYOUTS_3D: tuple[Layout3D, ...] = ("y", "z")


@dataclass(frozen=True)
class Cube:
    """This rank's view of the 3D cube.

    Attributes:
        weight: PARALLEL_3D_WEIGHT (varies x; local rank x).
        input: PARALLEL_3D_INPUT (varies y; local rank y).
        output: PARALLEL_3D_OUTPUT (varies z; local rank z).
        input_x_weight: same z, local rank ``y q + x``: the batch group of layout ``"z"``.
        output_x_weight: same y, local rank ``z q + x``: the batch group of layout ``"y"``.
        mirror: ``(TENSOR group, global rank of (x, z, y))``: the rank holding, in the other
            layout, the block this rank holds; ``None`` when the context's groups do not
            follow tessera's layout.
    """

    weight: GroupInfo
    input: GroupInfo
    output: GroupInfo
    input_x_weight: GroupInfo
    output_x_weight: GroupInfo
    mirror: tuple[dist.ProcessGroup, int] | None = None

    @property
    def q(self) -> int:
        """The side of the cube."""
        return self.weight.world_size

    def hidden(self, layout: Layout3D) -> GroupInfo:
        """The axis splitting the hidden dim in ``layout`` (y: INPUT, z: OUTPUT)."""
        return self.input if layout == "y" else self.output

    def across(self, layout: Layout3D) -> GroupInfo:
        """The axis that is neither the weight axis nor ``layout``'s hidden axis.

        It is the outer index of ``layout``'s batch block.
        """
        return self.output if layout == "y" else self.input

    def batch(self, layout: Layout3D) -> GroupInfo:
        """The q*q ranks sharing ``layout``'s hidden block: the batch is split over them."""
        return self.output_x_weight if layout == "y" else self.input_x_weight

    @property
    def hidden_axis(self) -> GroupInfo:
        """:class:`~tessera.layers.grid.base.Grid`: INPUT, the hidden axis of layout ``"y"``."""
        return self.input

    @property
    def batch_axis(self) -> GroupInfo:
        """:class:`~tessera.layers.grid.base.Grid`: the batch group of layout ``"y"``."""
        return self.output_x_weight

    @property
    def table_modes(self) -> tuple[str, str]:
        """:class:`~tessera.layers.grid.base.Grid`: tables lie on the INPUT x WEIGHT face."""
        return (self.input.mode, self.weight.mode)

    @property
    def table_replicated(self) -> tuple[str, ...]:
        """:class:`~tessera.layers.grid.base.Grid`: tables are replicated over OUTPUT."""
        return (self.output.mode,)

    def gather_table(self, param: torch.Tensor, dim: int) -> torch.Tensor:
        """A ``dim`` split over (INPUT, WEIGHT) and replicated over OUTPUT -> INPUT block ``y``.

        All-gather over WEIGHT (backward: reduce-scatter, summing the x ranks' partial
        gradients) after routing through OUTPUT (backward: sum over the z ranks). Used by
        the tables and heads whose output is in layout ``"y"`` (embeddings, classifier).
        """
        param = copy_to_group(param, self.output.group)
        return gather_along_dim(param, dim, self.weight.group, partial_grad=True)

    def check_local(
        self, x: torch.Tensor, dim: int, expected: int, what: str, *, name: str = "size"
    ) -> None:
        """``ValueError`` (before any collective) unless ``x.shape[dim] == expected``.

        ``expected`` is the local block ``full / q`` of a dim split over one cube axis; the
        message names ``what`` (the layer), ``name`` (what ``full`` is, e.g. ``in_features``)
        and the arithmetic (:func:`~tessera.layers.shared.input_checks.check_block_dim`).
        """
        block = f"a 3d activation, q={self.q}: split the input with split_activation / split_batch"
        check_block_dim(x, dim, expected, what, name, self.q, block)


def cube_of(context: ParallelContext) -> Cube:
    """The cube of a context with tensor mode ``'3d'``.

    Raises:
        ValueError: the context's tensor mode is not ``'3d'``.
    """
    if context.config.tensor_mode != "3d":
        raise ValueError(
            "3d layers need a context with tensor mode '3d', but its tensor mode is "
            f"{context.config.tensor_mode!r}"
        )
    weight = group_info(context, ParallelMode.PARALLEL_3D_WEIGHT)
    inputs = group_info(context, ParallelMode.PARALLEL_3D_INPUT)
    output = group_info(context, ParallelMode.PARALLEL_3D_OUTPUT)
    return Cube(
        weight=weight,
        input=inputs,
        output=output,
        input_x_weight=group_info(context, ParallelMode.PARALLEL_3D_INPUT_X_WEIGHT),
        output_x_weight=group_info(context, ParallelMode.PARALLEL_3D_OUTPUT_X_WEIGHT),
        mirror=_mirror(context, weight.rank, inputs.rank, output.rank, weight.world_size),
    )


def _mirror(
    context: ParallelContext, x: int, y: int, z: int, q: int
) -> tuple[dist.ProcessGroup, int] | None:
    """The TENSOR group and the global rank of ``(x, z, y)`` (tensor rank ``z q^2 + y q + x``)."""
    if not context.is_initialized(ParallelMode.TENSOR):
        return None
    tensor = context.get_ranks_in_group(ParallelMode.TENSOR)
    if len(tensor) != q**3 or context.get_local_rank(ParallelMode.TENSOR) != z * q * q + y * q + x:
        return None
    return context.get_group(ParallelMode.TENSOR), tensor[y * q * q + z * q + x]


class _SwapLayout(torch.autograd.Function):
    """Exchange blocks with the mirror rank; the backward exchanges the gradients back."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup, peer: int) -> torch.Tensor:
        ctx.group, ctx.peer = group, peer
        return _swap(x, group, peer)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _swap(grad, ctx.group, ctx.peer), None, None


def _swap(x: torch.Tensor, group: dist.ProcessGroup, peer: int) -> torch.Tensor:
    if peer == dist.get_rank():
        return x.clone()
    x = x.contiguous()
    out = torch.empty_like(x)
    for work in start_transfers([(peer, x)], [(peer, out)], group):
        work.wait()
    return out


def switch_cube_layout(x: torch.Tensor, cube: Cube, layout: Layout3D) -> torch.Tensor:
    """``[b/q^2, ..., h/q]`` in ``layout`` -> the same activation in the other layout.

    In layout ``"z"`` rank ``(x, y, z)`` holds batch block ``y q + x`` and hidden block ``z``;
    in ``"y"`` it holds batch block ``z q + x`` and hidden block ``y``: the block it needs is
    held by ``(x, z, y)``, so the two ranks swap (the diagonal keeps its own).

    Raises:
        ValueError: the context's groups do not follow tessera's 3d layout.
    """
    if cube.mirror is None:
        raise ValueError(
            "switch_cube_layout: the context's TENSOR group does not follow tessera's 3d layout "
            "(tensor rank z q^2 + y q + x), so the mirror rank is unknown"
        )
    group, peer = cube.mirror
    out = apply_function(_SwapLayout, x, group, peer)
    return mark_layout(out, other_layout(layout))


def ids_in_layout_y(ids: torch.Tensor, cube: Cube) -> torch.Tensor:
    """Row-indexed ids (``[b/q^2, s]``) in layout ``"y"``'s rows, which embeddings read.

    Ids marked ``"z"`` (:func:`mark_layout`) hold layout ``"z"``'s rows: per-sample position
    ids, which the model boundary gives in attention's rows (a mask or rotary positions built
    from them must match the rows attention runs on); the mirror ranks swap them. Anything
    else is returned as it is.
    """
    if getattr(ids, LAYOUT_ATTR, None) != "z":
        return ids
    return switch_cube_layout(ids, cube, "z")


def check_layout(layout: str, owner: str) -> Layout3D:
    """``layout`` as a :data:`Layout3D` (``ValueError`` naming ``owner`` otherwise)."""
    if layout == "y":
        return "y"
    if layout == "z":
        return "z"
    raise ValueError(f"{owner}: a 3d layout is 'y' or 'z' (the hidden dim's axis), got {layout!r}")


#: The attribute under which a 3D layer's output records its layout.
LAYOUT_ATTR = "_tessera_layout_3d"


def mark_layout(x: torch.Tensor, layout: Layout3D) -> torch.Tensor:
    """Record on ``x`` (a 3D layer's output) that it is in ``layout``; returns ``x``.

    Both layouts have the same local shape, so a layer fed the other one would compute
    garbage silently. The mark lets the next 3D layer check what it is given; it lives on this
    tensor only (an elementwise op in between returns an unmarked tensor, which is not checked).
    """
    setattr(x, LAYOUT_ATTR, layout)
    return x


def check_marked_layout(x: torch.Tensor, expected: Layout3D, owner: str, fix: str) -> None:
    """``ValueError`` if ``x`` carries a layout mark other than ``expected``.

    Args:
        x: The input of a 3D layer.
        expected: The layout the layer takes.
        owner: The layer, for the message.
        fix: What to change, for the message.
    """
    got = getattr(x, LAYOUT_ATTR, None)
    if got is not None and got != expected:
        raise ValueError(
            f"{owner} takes 3d layout {expected!r}, but its input is in layout {got!r} (the "
            f"output of a layer that switched the layout); {fix}"
        )


def other_layout(layout: Layout3D) -> Layout3D:
    """The layout a linear layer maps ``layout`` to."""
    return "z" if layout == "y" else "y"


class CubeModule(GridModule):
    """Base of the 3D layers: keeps the :class:`Cube`.

    Args:
        context: The ParallelContext (default the current one).
        device: Where parameters live (default the context's device).
    """

    def __init__(
        self,
        context: ParallelContext | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__(context, device)
        self.cube = cube_of(self.context)

    @property
    def grid(self) -> Cube:
        """The cube, as the :class:`~tessera.layers.grid.base.Grid` of the shared layers."""
        return self.cube

    def gather_table(self, param: torch.Tensor, dim: int) -> torch.Tensor:
        """:meth:`Cube.gather_table` of this layer's cube."""
        return self.cube.gather_table(param, dim)

    def extra_repr(self) -> str:
        """The summary shown by ``print(module)``."""
        return f"q={self.cube.q}"


# ---------------------------------------------------------------------------- activations


def _check(x: torch.Tensor, cube: Cube, dims: tuple[int, ...], what: str) -> None:
    if x.dim() < max(len(dims), 1) or (len(dims) == 2 and x.dim() < 2):
        raise ValueError(
            f"{what}: 3d splits the batch (dim 0) and the hidden dim (last) of "
            f"[batch, ..., hidden], but the activation has shape {list(x.shape)}"
        )
    names = {0: "batch", -1: "hidden"}
    for dim in dims:
        divisor = cube.q * cube.q if dim == 0 else cube.q
        check_divisible(
            x.shape[dim],
            divisor,
            f"{what}: dim {dim % x.dim()} ({names[dim]}) of activation {list(x.shape)} "
            f"under 3d (q={cube.q})",
        )


def split_cube_activation(x: torch.Tensor, cube: Cube, layout: Layout3D = "y") -> torch.Tensor:
    """``[b, ..., h]`` -> ``[b/q^2, ..., h/q]`` in ``layout``; the backward all-gathers."""
    _check(x, cube, (0, -1), "split_activation")
    x = split_along_dim(x, 0, cube.batch(layout).group)  # [b/q^2, ..., h]
    return split_along_dim(x, -1, cube.hidden(layout).group)  # [b/q^2, ..., h/q]


def gather_cube_activation(x: torch.Tensor, cube: Cube, layout: Layout3D = "y") -> torch.Tensor:
    """``[b/q^2, ..., h/q]`` in ``layout`` -> ``[b, ..., h]`` on every rank."""
    if x.dim() < 2:
        raise ValueError(
            f"gather_activation: 3d activations are [batch, ..., hidden], got {list(x.shape)}"
        )
    x = gather_along_dim(x, -1, cube.hidden(layout).group)  # [b/q^2, ..., h]
    return gather_along_dim(x, 0, cube.batch(layout).group)  # [b, ..., h]


def split_cube_batch(x: torch.Tensor, cube: Cube) -> torch.Tensor:
    """``[b, ...]`` -> ``[b/q^2, ...]``: the batch block of layout ``"y"`` (ids, targets)."""
    _check(x, cube, (0,), "split_batch")
    return split_along_dim(x, 0, cube.output_x_weight.group)
