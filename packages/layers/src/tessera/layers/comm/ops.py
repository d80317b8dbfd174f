"""Communication ops as autograd functions over one process group, each with its exact backward.

Megatron-LM (Shoeybi et al. 2019, "Megatron-LM: Training Multi-Billion Parameter Language Models
Using Model Parallelism", section 3) builds 1D tensor parallelism from two conjugate ops:

* ``f`` = :func:`copy_to_group`: identity forward, all-reduce backward (enters a column-parallel
  region: every rank's partial input gradient is summed);
* ``g`` = :func:`reduce_from_group`: all-reduce forward, identity backward (leaves a
  row-parallel region: the partial outputs are summed).

Sequence parallelism (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models", section 4.2.2) replaces them with the conjugate pair ``g``-bar / ``g``:
:func:`gather_along_dim` with ``partial_grad=True`` (all-gather forward, reduce-scatter backward)
and :func:`reduce_scatter_along_dim` (reduce-scatter forward, all-gather backward).

The backward of each op is the exact adjoint of its forward under tessera's gradient convention
(the global loss is the sum over ranks of each rank's loss on its local block; with a replicated
output every rank's loss is the whole loss). Every op is the identity on a group of one rank.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .collectives import (
    all_gather_along,
    all_to_all_along,
    reduce_scatter_along,
    split_along,
)
from .inflight import functional_collectives, tracing

__all__ = [
    "all_to_all",
    "apply_function",
    "broadcast",
    "copy_to_group",
    "gather_along_dim",
    "reduce_from_group",
    "reduce_scatter_along_dim",
    "split_along_dim",
]


def _size(group: dist.ProcessGroup) -> int:
    return dist.get_world_size(group)


def _rank(group: dist.ProcessGroup) -> int:
    return dist.get_rank(group)


def _all_reduce(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    if tracing():
        reduced: torch.Tensor = functional_collectives().all_reduce(x.contiguous(), "sum", group)
        return reduced
    out = x.contiguous().clone()
    dist.all_reduce(out, group=group)
    return out


class _CopyToGroup(torch.autograd.Function):
    """Megatron's f: forward identity, backward all-reduce (sum)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_reduce(grad, ctx.group), None


class _ReduceFromGroup(torch.autograd.Function):
    """Megatron's g: forward all-reduce (sum), backward identity."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _SplitAlongDim(torch.autograd.Function):
    """Forward: keep this rank's chunk along ``dim``; backward: all-gather the chunk gradients."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return split_along(x, dim, _rank(group), _size(group))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return all_gather_along(grad, ctx.dim, ctx.group, _size(ctx.group)), None, None


class _GatherSplitGrad(torch.autograd.Function):
    """Forward: all-gather along ``dim``; backward: keep this rank's chunk of the gradient.

    Right when every rank's gradient of the gathered tensor is already the full gradient
    (the gathered tensor feeds replicated computation).
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return all_gather_along(x, dim, group, _size(group))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return split_along(grad, ctx.dim, _rank(ctx.group), _size(ctx.group)), None, None


class _GatherReduceScatterGrad(torch.autograd.Function):
    """Forward: all-gather along ``dim``; backward: reduce-scatter the gradient.

    Right when each rank's gradient of the gathered tensor is a partial sum (the gathered
    tensor feeds a column-parallel matmul): Korthikanti et al.'s g-bar.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return all_gather_along(x, dim, group, _size(group))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return reduce_scatter_along(grad, ctx.dim, ctx.group, _size(ctx.group)), None, None


class _ReduceScatterAlongDim(torch.autograd.Function):
    """Forward: sum over the group, keep this rank's chunk along ``dim``; backward: all-gather."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return reduce_scatter_along(x, dim, group, _size(group))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return all_gather_along(grad, ctx.dim, ctx.group, _size(ctx.group)), None, None


class _AllToAll(torch.autograd.Function):
    """Forward: scatter ``scatter_dim``, gather ``gather_dim``; backward: the reverse all-to-all."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        scatter_dim: int,
        gather_dim: int,
        group: dist.ProcessGroup,
    ) -> torch.Tensor:
        ctx.dims, ctx.group = (scatter_dim, gather_dim), group
        return all_to_all_along(x, scatter_dim, gather_dim, group, _size(group))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        scatter_dim, gather_dim = ctx.dims
        out = all_to_all_along(grad, gather_dim, scatter_dim, ctx.group, _size(ctx.group))
        return out, None, None, None


class _Broadcast(torch.autograd.Function):
    """Forward: every rank gets ``src``'s tensor; backward: ``src`` gets the summed gradient.

    The other ranks get a zero gradient: their input did not affect any output.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, src: int, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.src, ctx.group = src, group
        if _size(group) > 1 and tracing():
            # the functional broadcast names its source by its rank in the group
            sent: torch.Tensor = functional_collectives().broadcast(x.contiguous(), src, group)
            return sent
        out = x.contiguous().clone()
        if _size(group) > 1:
            dist.broadcast(out, src=dist.get_global_rank(group, src), group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        if _size(ctx.group) == 1:
            return grad, None, None
        if tracing():  # no traced reduce: the sum everywhere, kept by src alone
            summed = _all_reduce(grad, ctx.group)
            return (summed if _rank(ctx.group) == ctx.src else torch.zeros_like(grad)), None, None
        out = grad.contiguous().clone()
        dist.reduce(out, dst=dist.get_global_rank(ctx.group, ctx.src), group=ctx.group)
        if _rank(ctx.group) != ctx.src:
            out.zero_()
        return out, None, None


def apply_function(fn: type[torch.autograd.Function], *args: object) -> torch.Tensor:
    """``fn.apply(*args)`` with a typed result (torch leaves ``apply`` untyped)."""
    out: torch.Tensor = fn.apply(*args)  # type: ignore[no-untyped-call]
    return out


def copy_to_group(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Megatron's f: identity forward; the backward all-reduces (sums) the gradient."""
    if _size(group) == 1:
        return x
    return apply_function(_CopyToGroup, x, group)


def reduce_from_group(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Megatron's g: all-reduce (sum) forward; identity backward."""
    if _size(group) == 1:
        return x
    return apply_function(_ReduceFromGroup, x, group)


def split_along_dim(x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    """This rank's chunk of a replicated ``x`` along ``dim``; the backward all-gathers.

    Raises:
        ValueError: ``x.shape[dim]`` is not divisible by the group size (before communicating).
    """
    if _size(group) == 1:
        return x
    return apply_function(_SplitAlongDim, x, dim, group)


def gather_along_dim(
    x: torch.Tensor, dim: int, group: dist.ProcessGroup, *, partial_grad: bool = False
) -> torch.Tensor:
    """All-gather ``x`` along ``dim``.

    Args:
        x: This rank's chunk.
        dim: The dimension to concatenate along.
        group: The group.
        partial_grad: How the backward treats the incoming gradient. ``False``: every rank
            holds the full gradient of the gathered tensor (it feeds replicated computation),
            so the backward keeps this rank's chunk. ``True``: every rank holds a partial sum
            (it feeds a column-parallel matmul), so the backward reduce-scatters
            (Korthikanti et al. 2022's g-bar).
    """
    if _size(group) == 1:
        return x
    fn = _GatherReduceScatterGrad if partial_grad else _GatherSplitGrad
    return apply_function(fn, x, dim, group)


def reduce_scatter_along_dim(x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    """Sum partial ``x`` over the group and keep this rank's chunk along ``dim``.

    The backward all-gathers (Korthikanti et al. 2022's g, after a row-parallel matmul).

    Raises:
        ValueError: ``x.shape[dim]`` is not divisible by the group size (before communicating).
    """
    if _size(group) == 1:
        return x
    return apply_function(_ReduceScatterAlongDim, x, dim, group)


def all_to_all(
    x: torch.Tensor, scatter_dim: int, gather_dim: int, group: dist.ProcessGroup
) -> torch.Tensor:
    """Re-split ``x`` from ``gather_dim`` to ``scatter_dim``.

    Chunk ``j`` along ``scatter_dim`` goes to rank ``j``, the received chunks are concatenated
    along ``gather_dim``. The
    backward is the reverse all-to-all (DeepSpeed-Ulysses, Jacobs et al. 2023, uses the pair
    to swap a sequence split for a head split).

    Raises:
        ValueError: ``x.shape[scatter_dim]`` is not divisible by the group size.
    """
    if _size(group) == 1:
        return x
    return apply_function(_AllToAll, x, scatter_dim, gather_dim, group)


def broadcast(x: torch.Tensor, src: int, group: dist.ProcessGroup) -> torch.Tensor:
    """Every rank gets the tensor of group-local rank ``src``.

    The backward sums the gradients into ``src``; other ranks' inputs get a zero gradient.
    """
    size = _size(group)
    if not 0 <= src < size:
        raise ValueError(f"broadcast source {src} is not a rank of a group of size {size}")
    if size == 1:
        return x
    return apply_function(_Broadcast, x, src, group)
