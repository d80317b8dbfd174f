"""This pipeline rank's part of a model: the layers of its virtual stages.

The model is a sequence of layers (an ``nn.Sequential`` or a list of modules). It is cut into
``pipeline_size * num_chunks`` contiguous parts (:mod:`tessera.pipeline.partition`) and rank r keeps
the parts of virtual stages ``c * pipeline_size + r`` for each chunk c, as :class:`PipelineStage`
modules holding the ORIGINAL layer objects (nothing is copied).

Parameter names: a stage names its layers like the full model does (the ``nn.Sequential``'s own
child names, or ``"0"``, ``"1"``, ... by global position for a list), so a parameter is called
the same on the stage and in the full model: the stage holding layers 4..6 has ``"4.weight"``,
and a stage's ``state_dict`` keys are a subset of the full model's. Integer indexing is local
(``stage[0]`` is its first layer); ``stage.layer_indices`` maps a local position to the global one.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any, Literal, Protocol

import torch
import torch.distributed as dist
from torch import nn

from tessera.context import ParallelMode, get_context
from tessera.pipeline.chunks import PipelineChunks
from tessera.pipeline.partition import (
    check_boundaries,
    partition_balanced,
    partition_uniform,
    stage_ranges,
)
from tessera.registry import LAYERS, ConfigError, build

__all__ = [
    "PartitionMethod",
    "PipelineRankSource",
    "PipelineStage",
    "partition_layers",
    "select_stage_layers",
    "build_pipeline_model",
    "build_pipeline_model_from_cfg",
    "describe_partition",
]

PartitionMethod = Literal["parameters", "uniform"] | Sequence[int]


class PipelineRankSource(Protocol):
    """What the model builders need from a context: the pipeline rank and size.

    ``tessera.context.ParallelContext`` satisfies it; so does any small object with these two
    methods (tests use one).
    """

    def get_local_rank(self, mode: ParallelMode) -> int:
        """This rank's index in its group of ``mode``."""
        ...

    def get_world_size(self, mode: ParallelMode) -> int:
        """The size of this rank's group of ``mode``."""
        ...


class PipelineStage(nn.Sequential):
    """The layers of one virtual stage, named as in the full model.

    Attributes:
        pipeline_rank: the pipeline rank holding this stage.
        num_stages: pipeline ranks.
        chunk: model chunk of that rank (0 when not interleaved).
        num_chunks: chunks per rank.
        virtual_stage: ``chunk * num_stages + pipeline_rank``.
        layer_indices: global index in the full model of each local layer.
        layer_names: the full model's name of each local layer (also its name here).
    """

    def __init__(
        self,
        named_layers: Sequence[tuple[str, nn.Module]],
        layer_indices: Sequence[int],
        *,
        pipeline_rank: int,
        num_stages: int,
        chunk: int,
        num_chunks: int,
    ) -> None:
        super().__init__(OrderedDict(named_layers))
        self.pipeline_rank = pipeline_rank
        self.num_stages = num_stages
        self.chunk = chunk
        self.num_chunks = num_chunks
        self.virtual_stage = chunk * num_stages + pipeline_rank
        self.layer_indices: tuple[int, ...] = tuple(layer_indices)
        self.layer_names: tuple[str, ...] = tuple(name for name, _ in named_layers)

    @property
    def is_first(self) -> bool:
        """True for virtual stage 0 (it reads the data)."""
        return self.virtual_stage == 0

    @property
    def is_last(self) -> bool:
        """True for the last virtual stage (it computes the loss)."""
        return self.virtual_stage == self.num_stages * self.num_chunks - 1

    def extra_repr(self) -> str:
        """Which virtual stage and layers this is (shown by ``print(stage)``)."""
        first, last = self.layer_indices[0], self.layer_indices[-1]
        return (
            f"virtual_stage={self.virtual_stage}, rank={self.pipeline_rank}, "
            f"chunk={self.chunk}, layers={first}..{last}"
        )


def _named_layers(
    layers: nn.Sequential | nn.ModuleList | Sequence[nn.Module],
) -> list[tuple[str, nn.Module]]:
    if isinstance(layers, nn.Sequential | nn.ModuleList):
        # _modules keeps a module listed twice under both names (named_children would not).
        named = list(layers._modules.items())
    else:
        named = [(str(i), layer) for i, layer in enumerate(layers)]
    out: list[tuple[str, nn.Module]] = []
    for name, layer in named:
        if not isinstance(layer, nn.Module):
            raise TypeError(f"layer {name!r} is {type(layer).__name__}, expected an nn.Module")
        out.append((name, layer))
    return out


def _parameter_count(layer: nn.Module) -> int:
    return sum(p.numel() for p in layer.parameters())


def partition_layers(
    weights: Sequence[float],
    num_stages: int,
    num_chunks: int = 1,
    method: PartitionMethod = "parameters",
) -> list[int]:
    """Boundaries for ``len(weights)`` layers by ``method``.

    Args:
        weights: per layer, its parameter count (used by ``"parameters"`` only).
        num_stages: pipeline ranks.
        num_chunks: chunks per rank.
        method: ``"parameters"`` (balance parameter counts, :func:`partition_balanced`),
            ``"uniform"`` (balance layer counts) or explicit boundaries.
    """
    if isinstance(method, str):
        if method == "parameters":
            return partition_balanced(weights, num_stages, num_chunks)
        if method == "uniform":
            return partition_uniform(len(weights), num_stages, num_chunks)
        raise ValueError(
            f"unknown partition method {method!r}; expected 'parameters', 'uniform' or a list "
            "of boundaries"
        )
    partition_uniform(len(weights), num_stages, num_chunks)  # same error for too few layers
    return check_boundaries(method, len(weights), num_stages * num_chunks)


def select_stage_layers(
    layers: nn.Sequential | nn.ModuleList | Sequence[nn.Module],
    pipeline_rank: int,
    pipeline_size: int,
    num_chunks: int = 1,
    method: PartitionMethod = "parameters",
) -> list[PipelineStage]:
    """The stages of ``pipeline_rank``, one per chunk (chunk 0 first); no context needed.

    Raises:
        ValueError: fewer layers than ``pipeline_size * num_chunks``, a bad rank or method.
    """
    named = _named_layers(layers)
    weights = (
        [float(_parameter_count(layer)) for _, layer in named]
        if method == "parameters"
        else [0.0] * len(named)
    )
    boundaries = partition_layers(weights, pipeline_size, num_chunks, method)
    stages = []
    for chunk, items in enumerate(
        stage_ranges(boundaries, pipeline_rank, pipeline_size, num_chunks)
    ):
        stages.append(
            PipelineStage(
                [named[i] for i in items],
                list(items),
                pipeline_rank=pipeline_rank,
                num_stages=pipeline_size,
                chunk=chunk,
                num_chunks=num_chunks,
            )
        )
    return stages


def _pipeline_position(context: PipelineRankSource | None) -> tuple[int, int]:
    source: PipelineRankSource = get_context() if context is None else context
    return (
        source.get_local_rank(ParallelMode.PIPELINE),
        source.get_world_size(ParallelMode.PIPELINE),
    )


def build_pipeline_model(
    layers: nn.Sequential | nn.ModuleList | Sequence[nn.Module],
    num_chunks: int = 1,
    method: PartitionMethod = "parameters",
    context: PipelineRankSource | None = None,
    verbose: bool = False,
) -> PipelineStage | PipelineChunks:
    """This pipeline rank's part of ``layers``.

    Args:
        layers: the whole model as a sequence of layers.
        num_chunks: model chunks per rank (more than 1 for interleaved 1F1B; chunk c of rank r is
            virtual stage ``c * pipeline_size + r``). Give the same number to the config
            (``num_chunks`` / ``NUM_CHUNKS``), or leave it out there: ``initialize`` reads it
            from the chunks.
        method: ``"parameters"``, ``"uniform"`` or explicit boundaries (see
            :func:`partition_layers`).
        context: where the pipeline rank and size come from; the current context when None.
        verbose: print the whole partition (each virtual stage's rank, chunk, layer range and
            parameter count), once per job (global rank 0, or this process without
            ``torch.distributed``): a ``tensor_shape`` must match the activation at each cut.

    Returns:
        One :class:`PipelineStage` when ``num_chunks == 1``, else a
        :class:`~tessera.pipeline.PipelineChunks` (a list of ``num_chunks`` stages, chunk 0
        first, that also answers ``parameters()``, ``state_dict()``, ``train()``...).
    """
    rank, size = _pipeline_position(context)
    stages = select_stage_layers(layers, rank, size, num_chunks, method)
    if verbose and (not dist.is_initialized() or dist.get_rank() == 0):
        print(describe_partition(layers, size, num_chunks, method))
    return stages[0] if num_chunks == 1 else PipelineChunks(stages)


def describe_partition(
    layers: nn.Sequential | nn.ModuleList | Sequence[nn.Module],
    pipeline_size: int,
    num_chunks: int = 1,
    method: PartitionMethod = "parameters",
) -> str:
    """The partition of ``layers`` as text: one line per virtual stage, in pipeline order.

    Each line names the virtual stage, the pipeline rank and chunk holding it, its layers (the
    full model's indices and names) and its parameter count, so a user can see where the cuts
    fall (tessera balances parameters, Colossal-AI balanced layer counts) and work out the
    activation shape each cut sends.
    """
    named = _named_layers(layers)
    counts = [_parameter_count(layer) for _, layer in named]
    weights = [float(c) for c in counts] if method == "parameters" else [0.0] * len(named)
    boundaries = partition_layers(weights, pipeline_size, num_chunks, method)
    how = method if isinstance(method, str) else "explicit boundaries"
    lines = [
        f"pipeline partition of {len(named)} layers ({sum(counts):,} parameters) into "
        f"{pipeline_size} stages x {num_chunks} chunks, by {how}:"
    ]
    for v in range(pipeline_size * num_chunks):
        first, end = boundaries[v], boundaries[v + 1]
        span = f"{first}..{end - 1}" if end - first > 1 else f"{first}"
        names = f"{named[first][0]}..{named[end - 1][0]}" if end - first > 1 else named[first][0]
        lines.append(
            f"  virtual stage {v}: rank {v % pipeline_size}, chunk {v // pipeline_size}, "
            f"layers {span} ({names}), {sum(counts[first:end]):,} parameters"
        )
    return "\n".join(lines)


def build_pipeline_model_from_cfg(
    model_cfg: Mapping[str, Any],
    num_chunks: int = 1,
    method: PartitionMethod = "parameters",
    context: PipelineRankSource | None = None,
) -> PipelineStage | PipelineChunks:
    """Like :func:`build_pipeline_model`, building only this rank's layers from a config.

    ``model_cfg["layers_cfg"]`` is a list of layer configs, each built with
    ``tessera.registry.build(entry, LAYERS)`` (``type`` is a name registered in ``LAYERS`` or a
    class). Other keys of ``model_cfg`` are ignored. Only this rank's layers are built for real;
    with ``method="parameters"`` every layer is first built on the meta device (no memory, no
    random numbers drawn) to count its parameters. So the weights differ from those of a full
    model built with the same seed: load them by name (the names match, see
    :class:`PipelineStage`) when that matters.

    Raises:
        ConfigError: ``layers_cfg`` is missing or not a list, or a layer cannot be built.
        ValueError: fewer layers than virtual stages.
    """
    layers_cfg = model_cfg.get("layers_cfg")
    if not isinstance(layers_cfg, Sequence) or isinstance(layers_cfg, str | bytes):
        raise ConfigError(
            f"model.layers_cfg: expected a list of layer configs, got {type(layers_cfg).__name__}"
        )
    rank, size = _pipeline_position(context)
    n = len(layers_cfg)
    if method == "parameters":
        weights = []
        for index, entry in enumerate(layers_cfg):
            try:
                with torch.device("meta"):
                    layer = _build_layer(entry, index)
            except ConfigError:
                raise
            except Exception as exc:
                raise ConfigError(
                    f"model.layers_cfg[{index}]: could not be built on the meta device to count "
                    f"its parameters ({type(exc).__name__}: {exc}); pass method='uniform' or "
                    "explicit boundaries"
                ) from exc
            weights.append(float(_parameter_count(layer)))
    else:
        weights = [0.0] * n
    boundaries = partition_layers(weights, size, num_chunks, method)
    stages = []
    for chunk, items in enumerate(stage_ranges(boundaries, rank, size, num_chunks)):
        named = [(str(i), _build_layer(layers_cfg[i], i)) for i in items]
        stages.append(
            PipelineStage(
                named,
                list(items),
                pipeline_rank=rank,
                num_stages=size,
                chunk=chunk,
                num_chunks=num_chunks,
            )
        )
    return stages[0] if num_chunks == 1 else PipelineChunks(stages)


def _build_layer(entry: Any, index: int) -> nn.Module:
    layer = build(entry, LAYERS)
    if not isinstance(layer, nn.Module):
        raise ConfigError(
            f"model.layers_cfg[{index}]: built a {type(layer).__name__}, expected an nn.Module"
        )
    return layer
