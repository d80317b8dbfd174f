"""``Engine``: one object that runs a training step, whatever parallelism is underneath.

The training loop written against an Engine is the same for a single process and for data x
pipeline x tensor parallelism (the design of Colossal-AI's Engine, Bian et al. 2021): the
Engine owns the wrapped model, the optimizer, the gradient handlers, mixed precision,
gradient accumulation and clipping, and returns only output, label and loss::

    engine.train()
    for batch in loader:
        engine.zero_grad()
        output, label, loss = engine.execute_schedule(iter([batch]))
        engine.step()

or, without a schedule, ``out = engine(x); loss = engine.criterion(out, y);
engine.backward(loss); engine.step()``.

Order inside ``step()`` (once every ``gradient_accumulation`` calls): the gradient handlers
(all-reduce over data, sequence, tied weights), then (under master weights) the move of the
model's low-precision gradients into the fp32 masters' (``master_weights.py``), then fp16
unscaling with one overflow decision for all ranks, or (without fp16) one decision of all ranks
on non-finite losses and gradients (``nonfinite.py``), then clipping by the global norm, then the
optimizer, then (under master weights) the masters rounded back into the model.

Ranks that read batches of different shapes do not fail loudly (a data rank with a smaller
batch weighs its gradients wrongly; a tensor group may hang), so the first forward of a job
compares the batch's shapes across all ranks (``check_agreement_every``; under debug, every
step).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tessera.context import ParallelContext, ParallelMode
from tessera.pipeline import PipelineRunner, Schedule

from .clipping import clip_grad_norm
from .consistency import agree_on_call, check_replicas_in_step, checks_batch
from .context_lookup import resolve_context
from .gradient_handlers.base import BaseGradientHandler
from .guarding import guarded, marking_reads
from .loss_scaler import DynamicLossScaler
from .master_weights import LOW_PRECISION_DTYPES, MasterWeights, cast_floating
from .nonfinite import NonFiniteError, find_nonfinite
from .schedule import NonPipelineSchedule, StepSchedule, as_step_schedule
from .token_weighting import TokenCounter, split_sum_and_count

__all__ = ["Engine"]

#: What an Engine trains: one module, or this pipeline rank's model chunks.
ModelLike = nn.Module | Sequence[nn.Module]


def _modules(model: ModelLike) -> list[nn.Module]:
    return [model] if isinstance(model, nn.Module) else list(model)


class _AutocastStage(nn.Module):
    """Runs a pipeline stage's forward under autocast (schedules call ``stage(x)`` themselves)."""

    def __init__(self, module: nn.Module, device_type: str, dtype: torch.dtype) -> None:
        super().__init__()
        self.module = module
        self._device_type = device_type
        self._dtype = dtype

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with torch.autocast(self._device_type, dtype=self._dtype):
            return self.module(*args, **kwargs)


class _CastInputsStage(nn.Module):
    """Casts a pipeline stage's floating-point inputs to its parameters' format (master weights).

    The first stage reads the batch in fp32; later stages receive activations already in the
    model's format, for which the cast is a no-op.
    """

    def __init__(self, module: nn.Module, dtype: torch.dtype) -> None:
        super().__init__()
        self.module = module
        self._dtype = dtype

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*cast_floating(args, self._dtype), **cast_floating(kwargs, self._dtype))


class Engine:
    """Runs forward, backward and the optimizer step of a (possibly parallel) model.

    Args:
        model: The module to train (possibly wrapped in DDP or sharded by FSDP2), or this
            pipeline rank's list of model chunks.
        optimizer: Its optimizer (possibly a ZeroRedundancyOptimizer).
        criterion: ``criterion(output, label) -> loss``; required for training.
        gradient_handlers: Run in order at every optimizer step, before clipping.
        schedule: Runs ``execute_schedule``: a :class:`StepSchedule` (``train_step`` /
            ``eval_step``), or a pipeline plan (``tessera.pipeline.Schedule``, run by a
            ``PipelineRunner`` on ``context``); default ``NonPipelineSchedule()``.
        clip_grad_norm: Clip to this global norm (``0``: no clipping).
        norm_type: p of the clipping norm.
        gradient_accumulation: Optimizer steps once every this many ``step()`` calls; the
            losses are divided by it so the gradient is the mean over the micro-steps.
        autocast_dtype: ``torch.float16`` or ``torch.bfloat16`` to run forward and loss under
            autocast; ``None`` for full precision.
        loss_scaler: Dynamic loss scaler (fp16); ``None`` for no scaling.
        master_weights: The fp32 masters of a model held in float16/bfloat16 (``optimizer``
            must be over ``master_weights.masters``); floating-point inputs are cast to the
            model's format and outputs back to fp32 for the loss. Excludes ``autocast_dtype``.
        nonfinite: A step whose loss or gradients hold inf or NaN: ``"raise"`` a
            ``NonFiniteError`` on every rank, ``"skip"`` it on every rank, or ``"warn"`` (skip
            and warn). Default: ``"skip"`` with a loss scaler (whose overflow skip it is; a
            ``"raise"`` then applies to non-finite losses only), else ``"raise"``.
        check_agreement_every: Compare the batch's shapes across all ranks at the first
            forward and then every this many optimizer steps, and after those steps also the
            replicated parameters' values (0: the batch at the first forward only; ``None``:
            never).
        per_token_loss: Weigh every token of the global step alike (``token_weighting.py``):
            the criterion returns ``(loss_sum, num_tokens)``; the gradients are the single
            process's mean over every token of the step however data ranks, microbatches and
            accumulation steps cut it. Not under tensor mode ``'sequence'``, whose own loss
            already averages over its ranks' tokens.
        context: The ParallelContext (default: the current one, or none).
    """

    #: Debug mode: every step checks that every rank reads a batch of the same shapes
    #: (``initialize`` sets it from ``debug=`` / ``$TESSERA_DEBUG``).
    debug: bool = False

    def __init__(
        self,
        model: ModelLike,
        optimizer: torch.optim.Optimizer,
        criterion: Callable[[Any, Any], torch.Tensor] | None = None,
        gradient_handlers: Iterable[BaseGradientHandler] = (),
        schedule: StepSchedule | Schedule | None = None,
        clip_grad_norm: float = 0.0,
        *,
        norm_type: float = 2.0,
        gradient_accumulation: int = 1,
        autocast_dtype: torch.dtype | None = None,
        loss_scaler: DynamicLossScaler | None = None,
        master_weights: MasterWeights | None = None,
        nonfinite: str | None = None,
        check_agreement_every: int | None = 0,
        per_token_loss: bool = False,
        context: ParallelContext | None = None,
    ) -> None:
        if gradient_accumulation < 1:
            raise ValueError(f"gradient_accumulation must be >= 1, got {gradient_accumulation}")
        if clip_grad_norm < 0:
            raise ValueError(f"clip_grad_norm must be >= 0, got {clip_grad_norm}")
        if autocast_dtype not in (None, torch.float16, torch.bfloat16):
            raise ValueError(
                f"autocast_dtype must be float16, bfloat16 or None, got {autocast_dtype}"
            )
        if master_weights is not None and autocast_dtype is not None:
            raise ValueError(
                f"autocast_dtype {autocast_dtype} and master weights in {master_weights.dtype} "
                "are two mixed-precision modes; choose one"
            )
        if nonfinite is None:
            nonfinite = "skip" if loss_scaler is not None else "raise"
        if nonfinite not in ("raise", "skip", "warn"):
            raise ValueError(f"nonfinite must be 'raise', 'skip' or 'warn', got {nonfinite!r}")
        if check_agreement_every is not None and check_agreement_every < 0:
            raise ValueError(
                f"check_agreement_every must be >= 0 or None, got {check_agreement_every}"
            )
        self._model = model
        self._modules = _modules(model)
        self._optimizer = optimizer
        self._criterion = criterion
        self._handlers = list(gradient_handlers)
        # A pipeline plan runs on the context it is given (else the current one): ours, so an
        # Engine built on a non-current context drives that one.
        self._schedule: StepSchedule = as_step_schedule(schedule, resolve_context(context))
        self.clip_grad_norm = float(clip_grad_norm)
        self.norm_type = float(norm_type)
        self.gradient_accumulation = int(gradient_accumulation)
        self.autocast_dtype = autocast_dtype
        self.loss_scaler = loss_scaler
        self.master_weights = master_weights
        self._context = resolve_context(context)
        self._micro_step = 0
        self.global_step = 0
        self.skipped_steps = 0
        self._recorded_losses: list[torch.Tensor] = []
        self._recorded_counts: list[torch.Tensor] = []  # per-token: each microbatch's tokens
        self.nonfinite = nonfinite
        self._backpropagated_losses: list[torch.Tensor] = []  # since the last optimizer step
        self.check_agreement_every = check_agreement_every
        self._agreement_due = check_agreement_every is not None
        # Found once: the per-step path must not search the modules (benchmark: <= 3% overhead).
        self._ddp_modules = [
            m for m in self._modules if isinstance(m, nn.parallel.DistributedDataParallel)
        ]
        self._sync_setters: list[Callable[[bool], None]] = []
        for m in self._modules:
            setter = getattr(m, "set_requires_gradient_sync", None)  # FSDP2 modules
            if callable(setter):
                self._sync_setters.append(setter)
        # handlers told which backward precedes a step, to overlap their sums with it: only
        # where each micro-step runs one backward and no DDP / FSDP2 hook rewrites .grad then
        one_backward = isinstance(self._schedule, NonPipelineSchedule) and isinstance(
            model, nn.Module
        )
        rewritten = bool(self._ddp_modules or self._sync_setters)
        self._backward_listeners = list(self._handlers) if one_backward and not rewritten else []
        first = next((p for m in self._modules for p in m.parameters()), None)
        self._device_type = first.device.type if first is not None else "cpu"
        self._tokens: TokenCounter | None = None
        if per_token_loss:
            ctx = self._context
            mode = None if ctx is None else ctx.config.mode
            if mode is not None and mode.token_loss_spans_ranks:
                raise ValueError(
                    f"per_token_loss is not supported under tensor mode {mode.name!r}: its token "
                    "loss (tessera.layers.token_loss) already averages over every token of "
                    "the sequence ranks; leave per_token_loss off there"
                )
            if not isinstance(self._schedule, NonPipelineSchedule | PipelineRunner):
                raise ValueError(
                    "per_token_loss needs to know how a step cuts its batch: it runs with "
                    "NonPipelineSchedule or a pipeline plan (PipelineRunner), not with "
                    f"{type(self._schedule).__name__}"
                )
            # the context's device: a parameter may sit on the CPU (ZeRO offload) under NCCL
            device = ctx.device if ctx is not None else torch.device("cpu")
            self._tokens = TokenCounter(ctx, device)

    @property
    def per_token_loss(self) -> bool:
        """Whether every token of the global step weighs alike (see ``token_weighting.py``)."""
        return self._tokens is not None

    # ------------------------------------------------------------------ accessors

    @property
    def model(self) -> ModelLike:
        """The model as the Engine runs it (a DDP wrapper, an FSDP2 module, chunks...)."""
        return self._model

    @property
    def module(self) -> ModelLike:
        """The model without a DDP wrapper: the names its state dict uses."""
        unwrapped = [
            m.module if isinstance(m, nn.parallel.DistributedDataParallel) else m
            for m in self._modules
        ]
        if isinstance(self._model, nn.Module):
            return unwrapped[0]
        return unwrapped

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The optimizer."""
        return self._optimizer

    @property
    def schedule(self) -> StepSchedule:
        """The schedule ``execute_schedule`` runs (a pipeline job's: a ``PipelineRunner``)."""
        return self._schedule

    @property
    def num_microbatches(self) -> int:
        """Microbatches a step's batch is cut into: the pipeline plan's, else 1."""
        plan = getattr(self._schedule, "schedule", None)
        return plan.num_microbatches if isinstance(plan, Schedule) else 1

    @property
    def gradient_handlers(self) -> list[BaseGradientHandler]:
        """The gradient handlers, in the order they run."""
        return list(self._handlers)

    @property
    def context(self) -> ParallelContext | None:
        """The ParallelContext (``None`` for a single process)."""
        return self._context

    @property
    def micro_step(self) -> int:
        """``step()`` calls so far (micro-steps under gradient accumulation)."""
        return self._micro_step

    def progress_state_dict(self) -> dict[str, Any]:
        """Counters and the loss scaler: what a checkpoint needs besides weights and optimizer.

        Plain numbers only (loads with ``weights_only=True``).
        """
        return {
            "global_step": self.global_step,
            "micro_step": self._micro_step,
            "skipped_steps": self.skipped_steps,
            "loss_scaler": self.loss_scaler.state_dict() if self.loss_scaler is not None else None,
        }

    def load_progress_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``progress_state_dict`` returned."""
        self.global_step = int(state["global_step"])
        self._micro_step = int(state["micro_step"])
        self.skipped_steps = int(state["skipped_steps"])
        scaler = state.get("loss_scaler")
        if self.loss_scaler is not None and scaler is not None:
            self.loss_scaler.load_state_dict(scaler)

    def parameters(self) -> Iterator[nn.Parameter]:
        """Every parameter this rank holds."""
        for m in self._modules:
            yield from m.parameters()

    # ------------------------------------------------------------------ modes

    def train(self) -> None:
        """Put the model in training mode."""
        for m in self._modules:
            m.train()

    def eval(self) -> None:
        """Put the model in evaluation mode."""
        for m in self._modules:
            m.eval()

    # ------------------------------------------------------------------ forward and loss

    def _model_inputs(self, obj: Any) -> Any:
        """Floating-point inputs in the model's format under master weights, else as given."""
        if self.master_weights is None:
            return obj
        return cast_floating(obj, self.master_weights.dtype)

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self._device_type, dtype=self.autocast_dtype)

    def _batch_check_due(self) -> bool:
        """Whether this step's batch is compared across ranks (and the check is then spent)."""
        due = self._agreement_due or self.debug
        self._agreement_due = False
        return due

    @property
    def _is_last_micro_step(self) -> bool:
        return (self._micro_step + 1) % self.gradient_accumulation == 0

    def _set_grad_sync(self, enabled: bool) -> None:
        """Let DDP / FSDP2 reduce gradients in this backward or not (accumulation)."""
        for ddp in self._ddp_modules:
            ddp.require_backward_grad_sync = enabled
        for setter in self._sync_setters:
            setter(enabled)
        for handler in self._backward_listeners:
            handler.before_backward(enabled)

    @guarded("engine.forward")
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Forward through the model (under autocast when mixed precision is on)."""
        if not isinstance(self._model, nn.Module):
            raise TypeError(
                f"this Engine holds {len(self._modules)} model chunks (a pipeline stage): "
                "run it with execute_schedule()"
            )
        if self._batch_check_due():
            agree_on_call(args, kwargs, self._context)
        self._set_grad_sync(self._is_last_micro_step)
        args, kwargs = self._model_inputs(args), self._model_inputs(kwargs)
        with self._autocast():
            return self._model(*args, **kwargs)

    def criterion(self, output: Any, label: Any) -> torch.Tensor:
        """The loss of ``output`` against ``label`` (under autocast, returned in float32).

        Under ``per_token_loss``: the pair ``(loss_sum, num_tokens)`` the criterion returned.
        Under master weights the low-precision output is cast to fp32 first: a softmax
        cross-entropy summed in float16 loses the small terms.

        Raises:
            RuntimeError: the Engine was built without a criterion.
        """
        if self._criterion is None:
            raise RuntimeError("this Engine has no criterion: pass criterion= to Engine/initialize")
        if self.master_weights is not None:
            output = cast_floating(output, torch.float32, only=LOW_PRECISION_DTYPES)
        with self._autocast():
            loss = self._criterion(output, label)
        if self._tokens is not None:
            total, count = split_sum_and_count(loss)
            return total.float(), count  # type: ignore[return-value]  # the per-token pair
        return loss.float() if loss.is_floating_point() else loss

    def _loss_factor(self) -> float:
        # per-token: the sums are backpropagated; step() divides by the global token count
        factor = 1.0 if self._tokens is not None else 1.0 / self.gradient_accumulation
        if self.loss_scaler is not None:
            factor *= self.loss_scaler.scale
        return factor

    # ------------------------------------------------------------------ backward

    @guarded("engine.backward")
    def backward(self, loss: torch.Tensor | tuple[torch.Tensor, torch.Tensor]) -> None:
        """Backpropagate ``loss``.

        (scaled by the loss scale and divided by the accumulation
        count). Under ``per_token_loss``: the ``(loss_sum, num_tokens)`` pair ``criterion``
        returned; the sum is backpropagated and the tokens counted.
        """
        total = self._count_tokens(loss) if self._tokens is not None else loss
        if not isinstance(total, torch.Tensor):
            raise TypeError(
                "backward takes the loss tensor (a (loss_sum, num_tokens) pair needs "
                "per_token_loss=True)"
            )
        self._backpropagated_losses.append(total.detach())
        factor = self._loss_factor()
        torch.autograd.backward(total * factor if factor != 1.0 else total)

    def _token_mean(self, output: Any, label: Any) -> torch.Tensor:
        """A per-token criterion's mean, for evaluation (nothing is counted)."""
        total, count = split_sum_and_count(self.criterion(output, label))
        return total / count

    def _count_tokens(self, value: Any) -> torch.Tensor:
        """The loss sum of a per-token criterion's ``(sum, count)``; the count is kept."""
        assert self._tokens is not None
        total, count = split_sum_and_count(value)
        self._tokens.add(count)
        return total

    @guarded("engine.backward")
    def backward_by_grad(self, tensors: torch.Tensor | Sequence[torch.Tensor], grads: Any) -> None:
        """Backpropagate from ``tensors`` given their gradients.

        (a pipeline stage that is not
        the last receives those from the next stage, already scaled).
        """
        torch.autograd.backward(tensors, grads)

    # ------------------------------------------------------------------ schedule

    def _stage(self) -> Any:
        """What the schedule calls for the forward."""
        if isinstance(self._schedule, NonPipelineSchedule) and isinstance(self._model, nn.Module):
            return self
        if self.master_weights is not None:
            dtype = self.master_weights.dtype
            cast = [_CastInputsStage(m, dtype) for m in self._modules]
            return cast[0] if isinstance(self._model, nn.Module) else cast
        if self.autocast_dtype is None:
            return self._model
        wrapped = [_AutocastStage(m, self._device_type, self.autocast_dtype) for m in self._modules]
        return wrapped[0] if isinstance(self._model, nn.Module) else wrapped

    def _loss_for_backward(self, output: Any, label: Any) -> torch.Tensor:
        loss = self.criterion(output, label)
        if self._tokens is not None:
            self._recorded_counts.append(split_sum_and_count(loss)[1].detach())
            loss = self._count_tokens(loss)
        self._recorded_losses.append(loss.detach())
        self._backpropagated_losses.append(loss.detach())
        factor = self._loss_factor()
        return loss * factor if factor != 1.0 else loss

    @guarded("engine.execute_schedule")
    @checks_batch
    def execute_schedule(
        self,
        data_iter: Iterator[Any],
        forward_only: bool = False,
        return_loss: bool = True,
        return_output_label: bool = True,
    ) -> tuple[Any, Any, torch.Tensor | None]:
        """Run one step's forward (and backward) through the schedule.

        Returns:
            ``(output, label, loss)`` as the schedule returns them, with ``loss`` the unscaled
            mean loss of the step (``None`` where the schedule gives none, e.g. on a pipeline
            stage that is not the last).
        """
        self._recorded_losses, self._recorded_counts = [], []
        data_iter = marking_reads(data_iter, self._context)
        if forward_only:
            criterion = self._token_mean if self._tokens is not None else self.criterion
            return self._schedule.eval_step(
                self._stage(),
                data_iter,
                criterion if return_loss else None,
                keep_outputs=return_output_label,
            )
        if isinstance(self._model, nn.Module):
            self._set_grad_sync(self._is_last_micro_step)
        output, label, loss = self._schedule.train_step(
            self._stage(), data_iter, self._loss_for_backward, keep_outputs=return_output_label
        )
        if not return_loss:
            loss = None
        recorded, counts = self._recorded_losses, self._recorded_counts
        if loss is not None and recorded and counts:  # per-token: this call's token mean
            loss = torch.stack(recorded).sum() / torch.stack(counts).sum()
        elif loss is not None and recorded:
            loss = recorded[0] if len(recorded) == 1 else torch.stack(recorded).mean()
        self._recorded_losses, self._recorded_counts = [], []
        return output, label, loss

    # ------------------------------------------------------------------ optimizer

    def zero_grad(self) -> None:
        """Clear the gradients, at the start of an accumulation cycle only."""
        if self._micro_step % self.gradient_accumulation == 0:
            self._optimizer.zero_grad(set_to_none=True)
            if self._tokens is not None:
                self._tokens.reset()  # the tokens of the gradients just cleared
            if self.master_weights is not None:
                self.master_weights.zero_model_grads()

    def _found_inf_group(self) -> dist.ProcessGroup | None:
        """Every rank that holds parameters: the overflow decision must be unanimous."""
        if self._context is not None:
            if self._context.world_size > 1:
                return self._context.get_group(ParallelMode.GLOBAL)
            return None
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            return dist.group.WORLD
        return None

    def _duplicate_parameters(self) -> list[torch.Tensor]:
        dups: list[torch.Tensor] = []
        for handler in self._handlers:
            dups.extend(handler.duplicate_parameters())
        if self.master_weights is not None:  # clipping runs on the masters
            return self.master_weights.masters_of(dups)
        return dups

    @guarded("engine.step")
    def step(self) -> bool:
        """One micro-step; every ``gradient_accumulation``-th call updates the parameters.

        Returns:
            Whether the optimizer stepped (``False`` between accumulation boundaries and when
            an fp16 overflow on any rank made every rank skip this step).
        """
        self._micro_step += 1
        if self._micro_step % self.gradient_accumulation != 0:
            return False
        for handler in self._handlers:
            handler.after_backward()
        for handler in self._handlers:
            handler.handle_gradient()
        losses, self._backpropagated_losses = self._backpropagated_losses, []
        masters = self.master_weights
        params: list[torch.Tensor]
        if masters is not None:
            grads = masters.grads_to_masters()
            params = list(masters.masters)
        else:
            params = list(self.parameters())
            grads = [p.grad for p in params if p.grad is not None]
        if self._tokens is not None:
            factor = self._tokens.gradient_factor(self.num_microbatches)
            for grad in grads:
                grad.mul_(factor)
        if self.loss_scaler is not None:
            if self.nonfinite == "raise":  # an overflow is the scaler's; a bad loss is not
                self._apply_nonfinite_policy(losses, [])
            found_inf = self.loss_scaler.unscale_(grads, self._found_inf_group())
            self.loss_scaler.update(found_inf)
            if found_inf:
                self.skipped_steps += 1
                return False
        elif not self._apply_nonfinite_policy(losses, grads):
            return False
        if self.clip_grad_norm > 0:
            clip_grad_norm(
                params,
                self.clip_grad_norm,
                self.norm_type,
                self._context,
                exclude=self._duplicate_parameters(),
            )
        self._optimizer.step()
        if masters is not None:
            masters.copy_to_model()
        self.global_step += 1
        every = self.check_agreement_every
        if every and self.global_step % every == 0:
            self._agreement_due = True
            self._check_replicas()
        return True

    def _check_replicas(self) -> None:
        """Replicated parameters still agree (every ``check_agreement_every`` steps).

        Skipped under ZeRO-2/3: FSDP2 shards the parameters, so replicas hold no copies.
        """
        ctx = self._context
        if ctx is None or ctx.world_size < 2 or self._sync_setters:
            return
        modules = [
            m.module if isinstance(m, nn.parallel.DistributedDataParallel) else m
            for m in self._modules
        ]
        check_replicas_in_step(modules, ctx, self.global_step)

    def _apply_nonfinite_policy(
        self, losses: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]
    ) -> bool:
        """Whether the step may go on; raise, or skip (and warn), when anything is non-finite.

        Every rank gathers every rank's flags, so all take the same branch.
        """
        report = find_nonfinite(losses, grads, self.global_step + 1, self._found_inf_group())
        if report is None:
            return True
        if self.nonfinite == "raise":
            raise NonFiniteError(report)
        self.skipped_steps += 1
        if self.nonfinite == "warn":
            warnings.warn(
                f"skipped {report.describe()} (nonfinite='warn')", RuntimeWarning, stacklevel=3
            )
        return False
