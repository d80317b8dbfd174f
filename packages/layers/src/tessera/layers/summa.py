"""SUMMA matrix products on a q x q mesh, as autograd functions with exact backward.

van de Geijn and Watts 1997, "SUMMA: Scalable Universal Matrix Multiplication Algorithm", as
used by Xu et al. 2021 (2D tensor parallelism, section 3) and, in every depth layer, by Wang
et al. 2021 (Tesseract). Every matrix is split into q x q blocks; rank ``(i, j)`` holds block
``(i, j)`` of each operand (the row dim of an activation is its local batch). Three products:

* ``ab``:  ``C = A B``,   ``C_ij = sum_l A_il B_lj``: step ``l`` broadcasts ``A_il`` along
  row ``i`` (from rank ``(i, l)``) and ``B_lj`` along column ``j`` (from ``(l, j)``), and every
  rank accumulates its product (the paper's forward of a linear layer);
* ``abt``: ``C = A B^T``, ``C_il = sum_j A_ij B_lj^T``: step ``l`` broadcasts ``B_lj`` along
  column ``j`` and reduces the partial products ``A_ij B_lj^T`` along row ``i`` into rank
  ``(i, l)``;
* ``atb``: ``C = A^T B``, ``C_lj = sum_i A_il^T B_ij``: step ``l`` broadcasts ``A_il`` along
  row ``i`` and reduces ``A_il^T B_ij`` along column ``j`` into rank ``(l, j)``.

Each one's gradients are the other two (``d(AB)``: ``dA = dC B^T``, ``dB = A^T dC``), so the
backward of a SUMMA product is two SUMMA products. Only the local blocks are saved for
backward: the broadcast panels are received again, so no rank ever keeps more than one panel
of another rank's block (SUMMA's point: memory ``O(n^2 / P)`` per rank).

The products know only a ROW and a COL group. In 2.5D each depth layer runs them on its own
groups; what differs (the weight gradient's sum across depth) is done by the caller.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from .comm import apply_function
from .context_access import GroupInfo

__all__ = ["summa_ab", "summa_abt", "summa_atb"]

Kernel = Callable[[torch.Tensor, torch.Tensor, GroupInfo, GroupInfo], torch.Tensor]


def _broadcast(block: torch.Tensor, src: int, group: GroupInfo) -> torch.Tensor:
    """Group-local rank ``src``'s ``block`` on every rank of ``group`` (same shape everywhere)."""
    if group.world_size == 1:
        return block
    buf = (
        block.contiguous()
        if group.rank == src
        else torch.empty_like(block, memory_format=torch.contiguous_format)
    )
    dist.broadcast(buf, src=dist.get_global_rank(group.group, src), group=group.group)
    return buf


def _reduce(part: torch.Tensor, dst: int, group: GroupInfo) -> torch.Tensor:
    """Sum ``part`` over ``group`` into group-local rank ``dst`` (others get garbage)."""
    if group.world_size == 1:
        return part
    part = part.contiguous()
    dist.reduce(part, dst=dist.get_global_rank(group.group, dst), group=group.group)
    return part


def _ab(a: torch.Tensor, b: torch.Tensor, row: GroupInfo, col: GroupInfo) -> torch.Tensor:
    """``C_ij = sum_l A_il B_lj``; ``a`` ``[m, k/q]``, ``b`` ``[k/q, n/q]`` -> ``[m, n/q]``."""
    out = a.new_zeros(a.shape[0], b.shape[1])
    for step in range(row.world_size):
        a_panel = _broadcast(a, step, row)  # A_il: [m, k/q], along row i
        b_panel = _broadcast(b, step, col)  # B_lj: [k/q, n/q], along column j
        out.addmm_(a_panel, b_panel)
    return out


def _abt(a: torch.Tensor, b: torch.Tensor, row: GroupInfo, col: GroupInfo) -> torch.Tensor:
    """``C_il = sum_j A_ij B_lj^T``; ``a`` ``[m, n/q]``, ``b`` ``[k/q, n/q]`` -> ``[m, k/q]``."""
    out = a.new_empty(a.shape[0], b.shape[0])
    for step in range(row.world_size):
        b_panel = _broadcast(b, step, col)  # B_lj: [k/q, n/q], along column j
        part = _reduce(a @ b_panel.t(), step, row)  # into (i, l): [m, k/q]
        if row.rank == step:
            out = part
    return out


def _atb(a: torch.Tensor, b: torch.Tensor, row: GroupInfo, col: GroupInfo) -> torch.Tensor:
    """``C_lj = sum_i A_il^T B_ij``; ``a`` ``[m, k/q]``, ``b`` ``[m, n/q]`` -> ``[k/q, n/q]``."""
    out = a.new_empty(a.shape[1], b.shape[1])
    for step in range(row.world_size):
        a_panel = _broadcast(a, step, row)  # A_il: [m, k/q], along row i
        part = _reduce(a_panel.t() @ b, step, col)  # into (l, j): [k/q, n/q]
        if col.rank == step:
            out = part
    return out


_KERNELS: dict[str, Kernel] = {"ab": _ab, "abt": _abt, "atb": _atb}


class _Summa(torch.autograd.Function):
    """One SUMMA product; the backward is the two products of its gradient."""

    @staticmethod
    def forward(
        ctx: Any,
        a: torch.Tensor,
        b: torch.Tensor,
        kind: str,
        row: GroupInfo,
        col: GroupInfo,
    ) -> torch.Tensor:
        ctx.kind, ctx.row, ctx.col = kind, row, col
        ctx.save_for_backward(a, b)
        return _KERNELS[kind](a.detach(), b.detach(), row, col)

    @staticmethod
    def backward(
        ctx: Any, grad: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None, None]:
        a, b = ctx.saved_tensors
        row, col = ctx.row, ctx.col
        need_a, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_a = grad_b = None
        if ctx.kind == "ab":  # C = A B: dA = dC B^T, dB = A^T dC
            grad_a = _abt(grad, b, row, col) if need_a else None
            grad_b = _atb(a, grad, row, col) if need_b else None
        elif ctx.kind == "abt":  # C = A B^T: dA = dC B, dB = dC^T A
            grad_a = _ab(grad, b, row, col) if need_a else None
            grad_b = _atb(grad, a, row, col) if need_b else None
        else:  # C = A^T B: dA = B dC^T, dB = A dC
            grad_a = _abt(b, grad, row, col) if need_a else None
            grad_b = _ab(a, grad, row, col) if need_b else None
        return grad_a, grad_b, None, None, None


def _summa(
    kind: str, a: torch.Tensor, b: torch.Tensor, row: GroupInfo, col: GroupInfo
) -> torch.Tensor:
    if a.dim() != 2 or b.dim() != 2:
        raise ValueError(
            f"summa_{kind} multiplies 2-dim blocks, got {list(a.shape)} and {list(b.shape)}"
        )
    if row.world_size != col.world_size:
        raise ValueError(
            f"summa_{kind} needs a square mesh: ROW group of {row.world_size} ranks, COL group "
            f"of {col.world_size}"
        )
    return apply_function(_Summa, a, b, kind, row, col)


def summa_ab(a: torch.Tensor, b: torch.Tensor, row: GroupInfo, col: GroupInfo) -> torch.Tensor:
    """``C = A B`` from blocks ``a`` ``[m, k/q]`` and ``b`` ``[k/q, n/q]``: ``[m, n/q]``.

    ``row`` is the group of ranks sharing this rank's mesh row (local rank = column), ``col``
    the group sharing its column (local rank = row).
    """
    return _summa("ab", a, b, row, col)


def summa_abt(a: torch.Tensor, b: torch.Tensor, row: GroupInfo, col: GroupInfo) -> torch.Tensor:
    """``C = A B^T`` from blocks ``a`` ``[m, n/q]`` and ``b`` ``[k/q, n/q]``: ``[m, k/q]``."""
    return _summa("abt", a, b, row, col)


def summa_atb(a: torch.Tensor, b: torch.Tensor, row: GroupInfo, col: GroupInfo) -> torch.Tensor:
    """``C = A^T B`` from blocks ``a`` ``[m, k/q]`` and ``b`` ``[m, n/q]``: ``[k/q, n/q]``."""
    return _summa("atb", a, b, row, col)
