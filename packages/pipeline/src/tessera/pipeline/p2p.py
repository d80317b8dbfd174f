"""Point-to-point communication between pipeline ranks: batched isend/irecv plus shape metadata.

One executor step that holds communication actions becomes ONE call of :meth:`PipelineComm.
communicate`: every send and receive of the batch is posted together with
``torch.distributed.batch_isend_irecv`` and waited on as a whole. That is how the fused pairs of
Megatron-LM (``send_forward_recv_backward``, ``send_backward_recv_forward``; Narayanan et al.
2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM") come out
of the action lists: a schedule puts a send and a receive in the same batch.

Ranks. Everything runs over the PIPELINE group of the context; a pipeline rank ``i`` is global
rank ``context.get_ranks_in_group(PIPELINE)[i]`` (``P2POp`` takes global ranks).

Metadata. A receiver must allocate its buffers before the data arrives, so it needs the
payload's structure, shapes, dtypes and which tensors require grad (:class:`PayloadMeta`). On
a step that needs it (the first one for given input shapes), every message of the step travels
with its metadata over the context's CPU (gloo) group, each receive posting its next part as
soon as the previous one landed (:meth:`PipelineComm._communicate_with_meta`), so a batch makes
progress exactly as it would with known shapes. Later steps post each batch at once with the
cached shapes. Metadata and tensors use different tags, so on gloo, where the CPU group is the
same group, they never match each other.

Order. NCCL matches point-to-point messages between two ranks in the order they are posted,
whatever their tag. The executor therefore relies on the action lists posting, for every pair
of ranks, the sends in the order the peer posts the receives; :func:`check_message_order` checks
it (every built-in schedule satisfies it, tested for p up to 8).
"""

from __future__ import annotations

import pickle
from collections import deque
from collections.abc import Sequence
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import torch
import torch.distributed as dist

from tessera.context import ParallelMode
from tessera.pipeline.actions import Action, ActionKind, peer_rank, virtual_stage
from tessera.pipeline.errors import ScheduleError
from tessera.pipeline.payload import Spec

__all__ = [
    "CommContext",
    "TensorMeta",
    "PayloadMeta",
    "Transfer",
    "PipelineComm",
    "check_message_order",
]

# Tags keep the three kinds of messages apart where they share a gloo group.
TAG_TENSOR = 0
TAG_META_LENGTH = 1
TAG_META_BYTES = 2


class CommContext(Protocol):
    """What :class:`PipelineComm` needs from a context (``tessera.context.ParallelContext``)."""

    def get_group(self, mode: ParallelMode) -> Any:
        """The process group of ``mode`` (NCCL or gloo)."""
        ...

    def get_cpu_group(self, mode: ParallelMode) -> Any:
        """A gloo group with the same ranks (the same group under gloo)."""
        ...

    def get_ranks_in_group(self, mode: ParallelMode) -> list[int]:
        """Global ranks of this rank's group of ``mode``, by local rank."""
        ...

    def get_local_rank(self, mode: ParallelMode) -> int:
        """This rank's index in its group of ``mode``."""
        ...

    def get_world_size(self, mode: ParallelMode) -> int:
        """The size of this rank's group of ``mode``."""
        ...

    @property
    def device(self) -> torch.device:
        """Where this rank's tensors live."""
        ...


@dataclass(frozen=True)
class TensorMeta:
    """Shape, dtype and whether a gradient comes back, for one tensor of a message."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool

    @classmethod
    def of(cls, tensor: torch.Tensor, requires_grad: bool | None = None) -> TensorMeta:
        """The metadata of ``tensor`` (``requires_grad`` defaults to the tensor's flag)."""
        flag = tensor.requires_grad if requires_grad is None else requires_grad
        return cls(tuple(int(s) for s in tensor.shape), tensor.dtype, bool(flag))

    def matches(self, tensor: torch.Tensor) -> bool:
        """Same shape and dtype as ``tensor``."""
        return tuple(tensor.shape) == self.shape and tensor.dtype == self.dtype


@dataclass(frozen=True)
class PayloadMeta:
    """What a receiver needs to allocate and rebuild a message: structure and tensor metadata.

    Attributes:
        spec: the payload's structure (:func:`tessera.pipeline.payload.flatten_payload`).
        tensors: one :class:`TensorMeta` per tensor, in flattening order.
    """

    spec: Spec
    tensors: tuple[TensorMeta, ...]

    @property
    def grad_mask(self) -> tuple[bool, ...]:
        """Per tensor, whether its gradient is sent back (it requires grad)."""
        return tuple(t.requires_grad for t in self.tensors)

    def gradient_meta(self) -> PayloadMeta:
        """The metadata of the gradient message that answers this one.

        Only the tensors that require grad get a gradient, in the same order; the message is a
        flat list (an empty one when nothing requires grad: then nothing is sent at all).
        """
        grads = tuple(TensorMeta(t.shape, t.dtype, False) for t in self.tensors if t.requires_grad)
        return PayloadMeta(("list", tuple(("tensor",) for _ in grads)), grads)

    def describe(self) -> str:
        """Short human form used in error messages."""
        parts = [
            f"{list(t.shape)}:{str(t.dtype).removeprefix('torch.')}{'*' if t.requires_grad else ''}"
            for t in self.tensors
        ]
        return "(" + ", ".join(parts) + ")"

    def encode(self) -> bytes:
        """Bytes for the metadata message (dtypes by name, so the message is plain data)."""
        plain = (
            self.spec,
            tuple(
                (t.shape, str(t.dtype).removeprefix("torch."), t.requires_grad)
                for t in self.tensors
            ),
        )
        return pickle.dumps(plain, protocol=pickle.HIGHEST_PROTOCOL)

    @classmethod
    def decode(cls, data: bytes) -> PayloadMeta:
        """Inverse of :meth:`encode`."""
        spec, tensors = pickle.loads(data)
        metas = []
        for shape, dtype_name, requires_grad in tensors:
            dtype = getattr(torch, dtype_name)
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"metadata names an unknown dtype {dtype_name!r}")
            metas.append(TensorMeta(tuple(shape), dtype, bool(requires_grad)))
        return cls(spec, tuple(metas))


@dataclass
class Transfer:
    """One send or receive of a batch.

    Attributes:
        op: ``"send"`` or ``"recv"``.
        peer: the PIPELINE rank at the other end.
        tensors: what to send (sends only), in the order of ``meta.tensors``.
        meta: for a send, the metadata of ``tensors`` (sent when metadata is exchanged); for a
            receive, the expected metadata, or None to take it from the metadata message.
        received: filled by :meth:`PipelineComm.communicate` for a receive.
        received_meta: the metadata the receive used (exchanged or expected).
    """

    op: Literal["send", "recv"]
    peer: int
    tensors: Sequence[torch.Tensor] = ()
    meta: PayloadMeta | None = None
    received: list[torch.Tensor] = field(default_factory=list)
    received_meta: PayloadMeta | None = None


class PipelineComm:
    """Batched point-to-point transfers over the PIPELINE group of a context.

    Args:
        context: the parallel context (``get_group``, ``get_cpu_group``,
            ``get_ranks_in_group``, ``get_local_rank``, ``get_world_size``, ``device``).
        mode: the group to use; PIPELINE unless a caller has its own reason.
    """

    def __init__(self, context: CommContext, mode: ParallelMode = ParallelMode.PIPELINE) -> None:
        self.mode = mode
        self.group = context.get_group(mode)
        self.cpu_group = context.get_cpu_group(mode)
        self.global_ranks: tuple[int, ...] = tuple(context.get_ranks_in_group(mode))
        self.rank = context.get_local_rank(mode)
        self.size = context.get_world_size(mode)
        self.device = torch.device(context.device)
        self.backend = str(dist.get_backend(self.group))
        if len(self.global_ranks) != self.size:
            raise ValueError(
                f"the {mode} group lists {len(self.global_ranks)} ranks but has size {self.size}"
            )
        self._ready = "nccl" not in self.backend
        timeout = getattr(context, "timeout", None)
        self.timeout_s = timeout.total_seconds() if timeout is not None else 1800.0
        self._pool: futures.ThreadPoolExecutor | None = None

    def global_rank(self, pipeline_rank: int) -> int:
        """The global rank of pipeline rank ``pipeline_rank`` (what ``P2POp`` takes)."""
        if not 0 <= pipeline_rank < self.size:
            raise ValueError(f"pipeline rank {pipeline_rank} is outside [0, {self.size})")
        return self.global_ranks[pipeline_rank]

    def ensure_ready(self) -> None:
        """Under NCCL, run one collective on the group before the first batched p2p.

        ``batch_isend_irecv`` requires every rank of an NCCL group to take part in the group's
        first collective; a one-element all-reduce, called by every rank at the start of a step,
        satisfies that. No-op under gloo and after the first call.
        """
        if self._ready:
            return
        probe = torch.zeros(1, device=self.device)
        dist.all_reduce(probe, group=self.group)
        self._ready = True

    def communicate(self, transfers: Sequence[Transfer], *, exchange_meta: bool) -> None:
        """Run one batch of transfers and wait for all of them.

        Without metadata: every send and receive in ONE ``batch_isend_irecv`` on the group.
        With metadata (both ends of every transfer agree on ``exchange_meta``; the executor
        decides it identically on all ranks), see :meth:`_communicate_with_meta`. Receives
        land in ``transfer.received`` (on this rank's device).

        Raises:
            ValueError: a receive has no metadata and none is exchanged, a send's tensors do
                not match its metadata, or the received metadata differs from the expected.
        """
        if exchange_meta:
            self._communicate_with_meta(transfers)
            return
        ops: list[dist.P2POp] = []
        for transfer in transfers:
            peer = self.global_rank(transfer.peer)
            if transfer.op == "send":
                self._check_send(transfer)
                ops.extend(
                    dist.P2POp(dist.isend, tensor.contiguous(), peer, self.group, TAG_TENSOR)
                    for tensor in transfer.tensors
                )
                continue
            meta = transfer.meta
            if meta is None:
                raise ValueError(
                    f"pipeline rank {self.rank}: a receive from pipeline rank {transfer.peer} "
                    "has no metadata; exchange it or give tensor_shape"
                )
            transfer.received_meta = meta
            transfer.received = [
                torch.empty(t.shape, dtype=t.dtype, device=self.device) for t in meta.tensors
            ]
            ops.extend(
                dist.P2POp(dist.irecv, buffer, peer, self.group, TAG_TENSOR)
                for buffer in transfer.received
            )
        _run(ops)

    def _check_send(self, transfer: Transfer) -> None:
        meta = transfer.meta
        if meta is None:
            return
        if len(meta.tensors) != len(transfer.tensors):
            raise ValueError(
                f"pipeline rank {self.rank}: a message to pipeline rank {transfer.peer} holds "
                f"{len(transfer.tensors)} tensors, its metadata {len(meta.tensors)}"
            )
        for index, tensor in enumerate(transfer.tensors):
            if not meta.tensors[index].matches(tensor):
                raise ValueError(
                    f"pipeline rank {self.rank}: tensor {index} of a message to pipeline rank "
                    f"{transfer.peer} has shape {list(tensor.shape)} and dtype {tensor.dtype}, "
                    f"but the agreed metadata is {meta.describe()}"
                )

    def _communicate_with_meta(self, transfers: Sequence[Transfer]) -> None:
        """A batch whose receivers do not know the shapes yet (the first step of a shape).

        Every message becomes three on the CPU group: its metadata's length, the metadata, the
        tensors (copied through the CPU when the device is not). A send posts all three at
        once. A receive posts the length at once and each next part as soon as the previous
        arrived (watched by helper threads), so nothing waits for more than its own message: a
        batch progresses exactly as it would if the shapes were known, which is what keeps the
        deadlock-free action lists deadlock-free here. Waiting for all metadata first would
        not: a fused ``[SEND_F, RECV_B]`` batch would hold back the forward that produces its
        own gradient.
        """
        pg = self.cpu_group
        cpu = torch.device("cpu")
        final: list[Any] = []
        queues: dict[int, deque[_PendingRecv]] = {}
        for transfer in transfers:
            peer = self.global_rank(transfer.peer)
            if transfer.op == "send":
                if transfer.meta is None:
                    raise ValueError(f"pipeline rank {self.rank}: a send without metadata")
                self._check_send(transfer)
                data = torch.frombuffer(bytearray(transfer.meta.encode()), dtype=torch.uint8)
                length = torch.tensor([data.numel()], dtype=torch.int64)
                final.append(dist.isend(length, peer, group=pg, tag=TAG_META_LENGTH))
                final.append(dist.isend(data, peer, group=pg, tag=TAG_META_BYTES))
                for tensor in transfer.tensors:
                    payload = tensor.detach().to(cpu).contiguous()
                    final.append(dist.isend(payload, peer, group=pg, tag=TAG_TENSOR))
                continue
            length = torch.zeros(1, dtype=torch.int64)
            work = dist.irecv(length, peer, group=pg, tag=TAG_META_LENGTH)
            queues.setdefault(peer, deque()).append(_PendingRecv(transfer, length, work))
        # Per peer, strictly in order, so each tag's messages are posted in message order.
        # Only the heads wait, each in a helper thread (gloo's works have no completion poll),
        # and every op is posted from this thread.
        landed: list[tuple[Transfer, list[torch.Tensor]]] = []
        pool = self._waiter_pool()
        for queue in queues.values():
            queue[0].future = pool.submit(queue[0].work.wait)
        while any(queues.values()):
            heads = [q[0].future for q in queues.values() if q and q[0].future is not None]
            done, _ = futures.wait(heads, timeout=self.timeout_s, return_when="FIRST_COMPLETED")
            if not done:
                waiting = sorted(peer for peer, queue in queues.items() if queue)
                raise TimeoutError(
                    f"pipeline rank {self.rank}: no metadata from global rank(s) {waiting} "
                    f"within {self.timeout_s:.0f} s"
                )
            for peer, queue in queues.items():
                while queue and queue[0].future is not None and queue[0].future.done():
                    head = queue[0]
                    assert head.future is not None
                    head.future.result()  # raises what the wait raised
                    if head.data is None:
                        head.data = torch.empty(int(head.length.item()), dtype=torch.uint8)
                        head.work = dist.irecv(head.data, peer, group=pg, tag=TAG_META_BYTES)
                        head.future = pool.submit(head.work.wait)
                        continue
                    meta = self._decode(head.transfer, head.data)
                    buffers = [
                        torch.empty(t.shape, dtype=t.dtype, device=cpu) for t in meta.tensors
                    ]
                    final.extend(
                        dist.irecv(buffer, peer, group=pg, tag=TAG_TENSOR) for buffer in buffers
                    )
                    landed.append((head.transfer, buffers))
                    queue.popleft()
                    if queue:
                        queue[0].future = pool.submit(queue[0].work.wait)
        for work in final:
            if work is not None:
                work.wait()
        for transfer, buffers in landed:
            transfer.received = [buffer.to(self.device) for buffer in buffers]

    def _waiter_pool(self) -> futures.ThreadPoolExecutor:
        if self._pool is None:
            self._pool = futures.ThreadPoolExecutor(
                max_workers=8, thread_name_prefix="tessera-p2p-meta"
            )
        return self._pool

    def _decode(self, transfer: Transfer, data: torch.Tensor) -> PayloadMeta:
        received = PayloadMeta.decode(data.numpy().tobytes())
        expected = transfer.meta
        if expected is not None and expected != received:
            raise ValueError(
                f"pipeline rank {self.rank}: pipeline rank {transfer.peer} sends "
                f"{received.describe()}, expected {expected.describe()}"
            )
        transfer.received_meta = received
        return received


@dataclass
class _PendingRecv:
    """A receive of a metadata step: length, then metadata, then the tensors are posted."""

    transfer: Transfer
    length: torch.Tensor
    work: Any
    data: torch.Tensor | None = None
    future: futures.Future[Any] | None = None


def _run(ops: Sequence[dist.P2POp]) -> None:
    if not ops:
        return
    for work in dist.batch_isend_irecv(list(ops)):
        if work is not None:
            work.wait()


def _message(action: Action, rank: int, num_stages: int) -> tuple[str, int, int]:
    """(direction, microbatch, producing virtual stage) of a communication action."""
    v = virtual_stage(rank, action.chunk, num_stages)
    if action.kind is ActionKind.SEND_F:
        return ("F", action.microbatch, v)
    if action.kind is ActionKind.RECV_F:
        return ("F", action.microbatch, v - 1)
    if action.kind is ActionKind.SEND_B:
        return ("B", action.microbatch, v)
    return ("B", action.microbatch, v + 1)


def check_message_order(table: Sequence[Sequence[Action]]) -> None:
    """Check that every pair of ranks posts sends in the order the receiver posts receives.

    Backends such as NCCL match the messages between two ranks in posting order, ignoring
    tags; a list that breaks this order would silently pair the wrong tensors.

    Raises:
        ScheduleError: naming the pair of ranks and the first message out of order.
    """
    p = len(table)
    sends: dict[tuple[int, int], list[tuple[str, int, int]]] = {}
    recvs: dict[tuple[int, int], list[tuple[str, int, int]]] = {}
    for rank, actions in enumerate(table):
        for action in actions:
            if action.kind.is_compute:
                continue
            peer = peer_rank(action, rank, p)
            message = _message(action, rank, p)
            if action.kind.is_send:
                sends.setdefault((rank, peer), []).append(message)
            else:
                recvs.setdefault((peer, rank), []).append(message)
    for pair in sorted(set(sends) | set(recvs)):
        sent, received = sends.get(pair, []), recvs.get(pair, [])
        if sent == received:
            continue
        index = next(
            (i for i, (s, r) in enumerate(zip(sent, received, strict=False)) if s != r),
            min(len(sent), len(received)),
        )
        raise ScheduleError(
            f"messages from rank {pair[0]} to rank {pair[1]} are sent in another order than "
            f"they are received: message {index} is sent as {sent[index : index + 1]} and "
            f"received as {received[index : index + 1]} (direction, microbatch, virtual stage)"
        )
