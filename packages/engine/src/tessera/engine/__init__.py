"""tessera-engine: the Engine and everything around a training step.

Gradient handlers, initialize(), mixed precision (autocast or fp32 master weights), ZeRO,
gradient accumulation, global-norm clipping, data loading, checkpoints that reshard across
layouts, and the Trainer with hooks.

It knows no layer class: what it needs about sharded parameters comes from
``tessera.context.ShardInfo``; pipeline schedules come from tessera-pipeline.
"""

from .accumulation import AccumulatedLRScheduler
from .buckets import all_reduce_coalesced, broadcast_coalesced, bucketize
from .checkpoint import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointInfo,
    CheckpointParts,
    export_pretrained,
    export_torch_state_dict,
    latest_checkpoint,
    load_checkpoint,
    prepare_checkpoint_dir,
    prune_checkpoints,
    save_checkpoint,
    verify_checkpoint,
)
from .clipping import (
    clip_grad_norm,
    combine_norms,
    global_grad_norm,
    norm_contributions,
    reduce_contributions,
)
from .data import ResumableDataLoader, ResumableDistributedSampler, get_dataloader
from .data_agreement import AgreedBatches, agree_on_data, agree_on_length
from .dist_logger import DistributedLogger, disable_existing_loggers, get_dist_logger
from .engine import Engine
from .gradient_handlers import (
    BaseGradientHandler,
    BufferBroadcastHandler,
    DataParallelGradientHandler,
    DeferredSumGradientHandler,
    PipelineSharedModuleGradientHandler,
    SequenceParallelGradientHandler,
    mark_pipeline_shared,
)
from .hooks import (
    PREEMPTED_EXIT_CODE,
    AccuracyHook,
    BaseHook,
    LoadCheckpointHook,
    LogMemoryByEpochHook,
    LogMetricByEpochHook,
    LogMetricByStepHook,
    LogTimingByEpochHook,
    LossHook,
    LRSchedulerHook,
    PreemptionHook,
    SaveCheckpointHook,
    TensorboardHook,
    ThroughputHook,
)
from .initialize import ENGINE_CONFIG_KEYS, initialize, sync_replicated_parameters
from .loss_scaler import DynamicLossScaler
from .lr_schedulers import (
    CosineAnnealingWarmupLR,
    LinearWarmupLR,
    MultiStepWarmupLR,
    OneCycleLR,
)
from .master_weights import MasterWeights
from .metrics import AverageMetric, ThroughputMetric
from .nonfinite import NonFiniteError, NonFiniteReport
from .registries import GRADIENT_HANDLERS, HOOKS, SCHEDULES
from .schedule import NonPipelineSchedule, StepSchedule, as_step_schedule
from .settings import EngineSettings, read_engine_settings
from .timer import MultiTimer, Timer
from .trainer import Trainer
from .zero import rebuild_optimizer, shard_with_fsdp2, zero_redundancy_optimizer

__all__ = [
    # engine and setup
    "Engine",
    # the engine's registries (config names of handlers, schedules, hooks)
    "GRADIENT_HANDLERS",
    "SCHEDULES",
    "HOOKS",
    "initialize",
    "ENGINE_CONFIG_KEYS",
    "EngineSettings",
    "read_engine_settings",
    "sync_replicated_parameters",
    # schedules
    "StepSchedule",
    "as_step_schedule",
    "NonPipelineSchedule",
    # gradient handlers
    "BaseGradientHandler",
    "BufferBroadcastHandler",
    "DataParallelGradientHandler",
    "DeferredSumGradientHandler",
    "SequenceParallelGradientHandler",
    "PipelineSharedModuleGradientHandler",
    "mark_pipeline_shared",
    # precision, ZeRO, accumulation, clipping
    "DynamicLossScaler",
    "MasterWeights",
    "NonFiniteError",
    "NonFiniteReport",
    "zero_redundancy_optimizer",
    "shard_with_fsdp2",
    "rebuild_optimizer",
    "AccumulatedLRScheduler",
    # learning-rate schedules with warm-up (registered in tessera.registry.LR_SCHEDULERS)
    "LinearWarmupLR",
    "CosineAnnealingWarmupLR",
    "MultiStepWarmupLR",
    "OneCycleLR",
    "clip_grad_norm",
    "global_grad_norm",
    "norm_contributions",
    "combine_norms",
    "reduce_contributions",
    # collectives
    "bucketize",
    "all_reduce_coalesced",
    "broadcast_coalesced",
    # data
    "get_dataloader",
    "agree_on_data",
    "agree_on_length",
    "AgreedBatches",
    "ResumableDataLoader",
    "ResumableDistributedSampler",
    # checkpoints
    "save_checkpoint",
    "load_checkpoint",
    "CheckpointParts",
    "CheckpointInfo",
    "CheckpointError",
    "CheckpointCorruptError",
    "export_torch_state_dict",
    "export_pretrained",
    "verify_checkpoint",
    "latest_checkpoint",
    "prune_checkpoints",
    "prepare_checkpoint_dir",
    # trainer, hooks, metrics, timing, logging
    "Trainer",
    "BaseHook",
    "LRSchedulerHook",
    "LossHook",
    "AccuracyHook",
    "ThroughputHook",
    "LogMetricByEpochHook",
    "LogMetricByStepHook",
    "LogTimingByEpochHook",
    "LogMemoryByEpochHook",
    "TensorboardHook",
    "SaveCheckpointHook",
    "LoadCheckpointHook",
    "PreemptionHook",
    "PREEMPTED_EXIT_CODE",
    "AverageMetric",
    "ThroughputMetric",
    "MultiTimer",
    "Timer",
    "DistributedLogger",
    "get_dist_logger",
    "disable_existing_loggers",
]
