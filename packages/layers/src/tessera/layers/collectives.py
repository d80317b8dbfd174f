"""Plain (non-autograd) collectives along one tensor dimension, and the size checks before them.

torch's collectives work on flat, contiguous buffers split along dim 0. Tensor-parallel layers
need them along an arbitrary dimension (the hidden dim, the sequence dim): these helpers move
that dimension to the front, run one collective, and move it back. Every helper is a no-op
for a group of one rank, and checks divisibility *before* communicating so a bad size raises
the same ``ValueError`` on every rank instead of hanging one of them in a collective.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

__all__ = [
    "all_gather_along",
    "all_to_all_along",
    "check_divisible",
    "normalize_dim",
    "reduce_scatter_along",
    "split_along",
]

_Collective = Callable[..., object]

# torch >= 2.12 renamed the flat collectives; older versions only have the old names.
_all_gather_flat: _Collective = getattr(dist, "all_gather_single", None) or (
    dist.all_gather_into_tensor
)
_reduce_scatter_flat: _Collective = getattr(dist, "reduce_scatter_single", None) or (
    dist.reduce_scatter_tensor
)


def normalize_dim(dim: int, ndim: int) -> int:
    """Return ``dim`` as a non-negative index into a tensor of ``ndim`` dimensions.

    Raises:
        ValueError: ``dim`` is out of range.
    """
    if not -ndim <= dim < ndim:
        raise ValueError(f"dim {dim} is out of range for a tensor with {ndim} dimensions")
    return dim % ndim


def check_divisible(size: int, divisor: int, what: str) -> None:
    """Raise ``ValueError`` unless ``size`` splits into ``divisor`` equal parts.

    Args:
        size: The size to split.
        divisor: The number of parts (usually a group's world size).
        what: Names the size in the message, e.g. ``"dim 1 (sequence) of input [2, 6, 8]"``.
    """
    if size % divisor != 0:
        raise ValueError(
            f"{what}: size {size} is not divisible by {divisor} "
            f"({size} % {divisor} = {size % divisor})"
        )


def split_along(x: torch.Tensor, dim: int, rank: int, world_size: int) -> torch.Tensor:
    """This rank's contiguous chunk of ``x`` along ``dim`` (no communication)."""
    if world_size == 1:
        return x
    dim = normalize_dim(dim, x.dim())
    check_divisible(x.shape[dim], world_size, f"dim {dim} of tensor {list(x.shape)}")
    return x.chunk(world_size, dim)[rank].contiguous()


def all_gather_along(
    x: torch.Tensor, dim: int, group: dist.ProcessGroup, world_size: int
) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim``, in group-rank order."""
    if world_size == 1:
        return x
    dim = normalize_dim(dim, x.dim())
    x = x.contiguous()
    if x.dim() == 0:
        x = x.reshape(1)
    flat = torch.empty((world_size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    _all_gather_flat(flat, x, group=group)  # [w*s0, ..]
    if dim == 0:
        return flat
    out = flat.view(world_size, *x.shape)  # [w, *x]
    # [w, s0.., sd, ..] -> [s0.., w, sd, ..] -> [s0.., w*sd, ..]
    moved = out.movedim(0, dim)
    shape = list(x.shape)
    shape[dim] *= world_size
    return moved.reshape(shape)


def reduce_scatter_along(
    x: torch.Tensor, dim: int, group: dist.ProcessGroup, world_size: int
) -> torch.Tensor:
    """Sum ``x`` over the group and keep this rank's chunk along ``dim``."""
    if world_size == 1:
        return x
    dim = normalize_dim(dim, x.dim())
    check_divisible(x.shape[dim], world_size, f"dim {dim} of tensor {list(x.shape)}")
    shape = list(x.shape)
    chunk = shape[dim] // world_size
    # [.., w*c, ..] -> [.., w, c, ..] -> [w, .., c, ..]: chunk r is contiguous block r.
    blocks = x.reshape(*shape[:dim], world_size, chunk, *shape[dim + 1 :]).movedim(dim, 0)
    out_shape = [*shape[:dim], chunk, *shape[dim + 1 :]]
    out = torch.empty(out_shape, dtype=x.dtype, device=x.device)
    send = blocks.contiguous()
    _reduce_scatter_flat(out, send.view(world_size * out_shape[0], *out_shape[1:]), group=group)
    return out


def all_to_all_along(
    x: torch.Tensor,
    scatter_dim: int,
    gather_dim: int,
    group: dist.ProcessGroup,
    world_size: int,
) -> torch.Tensor:
    """Send chunk ``j`` of ``x`` along ``scatter_dim`` to rank ``j``.

    The received chunks are concatenated along ``gather_dim`` in group-rank order.
    """
    if world_size == 1:
        return x
    scatter_dim = normalize_dim(scatter_dim, x.dim())
    gather_dim = normalize_dim(gather_dim, x.dim())
    shape = list(x.shape)
    check_divisible(shape[scatter_dim], world_size, f"dim {scatter_dim} of tensor {shape}")
    chunk = shape[scatter_dim] // world_size
    # [.., w*c, ..] -> [w, .., c, ..]: block j goes to rank j.
    send = x.reshape(*shape[:scatter_dim], world_size, chunk, *shape[scatter_dim + 1 :])
    send = send.movedim(scatter_dim, 0).contiguous()
    recv = torch.empty_like(send)  # recv[j] came from rank j
    dist.all_to_all_single(recv, send, group=group)
    block = list(send.shape[1:])
    moved = recv.movedim(0, gather_dim)  # [.., w, g, ..]
    block[gather_dim] *= world_size
    return moved.reshape(block)
