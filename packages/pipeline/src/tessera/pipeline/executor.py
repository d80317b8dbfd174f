"""ONE executor for every schedule: it runs one rank's row of an action table, for one step.

The table (:class:`tessera.pipeline.ActionTable`) has the row cut into compute steps (F, B, W)
and communication batches. A compute step runs a chunk of the stage; a batch is one
:meth:`tessera.pipeline.PipelineComm.communicate` (posted at once, its receives waited on;
sends finish in the background, all of them by the end of the step). Because receives may come
several steps before their consumer (the lists are made deadlock-free by moving receives
earlier), everything in flight is kept in dicts keyed by (microbatch, chunk).

Per (microbatch, chunk), what is held and when it is released:

- F keeps the stage's input leaves and the outputs that get a gradient (their autograd graph);
  on the last virtual stage the loss ``loss_fn(output, label) / num_microbatches``;
- B (unsplit) runs the full backward, weights accumulating into ``.grad`` (fused linear layers'
  rows may wait in the step's :class:`WeightGradBatcher` until the step ends), and releases them;
- B (split) computes only the input gradient (:func:`tessera.pipeline.backward_input`), keeps
  what W needs; W accumulates the weight gradients and releases everything.

So a rank holds exactly the microbatches its schedule has between F and the last backward
piece: ``p - r`` for 1F1B on rank r, m for GPipe (``RunRecord.peak_live``).

Inputs of a stage that come from another stage are fresh leaves (received buffers, or a
detached copy when the previous virtual stage is on the same rank, i.e. one pipeline rank with
several chunks): each chunk's graph ends at its own inputs and the gradients of those leaves are
what B sends back. Tensors that do not require grad flow forward and get no gradient: the
metadata carries the mask, so the sender does not wait for one and the receiver sends none.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from tessera.pipeline.actions import Action, ActionKind, peer_rank
from tessera.pipeline.backward_split import (
    WeightGradWork,
    backward_input,
    backward_weight,
    full_backward,
)
from tessera.pipeline.p2p import (
    PayloadMeta,
    PipelineComm,
    TensorMeta,
    Transfer,
    link_of,
    message_tag,
)
from tessera.pipeline.payload import flatten_payload, unflatten_payload
from tessera.pipeline.table import ActionTable
from tessera.pipeline.timeline import TimelineEvent
from tessera.pipeline.weight_grad_fusion import (
    FuseLinearWeightGrad,
    WeightGradBatcher,
    WeightGradStore,
    stage_allows_fusion,
)

__all__ = ["LossFn", "PipelineExecutor", "StepLinks", "StepOptions"]

#: ``loss_fn(output, label) -> scalar tensor``, called per microbatch on the last stage.
LossFn = Callable[[Any, Any], torch.Tensor]


@dataclass(frozen=True)
class StepOptions:
    """How one step runs, beyond what its table says.

    Attributes:
        keep_outputs: keep the last stage's outputs (detached) to return them.
        fuse_weight_grad: compute the weight gradients of linear layers straight into
            ``.grad`` (or keep them for W), :mod:`tessera.pipeline.weight_grad_fusion`.
        record_timeline: record a :class:`TimelineEvent` per action.
        track_memory: count the bytes saved for backward (a saved-tensor hook on F).
    """

    keep_outputs: bool = True
    fuse_weight_grad: bool = True
    record_timeline: bool = False
    track_memory: bool = False


@dataclass
class StepLinks:
    """What one step knows of the links to its neighbouring stages.

    Attributes:
        comm: the point-to-point layer (None with one pipeline rank).
        meta: known metadata per link, ``("in", chunk)`` / ``("out", chunk)``; filled with
            what the step learns when ``exchange`` is True.
        exchange: learn the shapes this step: the first activation message of each link
            carries its metadata (both ends must agree; the runner decides it from what every
            rank has alike).
        fixed: the one-tensor metadata from ``tensor_shape`` (no exchange at all).
    """

    comm: PipelineComm | None = None
    meta: dict[tuple[str, int], PayloadMeta] = field(default_factory=dict)
    exchange: bool = True
    fixed: PayloadMeta | None = None


@dataclass
class _Held:
    """What a (microbatch, chunk) keeps from its F until its last backward piece."""

    roots: list[torch.Tensor]  # outputs that get a gradient, or [loss] on the last stage
    inputs: list[torch.Tensor]  # input leaves that require grad
    grad_meta: PayloadMeta | None  # metadata of the gradient message RECV_B gets
    storages: dict[int, int] = field(default_factory=dict)  # saved storages: ptr -> bytes
    work: WeightGradWork | None = None
    store: WeightGradStore | None = None  # the forward's fused linear layers


@dataclass
class _Results:
    losses: list[torch.Tensor] = field(default_factory=list)
    outputs: list[Any] = field(default_factory=list)


def _detach(payload: Any) -> Any:
    tensors, spec = flatten_payload(payload, where="output")
    return unflatten_payload([t.detach() for t in tensors], spec)


class PipelineExecutor:
    """Runs one rank's row of an action table for one step (one use).

    :class:`tessera.pipeline.PipelineRunner` builds one per step. Using it directly lets a
    custom driver run its own table.

    Args:
        stages: this rank's model chunks, chunk 0 first.
        table: the step's actions on every rank; a forward-only table runs F only, under
            ``torch.no_grad`` (nothing kept, gradients untouched).
        pipeline_rank: this rank's row of ``table``.
        loss_fn: ``loss_fn(output, label)`` on the last virtual stage (None: no loss; then the
            table must be forward-only).
        links: the point-to-point layer and the link metadata.
        options: what to keep and measure.
        clock_start: ``time.perf_counter()`` value the timeline is relative to.
    """

    def __init__(
        self,
        *,
        stages: Sequence[nn.Module],
        table: ActionTable,
        pipeline_rank: int,
        loss_fn: LossFn | None,
        links: StepLinks | None = None,
        options: StepOptions | None = None,
        clock_start: float | None = None,
    ) -> None:
        links = links if links is not None else StepLinks()
        options = options if options is not None else StepOptions()
        self.stages = list(stages)
        self.actions = table.row(pipeline_rank)
        self._steps = table.steps_of(pipeline_rank)
        self.rank = pipeline_rank
        self.p = table.num_stages
        self.m = table.num_microbatches
        self.v = len(self.stages)
        self.last = self.p * self.v - 1
        self.split = table.splits_backward
        self.loss_fn = loss_fn
        self.training = not table.forward_only
        self.comm = links.comm
        self.link_meta = links.meta
        self.exchange = links.exchange and links.fixed is None
        self.fixed = links.fixed
        self.keep_outputs = options.keep_outputs
        self.fuse = [options.fuse_weight_grad and stage_allows_fusion(s) for s in self.stages]
        # Weight gradients the schedule does not place (no W) are batched over microbatches.
        self._batcher = WeightGradBatcher() if any(self.fuse) else None
        self.record = options.record_timeline
        self.track_memory = options.track_memory
        self.t0 = time.perf_counter() if clock_start is None else clock_start
        if self.v != table.num_chunks:
            raise ValueError(
                f"the table runs {table.num_chunks} model chunk(s) per rank but got {self.v} "
                "stage module(s)"
            )
        if self.training and loss_fn is None:
            raise ValueError(
                "a training step needs a loss_fn; run a forward-only table to evaluate"
            )
        if self.p > 1 and self.comm is None:
            raise ValueError(f"{self.p} pipeline ranks need a PipelineComm")
        # (microbatch, chunk) -> state
        self._inputs: dict[tuple[int, int], tuple[Any, list[torch.Tensor]]] = {}
        self._in_meta: dict[tuple[int, int], PayloadMeta] = {}
        self._send_f: dict[tuple[int, int], tuple[list[torch.Tensor], PayloadMeta]] = {}
        self._send_b: dict[tuple[int, int], list[torch.Tensor]] = {}
        self._recv_b: dict[tuple[int, int], list[torch.Tensor]] = {}
        self._held: dict[tuple[int, int], _Held] = {}
        # receives posted ahead: per stream (RECV_F | RECV_B, chunk) the ones still to post,
        # and the posted ones by action (_plan_prefetch)
        self._queues: dict[tuple[ActionKind, int], deque[Action]] = {}
        self._prefetched: dict[Action, Transfer] = {}
        self.results = _Results()
        self.events: list[TimelineEvent] = []
        self.peak_live = 0
        self.live_bytes = 0
        self.peak_bytes = 0
        self._storage_users: dict[int, int] = {}
        self._param_storages: set[int] = set()
        if self.track_memory:
            self._param_storages = {
                p.untyped_storage().data_ptr() for stage in self.stages for p in stage.parameters()
            }

    # -- driver -------------------------------------------------------------------------------

    def run(self, inputs: Sequence[Any], labels: Sequence[Any]) -> _Results:
        """Run every step of this rank's row.

        Args:
            inputs: the microbatches' inputs (read by the first virtual stage).
            labels: the microbatches' labels (read by the last virtual stage).
        """
        self._data, self._labels = list(inputs), list(labels)
        self._plan_prefetch(self._steps)
        for step in self._steps:
            start = time.perf_counter() if self.record else 0.0
            if step[0].kind.is_compute:
                self._compute(step[0])
            else:
                self._communicate(step)
            if self.record:
                end = time.perf_counter()
                for action in step:
                    self.events.append(
                        TimelineEvent(start - self.t0, end - self.t0, self.rank, action)
                    )
        if self._batcher is not None:
            self._batcher.flush()  # weight gradients kept over microbatches
        if self.comm is not None:
            self.comm.flush()  # sends still in flight
        leftover = [key for key, held in self._held.items() if held is not None]
        if leftover:
            raise RuntimeError(
                f"pipeline rank {self.rank}: the action list left activations of (microbatch, "
                f"chunk) {sorted(leftover)} without their backward"
            )
        return self.results

    def _virtual(self, chunk: int) -> int:
        return chunk * self.p + self.rank

    # -- compute ------------------------------------------------------------------------------

    def _compute(self, action: Action) -> None:
        if action.kind is ActionKind.F:
            self._forward(action.microbatch, action.chunk)
        elif action.kind is ActionKind.B:
            self._backward(action.microbatch, action.chunk)
        else:
            self._weight(action.microbatch, action.chunk)

    def _memory_hooks(self) -> tuple[AbstractContextManager[Any], dict[int, int], Any]:
        """The saved-tensor hooks that count F's saved bytes, the count, and the pack function."""
        saved: dict[int, int] = {}
        if not self.track_memory:
            return nullcontext(), saved, None

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            storage = tensor.untyped_storage()
            ptr = storage.data_ptr()
            if ptr not in self._param_storages:
                saved[ptr] = storage.nbytes()
            # A detached alias: returning the tensor itself would tie an output to its own
            # grad_fn in a reference cycle.
            return tensor.detach()

        def unpack(tensor: torch.Tensor) -> torch.Tensor:
            return tensor

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack), saved, pack

    def _forward(self, m: int, c: int) -> None:
        vs = self._virtual(c)
        in_leaves: list[torch.Tensor]
        if vs == 0:
            payload, in_leaves = self._data[m], []
        else:
            try:
                payload, in_leaves = self._inputs.pop((m, c))
            except KeyError:
                raise RuntimeError(
                    f"pipeline rank {self.rank}: F{m}:{c} runs before its input arrived"
                ) from None
        hooks, saved, pack = self._memory_hooks()
        grad_mode = torch.enable_grad() if self.training else torch.no_grad()
        store = WeightGradStore(self._batcher) if self.training and self.fuse[c] else None
        fusion = FuseLinearWeightGrad(store, pack) if store is not None else nullcontext()
        with grad_mode, hooks, fusion:
            out = self.stages[c](payload)
            loss = None
            if vs == self.last and self.loss_fn is not None:
                loss = self.loss_fn(out, self._labels[m])
                if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                    shape = list(loss.shape) if isinstance(loss, torch.Tensor) else type(loss)
                    raise ValueError(f"loss_fn must return a scalar tensor, got {shape}")
                loss = loss.reshape(()) / self.m
        if vs == self.last:
            if loss is not None:
                self.results.losses.append(loss.detach())
            if self.keep_outputs:
                self.results.outputs.append(_detach(out))
            if self.training:
                assert loss is not None
                self._hold(m, c, _Held([loss], in_leaves, None, saved, store=store))
            return
        flat, spec = flatten_payload(out, where=f"the output of virtual stage {vs}")
        if self.fixed is not None:
            self._check_fixed(flat, spec, vs)
            meta = self.fixed
        else:
            meta = PayloadMeta(
                spec,
                tuple(TensorMeta.of(t, self.training and t.requires_grad) for t in flat),
            )
        mask = meta.grad_mask
        detached = [t.detach() for t in flat]
        if self.p == 1:  # the next virtual stage is the next chunk of this rank
            leaves = [d.requires_grad_() if g else d for d, g in zip(detached, mask, strict=True)]
            self._inputs[(m, c + 1)] = (
                unflatten_payload(leaves, spec),
                [t for t, g in zip(leaves, mask, strict=True) if g],
            )
        else:
            self._send_f[(m, c)] = (detached, meta)
        if self.training:
            roots = [t for t, g in zip(flat, mask, strict=True) if g]
            self._hold(m, c, _Held(roots, in_leaves, meta.gradient_meta(), saved, store=store))

    def _check_fixed(self, flat: list[torch.Tensor], spec: Any, vs: int) -> None:
        fixed = self.fixed
        assert fixed is not None
        if spec != fixed.spec or not fixed.tensors[0].matches(flat[0]):
            got = [(list(t.shape), t.dtype) for t in flat]
            raise ValueError(
                f"pipeline rank {self.rank}: virtual stage {vs} outputs {got}, but tensor_shape "
                f"says one tensor of {fixed.describe()}; {_short_batch_hint(flat, fixed)}fix "
                "tensor_shape / TENSOR_SHAPE or leave it unset so the shapes are exchanged"
            )

    def _hold(self, m: int, c: int, held: _Held) -> None:
        self._held[(m, c)] = held
        self.peak_live = max(self.peak_live, len(self._held))
        # A storage shared by several microbatches (views of one batch) counts once.
        for ptr, nbytes in held.storages.items():
            count = self._storage_users.get(ptr, 0)
            if count == 0:
                self.live_bytes += nbytes
            self._storage_users[ptr] = count + 1
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def _release(self, m: int, c: int) -> None:
        held = self._held.pop((m, c))
        for ptr, nbytes in held.storages.items():
            count = self._storage_users.pop(ptr) - 1
            if count:
                self._storage_users[ptr] = count
            else:
                self.live_bytes -= nbytes

    def _backward(self, m: int, c: int) -> None:
        vs = self._virtual(c)
        held = self._held.get((m, c))
        if held is None:
            raise RuntimeError(f"pipeline rank {self.rank}: B{m}:{c} runs without its forward")
        if vs == self.last:
            grads = [torch.ones_like(held.roots[0])]
        else:
            try:
                grads = self._recv_b.pop((m, c))
            except KeyError:
                raise RuntimeError(
                    f"pipeline rank {self.rank}: B{m}:{c} runs before its output gradient arrived"
                ) from None
        if self.split:
            in_grads, held.work = backward_input(held.roots, grads, held.inputs, held.store)
            held.roots = []
        else:
            in_grads = full_backward(held.roots, grads, held.inputs)
            self._release(m, c)
        if vs == 0:
            return
        if self.p == 1:
            self._recv_b[(m, c - 1)] = in_grads
        else:
            self._send_b[(m, c)] = in_grads

    def _weight(self, m: int, c: int) -> None:
        held = self._held.get((m, c))
        if held is None or held.work is None:
            raise RuntimeError(f"pipeline rank {self.rank}: W{m}:{c} runs before its B")
        work, held.work = held.work, None
        backward_weight(work)
        self._release(m, c)

    # -- communication ------------------------------------------------------------------------

    def _communicate(self, batch: Sequence[Action]) -> None:
        assert self.comm is not None
        transfers: list[tuple[Action, Transfer]] = []
        first_in: dict[int, Transfer] = {}  # exchange: chunk -> this batch's announced receive
        refill: list[tuple[ActionKind, int]] = []  # streams whose posted receive is used here
        for action in batch:
            key = (action.microbatch, action.chunk)
            peer = peer_rank(action, self.rank, self.p)
            kind = action.kind
            if kind is ActionKind.SEND_F:
                tensors, meta = self._send_f.pop(key)
                meta, announce = self._agreed_output_meta(action, meta)
                transfer = Transfer("send", peer, tensors, meta, announce=announce)
            elif action in self._prefetched:
                transfer = self._prefetched.pop(action)
                refill.append((kind, action.chunk))
            elif self._unqueue(action):
                # Not posted ahead (a later receive of a stream whose earlier one is in this
                # batch too): posted here, after that one, and never again.
                transfer = self._receive(action, self._receive_meta(kind, action.chunk))
            elif kind is ActionKind.RECV_F:
                expected = self.fixed or self.link_meta.get(("in", action.chunk))
                transfer = Transfer("recv", peer, meta=expected)
                if expected is None and self.exchange:
                    # The first activation of this link in the step: its metadata comes with
                    # it; a later microbatch of the same batch shares it.
                    transfer.meta_from = first_in.get(action.chunk)
                    first_in.setdefault(action.chunk, transfer)
            elif kind is ActionKind.SEND_B:
                grads = self._send_b.pop(key)
                meta = self._in_meta.pop(key).gradient_meta()
                transfer = Transfer("send", peer, grads, meta, announce=False)
            else:
                grad_meta = self._held[key].grad_meta
                transfer = Transfer("recv", peer, meta=grad_meta)
            transfer.tag = message_tag(action, self.rank, self.p)
            transfer.link = link_of(action, self.rank, self.p)
            transfer.microbatch = action.microbatch
            transfers.append((action, transfer))
        self.comm.communicate([t for _, t in transfers], exchange_meta=self.exchange)
        for stream in refill:
            self._prefetch_next(stream)
        for action, transfer in transfers:
            key = (action.microbatch, action.chunk)
            if action.kind is ActionKind.RECV_F:
                got = transfer.received_meta
                assert got is not None
                if self.exchange:
                    self.link_meta.setdefault(("in", action.chunk), got)
                wants = [self.training and t.requires_grad for t in got.tensors]
                leaves = [
                    b.requires_grad_() if g else b
                    for b, g in zip(transfer.received, wants, strict=True)
                ]
                grad_leaves = [b for b, g in zip(leaves, wants, strict=True) if g]
                self._inputs[key] = (unflatten_payload(leaves, got.spec), grad_leaves)
                if self.training:
                    self._in_meta[key] = got
            elif action.kind is ActionKind.RECV_B:
                self._recv_b[key] = transfer.received

    # -- receives posted ahead ---------------------------------------------------------------

    def _plan_prefetch(self, steps: Sequence[tuple[Action, ...]]) -> None:
        """Queue every receive by stream and post the first of each (gloo, known shapes).

        A stream is one link and direction, ``(RECV_F | RECV_B, chunk)``. Each keeps one
        receive posted ahead: when one is waited for, the next of its stream is posted
        (:meth:`PipelineComm.prefetch` says why). One extra buffer per stream; waits stay where
        the action list puts them, so the lists stay deadlock-free. Steps that exchange shapes
        post every receive in its batch.
        """
        self._queues.clear()
        self._prefetched.clear()
        if self.comm is None or not self.comm.can_prefetch or self.exchange:
            return
        for step in steps:
            for action in step:
                if action.kind in (ActionKind.RECV_F, ActionKind.RECV_B):
                    self._queues.setdefault((action.kind, action.chunk), deque()).append(action)
        for stream in list(self._queues):
            self._prefetch_next(stream)

    def _receive_meta(self, kind: ActionKind, chunk: int) -> PayloadMeta | None:
        """The known metadata of a stream's receives (None: not known on this step)."""
        if kind is ActionKind.RECV_F:
            return self.fixed or self.link_meta.get(("in", chunk))
        out = self.fixed or self.link_meta.get(("out", chunk))
        return None if out is None else out.gradient_meta()

    def _unqueue(self, action: Action) -> bool:
        """Take a receive that was not posted ahead out of its stream's queue, if it is there."""
        queue = self._queues.get((action.kind, action.chunk))
        if queue is None or action not in queue:
            return False
        queue.remove(action)
        return True

    def _prefetch_next(self, stream: tuple[ActionKind, int]) -> None:
        queue = self._queues.get(stream)
        if not queue:
            return
        action = queue.popleft()
        kind, chunk = stream
        meta = self._receive_meta(kind, chunk)
        if meta is None:  # shapes unknown here: this stream's receives go in their batches
            del self._queues[stream]
            return
        transfer = self._receive(action, meta)
        assert self.comm is not None
        self.comm.prefetch(transfer)
        self._prefetched[action] = transfer

    def _receive(self, action: Action, meta: PayloadMeta | None) -> Transfer:
        transfer = Transfer("recv", peer_rank(action, self.rank, self.p), meta=meta)
        transfer.tag = message_tag(action, self.rank, self.p)
        transfer.link = link_of(action, self.rank, self.p)
        transfer.microbatch = action.microbatch
        return transfer

    def _agreed_output_meta(self, action: Action, meta: PayloadMeta) -> tuple[PayloadMeta, bool]:
        """F's output metadata as agreed with the receiver, and whether to announce it.

        On a step that exchanges metadata, the first message of each link announces it and
        every later one must match it (the receiver reuses it); on other steps every message
        must match the metadata agreed on the first step with these input shapes.
        """
        if self.fixed is not None:
            return meta, False
        link = ("out", action.chunk)
        agreed = self.link_meta.get(link)
        if agreed is None:
            if not self.exchange:
                raise RuntimeError(f"pipeline rank {self.rank}: no agreed metadata for {action}")
            self.link_meta[link] = meta
            return meta, True
        if agreed != meta:
            raise ValueError(
                f"pipeline rank {self.rank}: {action} sends {meta.describe()}, but the shapes "
                f"agreed on the first step with these input shapes were {agreed.describe()}; "
                "stage output shapes must depend only on the input shapes (run another model "
                "with another schedule object)"
            )
        return agreed, False


def _short_batch_hint(flat: list[torch.Tensor], fixed: PayloadMeta) -> str:
    """Why a tensor_shape that fit earlier batches fails now: a smaller microbatch.

    tensor_shape fixes the microbatch size (its first dimension); a dataset whose size is not
    a multiple of the batch size ends with a short batch, whose microbatches are smaller. The
    plain mismatch message did not say so, and the first full epoch had worked.
    """
    want = fixed.tensors[0].shape
    if len(flat) != 1 or flat[0].ndim != len(want) or not want:
        return ""
    got = tuple(flat[0].shape)
    if got[1:] != want[1:] or got[0] >= want[0]:
        return ""
    return (
        f"this batch's microbatches hold {got[0]} samples where tensor_shape's first dimension "
        f"says {want[0]}: a short batch (the last one of a dataset whose size is not a "
        "multiple of the batch size); give the dataloader drop_last=True (get_dataloader(..., "
        "drop_last=True)), or "
    )
