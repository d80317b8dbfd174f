"""Collectives in flight, and the fastest way each backend moves a group's blocks.

A kernel that posts a collective, multiplies, and only then waits hides the communication
behind the matmul (with NCCL on its own stream; with gloo on gloo's worker threads). The
functions here post and return a :class:`Pending`; ``wait()`` gives the result.

Two exchanges carry almost all tensor-parallel traffic: *gather blocks* (every rank gets
every rank's block: an all-gather) and *scatter blocks* (rank ``l`` gets the sum of every
rank's block ``l``: a reduce-scatter). NCCL runs them as its collectives. gloo's all-gather
and reduce-scatter go through staging copies and, for the reduce-scatter, a full reduction
(measured here, 2 ranks, 4 MB blocks: all-gather 5.6 ms and reduce-scatter 10.2 ms against
2.8 ms and 3.1 ms for the same blocks sent pairwise), so on gloo each rank sends each peer
the block it needs, straight from its own memory, and sums what it receives in group-rank
order. The bytes per rank are the same ``(w - 1)`` blocks either way.

On gloo those pairwise blocks travel as one all-to-all (:func:`post_all_to_all`), which
gloo runs on the process group's worker thread, not as sends and receives posted from the
calling thread. The reason is gloo's socket thread: it only *tries* the lock of a peer's
connection, and while another thread holds it (posting a send or a receive there) it
returns to ``epoll`` at once and spins. The calling thread, which has just multiplied and
used up its time slice, is the one likely to be preempted while holding that lock; the
worker thread wakes only to communicate. Measured with eight ranks on two cores (a 3D MLP
step, hidden 512): the socket threads' spins fell to a third, system time per rank and step
from 11 to 7 ms, and the transformer block's step by 13 % (``benchmarks/bench_colossal.py``).
A gather sends its block once per peer from a ``[w, *block]`` copy (``w - 1`` blocks more
memory for the duration of the call); between two ranks, the commonest group of a 2 x 2 mesh,
the block travels as it is and a reduce-scatter receives only the peer's part
(:func:`post_peer_exchange`).

The point-to-point transfers that remain (:func:`start_transfers`: SUMMA's panels, the 3D
layout switch) are posted on the group's ``ProcessGroup`` directly, with group ranks looked
up once per group: torch's ``P2POp`` / ``batch_isend_irecv`` path translates ranks and checks
arguments in Python on every call, which cost about 0.3 ms of CPU per exchange here (with
eight ranks on two cores, CPU time is step time). On NCCL they stay one
``batch_isend_irecv``: NCCL needs their sends and receives in one group call.

Under ``torch.compile`` every exchange here goes through torch's functional collectives
(``torch.distributed._functional_collectives``), which Dynamo traces into the graph, where
the ``Work`` handles of ``async_op=True`` calls, gloo's direct process-group calls and
point-to-point sends would each break it: the compiler then schedules the overlap itself.
The point-to-point transfers of one call become one all-to-all over their group (their
callers, SUMMA's stationary-weights product and the 3D layout switch, post them on every
rank of that group at once, as an all-to-all needs).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "Pending",
    "functional_collectives",
    "post_all_to_all",
    "post_peer_exchange",
    "start_all_reduce",
    "start_all_to_all_blocks",
    "start_gather_blocks",
    "start_scatter_blocks",
    "start_transfers",
    "tracing",
]

_Collective = Callable[..., object]

# torch >= 2.12 renamed the flat collectives; older versions only have the old names.
_all_gather_flat: _Collective = getattr(dist, "all_gather_single", None) or (
    dist.all_gather_into_tensor
)
_reduce_scatter_flat: _Collective = getattr(dist, "reduce_scatter_single", None) or (
    dist.reduce_scatter_tensor
)


class Pending:
    """Communication in flight: :meth:`wait` blocks until it is done and returns its result.

    Args:
        works: The handles of the posted operations (none if there was nothing to send).
        finish: Builds the result once every operation is done.
        keep: Tensors that must stay alive until then (the buffers being sent).
    """

    def __init__(
        self,
        works: Sequence[dist.Work],
        finish: Callable[[], torch.Tensor],
        keep: Sequence[torch.Tensor] = (),
    ) -> None:
        self._works, self._finish, self._keep = list(works), finish, keep

    @classmethod
    def done(cls, result: torch.Tensor) -> Pending:
        """Communication that had nothing to do (a group of one rank)."""
        return cls((), lambda: result)

    def then(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> Pending:
        """The same communication, its result passed through ``fn`` (a view or reshape)."""
        return Pending((), lambda: fn(self.wait()))

    def wait(self) -> torch.Tensor:
        """Block until every operation is done; the result."""
        for work in self._works:
            work.wait()
        self._works, self._keep = [], ()
        return self._finish()


def tracing() -> bool:
    """Whether ``torch.compile`` is tracing (the functional collectives' path, above)."""
    return bool(torch.compiler.is_compiling())


def functional_collectives() -> Any:
    """The functional collectives of torch (imported when first traced, never in eager runs)."""
    import torch.distributed._functional_collectives as funcol

    return funcol


def _work(handle: object) -> dist.Work:
    """The handle an ``async_op=True`` call returned (typed: torch leaves it ``Any``)."""
    assert isinstance(handle, dist.Work)
    return handle


@dataclass(frozen=True)
class _Route:
    """What the exchanges need to know of a group, looked up once.

    Attributes:
        pairwise: Blocks travel pairwise, as one all-to-all (gloo), rather than as the
            backend's all-gather and reduce-scatter.
        global_rank: The group's ranks in order: rank in the group -> global rank.
        group_rank: Global rank -> rank in the group.
    """

    pairwise: bool
    global_rank: tuple[int, ...]
    group_rank: dict[int, int]


#: A cache of facts that never change while a group lives (its backend, its ranks); an entry
#: goes with its group.
_ROUTES: weakref.WeakKeyDictionary[dist.ProcessGroup, _Route] = weakref.WeakKeyDictionary()


def _route(group: dist.ProcessGroup) -> _Route:
    route = _ROUTES.get(group)
    if route is None:
        ranks = tuple(dist.get_process_group_ranks(group))
        local = {peer: i for i, peer in enumerate(ranks)}
        route = _Route(dist.get_backend(group) == "gloo", ranks, local)
        _ROUTES[group] = route
    return route


def _pairwise(group: dist.ProcessGroup) -> bool:
    """Whether blocks travel pairwise (gloo) rather than as the backend's collectives."""
    return _route(group).pairwise


def post_exchange(
    sends: Sequence[tuple[int, torch.Tensor]],
    recvs: Sequence[tuple[int, torch.Tensor]],
    group: dist.ProcessGroup,
) -> list[dist.Work]:
    """Post sends, then receives, ``(group rank, contiguous tensor)``, through ``group``.

    gloo: on the process group itself, one call each. NCCL: as one ``batch_isend_irecv``,
    which fuses them in one NCCL group call (sends and receives that must progress together
    would deadlock posted one by one once a message outgrows NCCL's buffers). The one place
    the layers post point-to-point exchanges (looked up at each call, so a benchmark's traffic
    counter can wrap it: ``benchmarks/meters.py``).

    Raises:
        ValueError: a tensor is not contiguous (checked before anything is posted).
    """
    for _, tensor in (*sends, *recvs):
        if not tensor.is_contiguous():
            raise ValueError(
                f"a point-to-point buffer must be contiguous, got strides {tensor.stride()}"
            )
    route = _route(group)
    if not route.pairwise:
        ranks = route.global_rank
        ops = [dist.P2POp(dist.isend, t, ranks[peer], group) for peer, t in sends]
        ops += [dist.P2POp(dist.irecv, t, ranks[peer], group) for peer, t in recvs]
        return [_work(w) for w in dist.batch_isend_irecv(ops)] if ops else []
    works = [group.send([tensor], peer, 0) for peer, tensor in sends]
    works += [group.recv([tensor], peer, 0) for peer, tensor in recvs]
    return works


def post_all_to_all(
    received: torch.Tensor, blocks: torch.Tensor, group: dist.ProcessGroup
) -> dist.Work:
    """Post ``blocks[l]`` ``[w, *s]`` to group rank ``l``, into ``received[l]`` from it (gloo).

    Run by the group's worker thread (see the module docstring), called on the process group
    itself (``dist.all_to_all_single`` checks its arguments in Python on every call). The one
    place the layers post their gloo block exchanges (looked up at each call, so a
    benchmark's traffic counter can wrap it: ``benchmarks/meters.py``). Both buffers must be
    contiguous; they travel as bytes (gloo's all-to-all takes no complex dtype, its sends did).
    """
    return group.alltoall_base(_bytes(received), _bytes(blocks), [], [])


def post_peer_exchange(
    received: torch.Tensor, block: torch.Tensor, group: dist.ProcessGroup
) -> dist.Work:
    """Two ranks: post ``block`` to the other rank of ``group``, into ``received`` from it (gloo).

    The all-to-all of :func:`post_all_to_all`, its own chunk empty: nothing is copied, where
    a ``[2, *block]`` send buffer would hold two blocks more. Both contiguous and the same
    size; counted by a benchmark's traffic counter as :func:`post_all_to_all` is.
    """
    size = block.numel() * block.element_size()
    splits = [0, size] if _route(group).group_rank[dist.get_rank()] == 0 else [size, 0]
    flat_in, flat_out = block.reshape(-1).view(torch.uint8), received.reshape(-1).view(torch.uint8)
    return group.alltoall_base(flat_out, flat_in, splits, splits)


def _bytes(blocks: torch.Tensor) -> torch.Tensor:
    """``[w, *s]`` seen as ``[w, bytes of one block]`` (no copy)."""
    return blocks.view(blocks.shape[0], blocks.numel() // blocks.shape[0]).view(torch.uint8)


def start_transfers(
    sends: Sequence[tuple[int, torch.Tensor]],
    recvs: Sequence[tuple[int, torch.Tensor]],
    group: dist.ProcessGroup,
) -> list[dist.Work]:
    """Post point-to-point sends and receives ``(global rank, tensor)`` through ``group``.

    Every peer must be a rank of ``group`` other than this one, every tensor contiguous.
    Between two ranks, sends arrive in the order they were posted.
    """
    if tracing():
        return _transfers_as_all_to_all(sends, recvs, group)
    local = _route(group).group_rank
    return post_exchange(
        [(local[peer], t) for peer, t in sends], [(local[peer], t) for peer, t in recvs], group
    )


def _transfers_as_all_to_all(
    sends: Sequence[tuple[int, torch.Tensor]],
    recvs: Sequence[tuple[int, torch.Tensor]],
    group: dist.ProcessGroup,
) -> list[dist.Work]:
    """:func:`start_transfers` as one traced all-to-all over ``group``: done when it returns.

    Every rank of ``group`` must call it at once (each with its own sends and receives, a
    peer may be this rank itself). The sends go out flattened in group-rank order, each
    peer's in the order posted, and arrive into the receive buffers in the same order.
    """
    tensors = [t for _, t in (*sends, *recvs)]
    if not tensors:
        return []
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) > 1:
        raise ValueError(
            f"traced transfers take one dtype per call, got {sorted(map(str, dtypes))}"
        )
    route = _route(group)
    width = len(route.global_rank)
    outgoing: list[list[torch.Tensor]] = [[] for _ in range(width)]
    incoming: list[list[torch.Tensor]] = [[] for _ in range(width)]
    for peer, tensor in sends:
        outgoing[route.group_rank[peer]].append(tensor.reshape(-1))
    for peer, tensor in recvs:
        incoming[route.group_rank[peer]].append(tensor)
    flat = [t for per_peer in outgoing for t in per_peer]
    sent = torch.cat(flat) if flat else tensors[0].new_empty(0)
    got = functional_collectives().all_to_all_single(
        sent,
        [sum(t.numel() for t in per_peer) for per_peer in incoming],
        [sum(t.numel() for t in per_peer) for per_peer in outgoing],
        group,
    )
    offset = 0
    for per_peer in incoming:
        for tensor in per_peer:
            tensor.copy_(got[offset : offset + tensor.numel()].view(tensor.shape))
            offset += tensor.numel()
    return []


def start_gather_blocks(block: torch.Tensor, group: dist.ProcessGroup, world_size: int) -> Pending:
    """Post an all-gather; ``wait()`` gives ``[w, *block.shape]``, entry ``l`` from rank ``l``."""
    block = block.contiguous()
    if world_size == 1:
        return Pending.done(block.unsqueeze(0))
    if tracing():
        return Pending.done(
            functional_collectives().all_gather_tensor(block.unsqueeze(0), 0, group)
        )
    out = torch.empty((world_size, *block.shape), dtype=block.dtype, device=block.device)
    if not _pairwise(group):
        flat = out.view(world_size * block.shape[0], *block.shape[1:]) if block.dim() else out
        works = [_work(_all_gather_flat(flat, block, group=group, async_op=True))]
        return Pending(works, lambda: out, (block,))
    if world_size == 2:  # the peer's block straight into its slot, this one's copied
        peer = 1 - _route(group).group_rank[dist.get_rank()]
        work = post_peer_exchange(out[peer], block, group)
        out[1 - peer].copy_(block)
        return Pending([work], lambda: out, (block,))
    copies = block.unsqueeze(0).expand(world_size, *block.shape).contiguous()  # [w, *block]
    return Pending([post_all_to_all(out, copies, group)], lambda: out, (copies,))


def start_scatter_blocks(
    blocks: torch.Tensor, group: dist.ProcessGroup, world_size: int
) -> Pending:
    """Post a reduce-scatter of ``blocks`` ``[w, *s]``: ``wait()`` gives ``sum over ranks [l]``.

    ``l`` is this rank's index in the group; the result has shape ``[*s]``.
    """
    if blocks.shape[0] != world_size:
        raise ValueError(
            f"scatter_blocks: {blocks.shape[0]} blocks for a group of {world_size} ranks"
        )
    blocks = blocks.contiguous()
    if world_size == 1:
        return Pending.done(blocks[0])
    if tracing():
        return Pending.done(
            functional_collectives().reduce_scatter_tensor(blocks, "sum", 0, group)[0]
        )
    shape = blocks.shape[1:]
    if not _pairwise(group):
        out = torch.empty(shape, dtype=blocks.dtype, device=blocks.device)
        send = blocks.view(world_size * shape[0], *shape[1:]) if len(shape) else blocks
        works = [_work(_reduce_scatter_flat(out, send, group=group, async_op=True))]
        return Pending(works, lambda: out, (blocks,))
    if world_size == 2:  # only the peer's part travels; a sum of two is the same either way
        own = _route(group).group_rank[dist.get_rank()]
        part = torch.empty(shape, dtype=blocks.dtype, device=blocks.device)
        work = post_peer_exchange(part, blocks[1 - own], group)
        summed: list[torch.Tensor] = []  # once, however often the result is asked for

        def total() -> torch.Tensor:
            if not summed:
                summed.append(part.add_(blocks[own]))
            return summed[0]

        return Pending([work], total, (blocks,))
    received = torch.empty_like(blocks)  # [w, *s]: entry l is rank l's block for this rank
    work = post_all_to_all(received, blocks, group)
    return Pending([work], lambda: received.sum(0), (blocks,))


def start_all_to_all_blocks(
    blocks: torch.Tensor, group: dist.ProcessGroup, world_size: int
) -> Pending:
    """Post ``blocks[l]`` ``[w, *s]`` to rank ``l``; ``wait()`` gives what each rank sent here."""
    if blocks.shape[0] != world_size:
        raise ValueError(
            f"all_to_all_blocks: {blocks.shape[0]} blocks for a group of {world_size} ranks"
        )
    blocks = blocks.contiguous()
    if world_size == 1:
        return Pending.done(blocks)
    if tracing():
        return Pending.done(functional_collectives().all_to_all_single(blocks, None, None, group))
    received = torch.empty_like(blocks)
    if not _pairwise(group):
        works = [_work(dist.all_to_all_single(received, blocks, group=group, async_op=True))]
        return Pending(works, lambda: received, (blocks,))
    return Pending([post_all_to_all(received, blocks, group)], lambda: received, (blocks,))


def start_all_reduce(x: torch.Tensor, group: dist.ProcessGroup, world_size: int) -> Pending:
    """Post a sum of ``x`` over the group, in place; ``wait()`` returns ``x``."""
    if world_size == 1:
        return Pending.done(x)
    if tracing():  # in place, as the eager path: callers may read x itself
        return Pending.done(x.copy_(functional_collectives().all_reduce(x, "sum", group)))
    return Pending([_work(dist.all_reduce(x, group=group, async_op=True))], lambda: x)
