"""``initialize``: turn a model, optimizer and config into an Engine ready for the job.

It reads the engine keys of the configuration (the one ``launch`` was given, unless
``config=`` is passed):

=========================  ================================================================
key                        effect
=========================  ================================================================
``fp16=dict(mode="torch",  float16 autocast + dynamic loss scaling; an overflow on any rank
init_scale=2**16, ...)``   skips the step on every rank (``DynamicLossScaler`` keywords);
                           ``fp16=dict()`` is mode "torch", ``dict(mode=None)`` is off;
                           mode "naive": the model held in float16, fp32 master weights in
                           the optimizer, the same loss scaling (``master_weights.py``)
``bf16=True``              bfloat16 autocast (no scaling needed); ``bf16=dict(mode="naive")``:
                           the model held in bfloat16 with fp32 master weights
``zero=dict(stage=1|2|3,   ZeRO over DATA: ZeroRedundancyOptimizer (1), FSDP2 (2: gradients
offload=False)``           and optimizer state sharded, 3: also parameters; offload: CPU)
``gradient_accumulation``  N micro-steps per optimizer (and lr-scheduler) step
``clip_grad_norm``         clip to this global norm (ShardInfo-aware, every layout)
``gradient_handlers``      ``[dict(type="DataParallelGradientHandler"), ...]``; default:
                           torch DDP for plain data parallelism, else the matching handler;
                           with a pipeline, ``PipelineSharedModuleGradientHandler`` is always
                           added (weights tied across stages, ``mark_pipeline_shared``);
                           ``DeferredSumGradientHandler`` takes over the layers' own sums
                           (2.5D's depth sum) once per step, except under explicit
                           handlers or ZeRO-2/3
``ddp=dict(...)``          extra keywords of DistributedDataParallel; its
                           ``broadcast_buffers`` (default True) also rules the
                           ``DataParallelGradientHandler`` of pipelines and model chunks:
                           the first replica's buffers (BatchNorm statistics) are copied to
                           the others at every optimizer step
``schedule=dict(type=..)`` a schedule from the SCHEDULES registry; default: see below
``num_microbatches``,      with pipeline size > 1: ``PipelineSchedule`` (1F1B), or
``num_chunks``,            ``InterleavedPipelineSchedule`` when num_chunks > 1, from
``tensor_shape``           tessera.pipeline (Colossal-AI's ``NUM_MICRO_BATCHES``,
                           ``NUM_CHUNKS``, ``TENSOR_SHAPE`` are accepted as aliases);
                           without num_chunks, the chunks build_pipeline_model made
``nonfinite="raise"``      a step whose loss or gradients hold inf/NaN: ``"raise"``
                           (default; ``NonFiniteError`` on every rank), ``"skip"`` (every
                           rank skips it; the default under fp16) or ``"warn"`` (skip, warn)
``check_agreement=True``   every rank's batch has the same shapes, checked on the first
                           step; an int N: also every N optimizer steps, and after those
                           steps the replicated parameters still agree; False: never
``per_token_loss=False``   True: the criterion returns ``(loss_sum, num_tokens)`` and every
                           token of the global step weighs alike, however data ranks,
                           microbatches and accumulation steps cut the batch (uneven
                           padding, a masked LM's ignored labels); see token_weighting.py
``debug=True``             more cross-rank checks (also ``TESSERA_DEBUG=1``): batch shapes
                           every step
=========================  ================================================================

Keys of your own may sit beside these, but a key that is almost one of them
(``gradient_acumulation``, ``clip_grad_nrom``) or belongs inside a block (``sequence_parallel``
at the top level) is a ``ConfigError`` naming the key it resembles (``settings.py``).

Every rank must build the same model and read the same configuration: ``initialize`` compares
the configuration keys above, and parameter names, shapes and dtypes across data and tensor
ranks, before its first broadcast, and then the values of replicated parameters
(``consistency.py``), so a mismatch is a clear ``ValueError`` on every rank instead of a hang
or silently mixed values.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from tessera.context import ConfigError, ParallelContext, ParallelMode, deferred_sum_mode
from tessera.pipeline import (
    InterleavedPipelineSchedule,
    PipelineRunner,
    PipelineSchedule,
    Schedule,
)
from tessera.registry import build

from .accumulation import AccumulatedLRScheduler
from .buckets import broadcast_coalesced
from .consistency import (
    check_config_agreement,
    check_model_agreement,
    check_parameter_checksums,
    debug_enabled,
)
from .context_lookup import group_if_parallel, replica_mode, resolve_context
from .engine import Engine
from .generators import align_replicated_generator
from .gradient_handlers import (
    BaseGradientHandler,
    BufferBroadcastHandler,
    DataParallelGradientHandler,
    DeferredSumGradientHandler,
    PipelineSharedModuleGradientHandler,
)
from .loss_scaler import DynamicLossScaler
from .master_weights import MasterWeights
from .optimizer_kinds import check_elementwise_optimizer
from .registries import GRADIENT_HANDLERS, SCHEDULES
from .schedule import StepSchedule, as_step_schedule
from .scheduler_binding import rebind_lr_scheduler
from .settings import ENGINE_CONFIG_KEYS, EngineSettings, read_engine_settings
from .zero import rebuild_optimizer, shard_with_fsdp2, zero_redundancy_optimizer

__all__ = ["ENGINE_CONFIG_KEYS", "initialize", "sync_replicated_parameters"]


def _modules(model: nn.Module | Sequence[nn.Module]) -> list[nn.Module]:
    return [model] if isinstance(model, nn.Module) else list(model)


def sync_replicated_parameters(
    model: nn.Module | Sequence[nn.Module], context: ParallelContext | None = None
) -> None:
    """Copy the parameters and buffers of the first replica to every other.

    (over DATA, or
    SEQUENCE_DP under sequence parallelism), so replicas start equal whatever their seeds.
    """
    ctx = resolve_context(context)
    if ctx is None:
        return
    mode = replica_mode(ctx)
    group = group_if_parallel(ctx, mode)
    if group is None:
        return
    src = ctx.get_ranks_in_group(mode)[0]
    tensors: list[torch.Tensor] = []
    for m in _modules(model):
        tensors.extend(p.data for p in m.parameters() if not p.is_meta)
        tensors.extend(b for b in m.buffers() if not b.is_meta)
    broadcast_coalesced(tensors, src, group)


def _model_chunks(modules: Sequence[nn.Module]) -> int:
    """How many chunks this rank was given: ``build_pipeline_model``'s ``num_chunks``."""
    return max(len(modules), *(int(getattr(m, "num_chunks", 1)) for m in modules))


def _chunks(settings: EngineSettings, cfg: Mapping[str, Any], modules: Sequence[nn.Module]) -> int:
    """``num_chunks`` from the config, else from the model; both given, they must agree.

    The interleaved schedule needs the count in the config, the model builder needs it in its
    call; Colossal-AI's readers give it to the call only, and the first step then failed far
    from the cause. The chunks the builder made say it.

    Raises:
        ConfigError: the config's ``num_chunks`` / ``NUM_CHUNKS`` differs from the model's.
    """
    built = _model_chunks(modules)
    key = next((k for k in ("num_chunks", "NUM_CHUNKS") if k in cfg), None)
    if key is None:
        return built
    if settings.chunks != built:
        raise ConfigError(
            f"config key {key}={settings.chunks} but the model holds {built} chunk(s) on this "
            f"rank (build_pipeline_model(..., num_chunks={built})): give both the same number, "
            f"or leave {key} out of the config and it is taken from the model"
        )
    return settings.chunks


def _pipeline_plan(settings: EngineSettings, ctx: ParallelContext, chunks: int) -> Schedule:
    """1F1B, or interleaved 1F1B with ``num_chunks > 1``, from the pipeline keys."""
    if settings.micro_batches is None:
        raise ConfigError(
            f"pipeline size is {ctx.pipeline_size} but the config has no num_microbatches "
            "(NUM_MICRO_BATCHES): set num_microbatches (and num_chunks for the interleaved "
            "schedule)"
        )
    if chunks > 1:
        return InterleavedPipelineSchedule(
            settings.micro_batches, chunks, tensor_shape=settings.tensor_shape
        )
    return PipelineSchedule(settings.micro_batches, tensor_shape=settings.tensor_shape)


def _configured_schedule(entry: Mapping[str, Any], ctx: ParallelContext | None) -> Any:
    """Build ``schedule=dict(type=...)`` from SCHEDULES, giving it the context if it takes one."""
    target = entry["type"]
    if isinstance(target, str):
        try:
            target = SCHEDULES.get(target)
        except KeyError as exc:  # the registry's message lists the closest names
            raise ConfigError(f"schedule.type: {exc.args[0]}") from None
    extra: dict[str, Any] = {}
    if "context" in _parameters(target):
        extra["context"] = ctx
    return build(entry, SCHEDULES, **extra)


def _build_handlers(
    settings: EngineSettings,
    forward_model: nn.Module | Sequence[nn.Module],
    optimizer: torch.optim.Optimizer,
    ctx: ParallelContext,
) -> list[BaseGradientHandler]:
    handlers = []
    for i, entry in enumerate(settings.gradient_handlers):
        handler = build(
            entry, GRADIENT_HANDLERS, model=forward_model, optimizer=optimizer, context=ctx
        )
        if not isinstance(handler, BaseGradientHandler):
            raise ConfigError(
                f"gradient_handlers[{i}] built a {type(handler).__name__}, not a "
                "BaseGradientHandler"
            )
        handlers.append(handler)
    return handlers


def _check_zero_layout(
    settings: EngineSettings, ctx: ParallelContext | None, modules: Sequence[nn.Module]
) -> None:
    """ZeRO needs a context; stages 2 and 3 (FSDP2) one whole model, no pipeline."""
    stage = settings.zero_stage
    if stage and ctx is None:
        raise ConfigError("zero needs a ParallelContext (launch tessera first)")
    pipeline_size = ctx.pipeline_size if ctx is not None else 1
    if stage >= 2 and (pipeline_size > 1 or len(modules) > 1):
        raise ConfigError(
            f"zero.stage {stage} (FSDP2) is not supported with pipeline size "
            f"{pipeline_size}; use zero.stage 1 with pipeline parallelism"
        )


def _equal_replicas(
    modules: Sequence[nn.Module],
    ctx: ParallelContext,
    cfg: Mapping[str, Any],
    debug: bool,
    settings: EngineSettings,
) -> None:
    """Step 1: the ranks agree (config, model), the model on the device, replicas equal.

    Parameter values are compared on every job, not only under debug: a tensor rank seeded
    differently holds different replicated weights and would train its own model silently
    (see consistency.py).
    """
    check_config_agreement({**cfg, "debug": debug}, ENGINE_CONFIG_KEYS, ctx)
    check_model_agreement(modules, ctx)
    for m in modules:
        if _left_on_meta(m, settings):
            _buffers_to(m, ctx.device)
        else:
            m.to(ctx.device)
    sync_replicated_parameters(modules, ctx)
    check_parameter_checksums(modules, ctx)
    align_replicated_generator(ctx)


def _left_on_meta(module: nn.Module, settings: EngineSettings) -> bool:
    """Whether ``module`` holds parameters on meta, for FSDP2 to shard there (ZeRO-2/3).

    A model built inside ``meta_parameters`` with no tensor mode to allocate it reaches here
    on meta; FSDP2 shards it without memory and ``load_pretrained`` after ``initialize``
    allocates and reads each data rank's rows only (replicas hold no values to compare yet).

    Raises:
        ConfigError: meta parameters under any other setting (nothing would allocate them).
    """
    meta = [name for name, p in module.named_parameters() if p.is_meta]
    if not meta:
        return False
    if settings.zero_stage >= 2 and settings.master_dtype is None:
        return True
    raise ConfigError(
        f"initialize: the parameters {meta[:4]}{' ...' if len(meta) > 4 else ''} are on the "
        "meta device (built inside meta_parameters, and no tensor mode allocated them): call "
        "tessera.layers.load_pretrained(model, folder) before initialize, which allocates "
        "and reads them; only under zero.stage 2 or 3 (FSDP2 shards them on meta) may it "
        "come after, each data rank then reading its own rows"
    )


def _buffers_to(module: nn.Module, device: torch.device) -> None:
    """Move ``module``'s buffers (real, under ``meta_parameters``) to ``device``."""
    for sub in module.modules():
        for key, buffer in sub._buffers.items():
            if buffer is not None and not buffer.is_meta:
                sub._buffers[key] = buffer.to(device)


def _precision_and_zero(
    settings: EngineSettings,
    model: nn.Module | Sequence[nn.Module],
    modules: list[nn.Module],
    optimizer: torch.optim.Optimizer,
    ctx: ParallelContext | None,
) -> tuple[MasterWeights | None, torch.optim.Optimizer, nn.Module | list[nn.Module]]:
    """Step 2: master weights, then ZeRO-2/3; both may replace the optimizer.

    Master weights cast the model in place and move the optimizer onto fp32 copies (after
    the replicas' broadcast, so the masters of replicas are equal); FSDP2 replaces the
    parameters. Returns the masters, the optimizer to step and the model to call.
    """
    masters: MasterWeights | None = None
    if settings.master_dtype is not None:
        masters = MasterWeights(modules, settings.master_dtype)
        optimizer = masters.rebuild_optimizer(optimizer)
    forward_model: nn.Module | list[nn.Module] = model if isinstance(model, nn.Module) else modules
    if settings.zero_stage >= 2:
        assert ctx is not None and isinstance(forward_model, nn.Module)
        names = {id(p): n for n, p in forward_model.named_parameters()}
        shard_with_fsdp2(forward_model, ctx, settings.zero_stage, settings.zero_offload)
        optimizer = rebuild_optimizer(optimizer, names, forward_model)
    return masters, optimizer, forward_model


def _gradient_sync(
    settings: EngineSettings,
    forward_model: nn.Module | list[nn.Module],
    optimizer: torch.optim.Optimizer,
    ctx: ParallelContext,
) -> tuple[list[BaseGradientHandler], nn.Module | list[nn.Module]]:
    """Step 3: the gradient handlers, or torch DDP for plain data parallelism.

    The configured handlers; without any (and below ZeRO-2, whose FSDP2 reduces), the one the
    layout needs. Every pipeline job also gets the handler of weights tied across stages.
    Returns the handlers and the model to call (DDP-wrapped, or as given).
    """
    pipeline_size, data_size = ctx.pipeline_size, ctx.data_size
    handlers = _build_handlers(settings, forward_model, optimizer, ctx)
    if not settings.gradient_handlers and settings.zero_stage < 2:
        # 2.5D's depth sums once per step and bucketed, not per layer and backward (FSDP2's
        # DTensor gradients under ZeRO-2/3 keep them in autograd)
        deferred = DeferredSumGradientHandler(forward_model, optimizer, ctx)
        if deferred.sums:
            handlers.append(deferred)
        mode = ctx.config.mode
        replicas = replica_mode(ctx)
        if mode is not None and mode.gradient_handler and group_if_parallel(ctx, replicas):
            # the tensor mode's own handler sums over its replica group (sequence: data x
            # sequence ranks), with DDP's buffer broadcast
            handler: Any = GRADIENT_HANDLERS.get(mode.gradient_handler)  # takes DDP's option
            handlers.append(
                handler(
                    forward_model, optimizer, ctx, broadcast_buffers=_broadcast_buffers(settings)
                )
            )
        elif data_size > 1 and (pipeline_size > 1 or not isinstance(forward_model, nn.Module)):
            # DDP's option, also where DDP does not fit: replicas agree on BatchNorm statistics
            handlers.append(
                DataParallelGradientHandler(
                    forward_model, optimizer, ctx, broadcast_buffers=_broadcast_buffers(settings)
                )
            )
        elif data_size > 1 and isinstance(forward_model, nn.Module):
            ddp_kwargs = dict(settings.ddp)
            if ctx.device.type == "cuda":
                ddp_kwargs.setdefault("device_ids", [ctx.device.index])
            forward_model = nn.parallel.DistributedDataParallel(
                forward_model, process_group=ctx.get_group(ParallelMode.DATA), **ddp_kwargs
            )
    zero_replicas = settings.zero_stage >= 2 and data_size > 1
    if not settings.gradient_handlers and zero_replicas and _broadcast_buffers(settings):
        # FSDP2 reduces the gradients but never syncs buffers (BatchNorm's statistics)
        modules = [forward_model] if isinstance(forward_model, nn.Module) else forward_model
        if any(True for m in modules for _ in m.buffers()):
            handlers.append(BufferBroadcastHandler(forward_model, optimizer, ctx))
    _check_deferred_sums(handlers, forward_model)
    if pipeline_size > 1 and not any(
        isinstance(h, PipelineSharedModuleGradientHandler) for h in handlers
    ):
        # weights tied across stages (mark_pipeline_shared): without their summed gradient
        # the copies would drift apart, silently; a job without ties pays one small exchange
        # at construction, nothing per step
        handlers.append(PipelineSharedModuleGradientHandler(forward_model, optimizer, ctx))
    return handlers, forward_model


def _broadcast_buffers(settings: EngineSettings) -> bool:
    """``ddp=dict(broadcast_buffers=...)``, DDP's own default (True) when absent."""
    value = settings.ddp.get("broadcast_buffers", True)
    if not isinstance(value, bool):
        raise ConfigError(f"ddp.broadcast_buffers must be True or False, got {value!r}")
    return value


def _check_deferred_sums(
    handlers: list[BaseGradientHandler], forward_model: nn.Module | list[nn.Module]
) -> None:
    """A model whose layers leave gradient sums to the loop must get a handler that sums them.

    Its layers were switched by an earlier ``DeferredSumGradientHandler`` (an earlier
    ``initialize`` of the same model); without one now, nothing would sum them: silently wrong.

    Raises:
        ConfigError: naming the parameters and what to do.
    """
    if any(isinstance(h, DeferredSumGradientHandler) for h in handlers):
        return
    modules = [forward_model] if isinstance(forward_model, nn.Module) else forward_model
    left = [
        f"{name} (over {mode})"
        for m in modules
        for name, p in m.named_parameters()
        if (mode := deferred_sum_mode(p)) is not None
    ]
    if left:
        more = " ..." if len(left) > 3 else ""
        raise ConfigError(
            f"gradient_handlers: the model's layers leave the sums of {left[:3]}{more} to a "
            "DeferredSumGradientHandler (switched by an earlier initialize of this model), and "
            "none is configured now (explicit gradient_handlers, or ZeRO-2/3); add "
            "dict(type='DeferredSumGradientHandler') to gradient_handlers, or build the model "
            "afresh"
        )


def _schedule(
    settings: EngineSettings,
    ctx: ParallelContext | None,
    masters: MasterWeights | None,
    chunks: int,
) -> StepSchedule:
    """Step 4: the configured schedule, else the pipeline's (1F1B, interleaved), else none."""
    planned: Any = None
    if settings.schedule is not None:
        planned = _configured_schedule(settings.schedule, ctx)
    elif ctx is not None and ctx.pipeline_size > 1:
        planned = _pipeline_plan(settings, ctx, chunks)
    schedule = as_step_schedule(planned, ctx)
    # tensor_shape's receive buffers take the model's format under master weights (a runner's,
    # or an older-interface schedule's own tensor_dtype)
    runs = schedule if isinstance(schedule, PipelineRunner) else getattr(schedule, "inner", None)
    if masters is not None and getattr(runs, "tensor_dtype", False) is None:
        runs.tensor_dtype = masters.dtype  # type: ignore[union-attr]
    return schedule


def initialize(
    model: nn.Module | Sequence[nn.Module],
    optimizer: torch.optim.Optimizer,
    criterion: Any = None,
    train_dataloader: Any = None,
    test_dataloader: Any = None,
    lr_scheduler: Any = None,
    config: Mapping[str, Any] | None = None,
    context: ParallelContext | None = None,
) -> tuple[Engine, Any, Any, Any]:
    """Build the Engine for ``model`` under the current (or given) parallel context.

    Every rank must call it (it broadcasts replicated parameters and may create groups).

    Args:
        model: This rank's model (a pipeline stage or its chunks, tensor-parallel layers...).
        optimizer: Its optimizer. Under ZeRO or master weights a new optimizer of the same
            class and param-group settings replaces it (read ``engine.optimizer``; under
            master weights it holds the fp32 masters); its state is not carried over.
            ``lr_scheduler``, if it was built on ``optimizer``, is moved onto the new one.
            Under ZeRO-2/3 ``optimizer`` is emptied (no param groups' tensors, no state): it
            would otherwise keep the whole unsharded parameters alive wherever the caller
            still holds it.
        criterion: ``criterion(output, label) -> loss``.
        train_dataloader: Returned unchanged (build it with ``get_dataloader``).
        test_dataloader: Returned unchanged.
        lr_scheduler: Returned wrapped in ``AccumulatedLRScheduler`` under gradient
            accumulation (it must then be stepped once per micro-step); under ZeRO it drives
            the optimizer that replaced ``optimizer``.
        config: The configuration (default: the launcher's, ``context.full_config``).
        context: The ParallelContext (default: the current one; none: a single process).

    Returns:
        ``(engine, train_dataloader, test_dataloader, lr_scheduler)``.

    Raises:
        ConfigError: a key above has a bad value or a combination is unsupported.
    """
    ctx = resolve_context(context)
    # The checks, the broadcast and the wrappers below communicate: a rank that fails or dies
    # in them is named on the others, as in a training step.
    guard = ctx.guard("engine.initialize") if ctx is not None else contextlib.nullcontext()
    with guard:
        return _initialize(
            model,
            optimizer,
            criterion,
            train_dataloader,
            test_dataloader,
            lr_scheduler,
            config,
            ctx,
        )


def _initialize(
    model: nn.Module | Sequence[nn.Module],
    optimizer: torch.optim.Optimizer,
    criterion: Any,
    train_dataloader: Any,
    test_dataloader: Any,
    lr_scheduler: Any,
    config: Mapping[str, Any] | None,
    ctx: ParallelContext | None,
) -> tuple[Engine, Any, Any, Any]:
    """:func:`initialize` once the context is resolved (under its guard)."""
    cfg: Mapping[str, Any] = (
        config if config is not None else (ctx.full_config if ctx is not None else {})
    )
    user_optimizer = optimizer
    debug = debug_enabled(cfg)
    settings = read_engine_settings(cfg, debug=debug)
    modules = _modules(model)
    _check_zero_layout(settings, ctx, modules)
    check_elementwise_optimizer(optimizer)
    if ctx is not None:
        _equal_replicas(modules, ctx, cfg, debug, settings)
    masters, optimizer, forward_model = _precision_and_zero(
        settings, model, modules, optimizer, ctx
    )
    handlers: list[BaseGradientHandler] = []
    if ctx is not None:
        handlers, forward_model = _gradient_sync(settings, forward_model, optimizer, ctx)
    if settings.zero_stage == 1:
        assert ctx is not None
        optimizer = zero_redundancy_optimizer(optimizer, ctx)
    pipelined = ctx is not None and ctx.pipeline_size > 1 and settings.schedule is None
    chunks = _chunks(settings, cfg, modules) if pipelined else settings.chunks
    schedule = _schedule(settings, ctx, masters, chunks)

    scaler = DynamicLossScaler(**settings.loss_scaler) if settings.loss_scaler is not None else None
    accumulation = settings.gradient_accumulation
    engine = Engine(
        forward_model,
        optimizer,
        criterion,
        handlers,
        schedule,
        settings.clip_grad_norm,
        gradient_accumulation=accumulation,
        autocast_dtype=settings.autocast_dtype,
        loss_scaler=scaler,
        master_weights=masters,
        nonfinite=settings.nonfinite,
        check_agreement_every=settings.agreement_every,
        per_token_loss=settings.per_token_loss,
        context=ctx,
    )
    engine.debug = debug
    if lr_scheduler is not None and optimizer is not user_optimizer:
        rebind_lr_scheduler(lr_scheduler, user_optimizer, optimizer)
    if lr_scheduler is not None and accumulation > 1:
        lr_scheduler = AccumulatedLRScheduler(lr_scheduler, accumulation)
    return engine, train_dataloader, test_dataloader, lr_scheduler


def _parameters(obj: Any) -> set[str]:
    try:
        return set(inspect.signature(obj).parameters)
    except (TypeError, ValueError):
        return set()
