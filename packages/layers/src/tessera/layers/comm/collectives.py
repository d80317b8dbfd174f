"""Plain (non-autograd) collectives along one tensor dimension, and the size checks before them.

torch's collectives work on flat, contiguous buffers split along dim 0. Tensor-parallel layers
need them along an arbitrary dimension (the hidden dim, the sequence dim): these helpers move
that dimension to the front, run one collective, and move it back. Every helper is a no-op
for a group of one rank, and checks divisibility *before* communicating so a bad size raises
the same ``ValueError`` on every rank instead of hanging one of them in a collective.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .inflight import (
    Pending,
    functional_collectives,
    start_gather_blocks,
    start_scatter_blocks,
    tracing,
)

__all__ = [
    "all_gather_along",
    "all_to_all_along",
    "check_divisible",
    "normalize_dim",
    "reduce_scatter_along",
    "split_along",
    "start_all_gather",
    "start_reduce_scatter",
]


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


def start_all_gather(
    x: torch.Tensor, dim: int, group: dist.ProcessGroup, world_size: int
) -> Pending:
    """Post the all-gather of :func:`all_gather_along`; ``wait()`` returns the gathered tensor."""
    if world_size == 1:
        return Pending.done(x)
    dim = normalize_dim(dim, x.dim())
    if x.dim() == 0:
        x = x.reshape(1)
    shape = list(x.shape)
    shape[dim] *= world_size

    def concatenate(blocks: torch.Tensor) -> torch.Tensor:  # [w, *x] -> [.., w*sd, ..]
        if dim == 0:
            return blocks.view(shape)
        return blocks.movedim(0, dim).reshape(shape)

    return start_gather_blocks(x, group, world_size).then(concatenate)


def all_gather_along(
    x: torch.Tensor, dim: int, group: dist.ProcessGroup, world_size: int
) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim``, in group-rank order."""
    return start_all_gather(x, dim, group, world_size).wait()


def start_reduce_scatter(
    x: torch.Tensor, dim: int, group: dist.ProcessGroup, world_size: int
) -> Pending:
    """Post the reduce-scatter of :func:`reduce_scatter_along`; ``wait()`` returns the chunk.

    Raises:
        ValueError: ``x.shape[dim]`` is not divisible by ``world_size`` (before communicating).
    """
    if world_size == 1:
        return Pending.done(x)
    dim = normalize_dim(dim, x.dim())
    check_divisible(x.shape[dim], world_size, f"dim {dim} of tensor {list(x.shape)}")
    shape = list(x.shape)
    # [.., w*c, ..] -> [.., w, c, ..] -> [w, .., c, ..]: entry r is chunk r.
    blocks = x.reshape(*shape[:dim], world_size, shape[dim] // world_size, *shape[dim + 1 :])
    return start_scatter_blocks(blocks.movedim(dim, 0), group, world_size)


def reduce_scatter_along(
    x: torch.Tensor, dim: int, group: dist.ProcessGroup, world_size: int
) -> torch.Tensor:
    """Sum ``x`` over the group and keep this rank's chunk along ``dim``."""
    return start_reduce_scatter(x, dim, group, world_size).wait()


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
    recv: torch.Tensor
    if tracing():
        recv = functional_collectives().all_to_all_single(send, None, None, group)
    else:
        recv = torch.empty_like(send)  # recv[j] came from rank j
        dist.all_to_all_single(recv, send, group=group)
    block = list(send.shape[1:])
    moved = recv.movedim(0, gather_dim)  # [.., w, g, ..]
    block[gather_dim] *= world_size
    return moved.reshape(block)
