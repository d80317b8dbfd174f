"""``plan_layouts``: every layout of a job, its per-rank bytes and its estimated step time.

A layout fits when tessera can run it (:func:`~tessera.context.planner.layouts.layout_problems`)
and its fullest rank's bytes stay within the memory budget. Fitting layouts come first, fastest
first by the machine model; the others follow, smallest first, each with its reasons.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from tessera.registry import ConfigError

from .comm import (
    Collective,
    block_collectives,
    contributed_bytes,
    data_collectives,
    head_collectives,
    pipeline_collectives,
    sums_once_per_step,
)
from .layouts import (
    Layout,
    enumerate_layouts,
    layout_problems,
    microbatch_samples,
    microbatches,
)
from .machine import DEFAULT_MACHINE, Machine
from .memory import (
    MemoryBreakdown,
    block_parameters,
    embedding_parameters,
    rank_memory,
    stage_blocks,
)
from .precision import Precision, precision_for
from .shapes import ModelShape
from .units import format_bytes

__all__ = ["LayoutEstimate", "StageStep", "estimate_layout", "plan_layouts", "stage_steps"]


@dataclass(frozen=True)
class LayoutEstimate:
    """What the planner expects of one layout.

    Attributes:
        layout: The layout.
        memory: Peak bytes of the fullest rank, by kind.
        comm_bytes: Bytes the busiest rank contributes to collectives in one step (the
            convention of ``benchmarks/meters.py``; see ``comm.py``).
        collectives: Collective calls that rank makes in one step.
        step_seconds: Estimated time of one training step under the machine model.
        microbatches: Microbatches per step (1 without a pipeline).
        problems: Why the layout cannot run or does not fit; empty when it fits.
    """

    layout: Layout
    memory: MemoryBreakdown
    comm_bytes: int
    collectives: int
    step_seconds: float
    microbatches: int
    problems: tuple[str, ...] = ()

    @property
    def fits(self) -> bool:
        """Whether tessera can run the layout within the memory budget."""
        return not self.problems


@dataclass(frozen=True)
class StageStep:
    """One pipeline stage's share of a step, on one of its ranks.

    Attributes:
        flops: Operations of one microbatch on this rank (forward, backward, recomputation).
        per_microbatch: Tensor-parallel and pipeline collectives of one microbatch.
        per_step: Gradient synchronization, once per step.
    """

    flops: float
    per_microbatch: list[Collective]
    per_step: list[Collective]

    def seconds(self, machine: Machine) -> tuple[float, float]:
        """``(one microbatch, the step's synchronization)`` in seconds."""
        compute = machine.compute_seconds(self.flops)
        talk = sum(machine.collective_seconds(c) for c in self.per_microbatch)
        return compute + talk, sum(machine.collective_seconds(c) for c in self.per_step)

    def comm_bytes(self, microbatches: int) -> int:
        """Bytes contributed in one step."""
        return microbatches * contributed_bytes(self.per_microbatch) + contributed_bytes(
            self.per_step
        )

    def calls(self, microbatches: int) -> int:
        """Collective calls in one step."""
        once = sum(c.calls for c in self.per_step)
        return microbatches * sum(c.calls for c in self.per_microbatch) + once


def stage_steps(
    shape: ModelShape,
    layout: Layout,
    precision: Precision,
    backend: str = "nccl",
    *,
    engine_sums: bool = True,
) -> list[StageStep]:
    """The first pipeline stage's step and, with a pipeline, the last one's.

    A microbatch's compute is three forwards (four with checkpointing) of the stage's blocks,
    and three of the head on the last stage, split evenly over the tensor ranks. With
    checkpointing the forward's tensor-parallel collectives run again in the backward (the
    recomputation runs with gradients enabled, so a mesh ``Linear`` picks the same variant).
    ``backend`` moves the tensor modes' blocks (``comm.py``). With ``engine_sums`` the
    gradient sums the layers leave to the engine run once per step, bucketed
    (:func:`~tessera.context.planner.comm.sums_once_per_step`), below ZeRO-2 as the engine
    does; without, every layer sums in every backward, as the layers do alone.
    """
    samples = microbatch_samples(shape, layout)
    passes = 4 if layout.checkpoint else 3
    one_block = block_collectives(shape, layout, samples, precision, backend)
    if layout.checkpoint:  # the recomputed forward communicates again
        one_block += [c for c in one_block if c.phase == "forward"]
    first, last = stage_blocks(shape, layout)
    stages = [(first, 2, layout.pipeline == 1)]
    if layout.pipeline > 1:
        stages.append((last, 1, True))
    found = []
    for blocks, tables, has_head in stages:
        flops = blocks * shape.block_forward_flops(samples) * passes
        talk = [_times(c, blocks) for c in one_block]
        if has_head:
            flops += 3 * shape.head_forward_flops(samples)
            talk += head_collectives(shape, layout, samples, precision, backend)
        talk += pipeline_collectives(shape, layout, samples, precision)
        parameters = blocks * block_parameters(shape, layout)
        parameters += embedding_parameters(shape, layout, tables=tables, head=has_head)
        sync = data_collectives(layout, parameters, blocks, precision)
        if engine_sums and layout.zero < 2:  # ZeRO-2/3: FSDP2 keeps them in autograd
            talk, sums = sums_once_per_step(talk)
            sync = sums + sync
        found.append(StageStep(flops / layout.tensor, talk, sync))
    return found


def _times(collective: Collective, factor: int) -> Collective:
    """``collective`` with ``factor`` times its calls."""
    return replace(collective, calls=collective.calls * factor)


def estimate_layout(
    shape: ModelShape,
    layout: Layout,
    memory_budget: int,
    machine: Machine = DEFAULT_MACHINE,
    dtype: str = "fp32",
    *,
    engine_sums: bool = True,
) -> LayoutEstimate:
    """Memory, communication and step time of ``layout``, and why it would not fit.

    The step time is ``(m + p - 1)`` times the slowest stage's microbatch (compute plus its
    tensor-parallel and pipeline collectives: the bubble of a 1F1B or GPipe pipeline;
    Narayanan et al. 2021), plus that stage's gradient synchronization. The communication
    figures are the slowest stage's, with the tensor modes' blocks moved as ``machine.backend``
    moves them. ``engine_sums``: see :func:`stage_steps` (``False`` prices the layers as they
    run without the engine, what ``benchmarks/bench_layers_memory_comm.py`` measures).
    """
    precision = precision_for(dtype, layout.zero)
    memory = rank_memory(
        shape,
        layout,
        precision,
        machine.backend,
        runtime=machine.runtime,
        runtime_per_block=machine.runtime_per_block,
    )
    m = microbatches(shape, layout)
    steps = stage_steps(shape, layout, precision, machine.backend, engine_sums=engine_sums)

    def step_time(stage: StageStep) -> float:
        microbatch, sync = stage.seconds(machine)
        return (m + layout.pipeline - 1) * microbatch + sync

    slowest = max(steps, key=step_time)
    problems = layout_problems(shape, layout)
    if not problems and memory.total > memory_budget:
        problems.append(
            f"needs {format_bytes(memory.total)} > {format_bytes(memory_budget)} per rank "
            f"(parameters {format_bytes(memory.parameters)}, gradients "
            f"{format_bytes(memory.gradients)}, optimizer {format_bytes(memory.optimizer)}, "
            f"activations {format_bytes(memory.activations)})"
        )
    return LayoutEstimate(
        layout=layout,
        memory=memory,
        comm_bytes=slowest.comm_bytes(m),
        collectives=slowest.calls(m),
        step_seconds=step_time(slowest),
        microbatches=m,
        problems=tuple(problems),
    )


def plan_layouts(
    shape: ModelShape,
    world: int,
    memory_budget: int,
    machine: Machine = DEFAULT_MACHINE,
    *,
    dtype: str = "fp32",
    mode: str | None = None,
    tensor: int | None = None,
    pipeline: int | None = None,
) -> list[LayoutEstimate]:
    """Every layout of ``world`` ranks for ``shape``: the fitting ones fastest first, then the rest.

    Args:
        shape: The model and its global batch.
        world: Ranks in the job.
        memory_budget: Bytes one rank may hold.
        machine: The machine model that prices a step.
        dtype: ``"fp32"``, or ``"fp16"`` / ``"bf16"`` for mixed precision.
        mode: Only this tensor mode (``"none"``, ``"1d"``, ``"2d"``, ``"2.5d"``, ``"3d"``).
        tensor: Only this tensor size.
        pipeline: Only this pipeline size.

    Raises:
        ConfigError: a bad ``world``, filter, ``dtype`` or ``memory_budget``; the message
            starts with the key and shows the arithmetic.
    """
    if isinstance(memory_budget, bool) or not isinstance(memory_budget, int) or memory_budget < 1:
        raise ConfigError(f"memory must be a positive number of bytes, got {memory_budget!r}")
    precision_for(dtype, 0)  # checks the name
    found = [
        estimate_layout(shape, layout, memory_budget, machine, dtype)
        for layout in enumerate_layouts(shape, world, mode=mode, tensor=tensor, pipeline=pipeline)
    ]
    fitting = sorted((e for e in found if e.fits), key=lambda e: (e.step_seconds, e.memory.total))
    others = sorted(
        (e for e in found if not e.fits), key=lambda e: (e.memory.total, e.step_seconds)
    )
    return fitting + others
