"""The pipeline runner: runs a schedule's action table on this pipeline rank, step after step.

A schedule is a plan (:class:`tessera.pipeline.Schedule` makes immutable
:class:`tessera.pipeline.ActionTable` s); a step is one use of
:class:`tessera.pipeline.PipelineExecutor`. What outlives a step lives here, in one place:

- the point-to-point layer of each context (:class:`tessera.pipeline.PipelineComm`);
- the link metadata agreed on the first step with a given input signature, so later steps send
  no shapes;
- the ``tensor_shape`` declarations already compared across the pipeline ranks;
- what the last step measured (:attr:`PipelineRunner.last_run`).

The runner offers the two calls every step schedule of tessera offers,
:meth:`~PipelineRunner.train_step` and :meth:`~PipelineRunner.eval_step`, so the Engine drives a
pipeline exactly as it drives one process.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import nullcontext
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from tessera.context import ParallelMode, get_context, has_context
from tessera.pipeline.agreement import agree_on_fixed_meta
from tessera.pipeline.executor import LossFn, PipelineExecutor, StepLinks, StepOptions
from tessera.pipeline.p2p import PayloadMeta, PipelineComm, TensorMeta
from tessera.pipeline.payload import concat_microbatches, payload_signature, split_microbatches
from tessera.pipeline.recording import RunRecord
from tessera.pipeline.schedule import Schedule
from tessera.pipeline.stage import PipelineStage

__all__ = ["PipelineRunner", "StepOutput"]


class StepOutput(NamedTuple):
    """What a step returns on the rank holding the last virtual stage; all None elsewhere.

    Attributes:
        output: the last stage's outputs, detached, microbatches concatenated along dim 0
            (None unless asked to keep them).
        label: the batch's labels (None unless outputs are kept).
        loss: the step's loss, a detached 0-dim tensor: the mean over the microbatches of
            ``loss_fn(output, label)`` (None without a loss_fn).
    """

    output: Any
    label: Any
    loss: torch.Tensor | None


_NOTHING = StepOutput(None, None, None)


class PipelineRunner:
    """Runs ``schedule`` on this pipeline rank: one :meth:`train_step` or :meth:`eval_step` a step.

    Every pipeline rank calls the same method with the same arguments. Each reads ONE batch with
    ``next(data_iter)``, so all pipeline ranks must read the same batch (the first stage needs the
    inputs, the last the labels; the others use its shapes to know, like everyone, whether shapes
    must be exchanged).

    Args:
        schedule: the plan to run (1F1B, interleaved, GPipe, zero bubble, or a user's own).
        context: the parallel context whose PIPELINE group to run on; the current one when None
            (looked up at every step); with none at all, one pipeline rank.
        tensor_dtype: dtype of the tensor passed between stages when the schedule declares
            ``tensor_shape`` (default: ``torch.get_default_dtype()``); settable.
        fuse_weight_grad: compute the weight gradients of the stages' linear layers straight
            into ``.grad`` (an ``addmm_`` instead of a matmul plus an addition, over the rows of
            several microbatches at once; under zero bubble, kept for W): Megatron-LM's
            gradient accumulation fusion, see :mod:`tessera.pipeline.weight_grad_fusion`.
            Settable. Turn it off when something must see each microbatch's weight gradient
            through autograd (a hook added after the forward, for example).

    Attributes:
        last_run: what the last step measured on this rank (:class:`RunRecord`), None before
            the first.
    """

    def __init__(
        self,
        schedule: Schedule,
        *,
        context: Any = None,
        tensor_dtype: torch.dtype | None = None,
        fuse_weight_grad: bool = True,
    ) -> None:
        if not isinstance(schedule, Schedule):
            raise TypeError(
                f"PipelineRunner runs a tessera.pipeline.Schedule, got {type(schedule).__name__}"
            )
        self._schedule = schedule
        self._context = context
        self.tensor_dtype = tensor_dtype
        self.fuse_weight_grad = fuse_weight_grad
        self.last_run: RunRecord | None = None
        self._comms: list[tuple[Any, PipelineComm]] = []
        # Metadata agreed on a first step, by (input signature, forward_only, p, chunks).
        self._link_meta: dict[tuple[Any, ...], dict[tuple[str, int], PayloadMeta]] = {}
        self._agreed_shapes: set[tuple[int, str]] = set()

    @property
    def schedule(self) -> Schedule:
        """The plan this runner runs."""
        return self._schedule

    def train_step(
        self,
        stage: nn.Module | Sequence[nn.Module],
        data_iter: Iterator[Any],
        loss_fn: LossFn,
        *,
        keep_outputs: bool = True,
        record_timeline: bool = False,
        track_memory: bool = False,
    ) -> StepOutput:
        """One training step: every microbatch's forward and backward, and their transfers.

        Each microbatch's loss is divided by ``num_microbatches`` before its backward, so the
        gradients accumulate to those of the step's mean loss.

        Args:
            stage: what :func:`tessera.pipeline.build_pipeline_model` returned: one module, or
                a list of ``num_chunks`` modules (interleaved). A stage is called with ONE
                argument, the payload: the microbatch inputs on the first virtual stage, else
                what the previous virtual stage returned (tensor, tuple, list or dict).
            data_iter: yields ``(inputs, labels)``; inputs a tensor, tuple or dict (of tensors,
                non-tensor leaves are passed unchanged); each tensor is split into
                ``num_microbatches`` parts along dim 0.
            loss_fn: ``loss_fn(output, label) -> scalar`` per microbatch, on the last virtual
                stage.
            keep_outputs: return the last stage's outputs and the labels; keeps the outputs of
                the whole batch, so turn it off when they are not needed.
            record_timeline: record this rank's timeline in ``last_run.timeline`` (a barrier
                first aligns the ranks' clocks).
            track_memory: measure ``last_run.peak_activation_bytes``.

        Returns:
            :class:`StepOutput` on the rank holding the last virtual stage, all None elsewhere.

        Raises:
            ValueError: the batch size is not divisible by ``num_microbatches`` (both numbers
                named), the stages do not match the schedule, or the schedule cannot run on
                this many stages. All raised before any communication.
        """
        if loss_fn is None:
            raise ValueError("a training step needs a loss_fn; call eval_step to evaluate")
        options = StepOptions(keep_outputs, self.fuse_weight_grad, record_timeline, track_memory)
        return self._run(stage, data_iter, loss_fn, forward_only=False, options=options)

    def eval_step(
        self,
        stage: nn.Module | Sequence[nn.Module],
        data_iter: Iterator[Any],
        loss_fn: LossFn | None = None,
        *,
        keep_outputs: bool = True,
        record_timeline: bool = False,
        track_memory: bool = False,
    ) -> StepOutput:
        """One evaluation step: every microbatch's forward under ``torch.no_grad``.

        No activation is kept and no gradient touched. Arguments as :meth:`train_step`;
        without ``loss_fn`` the returned loss is None.
        """
        options = StepOptions(keep_outputs, False, record_timeline, track_memory)
        return self._run(stage, data_iter, loss_fn, forward_only=True, options=options)

    def __repr__(self) -> str:
        return f"PipelineRunner({self._schedule!r})"

    # -- one step -----------------------------------------------------------------------------

    def _run(
        self,
        stage: nn.Module | Sequence[nn.Module],
        data_iter: Iterator[Any],
        loss_fn: LossFn | None,
        *,
        forward_only: bool,
        options: StepOptions,
    ) -> StepOutput:
        context = self._context
        if context is None and has_context():
            context = get_context()
        if context is None:
            rank, size = 0, 1
        else:
            rank = context.get_local_rank(ParallelMode.PIPELINE)
            size = context.get_world_size(ParallelMode.PIPELINE)
        schedule = self._schedule
        stages = _stage_list(stage, schedule.num_chunks)
        _check_stage_positions(stages, rank, size)
        inputs, labels = _read_batch(data_iter)
        # Every check that can fail runs before the first message, identically on every rank
        # (all pipeline ranks read the same batch), so an error never leaves a peer waiting.
        m = schedule.num_microbatches
        input_parts = split_microbatches(inputs, m, what="inputs")
        label_parts = split_microbatches(labels, m, what="labels")
        table = schedule.table(size, forward_only=forward_only)
        holds_last = rank == size - 1
        device = _device_of(stages, context)
        if rank == 0:
            input_parts = [_to_device(part, device) for part in input_parts]
        if holds_last:
            label_parts = [_to_device(part, device) for part in label_parts]

        fixed = self._fixed_meta(context, forward_only)
        comm = self._comm_for(context) if size > 1 else None
        if fixed is not None and comm is not None:
            agree_on_fixed_meta(fixed, comm.cpu_group, self._agreed_shapes)
        # Identical on every pipeline rank (they read the same batch): whether to exchange
        # metadata is decided the same everywhere. Nothing rank-local (e.g. ids of the stage
        # objects, which differ between ranks and get reused) may enter it, or one rank could
        # announce metadata its peer does not read.
        cache_key = (payload_signature(input_parts[0]), forward_only, size, len(stages))
        known = self._link_meta.get(cache_key)
        exchange = fixed is None and known is None
        if comm is not None:
            comm.ensure_ready()
            if options.record_timeline:
                dist.barrier(group=comm.cpu_group)
        links = StepLinks(comm, dict(known) if known is not None else {}, exchange, fixed)
        executor = PipelineExecutor(
            stages=stages,
            table=table,
            pipeline_rank=rank,
            loss_fn=loss_fn,
            links=links,
            options=StepOptions(
                options.keep_outputs and holds_last,
                options.fuse_weight_grad,
                options.record_timeline,
                options.track_memory,
            ),
            clock_start=time.perf_counter(),
        )
        # A failure here is posted for the other ranks, which stop naming this rank
        # (tessera.context).
        guard = getattr(context, "guard", None)
        with guard(f"pipeline rank {rank} of {size}") if guard else nullcontext():
            results = executor.run(input_parts, label_parts)
        if exchange and size > 1:
            self._link_meta[cache_key] = dict(links.meta)
        self.last_run = RunRecord(
            pipeline_rank=rank,
            timeline=tuple(executor.events),
            peak_live=executor.peak_live,
            peak_activations=executor.peak_live / schedule.num_chunks,
            peak_activation_bytes=executor.peak_bytes,
            exchanged_metadata=exchange and size > 1,
        )
        if not holds_last:
            return _NOTHING
        output = concat_microbatches(results.outputs) if options.keep_outputs else None
        label = labels if options.keep_outputs else None
        loss = torch.stack(results.losses).sum() if results.losses else None
        return StepOutput(output, label, loss)

    def _fixed_meta(self, context: Any, forward_only: bool) -> PayloadMeta | None:
        """The one-tensor metadata declared by ``tensor_shape`` (or the context's config)."""
        shape = self._schedule.tensor_shape
        if shape is None and context is not None:
            config = getattr(context, "full_config", None)
            if config is not None and hasattr(config, "get"):
                given = config.get("TENSOR_SHAPE")
                if given is not None:
                    shape = tuple(int(s) for s in given)
        if shape is None:
            return None
        dtype = self.tensor_dtype or torch.get_default_dtype()
        grad = not forward_only and dtype.is_floating_point
        return PayloadMeta(("tensor",), (TensorMeta(tuple(shape), dtype, grad),))

    def _comm_for(self, context: Any) -> PipelineComm:
        """The point-to-point layer of ``context`` (made once per context)."""
        for known, comm in self._comms:
            if known is context:
                return comm
        comm = PipelineComm(context)
        self._comms.append((context, comm))
        return comm


def _read_batch(data_iter: Iterator[Any]) -> tuple[Any, Any]:
    batch = next(data_iter)
    if not isinstance(batch, tuple | list) or len(batch) != 2:
        length = f" of length {len(batch)}" if isinstance(batch, tuple | list) else ""
        raise TypeError(
            f"data_iter must yield (inputs, labels) pairs, got {type(batch).__name__}{length}"
        )
    return batch[0], batch[1]


def _stage_list(stage: nn.Module | Sequence[nn.Module], num_chunks: int) -> list[nn.Module]:
    stages = [stage] if isinstance(stage, nn.Module) else list(stage)
    if len(stages) != num_chunks:
        raise ValueError(
            f"the schedule runs {num_chunks} model chunk(s) per rank but got {len(stages)} "
            "stage module(s); pass what build_pipeline_model(..., num_chunks=...) returned"
        )
    for index, module in enumerate(stages):
        if not isinstance(module, nn.Module):
            raise TypeError(f"stage {index} is a {type(module).__name__}, expected an nn.Module")
    return stages


def _check_stage_positions(stages: Sequence[nn.Module], rank: int, size: int) -> None:
    for chunk, module in enumerate(stages):
        if not isinstance(module, PipelineStage):
            continue
        position = (module.pipeline_rank, module.num_stages, module.chunk, module.num_chunks)
        expected = (rank, size, chunk, len(stages))
        if position != expected:
            raise ValueError(
                f"stage {chunk} was built for (pipeline rank, pipeline size, chunk, chunks) = "
                f"{position} but runs at {expected}"
            )


def _device_of(stages: Sequence[nn.Module], context: Any) -> torch.device:
    if context is not None:
        return torch.device(context.device)
    for stage in stages:
        for param in stage.parameters():
            return param.device
    return torch.device("cpu")


def _to_device(payload: Any, device: torch.device) -> Any:
    if isinstance(payload, torch.Tensor):
        return payload.to(device)
    if isinstance(payload, tuple | list):
        items = [_to_device(item, device) for item in payload]
        return tuple(items) if isinstance(payload, tuple) else items
    if isinstance(payload, dict):
        return {key: _to_device(value, device) for key, value in payload.items()}
    return payload
