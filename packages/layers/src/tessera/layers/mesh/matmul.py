"""The 2D / 2.5D linear layer's product ``y = x W^T + b``, in whichever variant moves less.

van de Geijn and Watts 1997 (SUMMA, section 4) describe variants of the same product that
keep a different operand in place. Rank ``(i, j)`` holds the input block ``x_ij = X[rows_i,
in_j]`` ``[m, k/q]``, the weight block ``W[out_j, in_i]`` ``[n/q, k/q]`` (torch's layout, see
:mod:`tessera.layers.mesh.linear`) and the bias block ``b[out_j]``. Counting the elements one
rank sends in a training step (forward and backward), with ``X = m k/q``, ``Y = m n/q`` and
``W = n k / q^2`` the sizes of its input, output and weight blocks:

* **SUMMA, the weights travel** (Xu et al. 2021's 2D layer, :class:`_SummaLinear`): the
  input and weight panels are gathered in the forward and again in the backward, the input
  gradient and the weight gradient are reduce-scattered: ``3 X + 3 W``;
* **the weights stay** (:class:`_StationaryLinear`): the input blocks go to the ranks whose
  weight block they multiply, the partial outputs are reduce-scattered, and the backward
  gathers the output gradient, re-sends the inputs and sends the partial input gradients
  back: ``3 X + 2 Y``, and the weight gradient is complete where it is needed, unsent.

So the weights should stay when ``2 Y < 3 W``, i.e. when the rank's rows ``m`` are fewer than
``1.5 k/q`` (``m < k/q`` without a backward): small batches, wide layers, the usual case when
a model needs tensor parallelism at all. :func:`mesh_linear` picks the variant from the
shapes (the same on every rank); both give the same result to rounding.

In 2.5D (Wang et al. 2021, Tesseract) each depth layer runs the product on its own share of
the batch and the weight and bias gradients are summed across depth in one all-reduce.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Literal

import torch
import torch.distributed as dist

from ..comm.inflight import (
    Pending,
    start_all_reduce,
    start_gather_blocks,
    start_scatter_blocks,
    start_transfers,
    tracing,
)
from ..comm.ops import apply_function
from ..shared.block_linear import BlockLinearFunction, gradients_needed
from ..shared.context_access import GroupInfo
from .layout import Mesh, MeshRanks
from .summa import gather_blocks, scatter_blocks

__all__ = ["Algorithm", "choose_algorithm", "mesh_linear"]

#: ``"summa"``: the weights travel, each operand's panels in one gather; ``"streamed"``: the
#: same, panel by panel, one step ahead (what SUMMA runs on meshes larger than 2 x 2, where
#: holding every panel would cost ``q`` blocks); ``"stationary"``: the weights stay.
Algorithm = Literal["summa", "streamed", "stationary"]


def choose_algorithm(rows: int, in_block: int, *, backward: bool) -> Algorithm:
    """The variant that sends fewer elements for ``rows`` local rows and ``in_block = k/q``.

    The byte counts behind the rule are in the module docstring: the weights stay when
    ``2 m n/q < 3 n k/q^2`` with a backward, and when ``m n/q < n k/q^2`` without.
    """
    if backward:
        return "stationary" if 2 * rows < 3 * in_block else "summa"
    return "stationary" if rows < in_block else "summa"


class _DepthSum:
    """Tesseract's sum of the weight (and bias) gradients over DEP, in one all-reduce.

    Posted as soon as the gradients exist; the caller waits only after it has posted (or
    finished) the input gradient, so the two travel at once.
    """

    def __init__(
        self, grad_w: torch.Tensor, grad_b: torch.Tensor | None, dep: GroupInfo | None
    ) -> None:
        self._shape, self._size = grad_w.shape, grad_w.numel()
        self._local = (grad_w, grad_b)
        self._pending = None
        if dep is not None:
            flat = torch.cat([grad_w.reshape(-1)] + ([] if grad_b is None else [grad_b]))
            self._pending = start_all_reduce(flat, dep.group, dep.world_size)

    def wait(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The summed ``(grad_w, grad_b)``."""
        if self._pending is None:
            return self._local
        summed = self._pending.wait()
        grad_b = None if self._local[1] is None else summed[self._size :]
        return summed[: self._size].view(self._shape), grad_b


# ---------------------------------------------------------------------------- weights travel


class _SummaLinear(BlockLinearFunction):
    """SUMMA: the weight's COL group holds the blocks ``W[out_j, in_l]`` for every ``l``.

    Those are the panels of ``W^T``'s column ``j``, gathered in the weight's own layout, so
    nothing is transposed into a copy. Backward, all posted before the first matmul waits: the
    weight panels (for ``dx``) and the input panels (for ``dW``). ``dx`` is reduce-scattered
    over ROW; ``dW`` over COL, with this rank's partial bias gradient appended to every chunk,
    so the one reduce-scatter also sums the bias over the column.
    """

    @staticmethod
    def product(x: torch.Tensor, weight: torch.Tensor, mesh: Mesh) -> torch.Tensor:
        """``x W^T``: the input panels of the row and the weight panels of the column."""
        x_panels = gather_blocks(x, mesh.row)  # [q, m, k/q]: x_il
        w_panels = gather_blocks(weight, mesh.col)  # [q, n/q, k/q]: W[out_j, in_l]
        xs, ws = x_panels.wait(), w_panels.wait()
        out = torch.mm(xs[0], ws[0].t())  # [m, n/q]
        for step in range(1, xs.shape[0]):
            out.addmm_(xs[step], ws[step].t())
        return out

    @staticmethod
    def backward(
        ctx: Any, grad: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, None]:
        x, weight = ctx.saved_tensors
        mesh: Mesh = ctx.grid[0]
        grad = grad.contiguous()  # [m, n/q]
        need_x, need_w, need_b = gradients_needed(ctx)
        w_panels = gather_blocks(weight, mesh.col) if need_x else None
        x_panels = gather_blocks(x, mesh.row) if need_w or need_b else None
        depth_sum = None
        if x_panels is not None:  # dW[out_j, in_l] = sum_i dy_ij^T x_il, over COL
            xs = x_panels.wait()  # [q, m, k/q]
            q, size = xs.shape[0], weight.numel()
            parts = grad.new_empty(q, size + (grad.shape[1] if need_b else 0))
            for step in range(q):
                torch.mm(grad.t(), xs[step], out=parts[step, :size].view(weight.shape))
            if need_b:
                parts[:, size:] = grad.sum(0)  # every chunk carries the partial bias gradient
            summed = scatter_blocks(parts, mesh.col)
            del xs, x_panels  # q input blocks: gone before dx's product allocates its own
        grad_x = None
        if w_panels is not None:  # dx_il = sum_j dy_ij W[out_j, in_l]: [q, m, k/q] over ROW
            grad_x = scatter_blocks(torch.matmul(grad, w_panels.wait()), mesh.row)
        if need_w or need_b:
            flat = summed.wait()  # [size (+ n/q)]
            grad_w = flat[:size].view(weight.shape)
            depth_sum = _DepthSum(grad_w, flat[size:] if need_b else None, mesh.depth_sum)
        return _finish(grad_x, depth_sum, need_w)


# ---------------------------------------------------------------------------- panel by panel


def _panels(block: torch.Tensor, group: GroupInfo) -> Iterator[torch.Tensor]:
    """Rank ``l``'s ``block`` for ``l = 0 .. q-1``, step ``l + 1``'s broadcast in flight.

    SUMMA's own schedule (van de Geijn and Watts 1997): one broadcast per step, from the rank
    owning the panel, posted a step ahead so it travels while the previous panel multiplies;
    at most two panels are held (the one in use and the next).
    """
    if tracing():  # traced: every panel in one all-gather, the compiler schedules it
        yield from start_gather_blocks(block, group.group, group.world_size).wait()
        return

    def post(step: int) -> Pending:
        panel = block if group.rank == step else torch.empty_like(block)
        src = dist.get_global_rank(group.group, step)
        work = dist.broadcast(panel, src=src, group=group.group, async_op=True)
        assert isinstance(work, dist.Work)
        return Pending([work], lambda: panel)

    block = block.contiguous()
    ahead = post(0)
    for step in range(group.world_size):
        current, ahead = ahead, (post(step + 1) if step + 1 < group.world_size else ahead)
        yield current.wait()


def _reduce_into(
    parts: Iterator[torch.Tensor], group: GroupInfo, keep: torch.Tensor
) -> torch.Tensor:
    """Sum partial ``l`` over ``group`` into rank ``l``; this rank's sum lands in ``keep``.

    At most two reduces are in flight: step ``l``'s is waited for before step ``l + 2`` posts.
    """
    if tracing():  # traced: the partials in one reduce-scatter
        stacked = torch.stack(list(parts))  # [q, *keep]
        return keep.copy_(start_scatter_blocks(stacked, group.group, group.world_size).wait())
    in_flight: list[Pending] = []
    for step, part in enumerate(parts):
        target = keep if group.rank == step else part
        if target is keep:
            keep.copy_(part)
        dst = dist.get_global_rank(group.group, step)
        work = dist.reduce(target, dst=dst, group=group.group, async_op=True)
        assert isinstance(work, dist.Work)
        in_flight.append(Pending([work], lambda: keep))
        if len(in_flight) > 1:
            in_flight.pop(0).wait()
    for pending in in_flight:
        pending.wait()
    return keep


class _StreamedSummaLinear(BlockLinearFunction):
    """SUMMA panel by panel, two panels per operand at any ``q``.

    The forward broadcasts ``x_il`` along the row and ``W[out_j, in_l]`` along the column step
    by step; the backward broadcasts the weight panels again and reduces each step's partial
    input gradient into rank ``(i, l)``, and broadcasts the input panels and reduces each
    partial weight gradient into rank ``(l, j)``; the bias gradient is all-reduced over COL.
    """

    @staticmethod
    def product(x: torch.Tensor, weight: torch.Tensor, mesh: Mesh) -> torch.Tensor:
        """``x W^T``, summed over the steps ``l``."""
        out = x.new_zeros(x.shape[0], weight.shape[0])  # [m, n/q]
        for x_panel, w_panel in zip(_panels(x, mesh.row), _panels(weight, mesh.col), strict=True):
            out.addmm_(x_panel, w_panel.t())  # x_il W[out_j, in_l]^T
        return out

    @staticmethod
    def backward(
        ctx: Any, grad: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, None]:
        x, weight = ctx.saved_tensors
        mesh: Mesh = ctx.grid[0]
        grad = grad.contiguous()  # [m, n/q]
        need_x, need_w, need_b = gradients_needed(ctx)
        grad_b = None
        if need_b:  # every batch block of the column used the bias block
            grad_b = start_all_reduce(grad.sum(0), mesh.col.group, mesh.col.world_size)
        grad_x = None
        if need_x:  # dx_il = sum_j dy_ij W[out_j, in_l], into rank (i, l)
            partials = (grad @ w_panel for w_panel in _panels(weight, mesh.col))
            grad_x = _reduce_into(partials, mesh.row, torch.empty_like(x))
        depth_sum = None
        if need_w or need_b:  # dW[out_j, in_l] = sum_i dy_ij^T x_il, into rank (l, j)
            grad_w = weight.new_empty(0)
            if need_w:
                partials = (grad.t() @ x_panel for x_panel in _panels(x, mesh.row))
                grad_w = _reduce_into(partials, mesh.col, torch.empty_like(weight))
            bias = None if grad_b is None else grad_b.wait()
            depth_sum = _DepthSum(grad_w, bias, mesh.depth_sum)
        return _finish(Pending.done(grad_x) if grad_x is not None else None, depth_sum, need_w)


# ---------------------------------------------------------------------------- weights stay


def _send_to_row_of_column(x: torch.Tensor, ranks: MeshRanks, i: int, j: int) -> Pending:
    """Rank ``(i, j)``'s ``x`` to every rank of mesh row ``j``; receive column ``i``'s blocks.

    Rank ``(i, j)`` multiplies with ``W[out_j, in_i]``, which needs ``x_li`` for every ``l``:
    the blocks of mesh column ``i``, held by ranks ``(l, i)``. Each of those sends its block
    to all of mesh row ``i``. ``wait()`` gives ``[q, *x.shape]``, entry ``l`` from ``(l, i)``.
    """
    grid = ranks.grid
    q = len(grid)
    x = x.contiguous()
    panel = torch.empty((q, *x.shape), dtype=x.dtype, device=x.device)
    me = grid[i][j]
    sends = [(grid[j][col], x) for col in range(q) if grid[j][col] != me]
    recvs = [(grid[row][i], panel[row]) for row in range(q) if grid[row][i] != me]
    if i == j:  # a diagonal rank is in its own column's row
        panel[i].copy_(x)
    return Pending(start_transfers(sends, recvs, ranks.group), lambda: panel, (x,))


def _return_to_column(parts: torch.Tensor, ranks: MeshRanks, i: int, j: int) -> Pending:
    """Send ``parts[l]`` to rank ``(l, i)``; sum what mesh row ``j`` sends here, in order.

    The reverse of :func:`_send_to_row_of_column`: rank ``(i, j)`` computed a partial result
    for every block ``(l, i)`` of its column's input; the owners sum the ``q`` partials.
    """
    grid = ranks.grid
    q = len(grid)
    parts = parts.contiguous()
    received = torch.empty_like(parts)  # [q, ...]: entry c from rank (j, c)
    me = grid[i][j]
    sends = [(grid[row][i], parts[row]) for row in range(q) if grid[row][i] != me]
    recvs = [(grid[j][col], received[col]) for col in range(q) if grid[j][col] != me]
    if i == j:
        received[j].copy_(parts[i])
    works = start_transfers(sends, recvs, ranks.group)
    return Pending(works, lambda: received.sum(0), (parts,))


class _StationaryLinear(BlockLinearFunction):
    """The weights stay: rank ``(i, j)`` computes every product with ``W[out_j, in_i]``.

    Forward: ``x_li`` for every ``l`` arrives (:func:`_send_to_row_of_column`); the partial
    outputs ``x_li W[out_j, in_i]^T`` ``[q, m, n/q]`` are summed over ``i`` by a reduce-scatter
    over COL (rank ``(l, j)`` gets ``y_lj``). Backward: the output gradient's column panel
    ``dy_lj`` (every ``l``) is gathered over COL; ``dW = sum_l dy_lj^T x_li`` and ``db`` are
    then complete on this rank; the partial input gradients ``dy_lj W[out_j, in_i]`` go back to
    the ranks ``(l, i)`` that own ``x_li`` (:func:`_return_to_column`). ``dW`` comes first: the
    ``q`` input blocks it needs are freed before ``dx``'s ``q`` partials are allocated, and its
    sum over depth travels while ``dx`` multiplies.
    """

    @staticmethod
    def product(x: torch.Tensor, weight: torch.Tensor, mesh: Mesh) -> torch.Tensor:
        """``x W^T``: the input blocks of this rank's column arrive; the partials go out."""
        assert mesh.ranks is not None
        i, j = mesh.col.rank, mesh.row.rank
        panel = _send_to_row_of_column(x, mesh.ranks, i, j).wait()  # [q, m, k/q]: x_li
        parts = torch.matmul(panel, weight.t())  # [q, m, n/q]: x_li W[out_j, in_i]^T
        return scatter_blocks(parts, mesh.col).wait()  # [m, n/q]: y_ij

    @staticmethod
    def backward(
        ctx: Any, grad: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, None]:
        x, weight = ctx.saved_tensors
        mesh: Mesh = ctx.grid[0]
        assert mesh.ranks is not None
        i, j = mesh.col.rank, mesh.row.rank
        need_x, need_w, need_b = gradients_needed(ctx)
        grads = gather_blocks(grad.contiguous(), mesh.col)  # [q, m, n/q]: dy_lj
        inputs = _send_to_row_of_column(x, mesh.ranks, i, j) if need_w else None
        dys = grads.wait()
        del grads
        depth_sum = None
        if need_w or need_b:  # first: the q input blocks are gone before dx's partials exist
            flat = dys.reshape(-1, dys.shape[-1])  # [q m, n/q]
            grad_w = weight.new_empty(0)  # nothing to sum but the bias
            if inputs is not None:
                xs = inputs.wait()
                grad_w = flat.t() @ xs.reshape(-1, xs.shape[-1])  # [n/q, k/q]
                del xs, inputs
            # the depth sum travels while dx multiplies
            depth_sum = _DepthSum(grad_w, flat.sum(0) if need_b else None, mesh.depth_sum)
            del flat
        grad_x = None
        if need_x:  # [q, m, k/q]: dy_lj W[out_j, in_i], a partial of dx_li
            parts = torch.matmul(dys, weight)
            del dys  # the q output-gradient blocks: gone before the partials' sum arrives
            grad_x = _return_to_column(parts, mesh.ranks, i, j)
            del parts  # held by the transfer until it is done
        return _finish(grad_x, depth_sum, need_w)


def _finish(
    grad_x: Pending | None, depth_sum: _DepthSum | None, need_w: bool
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, None]:
    """Wait for the input gradient, then for the depth sum of the parameter gradients."""
    dx = None if grad_x is None else grad_x.wait()
    grad_w, grad_b = (None, None) if depth_sum is None else depth_sum.wait()
    return dx, grad_w if need_w else None, grad_b, None


_ALGORITHMS: dict[Algorithm, type[BlockLinearFunction]] = {
    "summa": _SummaLinear,
    "streamed": _StreamedSummaLinear,
    "stationary": _StationaryLinear,
}


def mesh_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    mesh: Mesh,
    algorithm: Algorithm | None = None,
) -> torch.Tensor:
    """``x W^T + b`` from blocks: the 2D / 2.5D linear layer's product.

    Args:
        x: ``[m, in/q]``, block ``(i, j)`` of the input.
        weight: ``[out/q, in/q]``, the block ``W[out_j, in_i]`` (torch's layout).
        bias: ``[out/q]``, the block ``b[out_j]``, or ``None``. Its gradient is summed over
            the batch group (every batch block uses it).
        mesh: The mesh.
        algorithm: ``"summa"``, ``"streamed"`` or ``"stationary"``; default:
            :func:`choose_algorithm`'s, with ``"summa"`` streamed on meshes larger than 2 x 2.

    Returns:
        ``[m, out/q]``, block ``(i, j)`` of the output.
    """
    if x.dim() != 2 or weight.dim() != 2:
        raise ValueError(
            f"mesh_linear multiplies 2-dim blocks, got {list(x.shape)} and {list(weight.shape)}"
        )
    if algorithm is None:
        backward = torch.is_grad_enabled() and (
            x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
        )
        algorithm = choose_algorithm(x.shape[0], x.shape[1], backward=backward)
        if algorithm == "summa" and mesh.q > 2:
            algorithm = "streamed"  # hold two panels per operand, not q
    if algorithm == "stationary" and mesh.ranks is None:
        algorithm = "summa"  # the groups do not follow tessera's layout: no rank grid
    return apply_function(_ALGORITHMS[algorithm], x, weight, bias, mesh)
