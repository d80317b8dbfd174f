"""Ring self-attention's two products as autograd functions (Li et al. 2021).

Li et al. 2021, "Sequence Parallelism: Long Sequence Training from System Perspective"
(a.k.a. "Making 4D Parallelism Possible"), section 3.1: the sequence is split into ``N``
contiguous chunks of ``c`` tokens, chunk ``r`` on rank ``r`` of the SEQUENCE group. Ring
self-attention computes

* :func:`ring_qk`: ``S_r = Q_r K^T`` ``[.., c, N c]``: every rank passes its key chunk to the
  next rank ``N - 1`` times and multiplies its queries by each chunk that arrives;
* :func:`ring_av`: ``O_r = P_r V`` ``[.., c, d]``: the same ring for the value chunks, each
  multiplied by its column block of the local attention probabilities ``P_r``.

Backward, exactly: ``dQ_r = dS_r K`` and ``dP_r = dO_r V^T`` need the same ring again; the
gradients of the passed chunks (``dK_j = sum_r dS_r[:, j]^T Q_r``, ``dV_j = sum_r
P_r[:, j]^T dO_r``) are sums over all ranks, accumulated in a buffer that travels the ring
once (``N - 1`` hops), each rank adding its contribution before passing it on, so it lands
complete on rank ``j``. Only the local chunks are saved for backward; every transfer is one
send and one receive per rank per hop (``batch_isend_irecv``), posted before the local
product so the two overlap.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..comm.inflight import start_transfers, tracing
from ..comm.ops import apply_function
from ..shared.context_access import GroupInfo

__all__ = ["Ring", "ring_av", "ring_of", "ring_qk"]


@dataclass(frozen=True)
class Ring:
    """A group seen as a ring: chunk ``r`` lives on group rank ``r``.

    Attributes:
        group: The process group (SEQUENCE).
        rank: This rank's index in it.
        world_size: ``N``.
        next_rank: The global rank of group rank ``(rank + 1) % N`` (we send to it).
        prev_rank: The global rank of group rank ``(rank - 1) % N`` (we receive from it).
    """

    group: dist.ProcessGroup
    rank: int
    world_size: int
    next_rank: int
    prev_rank: int


def ring_of(info: GroupInfo) -> Ring:
    """The ring over ``info``'s group, in group-rank order."""
    n, r = info.world_size, info.rank
    return Ring(
        group=info.group,
        rank=r,
        world_size=n,
        next_rank=dist.get_global_rank(info.group, (r + 1) % n),
        prev_rank=dist.get_global_rank(info.group, (r - 1) % n),
    )


def _shift(tensor: torch.Tensor, ring: Ring) -> tuple[torch.Tensor, list[dist.Work]]:
    """Post: send ``tensor`` to the next rank, receive the previous rank's into a new buffer."""
    recv = torch.empty_like(tensor, memory_format=torch.contiguous_format)
    if tracing():  # one traced all-to-all over the ring (comm/inflight.py): done on return
        return recv, start_transfers(
            [(ring.next_rank, tensor.contiguous())], [(ring.prev_rank, recv)], ring.group
        )
    ops = [
        dist.P2POp(dist.isend, tensor, ring.next_rank, ring.group),
        dist.P2POp(dist.irecv, recv, ring.prev_rank, ring.group),
    ]
    works = dist.batch_isend_irecv(ops)
    return recv, list(works)


def _wait(works: list[dist.Work]) -> None:
    for work in works:
        work.wait()


def _around(local: torch.Tensor, ring: Ring, use: Callable[[int, torch.Tensor], None]) -> None:
    """Call ``use(j, chunk_j)`` for every rank's chunk ``j``, the local one first.

    Hop ``t`` holds the chunk of group rank ``(rank - t) % N``; the next transfer is posted
    before ``use`` runs on the current chunk.
    """
    current = local.contiguous()
    for step in range(ring.world_size):
        last = step == ring.world_size - 1
        incoming, works = (current, []) if last else _shift(current, ring)
        use((ring.rank - step) % ring.world_size, current)
        _wait(works)
        current = incoming


def _accumulate(ring: Ring, contribution: Callable[[int], torch.Tensor]) -> torch.Tensor:
    """``sum_r contribution_r(j)`` on every rank ``j``: one buffer per target travels the ring.

    At hop ``t`` rank ``r`` holds the buffer of target ``(r - t - 1) % N``, adds its
    contribution and passes it on; after ``N - 1`` hops it adds its own and keeps it.
    """
    n, r = ring.world_size, ring.rank
    acc: torch.Tensor | None = None
    for step in range(n):
        part = contribution((r - step - 1) % n)
        acc = part if acc is None else acc + part
        if step < n - 1:
            incoming, works = _shift(acc.contiguous(), ring)
            _wait(works)
            acc = incoming
    assert acc is not None
    return acc


class _RingQK(torch.autograd.Function):
    """``S_r = Q_r [K_0 .. K_{N-1}]^T``: q, k ``[.., c, d]`` -> ``[.., c, N c]``."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, ring: Ring) -> torch.Tensor:
        ctx.ring = ring
        # A contiguous k (the copy the ring sends anyway) lets the fused qkv buffer it may
        # view be freed once q and v are done with it.
        # (Traced, the input itself is saved: a saved tensor may not alias it there.)
        saved = k if tracing() else k.contiguous()
        ctx.save_for_backward(q, saved)
        q, k = q.detach(), saved.detach().contiguous()
        c = k.shape[-2]
        out = q.new_empty(*q.shape[:-1], c * ring.world_size)

        def use(j: int, k_j: torch.Tensor) -> None:
            out[..., j * c : (j + 1) * c] = torch.matmul(q, k_j.transpose(-1, -2))

        _around(k, ring, use)
        return out

    @staticmethod
    def backward(
        ctx: Any, grad: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        q, k = ctx.saved_tensors
        k = k.contiguous()  # already, but where traced
        ring: Ring = ctx.ring
        c = k.shape[-2]
        grad = grad.contiguous()  # [.., c, N c]
        grad_q = grad_k = None
        if ctx.needs_input_grad[0]:
            dq = torch.zeros_like(q)

            def use(j: int, k_j: torch.Tensor) -> None:
                dq.add_(torch.matmul(grad[..., j * c : (j + 1) * c], k_j))  # [.., c, d]

            _around(k, ring, use)
            grad_q = dq
        if ctx.needs_input_grad[1]:
            grad_k = _accumulate(
                ring,
                lambda j: torch.matmul(grad[..., j * c : (j + 1) * c].transpose(-1, -2), q),
            )  # [.., c, d]: dK_j
        return grad_q, grad_k, None


class _RingAV(torch.autograd.Function):
    """``O_r = sum_j P_r[.., j] V_j``, p ``[.., c, N c]``, v ``[.., c, d]`` -> ``[.., c, d]``."""

    @staticmethod
    def forward(ctx: Any, p: torch.Tensor, v: torch.Tensor, ring: Ring) -> torch.Tensor:
        ctx.ring = ring
        saved = v if tracing() else v.contiguous()  # as k in _RingQK
        ctx.save_for_backward(p, saved)
        p, v = p.detach(), saved.detach().contiguous()
        c = v.shape[-2]
        out = p.new_zeros(*p.shape[:-1], v.shape[-1])

        def use(j: int, v_j: torch.Tensor) -> None:
            out.add_(torch.matmul(p[..., j * c : (j + 1) * c], v_j))

        _around(v, ring, use)
        return out

    @staticmethod
    def backward(
        ctx: Any, grad: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        p, v = ctx.saved_tensors
        v = v.contiguous()  # already, but where traced
        ring: Ring = ctx.ring
        c = v.shape[-2]
        grad = grad.contiguous()  # [.., c, d]
        grad_p = grad_v = None
        if ctx.needs_input_grad[0]:
            dp = torch.empty_like(p)

            def use(j: int, v_j: torch.Tensor) -> None:
                dp[..., j * c : (j + 1) * c] = torch.matmul(grad, v_j.transpose(-1, -2))

            _around(v, ring, use)
            grad_p = dp
        if ctx.needs_input_grad[1]:
            grad_v = _accumulate(
                ring,
                lambda j: torch.matmul(p[..., j * c : (j + 1) * c].transpose(-1, -2), grad),
            )  # [.., c, d]: dV_j
        return grad_p, grad_v, None


def _check(name: str, a: torch.Tensor, b: torch.Tensor, a_last: int, ring: Ring) -> None:
    if a.dim() < 2 or b.dim() < 2 or a.shape[:-2] != b.shape[:-2] or a.shape[-1] != a_last:
        raise ValueError(
            f"{name}: incompatible local chunks {list(a.shape)} and {list(b.shape)} on a ring "
            f"of {ring.world_size} ranks (expected [.., c, {a_last}] and [.., c, d] with the "
            "same leading dims)"
        )


def ring_qk(q: torch.Tensor, k: torch.Tensor, ring: Ring) -> torch.Tensor:
    """Attention scores of the local queries against the whole sequence's keys.

    Args:
        q: ``[.., c, d]`` the local chunk's queries (already scaled).
        k: ``[.., c, d]`` the local chunk's keys; every rank's chunk has the same shape.
        ring: The SEQUENCE ring.

    Returns:
        ``[.., c, N c]``: column block ``j`` holds ``Q_r K_j^T``.
    """
    _check("ring_qk", q, k, k.shape[-1], ring)
    if ring.world_size == 1:
        return torch.matmul(q, k.transpose(-1, -2))
    return apply_function(_RingQK, q, k, ring)


def ring_av(p: torch.Tensor, v: torch.Tensor, ring: Ring) -> torch.Tensor:
    """The local queries' attention output: probabilities times the whole sequence's values.

    Args:
        p: ``[.., c, N c]`` the local rows of the attention probabilities.
        v: ``[.., c, d]`` the local chunk's values.
        ring: The SEQUENCE ring.

    Returns:
        ``[.., c, d]``.
    """
    _check("ring_av", p, v, v.shape[-2] * ring.world_size, ring)
    if ring.world_size == 1:
        return torch.matmul(p, v)
    return apply_function(_RingAV, p, v, ring)
