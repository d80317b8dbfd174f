"""The 3D linear layer's product ``y = x W^T``, in whichever variant sends less.

Bian et al. 2021 (after Agarwal et al. 1995) put the product ``A_il B_lj`` on rank ``(i, l,
j)`` of the cube and move both operands to it. For a linear layer with input layout hidden
axis ``A`` and other axis ``B``, rank ``(x, a, b)`` holds ``n`` rows of the input (``n = T /
q^2``) in ``k = in/q`` features and the weight block ``W[out_{b q + x}, in_a]`` of ``o =
out/q^2`` rows. Counting the elements one rank sends in a training step:

* **the operands travel** (:class:`_GatheredCubeLinear`, the paper's): the input over ``B``,
  the weight over WEIGHT, the partial outputs reduce-scattered over ``A``, and in the
  backward the output gradient, the weight and the input again, with the input and weight
  gradients reduce-scattered: ``(q - 1)(3 n k + 2 n o q + 3 o k)``;
* **the weights stay** (:class:`_StationaryCubeLinear`): the input plane (the ``q^2`` ranks
  sharing ``a``) gathers every row of its ``k`` features, each rank multiplies them with its
  own weight block, and an all-to-all over the output plane (the ranks sharing ``b``) brings
  each rank its rows of every partial, summed over ``a``; the backward runs the all-to-all in
  reverse for the output gradient, re-gathers the input, reduce-scatters the input gradient
  over the input plane, and finds the weight gradient complete: ``(q^2 - 1)(3 n k + 2 n o)``.

Both carry the bias: its gradient rides in a collective the product runs anyway (the weight
gradient's reduce-scatter over WEIGHT, or a gather over WEIGHT of the complete slices), so it
costs no all-reduce over the output's batch group.

The weights stay when ``3 q n k + 2 n o < 3 o k`` (``q n k + n o < o k`` without a backward):
few rows per rank against wide layers, the case of small batches (:func:`choose_cube_algorithm`,
the same choice on every rank). Both give the same result to rounding.

**Keeping the gathered operands** (``keep=True``; Colossal-AI's ``Linear3D`` always does): the
forward saves what it gathered (the rows and the weight, or the input plane's rows) for the
backward, which then gathers them no more: ``(q - 1)(2 n k + 2 n o q + 2 o k)`` and
``(q^2 - 1)(2 n k + 2 n o)`` elements, the weights staying when ``q n k + n o < o k``. It
costs ``q (n k + o k)`` (operands travel: the gathered rows and weight) or ``q^2 n k``
(weights stay: the input plane's rows) more saved elements per layer; by default a layer
saves only its own blocks.

Fused parts (q, k, v in one weight): with ``f`` parts, a rank's ``o`` output features are
``f`` runs of ``r = o / f``; the other layout's ``out/q`` features of axis index ``b`` (and the
bias ``[out/q]``) are, per part, the ``q`` WEIGHT ranks' runs in order: ``(part, x, run)``.
"""

from __future__ import annotations

from typing import Any, Literal

import torch

from ..comm.collectives import start_all_gather, start_reduce_scatter
from ..comm.inflight import (
    Pending,
    start_all_to_all_blocks,
    start_gather_blocks,
    start_scatter_blocks,
)
from ..comm.ops import apply_function
from ..shared.block_linear import BlockLinearFunction, gradients_needed
from ..shared.dense import flat_weight
from .layout import Cube, Layout3D, other_layout

__all__ = ["CubeAlgorithm", "choose_cube_algorithm", "cube_linear"]

#: ``"gathered"``: the operands travel; ``"stationary"``: the weights stay (see the module).
CubeAlgorithm = Literal["gathered", "stationary"]


def choose_cube_algorithm(
    rows: int, in_block: int, out_block: int, q: int, *, backward: bool, keep: bool = False
) -> CubeAlgorithm:
    """The variant that sends fewer elements (the module docstring's counts).

    Args:
        rows: ``n``, the rows of this rank's input block.
        in_block: ``k = in/q``.
        out_block: ``o = out/q^2``, the rows of this rank's weight block.
        q: The side of the cube.
        backward: Whether a backward follows (training).
        keep: Whether the forward keeps its gathered operands for the backward.
    """
    n, k, o = rows, in_block, out_block
    if backward and not keep:
        return "stationary" if 3 * q * n * k + 2 * n * o < 3 * o * k else "gathered"
    return "stationary" if q * n * k + n * o < o * k else "gathered"


def _parts(weight: torch.Tensor) -> int:
    """How many fused parts (q, k, v) a weight ``[fused, o/fused, k]`` or ``[o, k]`` holds."""
    return weight.shape[0] if weight.dim() == 3 else 1


# ---------------------------------------------------------------------------- operands travel


class _GatheredCubeLinear(BlockLinearFunction):
    """The operands travel: Bian et al.'s product, saving only the local blocks.

    For input layout with hidden axis ``A`` (local rank ``a``) and other axis ``B`` (``b``),
    on rank ``(x, a, b)``:

    * forward: all-gather the rows over ``B`` (the ``q`` batch blocks ``b' q + x``) and ``W``
      over WEIGHT (output features block ``b``), both in flight at once; multiply (a partial
      sum over the input-feature block ``a``); reduce-scatter over ``A`` (batch block ``a q +
      x``, output features block ``b``: the other layout);
    * backward: the three gathers (``dy`` over ``A``, ``W`` over WEIGHT, the rows over ``B``)
      posted together; ``dW = dy^T x`` reduce-scattered over WEIGHT (summing the x ranks'
      batch blocks) while ``dx = dy W`` is computed, then reduce-scattered over ``B``. Each
      chunk of ``dW`` carries this rank's partial bias gradient, so the bias is summed over
      WEIGHT in the same call (``dy`` gathered over ``A`` already summed it over ``A``). In
      that order the gathered rows are freed before ``dx``'s partial sums are allocated.
    """

    @staticmethod
    def product(
        x: torch.Tensor, weight: torch.Tensor, cube: Cube, layout: Layout3D, keep: bool
    ) -> torch.Tensor | tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """See the class docstring."""
        across, hidden, axis = cube.across(layout), cube.hidden(layout), cube.weight
        x_all = start_all_gather(x, 0, across.group, across.world_size)  # [q n, k]
        # A fused weight [fused, o/fused, k] is gathered part by part (dim -2).
        w_all = start_all_gather(weight, -2, axis.group, axis.world_size)
        rows, table = x_all.wait(), w_all.wait()  # [q n, k], [.., out/q, k]
        partial = torch.matmul(rows, flat_weight(table).t())  # [q n, out/q]
        out = start_reduce_scatter(partial, 0, hidden.group, hidden.world_size).wait()
        return (out, (rows, table)) if keep else out

    @staticmethod
    def backward(
        ctx: Any, grad: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, None, None, None]:
        x, weight, *kept = ctx.saved_tensors
        cube: Cube = ctx.grid[0]
        layout: Layout3D = ctx.grid[1]
        across, hidden, axis = cube.across(layout), cube.hidden(layout), cube.weight
        need_x, need_w, need_b = gradients_needed(ctx)
        k = x.shape[-1]
        dy = grad.reshape(-1, grad.shape[-1])  # [n, out/q]
        g_all = start_all_gather(dy, 0, hidden.group, hidden.world_size)
        w_all: Pending | None = None
        x_all: Pending | None = None
        if kept:  # the forward's gathered rows and weight
            x_all, w_all = Pending.done(kept[0]), Pending.done(kept[1])
        else:
            if need_x:
                w_all = start_all_gather(weight, -2, axis.group, axis.world_size)
            if need_w:
                rows = x.reshape(-1, k)
                x_all = start_all_gather(rows, 0, across.group, across.world_size)
        g = g_all.wait()  # [q n, out/q]
        # dW first: its reduce-scatter travels while dx multiplies, and the gathered rows
        # (q n x k) are gone before dx's partial sums (as many) are allocated
        params = None
        if need_w or need_b:
            dw_all = None if x_all is None or not need_w else g.t() @ x_all.wait()  # [out/q, k]
            x_all = None
            params = _sum_over_weight(
                dw_all, g.sum(0) if need_b else None, weight, axis.group, cube.q
            )
        grad_x = None
        if need_x and w_all is not None:  # [q n, k], partial sums over ``B``
            dx_all = torch.matmul(g, flat_weight(w_all.wait()))
            grad_x = start_reduce_scatter(dx_all, 0, across.group, across.world_size)
        return _finish(grad_x, x.shape, params, weight, need_w)


def _sum_over_weight(
    dw_all: torch.Tensor | None,
    db: torch.Tensor | None,
    weight: torch.Tensor,
    group: torch.distributed.ProcessGroup,
    q: int,
) -> Pending:
    """Reduce-scatter ``dw_all`` ``[out/q, k]`` over WEIGHT, ``db`` ``[out/q]`` riding along.

    Chunk ``x`` holds the runs of rank ``x`` (per part) and, after them, this rank's partial
    bias gradient: rank ``x`` receives its weight gradient and the bias gradient summed.
    """
    f = _parts(weight)
    chunks = []
    if dw_all is not None:  # [f, q, r, k] -> [q, f r k]
        chunks.append(dw_all.view(f, q, -1, dw_all.shape[-1]).transpose(0, 1).reshape(q, -1))
    if db is not None:
        chunks.append(db.unsqueeze(0).expand(q, -1))
    return start_scatter_blocks(torch.cat(chunks, 1), group, q)


def _finish(
    grad_x: Pending | None,
    x_shape: torch.Size,
    params: Pending | None,
    weight: torch.Tensor,
    need_w: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, None, None, None]:
    """Wait for the input gradient, then split the weight and bias gradients."""
    dx = None if grad_x is None else grad_x.wait().view(x_shape)
    grad_w = grad_b = None
    if params is not None:
        flat = params.wait()
        size = weight.numel() if need_w else 0
        grad_w = flat[:size].view(weight.shape) if need_w else None
        grad_b = flat[size:] if flat.numel() > size else None
    return dx, grad_w, grad_b, None, None, None


# ---------------------------------------------------------------------------- weights stay


class _StationaryCubeLinear(BlockLinearFunction):
    """The weights stay; rows and partial outputs travel within the two planes of the rank.

    The input plane is the input layout's batch group (the ``q^2`` ranks sharing ``a``, local
    rank = row block), the output plane the other layout's (sharing ``b``). Forward: gather
    every row block of the plane, multiply with this rank's weight block (``[q^2, n, o]``,
    partial over ``a``), all-to-all over the output plane (row block ``s`` to its owner),
    sum over ``a`` and lay the runs of the ``q`` WEIGHT ranks side by side. Backward: the
    reverse all-to-all gives every row block's gradient of this rank's ``o`` features; ``dx``
    is reduce-scattered over the input plane; ``dW`` and this rank's run of ``db`` are then
    complete, and one gather over WEIGHT assembles ``db``.
    """

    @staticmethod
    def product(
        x: torch.Tensor, weight: torch.Tensor, cube: Cube, layout: Layout3D, keep: bool
    ) -> torch.Tensor | tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """See the class docstring."""
        in_plane, out_plane, q = cube.batch(layout), cube.batch(other_layout(layout)), cube.q
        w = flat_weight(weight)  # [o, k]
        inputs = start_gather_blocks(x, in_plane.group, in_plane.world_size).wait()
        parts = torch.matmul(inputs, w.t())  # [q^2, n, o]: every row block, partial
        # entry a' q + x' from rank (x', a', b): this rank's rows, run x', partial over a'
        got = start_all_to_all_blocks(parts, out_plane.group, out_plane.world_size).wait()
        n, o, f = x.shape[0], w.shape[0], _parts(weight)
        summed = got.view(q, q, n, f, o // f).sum(0)  # [q (x'), n, f, r]
        out = summed.permute(1, 2, 0, 3).reshape(n, q * o)  # [n, out/q]: (part, x', run)
        return (out, (inputs,)) if keep else out

    @staticmethod
    def backward(
        ctx: Any, grad: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, None, None, None]:
        x, weight, *kept = ctx.saved_tensors
        cube: Cube = ctx.grid[0]
        layout: Layout3D = ctx.grid[1]
        in_plane, out_plane, q = (
            cube.batch(layout),
            cube.batch(other_layout(layout)),
            cube.q,
        )
        need_x, need_w, need_b = gradients_needed(ctx)
        k, w = x.shape[-1], flat_weight(weight)  # [o, k]
        n, o, f = grad.numel() // grad.shape[-1], w.shape[0], _parts(weight)
        # Rank a' q + x' of the output plane gets run x' of this rank's rows: [q^2, n, o]
        runs = grad.reshape(n, f, q, o // f).permute(2, 0, 1, 3).reshape(q, n, o)
        sends = runs.unsqueeze(0).expand(q, q, n, o).reshape(q * q, n, o)
        grads = start_all_to_all_blocks(sends, out_plane.group, out_plane.world_size)
        inputs: Pending | None = None
        if need_w:  # every row of the input plane: kept by the forward, or gathered again
            inputs = (
                Pending.done(kept[0])
                if kept
                else start_gather_blocks(x.reshape(-1, k), in_plane.group, in_plane.world_size)
            )
        dys = grads.wait().reshape(-1, o)  # [q^2 n, o]: every row's gradient of this rank's o
        bias = None
        if need_b:  # this rank's run of db, complete; the q WEIGHT ranks' runs side by side
            runs_b = start_gather_blocks(dys.sum(0), cube.weight.group, q)
            bias = runs_b.then(lambda r: r.view(q, f, o // f).transpose(0, 1).reshape(-1))
        grad_x = None
        if need_x:  # [q^2, n, k], summed over the input plane
            parts = torch.matmul(dys.view(q * q, n, o), w)
            grad_x = start_scatter_blocks(parts, in_plane.group, in_plane.world_size)
        grad_w = None
        if inputs is not None:
            grad_w = (dys.t() @ inputs.wait().reshape(-1, k)).view(weight.shape)
        dx = None if grad_x is None else grad_x.wait().view(x.shape)
        return dx, grad_w, None if bias is None else bias.wait(), None, None, None


_ALGORITHMS: dict[CubeAlgorithm, type[BlockLinearFunction]] = {
    "gathered": _GatheredCubeLinear,
    "stationary": _StationaryCubeLinear,
}


def cube_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    cube: Cube,
    input_layout: Layout3D,
    algorithm: CubeAlgorithm | None = None,
    *,
    bias: torch.Tensor | None = None,
    keep: bool = False,
) -> torch.Tensor:
    """``x W^T (+ b)`` from blocks; the result is in the other layout.

    Args:
        x: ``[b/q^2, ..., in/q]`` in ``input_layout``.
        weight: ``[out/q^2, in/q]``: output features split over (other axis, WEIGHT),
            input features over ``input_layout``'s hidden axis (torch's ``[out, in]``).
        cube: The cube.
        input_layout: ``"y"`` or ``"z"``.
        algorithm: ``"gathered"`` or ``"stationary"``; default: :func:`choose_cube_algorithm`'s.
        bias: ``[out/q]``, the other axis's block, replicated over the rest of the cube; its
            gradient is summed over the output's batch group.
        keep: Save the gathered operands for the backward instead of gathering them again.

    Returns:
        ``[b/q^2, ..., out/q]`` in the other layout.
    """
    if x.dim() < 2:
        raise ValueError(f"cube_linear: the input must be [batch, ..., in], got {list(x.shape)}")
    if algorithm is None:
        backward = torch.is_grad_enabled() and (
            x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
        )
        rows = x.numel() // x.shape[-1]
        out_block = weight.numel() // weight.shape[-1]
        algorithm = choose_cube_algorithm(
            rows, x.shape[-1], out_block, cube.q, backward=backward, keep=keep
        )
    out = apply_function(_ALGORITHMS[algorithm], x, weight, bias, cube, input_layout, keep)
    return out.view(*x.shape[:-1], out.shape[-1])  # [b/q^2, ..., out/q]
