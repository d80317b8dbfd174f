"""The schedule interface and what every schedule shares: argument checks, communication, checks.

A schedule only decides the ORDER of compute actions on each rank
(:meth:`Schedule.compute_actions`). Where the sends and receives go follows from that order by one
rule (:func:`add_communication`): a receive goes right before the compute action that consumes it,
a send right after the one that produces it. The send of one compute action and the receive of
the next are then adjacent and form one batch: in the 1F1B steady state this yields exactly
Megatron-LM's fused ``send_forward_recv_backward`` / ``send_backward_recv_forward`` pairs
(Narayanan et al. 2021). Where that placement could deadlock on a backend whose sends wait for
their receive (interleaved 1F1B), :func:`tessera.pipeline.make_deadlock_free` then moves the
receives that are needed into earlier batches.
"""

from __future__ import annotations

import abc
from collections import Counter
from collections.abc import Iterator, Sequence
from typing import Any, ClassVar

import torch
from torch import nn

from tessera.pipeline.actions import Action, ActionKind, split_steps, virtual_stage
from tessera.pipeline.dataflow import make_deadlock_free
from tessera.pipeline.errors import ScheduleError
from tessera.pipeline.executor import LossFn, run_schedule
from tessera.pipeline.p2p import PayloadMeta, PipelineComm
from tessera.pipeline.recording import RunRecord

__all__ = ["Schedule", "add_communication", "check_actions"]

#: A rank's action list and the same cut into executor steps.
_Plan = tuple[tuple[Action, ...], tuple[tuple[Action, ...], ...]]


def _check_positive(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


class Schedule(abc.ABC):
    """A pipeline schedule: for each pipeline rank, an ordered list of actions.

    Subclasses implement :meth:`compute_actions` (the order of F, B and W on one rank) and set
    ``splits_backward``; everything else, including the communication actions, is shared. A user's
    own schedule plugs in the same way (and through the ``tessera.schedules`` entry points).

    Attributes:
        num_microbatches: microbatches per step.
        num_chunks: model chunks per rank (1 unless interleaved).
        tensor_shape: shape of the tensor passed between stages when known in advance (lets the
            executor skip the shape exchange on the first microbatch), else None.
        splits_backward: True when the backward is split into B (input gradient) and W (weight
            gradient); False when ``B`` is the full backward and no ``W`` appears.
        tensor_dtype: dtype of the tensor passed between stages when ``tensor_shape`` is given
            (default: ``torch.get_default_dtype()``); settable.
        last_run: what the last :meth:`forward_backward_step` measured on this rank
            (:class:`tessera.pipeline.RunRecord`), None before the first.
        fuse_weight_grad: compute the weight gradients of the stages' linear layers straight
            into ``.grad`` (an ``addmm_`` instead of a matmul plus an addition, over the rows of
            several microbatches at once; under zero bubble, kept for W): Megatron-LM's gradient
            accumulation fusion, see :mod:`tessera.pipeline.weight_grad_fusion`. True by
            default; settable. Set it to False when something must see each microbatch's weight
            gradient through autograd (a hook added after the forward, for example).
    """

    splits_backward: ClassVar[bool] = False

    def __init__(
        self,
        num_microbatches: int,
        *,
        num_chunks: int = 1,
        tensor_shape: Sequence[int] | None = None,
    ) -> None:
        _check_positive("num_microbatches", num_microbatches)
        _check_positive("num_chunks", num_chunks)
        self.num_microbatches = num_microbatches
        self.num_chunks = num_chunks
        self.tensor_shape: tuple[int, ...] | None = (
            None if tensor_shape is None else tuple(int(size) for size in tensor_shape)
        )
        self._tables: dict[tuple[int, bool, int, int], list[list[Action]]] = {}
        # (rank, stages, forward_only, m, chunks) -> (actions, split_steps(actions)), for the
        # executor: built once, not on every step.
        self._plans: dict[tuple[int, int, bool, int, int], _Plan] = {}
        self.tensor_dtype: torch.dtype | None = None
        self.fuse_weight_grad = True
        self.last_run: RunRecord | None = None
        # Metadata agreed on a first step, by (stage ids, input signature, forward_only, p).
        self._link_meta: dict[tuple[Any, ...], dict[tuple[str, int], PayloadMeta]] = {}
        self._comms: list[tuple[Any, PipelineComm]] = []

    @abc.abstractmethod
    def compute_actions(self, pipeline_rank: int, num_stages: int) -> list[Action]:
        """The ordered F, B (and W) actions of ``pipeline_rank``, without communication."""

    def check_stages(self, pipeline_rank: int, num_stages: int) -> None:
        """Validate ``(pipeline_rank, num_stages)``; subclasses add their own requirements.

        Raises:
            ValueError: the rank is outside ``[0, num_stages)`` or num_stages is not positive.
        """
        _check_positive("num_stages", num_stages)
        if not 0 <= pipeline_rank < num_stages:
            raise ValueError(f"pipeline_rank {pipeline_rank} is outside [0, {num_stages})")

    def actions(
        self, pipeline_rank: int, num_stages: int, *, forward_only: bool = False
    ) -> list[Action]:
        """The full ordered action list of ``pipeline_rank``: compute plus communication.

        Args:
            pipeline_rank: this rank's index in the pipeline group.
            num_stages: the pipeline group's size.
            forward_only: keep only the forwards and their transfers (evaluation: every
                microbatch's forward, in the schedule's forward order, no backward).
        """
        self.check_stages(pipeline_rank, num_stages)
        return self.action_table(num_stages, forward_only=forward_only)[pipeline_rank]

    def action_table(self, num_stages: int, *, forward_only: bool = False) -> list[list[Action]]:
        """Every rank's action list, ``table[rank]`` (see :meth:`actions`).

        Built from :meth:`compute_actions` by :func:`add_communication`, then made deadlock-free
        for backends whose sends wait for the receive
        (:func:`tessera.pipeline.dataflow.make_deadlock_free`): that needs all ranks' lists, so
        it is computed once per argument set and cached.
        """
        self.check_stages(0, num_stages)
        key = (num_stages, forward_only, self.num_microbatches, self.num_chunks)
        table = self._tables.get(key)
        if table is None:
            table = []
            for rank in range(num_stages):
                self.check_stages(rank, num_stages)
                compute = self.compute_actions(rank, num_stages)
                if forward_only:
                    compute = [action for action in compute if action.kind is ActionKind.F]
                table.append(add_communication(compute, rank, num_stages, self.num_chunks))
            table = make_deadlock_free(
                table, num_chunks=self.num_chunks, splits_backward=self.splits_backward
            )
            self._tables[key] = table
        return [list(actions) for actions in table]

    def _plan(self, pipeline_rank: int, num_stages: int, forward_only: bool) -> _Plan:
        """This rank's actions and their executor steps, cached (see :meth:`actions`)."""
        key = (pipeline_rank, num_stages, forward_only, self.num_microbatches, self.num_chunks)
        plan = self._plans.get(key)
        if plan is None:
            actions = tuple(self.actions(pipeline_rank, num_stages, forward_only=forward_only))
            plan = (actions, tuple(split_steps(actions)))
            self._plans[key] = plan
        return plan

    def forward_backward_step(
        self,
        stage: nn.Module | Sequence[nn.Module],
        data_iter: Iterator[Any],
        loss_fn: LossFn | None,
        forward_only: bool = False,
        return_loss: bool = True,
        return_output_label: bool = True,
        context: Any = None,
        *,
        record_timeline: bool = False,
        track_memory: bool = False,
    ) -> tuple[Any, Any, torch.Tensor | None]:
        """Run one step of this schedule on this pipeline rank: forwards, backwards, transfers.

        Every pipeline rank calls it with the same arguments. It reads ONE batch with
        ``next(data_iter)`` on every pipeline rank, so all pipeline ranks must read the same
        batch (the first stage needs the inputs, the last the labels; the others use its shapes
        to know, like everyone, whether shapes must be exchanged).

        Args:
            stage: what :func:`tessera.pipeline.build_pipeline_model` returned: one module, or
                a list of ``num_chunks`` modules (interleaved). A stage is called with ONE
                argument, the payload: the microbatch inputs on the first virtual stage, else
                what the previous virtual stage returned (tensor, tuple, list or dict).
            data_iter: yields ``(inputs, labels)``; inputs a tensor, tuple or dict (of tensors,
                non-tensor leaves are passed unchanged); each tensor is split into
                ``num_microbatches`` parts along dim 0.
            loss_fn: ``loss_fn(output, label) -> scalar`` per microbatch, on the last virtual
                stage; the step's loss is its mean over the microbatches (each microbatch's
                loss is divided by ``num_microbatches`` before its backward, so gradients
                accumulate to those of the mean). Not needed when ``forward_only``.
            forward_only: run only the forwards under ``torch.no_grad``: no activations kept,
                gradients untouched.
            return_loss: return the loss (on the last stage).
            return_output_label: return the last stage's outputs (detached, microbatches
                concatenated along dim 0) and the batch's labels; keeps the outputs of the
                whole batch, so turn it off when they are not needed.
            context: the parallel context; the current one when None; with none at all, one
                pipeline rank.
            record_timeline: record this rank's timeline in ``self.last_run.timeline``
                (a barrier first aligns the ranks' clocks).
            track_memory: measure ``self.last_run.peak_activation_bytes``.

        Returns:
            ``(output, label, loss)`` on the pipeline rank holding the last virtual stage
            (``loss`` a 0-dim detached tensor, None when ``return_loss`` is False or there is no
            loss_fn); ``(None, None, None)`` on every other pipeline rank.

        Raises:
            ValueError: the batch size is not divisible by ``num_microbatches`` (both numbers
                named), the stages do not match the schedule, the schedule cannot run on this
                many stages (interleaved: ``num_microbatches % num_stages != 0``), or no loss_fn
                for training. All raised before any communication.
        """
        return run_schedule(
            self,
            stage,
            data_iter,
            loss_fn,
            forward_only=forward_only,
            return_loss=return_loss,
            return_output_label=return_output_label,
            context=context,
            record_timeline=record_timeline,
            track_memory=track_memory,
        )

    def _comm_for(self, context: Any) -> PipelineComm:
        """The point-to-point layer of ``context`` (made once per context)."""
        for known, comm in self._comms:
            if known is context:
                return comm
        comm = PipelineComm(context)
        self._comms.append((context, comm))
        return comm

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(num_microbatches={self.num_microbatches}, "
            f"num_chunks={self.num_chunks})"
        )


def add_communication(
    compute: Sequence[Action], pipeline_rank: int, num_stages: int, num_chunks: int = 1
) -> list[Action]:
    """Insert the sends and receives that a list of compute actions needs.

    ``RECV_F`` goes right before an F whose input comes from another rank, ``SEND_F`` right after
    an F whose output goes to another rank; ``RECV_B`` / ``SEND_B`` likewise around B. W moves no
    data. With one pipeline rank every hand-off is local and nothing is inserted.
    """
    last = num_stages * num_chunks - 1
    remote = num_stages > 1
    out: list[Action] = []
    for action in compute:
        v = virtual_stage(pipeline_rank, action.chunk, num_stages)
        m, c = action.microbatch, action.chunk
        if remote and action.kind is ActionKind.F and v > 0:
            out.append(Action(ActionKind.RECV_F, m, c))
        if remote and action.kind is ActionKind.B and v < last:
            out.append(Action(ActionKind.RECV_B, m, c))
        out.append(action)
        if remote and action.kind is ActionKind.F and v < last:
            out.append(Action(ActionKind.SEND_F, m, c))
        if remote and action.kind is ActionKind.B and v > 0:
            out.append(Action(ActionKind.SEND_B, m, c))
    return out


def check_actions(
    actions: Sequence[Action],
    *,
    pipeline_rank: int,
    num_stages: int,
    num_microbatches: int,
    num_chunks: int = 1,
    splits_backward: bool = False,
    forward_only: bool = False,
) -> None:
    """Check one rank's list: every (microbatch, chunk) has exactly one F, B (and W), in order.

    Also checks that each transfer crossing ranks has exactly one send or receive on this rank,
    and that no action names a microbatch or chunk out of range. Cross-rank consistency (a
    receive without its matching send, deadlocks) is what :func:`tessera.pipeline.simulate` finds.

    Raises:
        ScheduleError: naming the rank and the offending action.
    """
    where = f"rank {pipeline_rank} of {num_stages}"
    last = num_stages * num_chunks - 1
    seen: Counter[Action] = Counter()
    for action in actions:
        if action.microbatch >= num_microbatches or action.chunk >= num_chunks:
            raise ScheduleError(
                f"{where}: {action} is out of range (num_microbatches={num_microbatches}, "
                f"num_chunks={num_chunks})"
            )
        if action.kind is ActionKind.W and not splits_backward:
            raise ScheduleError(f"{where}: {action} in a schedule that does not split backward")
        if action.kind is ActionKind.B and seen[Action(ActionKind.F, *_key(action))] == 0:
            raise ScheduleError(f"{where}: {action} comes before its forward")
        if action.kind is ActionKind.W and seen[Action(ActionKind.B, *_key(action))] == 0:
            raise ScheduleError(f"{where}: {action} comes before its backward B")
        seen[action] += 1
    kinds = [ActionKind.F] if forward_only else [ActionKind.F, ActionKind.B]
    if splits_backward and not forward_only:
        kinds.append(ActionKind.W)
    for m in range(num_microbatches):
        for c in range(num_chunks):
            v = virtual_stage(pipeline_rank, c, num_stages)
            wanted = list(kinds)
            if num_stages > 1:
                if v > 0:
                    wanted.append(ActionKind.RECV_F)
                if v < last:
                    wanted.append(ActionKind.SEND_F)
                if not forward_only and v > 0:
                    wanted.append(ActionKind.SEND_B)
                if not forward_only and v < last:
                    wanted.append(ActionKind.RECV_B)
            for kind in ActionKind:
                count = seen[Action(kind, m, c)]
                expected = 1 if kind in wanted else 0
                if count != expected:
                    raise ScheduleError(
                        f"{where}: {Action(kind, m, c)} appears {count} times, expected "
                        f"{expected} (virtual stage {v} of {last + 1})"
                    )


def _key(action: Action) -> tuple[int, int]:
    return action.microbatch, action.chunk
