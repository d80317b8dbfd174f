"""SUMMA matrix products on a q x q mesh, as autograd functions with exact backward.

van de Geijn and Watts 1997, "SUMMA: Scalable Universal Matrix Multiplication Algorithm", as
used by Xu et al. 2021 (2D tensor parallelism, section 3) and, in every depth layer, by Wang
et al. 2021 (Tesseract). Every matrix is split into q x q blocks; rank ``(i, j)`` holds block
``(i, j)`` of each operand (the row dim of an activation is its local batch). Three products:

* ``ab``:  ``C = A B``,   ``C_ij = sum_l A_il B_lj``: the panels ``A_il`` travel along row
  ``i`` and ``B_lj`` along column ``j``, and every rank sums its products (the paper's forward
  of a linear layer);
* ``abt``: ``C = A B^T``, ``C_il = sum_j A_ij B_lj^T``: the panels ``B_lj`` travel along
  column ``j``, and the partial products ``A_ij B_lj^T`` are summed along row ``i`` into rank
  ``(i, l)``;
* ``atb``: ``C = A^T B``, ``C_lj = sum_i A_il^T B_ij``: the panels ``A_il`` travel along row
  ``i``, and ``A_il^T B_ij`` are summed along column ``j`` into rank ``(l, j)``.

Each one's gradients are the other two (``d(AB)``: ``dA = dC B^T``, ``dB = A^T dC``), so the
backward of a SUMMA product is two SUMMA products. Only the local blocks are saved for
backward; the panels are gathered again, so saved activations stay ``1/P`` of one process's.

How the panels travel. The paper's SUMMA sends the ``q`` panels of an operand as ``q``
broadcasts and sums a split result with ``q`` reduces, each one blocking. Here one all-gather
brings all ``q`` panels of an operand (the same bytes in one collective, every rank sending at
once instead of one root per step) and one reduce-scatter replaces the ``q`` reduces (the
result is consumed split). A product runs in three phases (:class:`_Product`): post its
gathers, multiply and post its reduce-scatter, wait; the backward posts the gathers of both
its products before either multiplies, so one product's communication overlaps the other's
matmul. The price is memory: a gathered operand holds ``q`` blocks while it is used, one extra
block per operand at ``q = 2``.

The products know only a ROW and a COL group. In 2.5D each depth layer runs them on its own
groups. The linear layers run their own product (:mod:`tessera.layers.mesh.matmul`), which
fuses the bias and the sum across depth, and may keep the weights in place instead.
"""

from __future__ import annotations

from typing import Any

import torch

from ..comm.inflight import Pending, start_gather_blocks, start_scatter_blocks
from ..comm.ops import apply_function
from ..shared.autocast import autocast_dtype, computing_in
from ..shared.context_access import GroupInfo

__all__ = ["gather_blocks", "scatter_blocks", "summa_ab", "summa_abt", "summa_atb"]


def gather_blocks(block: torch.Tensor, group: GroupInfo) -> Pending:
    """Post the gather of every rank's ``block``; ``wait()`` gives ``[q, *block.shape]``.

    Entry ``l`` is the block of group-local rank ``l``: along a ROW group the panel of mesh
    column ``l``, along a COL group the panel of mesh row ``l``.
    """
    return start_gather_blocks(block, group.group, group.world_size)


def scatter_blocks(parts: torch.Tensor, group: GroupInfo) -> Pending:
    """Post the sum of ``parts`` ``[q, *s]`` over the group; rank ``l`` gets ``sum[l]`` ``[*s]``."""
    return start_scatter_blocks(parts, group.group, group.world_size)


class _Product:
    """One SUMMA product in three phases; see the module docstring.

    Constructing it posts its gathers; :meth:`multiply` waits for them, multiplies and posts
    the reduce-scatter of a split result; :meth:`result` waits for that.
    """

    def __init__(
        self,
        kind: str,
        a: torch.Tensor,
        b: torch.Tensor,
        row: GroupInfo,
        col: GroupInfo,
        gathered: dict[tuple[int, int], Pending] | None = None,
    ) -> None:
        self.kind, self.row, self.col = kind, row, col
        shared = {} if gathered is None else gathered

        def gather(block: torch.Tensor, group: GroupInfo) -> Pending:
            # one gather per operand and group, shared by the products posted together
            key = (id(block), id(group))
            if key not in shared:
                shared[key] = gather_blocks(block, group)
            return shared[key]

        # ab gathers both operands, abt the B panels of its column, atb the A panels of its row.
        self._a = gather(a, row) if kind in ("ab", "atb") else Pending.done(a)
        self._b = gather(b, col) if kind in ("ab", "abt") else Pending.done(b)
        self._out: Pending | None = None

    def multiply(self) -> None:
        """Multiply once the panels arrived; post the reduce-scatter of a split result."""
        a, b = self._a.wait(), self._b.wait()
        # drop the gathered panels with this product: a product posted beside it multiplies
        # next, and should not find them still held
        self._a = self._b = Pending.done(a[:0])
        if self.kind == "ab":  # a [q, m, k/q] (A_il), b [q, k/q, n/q] (B_lj)
            out = torch.mm(a[0], b[0])  # [m, n/q]
            for step in range(1, a.shape[0]):
                out.addmm_(a[step], b[step])
            self._out = Pending.done(out)
        elif self.kind == "abt":  # a [m, n/q] (A_ij), b [q, k/q, n/q] (B_lj)
            parts = a.new_empty(b.shape[0], a.shape[0], b.shape[1])  # [q, m, k/q]
            for step in range(b.shape[0]):  # A_ij B_lj^T
                torch.mm(a, b[step].t(), out=parts[step])
            self._out = scatter_blocks(parts, self.row)
        else:  # atb: a [q, m, k/q] (A_il), b [m, n/q] (B_ij)
            parts = a.new_empty(a.shape[0], a.shape[2], b.shape[1])  # [q, k/q, n/q]
            for step in range(a.shape[0]):  # A_il^T B_ij
                torch.mm(a[step].t(), b, out=parts[step])
            self._out = scatter_blocks(parts, self.col)

    def result(self) -> torch.Tensor:
        """The product's block on this rank."""
        assert self._out is not None, "multiply() first"
        return self._out.wait()


def _run(*products: _Product) -> list[torch.Tensor]:
    """Finish products whose gathers are posted: every multiply, then every wait."""
    for product in products:
        product.multiply()
    return [product.result() for product in products]


def _product(
    kind: str, a: torch.Tensor, b: torch.Tensor, row: GroupInfo, col: GroupInfo
) -> torch.Tensor:
    return _run(_Product(kind, a, b, row, col))[0]


#: The two products of each product's gradient: ``(kind, operands)`` for ``dA`` and ``dB``,
#: operands named from ``a``, ``b`` and the incoming gradient ``g``.
_GRADIENTS: dict[str, tuple[tuple[str, str, str], tuple[str, str, str]]] = {
    "ab": (("abt", "g", "b"), ("atb", "a", "g")),  # C = A B: dA = dC B^T, dB = A^T dC
    "abt": (("ab", "g", "b"), ("atb", "g", "a")),  # C = A B^T: dA = dC B, dB = dC^T A
    "atb": (("abt", "b", "g"), ("ab", "a", "g")),  # C = A^T B: dA = B dC^T, dB = A dC
}


class _Summa(torch.autograd.Function):
    """One SUMMA product; the backward is the two products of its gradient, overlapped."""

    @staticmethod
    def forward(
        ctx: Any,
        a: torch.Tensor,
        b: torch.Tensor,
        kind: str,
        row: GroupInfo,
        col: GroupInfo,
    ) -> torch.Tensor:
        dtype = autocast_dtype(a)
        a, b = (a, b) if dtype is None else (a.to(dtype), b.to(dtype))
        ctx.kind, ctx.row, ctx.col = kind, row, col
        ctx.save_for_backward(a, b)
        with computing_in(dtype, a.device):
            return _product(kind, a.detach(), b.detach(), row, col)

    @staticmethod
    def backward(
        ctx: Any, grad: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None, None]:
        a, b = ctx.saved_tensors
        operands = {"a": a, "b": b, "g": grad.contiguous()}
        # abt's two gradients both need the panels of g along the row: gathered once
        gathered: dict[tuple[int, int], Pending] = {}
        wanted = [
            (index, _Product(kind, operands[x], operands[y], ctx.row, ctx.col, gathered))
            for index, (kind, x, y) in enumerate(_GRADIENTS[ctx.kind])
            if ctx.needs_input_grad[index]
        ]  # both products' gathers in flight before either multiplies
        gathered.clear()  # the products hold what they need
        grads: list[torch.Tensor | None] = [None, None]
        for (index, _), result in zip(wanted, _run(*(p for _, p in wanted)), strict=True):
            grads[index] = result
        return grads[0], grads[1], None, None, None


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
