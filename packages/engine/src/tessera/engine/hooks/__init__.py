"""Trainer hooks: the callbacks a training run is extended with."""

from .base import BaseHook
from .checkpoint_hooks import LoadCheckpointHook, SaveCheckpointHook
from .log_hooks import (
    LogMemoryByEpochHook,
    LogMetricByEpochHook,
    LogMetricByStepHook,
    LogTimingByEpochHook,
    memory_usage,
)
from .lr_scheduler import LRSchedulerHook
from .metric_hooks import AccuracyHook, LossHook, ThroughputHook, top1_correct
from .preemption import PREEMPTED_EXIT_CODE, PreemptionHook
from .tensorboard import TensorboardHook

__all__ = [
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
    "memory_usage",
    "top1_correct",
]
