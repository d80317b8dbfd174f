"""Point-to-point communication between pipeline ranks: batched isend/irecv plus shape metadata.

One executor step that holds communication actions becomes ONE call of :meth:`PipelineComm.
communicate`: every send and receive of the batch is posted together (one
``torch.distributed.batch_isend_irecv``; on gloo, which has no batching, the same ops straight
on the group) and the receives are waited on. That is how the fused pairs of Megatron-LM
(``send_forward_recv_backward``, ``send_backward_recv_forward``; Narayanan et al. 2021,
"Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM") come out of
the action lists: a schedule puts a send and a receive in the same batch. Sends finish in the
background (``send_depth`` batches in flight, all of them by the end of the step).

Ranks. Everything runs over the PIPELINE group of the context; a pipeline rank ``i`` is global
rank ``context.get_ranks_in_group(PIPELINE)[i]`` and local rank ``i`` of the group.

Streams. Each boundary between virtual stages ``v -> v + 1`` and each direction is its own
stream with its own tag (:func:`message_tag`); on gloo, which matches by tag, only the order
within a stream matters (microbatch order on both ends).

Metadata. A receiver must allocate its buffers before the data arrives, so it needs the
payload's structure, shapes, dtypes and which tensors require grad (:class:`PayloadMeta`). On
a step that needs it (the first one for given input shapes), the first activation message of
each link this step is preceded by a metadata message over the context's CPU (gloo) group,
which the receiver reads (blocking, in one thread) before posting that receive
(:meth:`PipelineComm._communicate_with_meta`); later microbatches reuse it, gradients need none
(their shapes are those of the activations they answer). Later steps post each batch at once
with the cached shapes (on gloo, the executor posts each stream's next receive ahead of its
batch, :meth:`PipelineComm.prefetch`). No helper threads, no collectives: the order of every
message is fixed by the action lists alone.

Order. NCCL matches point-to-point messages between two ranks in the order they are posted,
whatever their tag. The executor therefore relies on the action lists posting, for every pair
of ranks, the sends in the order the peer posts the receives; :func:`check_message_order` checks
it (every built-in schedule satisfies it, tested for p up to 8).
"""

from __future__ import annotations

import pickle
from collections import deque
from collections.abc import Sequence
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
    "link_of",
    "message_tag",
]

#: Metadata messages: a fixed header ``[magic, link, microbatch, nbytes]``, then the bytes.
TAG_HEADER = 1
TAG_META = 2
#: Tensors: ``TAG_LINK + 2 * link + direction`` (:func:`message_tag`).
TAG_LINK = 16

_MAGIC = 0x7E55E7A
_HEADER_WORDS = 4


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


@dataclass(eq=False)
class Transfer:
    """One send or receive of a batch.

    Attributes:
        op: ``"send"`` or ``"recv"``.
        peer: the PIPELINE rank at the other end.
        tensors: what to send (sends only), in the order of ``meta.tensors``.
        meta: for a send, the metadata of ``tensors``; for a receive, the expected metadata,
            or None to read it from the sender's metadata message (steps that exchange
            metadata only; the send must then have ``announce`` set).
        tag: the message stream (:func:`message_tag`: one per link and direction). Sender and
            receiver must use the same tag; messages of one tag match in posting order.
        link: the boundary the message crosses (:func:`link_of`), checked against the
            metadata message when one is read.
        microbatch: the microbatch the message belongs to, checked likewise.
        announce: on a step that exchanges metadata, whether a send sends its metadata first
            (exactly when its receiver has ``meta=None`` and no ``meta_from``).
        meta_from: for a receive of an exchange step, an earlier receive of the same batch
            whose metadata this one shares (a later microbatch on the same link).
        received: filled by :meth:`PipelineComm.communicate` for a receive.
        received_meta: the metadata the receive used (read or expected).
        posted: the works of a receive posted ahead by :meth:`PipelineComm.prefetch`
            (``received`` already holds its buffers); :meth:`PipelineComm.communicate` only
            waits for them.
    """

    op: Literal["send", "recv"]
    peer: int
    tensors: Sequence[torch.Tensor] = ()
    meta: PayloadMeta | None = None
    tag: int = TAG_LINK
    link: int = 0
    microbatch: int = 0
    announce: bool = True
    meta_from: Transfer | None = None
    received: list[torch.Tensor] = field(default_factory=list)
    received_meta: PayloadMeta | None = None
    posted: list[Any] = field(default_factory=list)


def link_of(action: Action, pipeline_rank: int, num_stages: int) -> int:
    """The boundary a communication action crosses: ``v`` for the link ``v -> v + 1``.

    SEND_F and RECV_B of virtual stage ``v`` cross boundary ``v``; RECV_F and SEND_B cross
    ``v - 1``. Both ends of a message compute the same boundary.
    """
    v = virtual_stage(pipeline_rank, action.chunk, num_stages)
    if action.kind in (ActionKind.SEND_F, ActionKind.RECV_B):
        return v
    if action.kind in (ActionKind.RECV_F, ActionKind.SEND_B):
        return v - 1
    raise ValueError(f"{action} is a compute action; only send/receive actions cross a link")


def message_tag(action: Action, pipeline_rank: int, num_stages: int) -> int:
    """The tag of a communication action's messages: one stream per boundary and direction.

    On gloo (which matches by tag) every stream is then ordered on its own, so the order in
    which receives of *different* streams are posted does not matter; within a stream the
    microbatches go in the same order on both ends (:func:`check_message_order`). NCCL
    ignores tags and relies on that order alone.
    """
    backward = action.kind in (ActionKind.SEND_B, ActionKind.RECV_B)
    return TAG_LINK + 2 * link_of(action, pipeline_rank, num_stages) + int(backward)


class PipelineComm:
    """Batched point-to-point transfers over the PIPELINE group of a context.

    Args:
        context: the parallel context (``get_group``, ``get_cpu_group``,
            ``get_ranks_in_group``, ``get_local_rank``, ``get_world_size``, ``device``).
        mode: the group to use; PIPELINE unless a caller has its own reason.
        send_depth: how many batches of sends may still be in flight after their batch
            (:meth:`communicate`); 0 waits for every send within its batch.
    """

    def __init__(
        self,
        context: CommContext,
        mode: ParallelMode = ParallelMode.PIPELINE,
        *,
        send_depth: int = 2,
    ) -> None:
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
        if send_depth < 0:
            raise ValueError(f"send_depth must be >= 0, got {send_depth}")
        self.send_depth = send_depth
        self._ready = "nccl" not in self.backend
        # gloo posts every op on its own (no coalescing): call the group directly, which
        # skips torch.distributed's per-op Python checks on the hot path. That addresses
        # peers by group rank, so only where group rank i is pipeline rank i.
        self._direct = (
            self.backend == "gloo"
            and callable(getattr(self.group, "send", None))
            and dist.get_rank(self.group) == self.rank
            and all(
                dist.get_global_rank(self.group, i) == g for i, g in enumerate(self.global_ranks)
            )
        )
        self._in_flight: deque[list[Any]] = deque()  # per batch, its send works not yet waited
        #: Receives posted ahead of their batch so far (:meth:`prefetch`).
        self.prefetched = 0

    @property
    def can_prefetch(self) -> bool:
        """Whether receives may be posted ahead of their batch (:meth:`prefetch`).

        Only where messages match by tag (gloo, addressed straight on the group): every
        stream then keeps its own order, whatever is posted in between. NCCL matches the
        messages between two ranks in posting order, across tags, so there a receive must be
        posted where the action list puts it.
        """
        return self._direct

    def prefetch(self, transfer: Transfer) -> None:
        """Post a receive now; the batch that holds it later only waits for it.

        gloo moves a message only once its receive is posted (the receiver tells the sender
        it is ready, then the sender writes): a receive posted when its batch comes puts that
        round trip, two thread wake-ups on each side, on the critical path of every message.
        Posted early, the data lands in the background while this rank computes.

        Raises:
            ValueError: the receive has no metadata, or prefetching is not possible here.
        """
        if not self.can_prefetch:
            raise ValueError(f"receives cannot be posted ahead on a {self.backend} group")
        if transfer.op != "recv" or transfer.meta is None:
            raise ValueError("only a receive with known metadata can be posted ahead")
        transfer.received_meta = transfer.meta
        transfer.received = [
            torch.empty(t.shape, dtype=t.dtype, device=self.device) for t in transfer.meta.tensors
        ]
        transfer.posted = [
            self.group.recv([buffer], transfer.peer, transfer.tag) for buffer in transfer.received
        ]
        self.prefetched += 1

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
        """Run one batch of transfers; on return every receive has landed.

        Without metadata: every send and receive is posted at once (one
        ``batch_isend_irecv``, or the same ops straight on a gloo group) and the receives are
        waited on; a receive already posted by :meth:`prefetch` is only waited on. Sends
        complete in the background: the last ``send_depth`` batches' sends stay in flight and
        older ones are waited on here; :meth:`flush` waits for all (the executor calls it at
        the end of every step). Waiting for a send later than its batch never adds a
        dependency, so the action lists, deadlock-free when every send waits for its receive
        within its batch, stay deadlock-free.

        With metadata (both ends agree on ``exchange_meta``; the executor decides it
        identically on all ranks), see :meth:`_communicate_with_meta`. Receives land in
        ``transfer.received`` (on this rank's device).

        Raises:
            ValueError: a receive has no metadata and none is exchanged, a send's tensors do
                not match its metadata, or the received metadata differs from the expected.
        """
        if exchange_meta:
            self.flush()
            self._communicate_with_meta(transfers)
            return
        sends: list[tuple[int, int, torch.Tensor]] = []  # (group rank, tag, tensor)
        recvs: list[tuple[int, int, torch.Tensor]] = []
        posted: list[Any] = []  # works of receives posted ahead (prefetch)
        for transfer in transfers:
            if not 0 <= transfer.peer < self.size:
                raise ValueError(f"pipeline rank {transfer.peer} is outside [0, {self.size})")
            if transfer.op == "send":
                self._check_send(transfer)
                sends.extend(
                    (transfer.peer, transfer.tag, t if t.is_contiguous() else t.contiguous())
                    for t in transfer.tensors
                )
                continue
            if transfer.posted:
                posted += transfer.posted
                transfer.posted = []
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
            recvs.extend((transfer.peer, transfer.tag, b) for b in transfer.received)
        if self._direct:
            group = self.group
            sent = [group.send([t], peer, tag) for peer, tag, t in sends]
            for work in posted + [group.recv([b], peer, tag) for peer, tag, b in recvs]:
                work.wait()
        else:
            assert not posted, "receives are only posted ahead on the direct gloo path"
            ops = [
                dist.P2POp(dist.isend, t, self.global_ranks[peer], self.group, tag)
                for peer, tag, t in sends
            ]
            ops += [
                dist.P2POp(dist.irecv, b, self.global_ranks[peer], self.group, tag)
                for peer, tag, b in recvs
            ]
            works = [w for w in dist.batch_isend_irecv(ops) if w is not None] if ops else []
            if len(works) == len(ops):
                sent = works[: len(sends)]
                for work in works[len(sends) :]:
                    work.wait()
            else:  # coalesced (NCCL): one work for the whole batch
                sent = []
                for work in works:
                    work.wait()
        if sent:
            self._in_flight.append(sent)
        while len(self._in_flight) > self.send_depth:
            for work in self._in_flight.popleft():
                work.wait()

    def flush(self) -> None:
        """Wait for every send still in flight (end of a step)."""
        while self._in_flight:
            for work in self._in_flight.popleft():
                work.wait()

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
        """A batch whose receivers may not know the shapes yet (a step that exchanges them).

        Everything goes over the CPU (gloo) group, each op posted on its own, in one thread:

        1. every send is posted; an announcing send first posts its metadata message (a fixed
           header ``[magic, link, microbatch, nbytes]``, then the pickled
           :class:`PayloadMeta`), then its tensors;
        2. every receive whose metadata is known is posted, unless a receive of the same stream
           that waits for metadata comes before it in the batch;
        3. the others, in batch order: read the sender's metadata message (a blocking receive;
           a sender's metadata messages arrive in the order it posts them, which is the order
           this rank receives its messages, :func:`check_message_order`), then post them;
        4. wait for everything.

        Why this cannot deadlock where the same batch with known shapes would not: at step 3
        this rank has posted all its sends and every receive except those of messages the
        peer posts together with, or after, the metadata message it waits for, so nothing the
        peer needs in order to get to that metadata message is missing. Waiting for all
        metadata before posting any send would not be safe: a fused ``[SEND_F, RECV_F]``
        batch would hold back the forward that produces its own input. Steps with known
        shapes never come here.
        """
        pg = self.cpu_group
        cpu = torch.device("cpu")
        works: list[Any] = []
        landed: list[tuple[Transfer, list[torch.Tensor]]] = []
        for transfer in transfers:
            if transfer.op != "send":
                continue
            peer = self.global_rank(transfer.peer)
            meta = transfer.meta
            if meta is None:
                raise ValueError(f"pipeline rank {self.rank}: a send without metadata")
            self._check_send(transfer)
            if transfer.announce:
                data = torch.frombuffer(bytearray(meta.encode()), dtype=torch.uint8)
                header = torch.tensor(
                    [_MAGIC, transfer.link, transfer.microbatch, data.numel()], dtype=torch.int64
                )
                works.append(dist.isend(header, peer, group=pg, tag=TAG_HEADER))
                works.append(dist.isend(data, peer, group=pg, tag=TAG_META))
            for tensor in transfer.tensors:
                payload = tensor.detach().to(cpu).contiguous()
                works.append(dist.isend(payload, peer, group=pg, tag=transfer.tag))
        waiting: set[tuple[int, int]] = set()  # streams with an earlier receive not posted yet
        later: list[Transfer] = []
        for transfer in transfers:
            if transfer.op != "recv":
                continue
            stream = (transfer.peer, transfer.tag)
            if transfer.meta is None or stream in waiting:
                waiting.add(stream)
                later.append(transfer)
                continue
            landed.append((transfer, self._post_recv(transfer, transfer.meta, works)))
        for transfer in later:
            if transfer.meta is not None:
                meta = transfer.meta
            elif transfer.meta_from is not None:
                if transfer.meta_from.received_meta is None:
                    raise ValueError(
                        f"pipeline rank {self.rank}: a receive takes its metadata from a "
                        "receive that comes after it in the batch"
                    )
                meta = transfer.meta_from.received_meta
            else:
                meta = self._read_meta(transfer)
            landed.append((transfer, self._post_recv(transfer, meta, works)))
        for work in works:
            work.wait()
        for transfer, buffers in landed:
            transfer.received = [buffer.to(self.device) for buffer in buffers]

    def _post_recv(
        self, transfer: Transfer, meta: PayloadMeta, works: list[Any]
    ) -> list[torch.Tensor]:
        """Post the receives of ``transfer``'s tensors (on the CPU group) into new buffers."""
        transfer.received_meta = meta
        buffers = [torch.empty(t.shape, dtype=t.dtype) for t in meta.tensors]
        peer = self.global_rank(transfer.peer)
        works.extend(
            dist.irecv(buffer, peer, group=self.cpu_group, tag=transfer.tag) for buffer in buffers
        )
        return buffers

    def _read_meta(self, transfer: Transfer) -> PayloadMeta:
        """Read the sender's metadata message for ``transfer`` and check it is the expected one.

        Blocking; bounded by the CPU group's timeout (the context's).
        """
        peer = self.global_rank(transfer.peer)
        header = torch.zeros(_HEADER_WORDS, dtype=torch.int64)
        dist.recv(header, peer, group=self.cpu_group, tag=TAG_HEADER)
        magic, link, microbatch, nbytes = (int(v) for v in header.tolist())
        if magic != _MAGIC or (link, microbatch) != (transfer.link, transfer.microbatch):
            raise ValueError(
                f"pipeline rank {self.rank}: expected the metadata of microbatch "
                f"{transfer.microbatch} over link {transfer.link} from pipeline rank "
                f"{transfer.peer}, got microbatch {microbatch} over link {link} (magic "
                f"{magic:#x}); the ranks run action lists that do not match"
            )
        data = torch.empty(nbytes, dtype=torch.uint8)
        dist.recv(data, peer, group=self.cpu_group, tag=TAG_META)
        return self._decode(transfer, data)

    def _decode(self, transfer: Transfer, data: torch.Tensor) -> PayloadMeta:
        received = PayloadMeta.decode(data.numpy().tobytes())
        expected = transfer.meta
        if expected is not None and expected != received:
            raise ValueError(
                f"pipeline rank {self.rank}: pipeline rank {transfer.peer} sends "
                f"{received.describe()}, expected {expected.describe()}"
            )
        return received


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
