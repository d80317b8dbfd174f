"""Gradient handlers: what happens to the gradients between backward and the optimizer step."""

from .base import BaseGradientHandler
from .buffers import BufferBroadcastHandler, broadcast_buffers
from .data_parallel import DataParallelGradientHandler
from .deferred_sums import DeferredSumGradientHandler
from .pipeline_shared import (
    PipelineSharedModuleGradientHandler,
    mark_pipeline_shared,
)
from .sequence_parallel import SequenceParallelGradientHandler

__all__ = [
    "BaseGradientHandler",
    "BufferBroadcastHandler",
    "broadcast_buffers",
    "DataParallelGradientHandler",
    "DeferredSumGradientHandler",
    "SequenceParallelGradientHandler",
    "PipelineSharedModuleGradientHandler",
    "mark_pipeline_shared",
]
