"""The layout planner: its figures against measurement, its rules against tessera's, its CLI."""

from __future__ import annotations

import ast
import contextlib
import io
import json
import math
import pathlib
from dataclasses import replace

import pytest

from tessera.context import ConfigError, ParallelConfig
from tessera.context.__main__ import main as context_main
from tessera.context.planner import (
    DEFAULT_MACHINE,
    Layout,
    Machine,
    MemoryBreakdown,
    ModelShape,
    calibrate,
    enumerate_layouts,
    estimate_layout,
    layout_problems,
    parse_bytes,
    plan_layouts,
    precision_for,
)
from tessera.context.planner.comm import (
    block_collectives,
    contributed_bytes,
    cube_algorithm,
    linear_collectives,
    mesh_algorithm,
)
from tessera.context.planner.layouts import microbatch_samples, tensor_shapes
from tessera.context.planner.memory import (
    block_activation_bytes,
    block_parameters,
    checkpointed_block_bytes,
    embedding_parameters,
    freed_before_attention,
    head_activation_bytes,
    rank_memory,
)
from tessera.context.planner.rank import stage_steps
from tessera.context.planner.table import format_header
from tessera.context.planner.units import format_bytes
from tessera.context.planner.workspace import (
    attention_workspace_bytes,
    block_workspace_bytes,
    head_workspace_bytes,
    linear_workspace_bytes,
)

GIB = 2**30
FP32 = precision_for("fp32", 0)

# ------------------------------------------------------------------ against measurement

#: One pre-LN block, batch 8, seq 16, heads 4, hidden 128, fp32, per rank, one step.
BENCH_BLOCK = ModelShape(layers=1, hidden=128, heads=4, seq=16, vocab=0, batch=8)

#: The machine of that benchmark: gloo, whose ranks send a group's blocks pairwise.
GLOO = replace(DEFAULT_MACHINE, backend="gloo")

#: The benchmark counts torch.distributed's function names, and as ``exchange`` the layers'
#: block exchanges (point-to-point sends posted together); the planner calls those a ``send``.
PLANNER_KIND = {"exchange": "send"}

Measured = tuple[Layout, int, int, int, int, dict[str, int]]

#: Bytes per rank measured by benchmarks/bench_layers_memory_comm.py, run as
#: ``cd benchmarks && ../.nox/bench/bin/python bench_layers_memory_comm.py --steps 2``:
#: parameters, tensors saved for backward (SavedTensorMeter), bytes contributed to collectives
#: in the forward and in the backward (TrafficCounter; the busiest rank: under 2D/2.5D a rank
#: off the mesh diagonal; every 3D rank sends the same), and rank 0's collective calls by
#: kind. The run printed KiB (none 774.5 / 1058.0; 1D(4) 195.9 / 458.0 / 128.0 + 128.0; 2D(4)
#: 195.2 / 264.5 / 257.0..369.0 + 370.0..594.0; 2.5D(8,d=2) 195.2 / 132.2 / 128.5..184.5 +
#: 379.8..491.8; 3D(8) 99.2 / 132.2 / 224.5 + 363.2), rank 0's calls (1D(4) all_reduce 4;
#: 2D(4) all_reduce 4, exchange 22; 2.5D(8,d=2) all_reduce 8, exchange 22;
#: 3D(8) all_reduce 4, exchange 32) and "Every figure equals its formula to the
#: byte" (every rank against the formula of its mesh position), so the bytes below are its
#: formula() values. Every 2D and 2.5D Linear keeps its weights here (m = 64 or 32 rows < 1.5
#: in/q); under 3D (n = 32 rows, k = in/q, o = out/q^2) fc1 keeps its weights (3qnk + 2no =
#: 20480 < 3ok = 24576) and qkv (18432 = 18432), proj and fc2 move their operands.
MEASURED: dict[str, Measured] = {
    "none": (Layout(1, 1, 1, "none"), 793088, 1083392, 0, 0, {}),
    "1D(4)": (Layout(1, 1, 4, "1d"), 200576, 468992, 131072, 131072, {"all_reduce": 4}),
    "2D(4)": (
        Layout(1, 1, 4, "2d"),
        199936,
        270848,
        377856,
        608256,
        {"all_reduce": 4, "exchange": 22},
    ),
    "2.5D(8,d=2)": (
        Layout(1, 1, 8, "2.5d", depth=2),
        199936,
        135424,
        188928,
        503552,
        {"all_reduce": 8, "exchange": 22},
    ),
    "3D(8)": (
        Layout(1, 1, 8, "3d"),
        101632,
        135424,
        229888,
        371968,
        {"all_reduce": 4, "exchange": 32},
    ),
}

#: The same block at hidden 32 (``... bench_layers_memory_comm.py --steps 1 --hidden 32``),
#: where qkv, proj and fc1 run SUMMA (m = 64 or 32 rows >= 1.5 in/q = 24), fc2 keeps its
#: weights (1.5 in/q = 96) and every 3D Linear moves its operands (3qnk + 2no >= 3ok). The
#: run printed KiB (2D(4) 12.8 / 72.5 / 41.0..57.0 + 77.8..109.8; 2.5D(8,d=2) 12.8 / 36.2 /
#: 24.5..32.5 + 59.8..75.8; 3D(8) 6.8 / 36.2 / 38.5 + 59.3), rank 0's calls (2D(4)
#: all_reduce 4, exchange 25; 2.5D(8,d=2) all_reduce 8, exchange 25; 3D(8)
#: all_reduce 4, exchange 34) and "Every figure equals its formula to the byte".
BENCH_BLOCK_32 = replace(BENCH_BLOCK, hidden=32)
MEASURED_32: dict[str, Measured] = {
    "2D(4)": (
        Layout(1, 1, 4, "2d"),
        13120,
        74240,
        58368,
        112384,
        {"all_reduce": 4, "exchange": 25},
    ),
    "2.5D(8,d=2)": (
        Layout(1, 1, 8, "2.5d", depth=2),
        13120,
        37120,
        33280,
        77632,
        {"all_reduce": 8, "exchange": 25},
    ),
    "3D(8)": (
        Layout(1, 1, 8, "3d"),
        6976,
        37120,
        39424,
        60736,
        {"all_reduce": 4, "exchange": 34},
    ),
}

#: 3D(8) at hidden 384 (``... bench_layers_memory_comm.py --steps 0 --hidden 384 --modes
#: '3D(8)'``), where every 3D Linear keeps its weights (e.g. fc2: 3qnk + 2no = 153600 < 3ok =
#: 221184). The run printed KiB 3D(8) 873.8 / 388.2 / 828.5 + 1338.9, rank 0's calls
#: all_reduce 4, exchange 26, and "Every figure equals its formula to the byte".
BENCH_BLOCK_384 = replace(BENCH_BLOCK, hidden=384)
MEASURED_384: dict[str, Measured] = {
    "3D(8)": (
        Layout(1, 1, 8, "3d"),
        894720,
        397568,
        848384,
        1371008,
        {"all_reduce": 4, "exchange": 26},
    ),
}

#: 3D(8) keeping its gathered operands (``keep_gathered_operands``), ``...
#: bench_layers_memory_comm.py --steps 0 --modes '3D(8) kept'`` at hidden 128 (every Linear
#: moves its operands: qnk + no >= ok) and ``--hidden 384`` (every Linear keeps its weights).
#: The runs printed KiB 99.2 / 436.2 / 224.5 + 227.8 and 873.8 / 1060.2 / 828.5 + 834.9, rank
#: 0's calls all_reduce 4, exchange 26 and all_reduce 4, exchange 22, and "Every figure equals
#: its formula to the byte".
KEPT = Layout(1, 1, 8, "3d", keep_gathered=True)
MEASURED_KEPT: dict[str, tuple[ModelShape, Measured]] = {
    "3D(8) kept": (
        BENCH_BLOCK,
        (KEPT, 101632, 446720, 229888, 233216, {"all_reduce": 4, "exchange": 26}),
    ),
    "3D(8) kept-hidden384": (
        BENCH_BLOCK_384,
        (KEPT, 894720, 1085696, 848384, 854912, {"all_reduce": 4, "exchange": 22}),
    ),
}

CASES = [(BENCH_BLOCK, *MEASURED[mode]) for mode in MEASURED]
CASES += [(BENCH_BLOCK_32, *MEASURED_32[mode]) for mode in MEASURED_32]
CASES += [(BENCH_BLOCK_384, *MEASURED_384[mode]) for mode in MEASURED_384]
CASE_IDS = list(MEASURED) + [f"{mode}-hidden32" for mode in MEASURED_32]
CASE_IDS += [f"{mode}-hidden384" for mode in MEASURED_384]
CASES += [(shape, *measured) for shape, measured in MEASURED_KEPT.values()]
CASE_IDS += list(MEASURED_KEPT)


@pytest.mark.parametrize(
    ("shape", "layout", "params", "saved", "fwd", "bwd", "calls"), CASES, ids=CASE_IDS
)
def test_block_figures_equal_the_measured_bytes(
    shape: ModelShape,
    layout: Layout,
    params: int,
    saved: int,
    fwd: int,
    bwd: int,
    calls: dict[str, int],
) -> None:
    collectives = block_collectives(shape, layout, shape.batch, FP32, backend="gloo")
    assert 4 * block_parameters(shape, layout) == params
    assert block_activation_bytes(shape, layout, shape.batch, FP32) == saved
    assert contributed_bytes(collectives, "forward") == fwd
    assert contributed_bytes(collectives, "backward") == bwd
    by_kind: dict[str, int] = {}
    for c in collectives:
        by_kind[c.kind] = by_kind.get(c.kind, 0) + c.calls
    assert by_kind == {PLANNER_KIND.get(kind, kind): n for kind, n in calls.items()}


@pytest.mark.parametrize(
    ("shape", "layout", "params", "saved", "fwd", "bwd", "calls"), CASES, ids=CASE_IDS
)
def test_whole_estimate_of_one_block_equals_the_measurement(
    shape: ModelShape,
    layout: Layout,
    params: int,
    saved: int,
    fwd: int,
    bwd: int,
    calls: dict[str, int],
) -> None:
    """The path plan_layouts takes (stages, microbatches, ZeRO) gives the same bytes.

    With every layer summing its own gradients, as the benchmark's layers do without the engine.
    """
    estimate = estimate_layout(shape, layout, memory_budget=GIB, machine=GLOO, engine_sums=False)
    assert estimate.memory.parameters == params
    assert estimate.memory.activations == saved
    assert estimate.comm_bytes == fwd + bwd
    assert estimate.collectives == sum(calls.values())
    assert estimate.fits


@pytest.mark.parametrize(
    ("layout", "sums", "buckets"),
    [
        (Layout(1, 1, 4, "2d"), 2, 1),  # the two LayerNorms' affine sums
        (Layout(1, 1, 8, "2.5d", depth=2), 6, 2),  # and the four depth sums
        (Layout(1, 1, 8, "3d"), 2, 1),
        (Layout(1, 1, 8, "2.5d", depth=2, zero=2), 6, 6),  # FSDP2 keeps them in autograd
    ],
)
def test_under_the_engine_gradient_sums_run_once_per_step_in_buckets(
    layout: Layout, sums: int, buckets: int
) -> None:
    """The sums the engine's DeferredSumGradientHandler takes over: one bucket per group.

    One microbatch moves the same bytes either way; with a pipeline's ``m`` microbatches the
    layers alone sum ``m`` times, the engine once.
    """
    alone = estimate_layout(BENCH_BLOCK, layout, GIB, GLOO, engine_sums=False)
    engine = estimate_layout(BENCH_BLOCK, layout, GIB, GLOO)
    assert engine.comm_bytes == alone.comm_bytes
    assert alone.collectives - engine.collectives == sums - buckets
    if layout.zero:
        return
    shape = replace(BENCH_BLOCK, layers=4, batch=32)
    piped = replace(layout, pipeline=2)
    (first, _) = stage_steps(shape, piped, FP32, "gloo", engine_sums=False)
    per_microbatch = contributed_bytes([c for c in first.per_microbatch if c.sum_over])
    assert per_microbatch > 0
    m = estimate_layout(shape, piped, GIB, GLOO).microbatches
    assert m > 1
    alone = estimate_layout(shape, piped, GIB, GLOO, engine_sums=False)
    engine = estimate_layout(shape, piped, GIB, GLOO)
    assert alone.comm_bytes - engine.comm_bytes == (m - 1) * per_microbatch


def test_mesh_linear_variant_follows_tessera_rule() -> None:
    """Weights stay while 2 rows < 3 in/q (tessera.layers.choose_algorithm in training)."""
    assert mesh_algorithm(95, 64) == "stationary"  # 190 < 192
    assert mesh_algorithm(96, 64) == "summa"  # 192 = 192
    layout = Layout(1, 1, 4, "2d")
    stay = linear_collectives(layout, 95, 128, 128, FP32)
    travel = linear_collectives(layout, 96, 128, 128, FP32)
    assert {c.kind for c in stay} == {"send", "reduce_scatter", "all_gather"}  # NCCL
    assert {c.kind for c in travel} == {"all_gather", "reduce_scatter"}


def test_cube_linear_variant_follows_tessera_rule() -> None:
    """Weights stay while 3qnk + 2no < 3ok (tessera.layers.choose_cube_algorithm in training)."""
    # qkv of the benchmark's block at hidden 128 on 3d(8): n = 32 rows, k = 64, o = 96
    assert cube_algorithm(32, 64, 96, 2) == "gathered"  # 18432 = 18432
    assert cube_algorithm(32, 64, 97, 2) == "stationary"  # 18496 < 18624
    layout = Layout(1, 1, 8, "3d")
    stay = linear_collectives(layout, 32, 128, 4 * 128, FP32)  # fc1: o = 128
    travel = linear_collectives(layout, 32, 128, 3 * 128, FP32)
    assert {c.kind for c in stay} == {"all_gather", "all_to_all", "reduce_scatter"}  # NCCL
    assert {c.kind for c in travel} == {"all_gather", "reduce_scatter"}
    # the weights-stay variant's exchanges span a plane of q^2 ranks, the bias's gather q
    assert sorted(c.group for c in stay) == [2, 4, 4, 4, 4, 4]
    # an all-to-all contributes the blocks addressed to the others: [q^2, n, o] less its own
    (forward,) = [c for c in stay if c.kind == "all_to_all" and c.phase == "forward"]
    assert forward.contributed == 4 * 3 * 32 * 128


def test_nccl_and_gloo_move_the_same_bytes_on_the_wire() -> None:
    """Pairwise sends and NCCL's collectives differ in calls' kinds and contributed bytes only."""
    for layout in (Layout(1, 1, 4, "2d"), Layout(1, 1, 8, "2.5d", 2), Layout(1, 1, 8, "3d")):
        for shape in (BENCH_BLOCK, BENCH_BLOCK_32, BENCH_BLOCK_384):
            nccl = block_collectives(shape, layout, shape.batch, FP32, backend="nccl")
            gloo = block_collectives(shape, layout, shape.batch, FP32, backend="gloo")
            assert sum(c.wire for c in nccl) == pytest.approx(sum(c.wire for c in gloo))
            assert sum(c.calls for c in nccl) == sum(c.calls for c in gloo)


def test_activations_follow_korthikanti_with_dropout_in_fp16() -> None:
    """34 s b h + 5 a s^2 b bytes per block (their section 4.1), 1d: 10 sbh + 24 sbh/t + ..."""
    s, b, h, a, t = 64, 4, 256, 8, 4
    shape = ModelShape(layers=2, hidden=h, heads=a, seq=s, vocab=0, batch=b, dropout=True)
    fp16 = precision_for("fp16", 0)
    stats = 4 * 4 * s * b  # LayerNorm mean and rstd in fp32, which the paper leaves out
    none = block_activation_bytes(shape, Layout(1, 1, 1, "none"), b, fp16)
    assert none == 34 * s * b * h + 5 * a * s * s * b + stats
    one_d = block_activation_bytes(shape, Layout(1, 1, t, "1d"), b, fp16)
    assert one_d == 10 * s * b * h + 24 * s * b * h // t + 5 * a * s * s * b // t + stats


# ------------------------------------------------------------------ tessera's rules


@pytest.mark.parametrize("mode", ["1d", "2d", "2.5d", "3d"])
def test_tensor_sizes_are_what_parallel_config_accepts(mode: str) -> None:
    for size in range(2, 65):
        depths = range(2, size + 1) if mode == "2.5d" else [1]
        accepted = set()
        for depth in depths:
            try:
                config = ParallelConfig(tensor_size=size, tensor_mode=mode, tensor_depth=depth)
            except ConfigError:
                continue
            if config.tensor_dim > 1 or mode == "1d":  # a 1 x 1 mesh repeats another layout
                accepted.add((mode, depth))
        assert set(tensor_shapes(size, mode)) == accepted, size


def test_every_layout_is_a_parallel_block_tessera_accepts() -> None:
    shape = ModelShape(layers=8, hidden=256, heads=8, seq=32, vocab=512, batch=64)
    for world in (1, 2, 4, 6, 8, 12, 16, 27, 32):
        layouts = list(enumerate_layouts(shape, world))
        assert layouts, world
        for layout in layouts:
            assert layout.data * layout.pipeline * layout.tensor == world
            config = ParallelConfig.from_dict(layout.parallel(), world)
            assert (config.data_size, config.pipeline_size, config.tensor_size) == (
                layout.data,
                layout.pipeline,
                layout.tensor,
            )
            assert config.tensor_dim == layout.side


def test_layout_counts_and_the_options_of_one_split() -> None:
    shape = ModelShape(layers=2, hidden=64, heads=4, seq=8, vocab=0, batch=8)
    layouts = list(enumerate_layouts(shape, 4))
    # data x pipe x tensor: 4x1x1, 2x2x1, 2x1x2(1d), 1x2x2(1d), 1x1x4(1d, 2d); pipe 4 > layers 2
    splits = {(x.data, x.pipeline, x.tensor_name) for x in layouts}
    assert splits == {
        (4, 1, "none"),
        (2, 2, "none"),
        (2, 1, "1d(2)"),
        (1, 2, "1d(2)"),
        (1, 1, "1d(4)"),
        (1, 1, "2d(4)"),
    }
    # ZeRO 0-3 only with replicas; checkpointing on and off everywhere
    assert len(layouts) == 3 * 8 + 3 * 2


def _problems(layout: Layout, **changes: int) -> list[str]:
    fields = dict(layers=4, hidden=128, heads=4, seq=16, vocab=1024, batch=16)
    fields.update(changes)
    return layout_problems(ModelShape(**fields), layout)


def test_divisibility_rejects_what_tessera_rejects() -> None:
    assert _problems(Layout(1, 1, 4, "1d")) == []
    assert _problems(Layout(1, 1, 4, "1d"), heads=6, hidden=132) == [
        "heads 6 % 4 = 2: 1d(4) splits heads over 4 ranks"
    ]
    assert _problems(Layout(1, 1, 2, "1d"), vocab=50257)[0].startswith("vocab 50257 % 2 = 1")
    # 2d(9): q = 3 must divide hidden and heads
    two_d = _problems(Layout(1, 1, 9, "2d"), batch=18)
    assert [p.split(":")[0] for p in two_d] == [
        "hidden 128 % 3 = 2",
        "heads 4 % 3 = 1",
        "vocab 1024 % 3 = 1",
    ]
    # 3d needs hidden divisible by q^2 (Linear3D's [out/q^2, in/q]), 2d by q only
    assert _problems(Layout(1, 1, 4, "2d"), hidden=130, heads=2, vocab=1040) == []
    three_d = _problems(Layout(1, 1, 8, "3d"), hidden=130, heads=2, vocab=1040)
    assert [p.split(":")[0] for p in three_d] == ["hidden 130 % 4 = 2"]
    # the batch of a replica is cut into d*q (2.5d) or q (2d) blocks
    assert _problems(Layout(1, 1, 4, "2d"), batch=6) == []
    deep = _problems(Layout(1, 1, 8, "2.5d", depth=2), batch=6)
    assert deep == [
        "batch per replica 6 % 4 = 2: 2.5d(8,d=2) splits each replica's batch into 4 blocks"
    ]
    assert _problems(Layout(4, 1, 1, "none"), batch=6)[0].startswith("batch 6 % 4 = 2")
    assert _problems(Layout(1, 5, 1, "none"))[0].startswith("pipeline 5 > layers 4")
    assert "FSDP2" in _problems(Layout(2, 2, 1, "none", zero=2))[0]
    assert _problems(Layout(2, 2, 1, "none", zero=1)) == []


def test_bad_input_names_the_key_and_the_arithmetic() -> None:
    shape = ModelShape(layers=4, hidden=128, heads=4, seq=16, vocab=0, batch=16)
    with pytest.raises(
        ConfigError,
        match=r"^world 12 is not data x pipeline x tensor for any "
        r"layout with tensor 8: 12 % 8 = 4$",
    ):
        plan_layouts(shape, 12, GIB, tensor=8)
    with pytest.raises(ConfigError, match=r"^tensor 6 does not fit mode 2d: 2d needs q\*q ranks"):
        plan_layouts(shape, 12, GIB, mode="2d", tensor=6)
    with pytest.raises(ConfigError, match=r"^world 12 has no tensor size for mode 3d"):
        plan_layouts(shape, 12, GIB, mode="3d")
    with pytest.raises(ConfigError, match=r"^pipeline 8 > layers 4: every stage needs"):
        plan_layouts(shape, 16, GIB, pipeline=8)
    with pytest.raises(ConfigError, match=r"^memory must be a positive number of bytes"):
        plan_layouts(shape, 4, 0)
    with pytest.raises(
        ConfigError, match=r"^hidden 130 is not divisible by heads 4 \(130 % 4 = 2\)"
    ):
        ModelShape(layers=4, hidden=130, heads=4, seq=16, vocab=0, batch=16)
    with pytest.raises(ConfigError, match=r"^layers must be a positive int, got 0"):
        ModelShape(layers=0, hidden=128, heads=4, seq=16, vocab=0, batch=16)
    with pytest.raises(ConfigError, match=r"^dtype 'fp8' is not one of fp32, fp16, bf16"):
        plan_layouts(shape, 4, GIB, dtype="fp8")
    with pytest.raises(ConfigError, match=r"^latency must be finite and >= 0"):
        Machine(flops=1e12, bandwidth=1e10, latency=-1.0)


def test_memory_amounts() -> None:
    assert parse_bytes("16GiB") == 16 * GIB
    assert parse_bytes("16 gb") == 16 * 10**9
    assert parse_bytes("1.5MiB") == 3 * 2**19
    assert parse_bytes("1e9") == 10**9
    with pytest.raises(ConfigError, match=r"^memory '16XB' is not an amount of bytes"):
        parse_bytes("16XB")


# ------------------------------------------------------------------ memory behaviour

SHAPE = ModelShape(layers=8, hidden=512, heads=8, seq=128, vocab=4096, batch=32)


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_zero_divides_optimizer_state_then_gradients_then_parameters(dtype: str) -> None:
    def memory(zero: int) -> MemoryBreakdown:
        return estimate_layout(SHAPE, Layout(4, 1, 2, "1d", zero=zero), GIB, dtype=dtype).memory

    plain, one, two, three = (memory(z) for z in range(4))
    p0 = precision_for(dtype, 0)
    elements = plain.parameters // p0.parameter
    assert plain.optimizer == p0.optimizer * elements
    assert one.optimizer == p0.optimizer * math.ceil(elements / 4)  # stage 1: / data size
    assert (one.parameters, one.gradients) == (plain.parameters, plain.gradients)
    # under stages 2 and 3 mixed precision is autocast over fp32 parameters (no masters)
    p = precision_for(dtype, 2)
    assert two.gradients == p.gradient * math.ceil(elements / 4)
    assert two.optimizer == p.optimizer * math.ceil(elements / 4)
    assert two.parameters == p.parameter * elements
    block = block_parameters(SHAPE, Layout(4, 1, 2, "1d"))
    # stage 3 holds a shard; FSDP2 gathers the block it runs and prefetches the next one,
    # which only the blocks' moments meet (here the first block's backward, ``late``)
    assert three.parameters == p.parameter * math.ceil(elements / 4)
    assert three.late > two.late + p.parameter * block
    assert plain.total > one.total > three.total
    assert plain.activations == one.activations == two.activations == three.activations


def test_mixed_precision_counts_sixteen_bytes_per_parameter() -> None:
    """ZeRO's 2 + 2 + 12 bytes (section 3.1), fp32's 4 + 4 + 8."""
    layout = Layout(1, 1, 1, "none")
    for dtype in ("fp16", "fp32"):
        m = estimate_layout(SHAPE, layout, GIB, dtype=dtype).memory
        assert m.parameters + m.gradients + m.optimizer == 16 * SHAPE.parameters


@pytest.mark.parametrize(
    "layout",
    [
        Layout(4, 1, 1, "none"),
        Layout(1, 1, 4, "1d"),
        Layout(1, 1, 4, "2d"),
        Layout(1, 1, 8, "2.5d", 2),
        Layout(1, 1, 8, "3d"),
        Layout(1, 4, 1, "none"),
    ],
    ids=lambda x: x.tensor_name + f"-p{x.pipeline}",
)
def test_checkpointing_keeps_less(layout: Layout) -> None:
    off = estimate_layout(SHAPE, layout, GIB)
    on = estimate_layout(SHAPE, Layout(**{**layout.__dict__, "checkpoint": True}), GIB)
    assert on.memory.activations < off.memory.activations / 2
    # (a pipeline's fullest stage may change; where the optimizer step is the peak, both
    # runs reach the same one)
    assert on.memory.total <= off.memory.total
    assert on.comm_bytes >= off.comm_bytes  # the recomputed forward communicates again


def test_mesh_modes_cut_activations_by_all_ranks_and_1d_does_not() -> None:
    none = block_activation_bytes(SHAPE, Layout(1, 1, 1, "none"), 8, FP32)
    for layout in (Layout(1, 1, 4, "2d"), Layout(1, 1, 8, "2.5d", 2), Layout(1, 1, 8, "3d")):
        cut = block_activation_bytes(SHAPE, layout, 8, FP32)
        assert none / layout.tensor <= cut <= 1.01 * none / layout.tensor
    # 1d keeps 4Th + 4T whole on every rank (Korthikanti et al. 2022, section 4.2.1)
    assert block_activation_bytes(SHAPE, Layout(1, 1, 4, "1d"), 8, FP32) > 1.5 * none / 4


def test_working_memory_is_the_largest_layers_and_the_peak_one_of_two_moments() -> None:
    """What benchmarks/bench_largest_model.py measured on gloo (docs/choosing-a-layout.md)."""
    gloo = replace(DEFAULT_MACHINE, backend="gloo")
    samples, tokens = SHAPE.batch, SHAPE.batch * SHAPE.seq
    logits = 4 * tokens * SHAPE.vocab  # one process's, fp32
    for layout, machine, head in [
        (Layout(1, 1, 1, "none"), DEFAULT_MACHINE, 2),  # logits and the loss's copy
        (Layout(1, 1, 4, "1d"), DEFAULT_MACHINE, 2),
        (Layout(1, 1, 4, "2d"), DEFAULT_MACHINE, 1 + 2),  # and SUMMA's q panels
        (Layout(1, 1, 4, "2d"), gloo, 1 + 2),  # two ranks exchange without copies
        (Layout(1, 1, 16, "2d"), gloo, 1 + 2 * 4),  # gloo's exchanges: q copies more
    ]:
        m = estimate_layout(SHAPE, layout, GIB, machine=machine).memory
        assert head_workspace_bytes(SHAPE, layout, samples, machine.backend) == (
            head * logits // layout.tensor
        )
        block = block_workspace_bytes(SHAPE, layout, samples, FP32, machine.backend)
        assert m.workspace == max(block, head * logits // layout.tensor)
        # the start of the backward (no gradient yet) or the optimizer step (no activation)
        peak = max(m.gradients, m.activations + m.workspace)
        assert m.total == m.parameters + m.optimizer + peak
    # a 2D linear layer gathers q blocks of its widest input (the MLP's second layer's)
    wide = replace(SHAPE, vocab=0)
    layout = Layout(1, 1, 4, "2d")
    widest = 4 * (tokens // 2) * (wide.ffn // 2)
    assert block_workspace_bytes(wide, layout, samples, FP32) >= (2 + 1) * widest
    assert block_workspace_bytes(wide, layout, samples, FP32, "gloo") >= (2 + 1) * widest
    # and, in SUMMA's backward, the q panels of its weight block beside dW's q partials and
    # the block receiving their sum
    weight = 4 * wide.hidden * wide.ffn // 4
    scores = 4 * samples * wide.heads * wide.seq**2 // 4
    assert block_workspace_bytes(wide, layout, samples, FP32, "gloo") == max(
        2 * scores, (2 + 1) * widest + (2 * 2 + 1) * weight
    )


def _ladder(k: int) -> ModelShape:
    """Size ``k`` of benchmarks/bench_largest_model.py's ladder (examples/gpt's model)."""
    return ModelShape(
        layers=k, hidden=32 * k, heads=8, seq=128, vocab=1024, batch=16, tied_head=False
    )


#: What a rank of benchmarks/bench_largest_model.py holds beyond its tensors after a step, over
#: its baseline: a base (MKL's cached GEMM buffers, glibc's heap) and more per block (each
#: tensor's objects and the heap's small blocks): benchmarks/memory_trial.py's RUNTIME and
#: RUNTIME_PER_BLOCK, the least-squares line through its runs at depths 1-14.
BENCH_RUNTIME = 588 * 1024
BENCH_RUNTIME_PER_BLOCK = 352 * 1024

#: The benchmark's machine: gloo, and the runtime's own memory.
BENCH = replace(GLOO, runtime=BENCH_RUNTIME, runtime_per_block=BENCH_RUNTIME_PER_BLOCK)


def _block_moments(shape: ModelShape, layout: Layout, samples: int) -> tuple[int, int]:
    """A block's backward: (its widest linear's moment, its attention's), bytes on one rank."""
    block = block_activation_bytes(shape, layout, samples, FP32)
    flowing = 2 * checkpointed_block_bytes(shape, layout, samples, FP32)
    linear = block + linear_workspace_bytes(shape, layout, samples, FP32, "gloo")
    attention = (
        block
        - freed_before_attention(shape, layout, samples, FP32)
        + attention_workspace_bytes(shape, layout, samples, FP32)
    )
    return linear + flowing, attention + flowing


@pytest.mark.parametrize(
    ("layout", "k", "measured"),
    [
        (Layout(1, 1, 4, "2d", checkpoint=True), 11, 93.9),
        (Layout(1, 1, 4, "2d", checkpoint=True), 8, 47.0),
        (Layout(1, 1, 8, "3d", checkpoint=True), 11, 52.4),
        (Layout(8, 1, 1, "none", zero=3, checkpoint=True), 9, 41.3),
        (Layout(8, 1, 1, "none", zero=3, checkpoint=True), 6, 19.6),
        (Layout(4, 1, 1, "none", zero=3, checkpoint=True), 9, 66.7),
        (Layout(4, 1, 1, "none", zero=3, checkpoint=True), 6, 30.6),
    ],
    ids=lambda x: x.tensor_name + f"-zero{x.zero}" if isinstance(x, Layout) else str(x),
)
def test_a_checkpointed_step_peaks_at_the_first_blocks_backward(
    layout: Layout, k: int, measured: float
) -> None:
    """The first block's backward, the step's last, meets nearly every gradient.

    Its activations are recomputed (as large as every input the step kept), with its working
    memory and the gradients flowing in and out of it; its own gradients appear as its
    backward runs (at its attention's, all but the fused qkv weight's, a quarter of the
    block's). Under ZeRO-3 the second block's backward is larger: FSDP2 prefetches a whole
    block there (the first block's prefetches the stem), the first block still keeps its
    input, and FSDP2 still holds the third block's unsharded gradients, the reduce-scatter's
    input. ``measured``: the peak per rank in MiB of benchmarks/bench_largest_model.py at
    ladder size ``k`` (gloo, fp32, Adam, docs/figures/largest_model.json), which the planner
    missed by 16-24 % while the backward's start and the optimizer step were its only
    moments, and 3D's at size 11 by 11 % while the runtime's own memory was not counted.
    """
    shape = _ladder(k)
    m = estimate_layout(shape, layout, GIB, machine=BENCH).memory
    samples = microbatch_samples(shape, layout)
    own = block_parameters(shape, layout)
    stem = embedding_parameters(shape, layout, tables=2, head=False)
    later = k * own + embedding_parameters(shape, layout) - stem - own  # gradients by then
    done = own - own // 4  # the block's gradients by its attention's backward
    linear, attention = _block_moments(shape, layout, samples)
    if layout.zero >= 3:  # the second block's backward, two blocks gathered
        gathered = 4 * 2 * own + checkpointed_block_bytes(shape, layout, samples, FP32)
        linear, attention = linear + gathered, attention + gathered
        gradients = math.ceil((later - own) / layout.data) + own
    else:
        gradients = later
    assert m.late == 4 * gradients + max(linear, attention + 4 * done)
    assert m.late > max(m.gradients + m.update, m.activations + m.workspace)
    assert m.runtime == BENCH_RUNTIME + k * BENCH_RUNTIME_PER_BLOCK
    assert m.total == m.parameters + m.optimizer + m.runtime + m.late
    assert 0.9 <= m.total / (measured * 2**20) <= 1.1


@pytest.mark.parametrize(
    ("layout", "measured"),
    [
        (Layout(1, 1, 4, "1d"), 108.9),
        (Layout(1, 1, 8, "1d"), 74.4),
        (Layout(1, 1, 4, "2d"), 83.0),
        (Layout(1, 1, 8, "2.5d", depth=2), 44.5),
        (Layout(1, 1, 8, "3d"), 43.1),
        (Layout(4, 1, 1, "none", zero=3), 83.4),
        (Layout(8, 1, 1, "none", zero=3), 44.3),
    ],
    ids=lambda x: x.tensor_name + f"-zero{x.zero}" if isinstance(x, Layout) else str(x),
)
def test_the_last_blocks_attention_runs_after_its_mlp_freed_its_activations(
    layout: Layout, measured: float
) -> None:
    """Where activations dominate, the step peaks in the backward of the head or the last block.

    The head's activations (its fp32 logits) are gone before the last block's backward starts;
    the block's widest linear layer runs first, with every activation of the block, and its
    attention's two score blocks exist only after the MLP and the projection freed their
    inputs. Under ZeRO-3 the block is gathered and the one before it prefetched (gloo's
    all-gather holds it twice while the backward begins), beside the head's gradients, whole
    until their reduce-scatter. ``measured``: the peak per rank in MiB of
    benchmarks/bench_largest_model.py's whole step at hidden 128, depth 4, sequence 256
    (gloo, fp32, Adam), where the planner was 1.02-1.07 of it without the runtime's memory
    while it counted the attention's working memory beside every activation and the head's
    (1.10 with it).
    """
    shape = ModelShape(layers=4, hidden=128, heads=8, seq=256, vocab=1024, batch=16)
    shape = replace(shape, tied_head=False)
    m = estimate_layout(shape, layout, GIB, machine=BENCH).memory
    samples = microbatch_samples(shape, layout)
    block = block_activation_bytes(shape, layout, samples, FP32)
    head = head_activation_bytes(shape, layout, samples, FP32)
    saved = shape.layers * block
    moments = [saved + head + head_workspace_bytes(shape, layout, samples, "gloo")]
    gathered = 0
    if layout.zero >= 3:
        own = block_parameters(shape, layout)
        stem = embedding_parameters(shape, layout, tables=2, head=False)
        pending = 4 * (embedding_parameters(shape, layout) - stem)  # the head's gradients
        incoming = checkpointed_block_bytes(shape, layout, samples, FP32)
        moments.append(saved + incoming + 4 * 3 * own + pending)  # the backward begins
        gathered = 4 * 2 * own + pending
    moments += [saved - block + x + gathered for x in _block_moments(shape, layout, samples)]
    assert m.activations + m.workspace == max(moments)
    whole = saved + head + block_workspace_bytes(shape, layout, samples, FP32)
    assert max(moments) < whole + gathered
    assert m.runtime == BENCH_RUNTIME + shape.layers * BENCH_RUNTIME_PER_BLOCK
    assert 0.95 <= m.total / (measured * 2**20) <= 1.05


def test_the_runtimes_own_memory_counts_once_at_every_moment() -> None:
    """The runtime's memory beyond the tensors raises the peak by itself, at any moment.

    It is there from the first step on (MKL's cached buffers, the heap's small blocks).
    """
    for layout in (Layout(1, 1, 8, "3d", checkpoint=True), Layout(1, 1, 4, "1d")):
        without = rank_memory(_ladder(11), layout, FP32, "gloo")
        with_runtime = rank_memory(_ladder(11), layout, FP32, "gloo", runtime=BENCH_RUNTIME)
        assert with_runtime == replace(without, runtime=BENCH_RUNTIME)
        assert with_runtime.total == without.total + BENCH_RUNTIME
    # a machine that states it: every layout the planner estimates on it counts it
    machine = replace(GLOO, runtime=BENCH_RUNTIME)
    layout = Layout(1, 1, 4, "2d")
    bare = estimate_layout(_ladder(11), layout, GIB, GLOO).memory.total
    assert estimate_layout(_ladder(11), layout, GIB, machine).memory.total == bare + BENCH_RUNTIME
    with pytest.raises(ConfigError, match=r"^runtime must be a number of bytes >= 0"):
        replace(GLOO, runtime=-1)


def test_the_runtimes_memory_grows_with_the_blocks_a_rank_holds() -> None:
    """A base, and more per block: each tensor of a block brings its objects and heap blocks.

    One figure (2 MiB, the median at depth 4) put the planner at 1.22 of ZeRO-3(8)'s measured
    peak at hidden 128, depth 2, where the runtime held 1 MiB.
    """
    layout = Layout(1, 1, 4, "2d")
    per_block = replace(GLOO, runtime_per_block=BENCH_RUNTIME_PER_BLOCK)
    for depth in (1, 2, 4, 8):
        shape = replace(_ladder(4), layers=depth)
        bare = estimate_layout(shape, layout, GIB, GLOO).memory
        for machine, runtime in [
            (per_block, depth * BENCH_RUNTIME_PER_BLOCK),
            (BENCH, BENCH_RUNTIME + depth * BENCH_RUNTIME_PER_BLOCK),
        ]:
            counted = estimate_layout(shape, layout, GIB, machine).memory
            assert counted == replace(bare, runtime=runtime)
            assert counted.total == bare.total + runtime
    # the old spelling, a constant alone, still means one figure at every depth
    machine = Machine(flops=1e12, bandwidth=1e10, latency=1e-5, runtime=2**20)
    assert machine.runtime_per_block == 0
    for depth in (1, 8):
        memory = estimate_layout(replace(_ladder(4), layers=depth), layout, GIB, machine).memory
        assert memory.runtime == 2**20
    for wrong in (-1, 1.5, True):
        with pytest.raises(ConfigError, match=r"^runtime_per_block must be a number of bytes >= 0"):
            replace(GLOO, runtime_per_block=wrong)


def test_over_budget_layouts_come_last_with_the_reason() -> None:
    found = plan_layouts(SHAPE, 8, 200 * 2**20)
    fitting = [e for e in found if e.fits]
    assert fitting and len(fitting) < len(found)
    assert all(e.memory.total <= 200 * 2**20 for e in fitting)
    assert found[: len(fitting)] == fitting
    times = [e.step_seconds for e in fitting]
    assert times == sorted(times)
    over = [e for e in found if not e.fits and e.problems[0].startswith("needs")]
    assert over and all(e.memory.total > 200 * 2**20 for e in over)
    assert "> 200.0 MiB per rank (parameters" in over[0].problems[0]


# ------------------------------------------------------------------ the machine model


def test_step_time_is_monotone_in_the_machine() -> None:
    base = Machine(flops=1e12, bandwidth=1e10, latency=1e-5)
    faster = {
        "flops": Machine(flops=2e12, bandwidth=1e10, latency=1e-5),
        "bandwidth": Machine(flops=1e12, bandwidth=2e10, latency=1e-5),
        "latency": Machine(flops=1e12, bandwidth=1e10, latency=1e-6),
    }
    layouts = [x for x in enumerate_layouts(SHAPE, 8) if not layout_problems(SHAPE, x)]
    for layout in layouts:
        slow = estimate_layout(SHAPE, layout, GIB, base).step_seconds
        for better in faster.values():
            assert estimate_layout(SHAPE, layout, GIB, better).step_seconds <= slow


def test_ranking_follows_the_expensive_resource() -> None:
    """Free communication ranks by compute; costly latency ranks by collective rounds."""
    layouts = [x for x in enumerate_layouts(SHAPE, 4) if not layout_problems(SHAPE, x)]
    compute_bound = Machine(flops=1e12, bandwidth=1e30, latency=0.0)
    latency_bound = Machine(flops=1e30, bandwidth=1e30, latency=1.0)
    by_compute = [estimate_layout(SHAPE, x, GIB, compute_bound) for x in layouts]
    fastest = min(by_compute, key=lambda e: e.step_seconds)
    assert fastest.layout.pipeline == 1 and not fastest.layout.checkpoint
    for layout in layouts:
        e = estimate_layout(SHAPE, layout, GIB, latency_bound)
        (stage, *_) = stage_steps(SHAPE, layout, precision_for("fp32", layout.zero))
        rounds = [c.calls * math.ceil(math.log2(c.group)) for c in stage.per_microbatch]
        once = [c.calls * math.ceil(math.log2(c.group)) for c in stage.per_step]
        if layout.pipeline == 1:  # ceil(log2 n) rounds of latency per call among n ranks
            assert e.step_seconds == pytest.approx(sum(rounds) + sum(once))
        elif layout.data == 1:  # the bubble: m + p - 1 microbatch slots
            slots = e.microbatches + layout.pipeline - 1
            assert e.step_seconds >= slots * sum(rounds)


def test_calibration_measures_positive_numbers() -> None:
    machine = calibrate(seconds=0.05)
    assert machine.flops > 1e6 and machine.bandwidth > 1e5 and 0 < machine.latency < 1
    assert machine.backend == "gloo"


def test_calibration_runs_the_ranks_of_a_job_at_once() -> None:
    """Three ranks multiply and all-reduce together (2 latency rounds each call)."""
    machine = calibrate(seconds=0.05, ranks=3)
    assert machine.flops > 1e6 and machine.bandwidth > 1e5 and 0 < machine.latency < 1
    alone = calibrate(collectives=False, seconds=0.05, ranks=1)
    assert alone.backend == "nccl" and alone.latency == DEFAULT_MACHINE.latency
    for bad in (1, 0, True, 2.0):
        with pytest.raises(ConfigError, match=r"^ranks must be an integer >= 2"):
            calibrate(ranks=bad)  # type: ignore[arg-type]


# ------------------------------------------------------------------ paper claim (docs)


def test_2d_fits_the_papers_models_where_1d_and_data_parallelism_do_not() -> None:
    """Xu et al. 2021: ~3B parameters on 4 x 16 GB and ~12B on 16 at batch 16, no ZeRO.

    The same shapes as docs/choosing-a-layout.md; tensor parallelism alone (no pipeline).
    """
    cases = [  # (shape, ranks, whether 1D fits too)
        (ModelShape(layers=36, hidden=2560, heads=32, seq=1024, vocab=50304, batch=16), 4, True),
        (ModelShape(layers=60, hidden=4096, heads=32, seq=1024, vocab=50304, batch=16), 16, False),
    ]
    for shape, world, one_d in cases:
        found = plan_layouts(shape, world, 16 * GIB, dtype="fp16", pipeline=1)
        fits = {e.layout.tensor_name for e in found if e.fits and e.layout.zero == 0}
        assert f"2d({world})" in fits and "none" not in fits
        assert (f"1d({world})" in fits) == one_d
    # at sequence 2048 the head's working memory (three fp32 logits blocks) tips 2D over
    longer = replace(cases[0][0], seq=2048)
    two_d = estimate_layout(longer, Layout(1, 1, 4, "2d", checkpoint=True), 16 * GIB, dtype="fp16")
    assert not two_d.fits and two_d.memory.total - two_d.memory.workspace < 16 * GIB


# ------------------------------------------------------------------ the command line

ARGS = ["--layers", "8", "--hidden", "512", "--heads", "8", "--seq", "128", "--vocab", "4096"]
ARGS += ["--batch", "32", "--flops", "1e12", "--bandwidth", "1e10", "--latency", "1e-5"]


def _run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = context_main(argv)
        except SystemExit as exit_:
            code = int(exit_.code or 0)
    return code, out.getvalue(), err.getvalue()


def test_cli_prints_the_fitting_layouts_fastest_first() -> None:
    code, out, _ = _run(["plan", *ARGS, "--world", "4", "--memory", "200MiB", "--top", "5"])
    assert code == 0
    lines = out.splitlines()
    assert lines[0].startswith("model: 8 layers, hidden 512, heads 8, seq 128, vocab 4096")
    assert lines[1] == "job: 4 ranks, 200.0 MiB each"
    assert lines[2] == "machine (given): 1e+12 flop/s, 1e+10 B/s, 1e-05 s per collective, nccl"
    fit, total = (int(w) for w in lines[3].split()[0:3:2])
    assert lines[3] == f"{fit} of {total} layouts fit; the fastest 5:"
    header = lines[4].split()
    assert header[:4] == ["#", "data", "pipe", "tensor"] and header[-1] == "step"
    rows = [line.split() for line in lines[6:11]]
    assert [int(r[0]) for r in rows] == [1, 2, 3, 4, 5]
    expected = plan_layouts(
        ModelShape(layers=8, hidden=512, heads=8, seq=128, vocab=4096, batch=32),
        4,
        200 * 2**20,
        Machine(flops=1e12, bandwidth=1e10, latency=1e-5),
    )[:5]
    assert [(int(r[1]), int(r[2]), r[3]) for r in rows] == [
        (e.layout.data, e.layout.pipeline, e.layout.tensor_name) for e in expected
    ]
    assert lines[-1] == f"({total - fit} layouts that do not fit are listed with --all.)"


def test_cli_backend_sets_how_mesh_blocks_travel() -> None:
    argv = ["plan", *ARGS, "--world", "4", "--memory", "1GiB", "--mode", "2d", "--top", "1"]
    runs = {backend: _run([*argv, "--backend", backend])[1] for backend in ("nccl", "gloo")}
    assert runs["gloo"].splitlines()[2].endswith(" s per collective, gloo")
    shape = ModelShape(layers=8, hidden=512, heads=8, seq=128, vocab=4096, batch=32)
    machine = Machine(flops=1e12, bandwidth=1e10, latency=1e-5)
    for backend, out in runs.items():  # the same calls, fewer bytes contributed pairwise
        best = plan_layouts(shape, 4, GIB, replace(machine, backend=backend), mode="2d")[0]
        row = out.splitlines()[6].split()
        assert row[-5:-2] == [*format_bytes(best.comm_bytes).split(), str(best.collectives)]
    assert runs["nccl"].splitlines()[6] != runs["gloo"].splitlines()[6]
    with pytest.raises(ConfigError, match=r"^backend 'mpi' is not one of nccl, gloo$"):
        replace(machine, backend="mpi")


def test_cli_all_lists_what_does_not_fit_and_why() -> None:
    code, out, _ = _run(["plan", *ARGS, "--world", "4", "--memory", "100MiB", "--all"])
    assert code == 0
    assert "layouts do not fit (smallest first):" in out
    assert "why not" in out and "> 100.0 MiB per rank" in out
    code, out, _ = _run(["plan", *ARGS, "--world", "4", "--memory", "1MiB"])
    assert "No layout fits. The closest:" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--world", "12", "--tensor", "8"],
            "--world 12 is not data x pipeline x tensor for any layout with tensor 8: 12 % 8 = 4",
        ),
        (["--world", "4", "--memory", "16XB"], "--memory '16XB' is not an amount of bytes"),
        (["--world", "0"], "--world must be a positive int, got 0"),
        (["--world", "6", "--mode", "3d"], "--world 6 has no tensor size for mode 3d"),
    ],
)
def test_cli_errors_name_the_flag(argv: list[str], message: str) -> None:
    full = ["plan", *ARGS, "--memory", "1GiB", *argv]
    code, _, err = _run(full)
    assert code == 2
    assert message in err


def test_cli_heads_error_names_the_flag() -> None:
    argv = [a if a != "8" else "7" for a in ARGS[:6]] + ARGS[6:]  # heads 7 (and layers 7)
    code, _, err = _run(["plan", *argv, "--world", "4", "--memory", "1GiB"])
    assert code == 2 and "--hidden 512 is not divisible by heads 7 (512 % 7 = 1)" in err


def test_unknown_command_prints_the_commands() -> None:
    code, _, err = _run(["nope"])
    assert code == 2 and "unknown command 'nope'" in err and "plan" in err


def test_3d_keeping_gathered_operands_trades_memory_for_calls() -> None:
    """Listed beside every 3d layout; saves more, sends less and calls fewer collectives."""
    found = plan_layouts(SHAPE, 8, GIB, DEFAULT_MACHINE, mode="3d", pipeline=1)
    kept = {replace(e.layout, keep_gathered=False): e for e in found if e.layout.keep_gathered}
    plain = {e.layout: e for e in found if not e.layout.keep_gathered}
    assert kept.keys() == plain.keys() and kept
    for layout, k in kept.items():
        p = plain[layout]
        assert k.layout.tensor_name == "3d(8)+kept"
        assert k.memory.activations > p.memory.activations
        assert k.memory.parameters == p.memory.parameters
        assert k.comm_bytes < p.comm_bytes and k.collectives < p.collectives
    assert layout_problems(SHAPE, Layout(2, 1, 4, "2d", keep_gathered=True)) == [
        "keep_gathered with 2d(4): only 3d's Linear3D keeps its gathered operands"
    ]


# ------------------------------------------------------------------ models read from a config

#: config.json fields as transformers writes them (the keys the planner reads, and a few more).
GPT2_SMALL = {
    "model_type": "gpt2",
    "n_layer": 12,
    "n_embd": 768,
    "n_head": 12,
    "n_positions": 1024,
    "n_inner": None,
    "vocab_size": 50257,
    "layer_norm_epsilon": 1e-5,
}
LLAMA2_7B = {
    "model_type": "llama",
    "num_hidden_layers": 32,
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "intermediate_size": 11008,
    "vocab_size": 32000,
    "tie_word_embeddings": False,
    "max_position_embeddings": 4096,
    "attention_bias": False,
    "mlp_bias": False,
    "rms_norm_eps": 1e-5,
}
MISTRAL_7B = {
    **LLAMA2_7B,
    "model_type": "mistral",
    "num_key_value_heads": 8,
    "intermediate_size": 14336,
    "max_position_embeddings": 32768,
}


@pytest.mark.parametrize(
    ("config", "published"),
    [(GPT2_SMALL, 124_439_808), (LLAMA2_7B, 6_738_415_616), (MISTRAL_7B, 7_241_732_096)],
)
def test_a_config_gives_the_models_published_parameter_count(
    config: dict[str, object], published: int
) -> None:
    shape = ModelShape.from_config(config, seq=1024, batch=8)
    assert shape.parameters == published
    llama = config is not GPT2_SMALL
    assert (shape.gated_mlp, shape.norm == "rmsnorm", shape.positions == "rotary") == (llama,) * 3
    assert shape.tied_head == (not llama) and shape.fused_qkv == (not llama)


#: Pythia-160m's config.json (EleutherAI), the keys the planner reads and a few more.
PYTHIA_160M = {
    "model_type": "gpt_neox",
    "num_hidden_layers": 12,
    "hidden_size": 768,
    "num_attention_heads": 12,
    "intermediate_size": 3072,
    "vocab_size": 50304,
    "max_position_embeddings": 2048,
    "rotary_pct": 0.25,
    "use_parallel_residual": True,
    "tie_word_embeddings": False,
}


def test_gpt_neox_is_gpt2s_block_with_rotary_positions_and_an_untied_head() -> None:
    """Pythia-160m: 162,322,944 parameters as published; without attention biases (a
    config's ``attention_bias=False``) the MLP keeps its own."""
    shape = ModelShape.from_config(PYTHIA_160M, seq=2048, batch=8)
    assert shape.parameters == 162_322_944
    assert (shape.positions, shape.tied_head, shape.fused_qkv, shape.biases) == (
        "rotary",
        False,
        True,
        True,
    )
    assert (shape.norm, shape.gated_mlp) == ("layernorm", False)
    unbiased = ModelShape.from_config({**PYTHIA_160M, "attention_bias": False}, seq=8, batch=8)
    assert unbiased.biases == ("fc1", "fc2")
    assert shape.parameters - unbiased.parameters == 12 * (3 * 768 + 768)


def test_tied_heads_follow_each_familys_default() -> None:
    """transformers ties GPT-2's head and not Llama's when the config does not say."""
    llama = {k: v for k, v in LLAMA2_7B.items() if k != "tie_word_embeddings"}
    assert not ModelShape.from_config(llama, seq=8, batch=8).tied_head
    assert ModelShape.from_config({**llama, "tie_word_embeddings": True}, seq=8, batch=8).tied_head
    assert ModelShape.from_config(GPT2_SMALL, seq=8, batch=8).tied_head


@pytest.mark.parametrize(
    ("keys", "biases", "header"),
    [
        (dict(model_type="qwen2"), ("q", "k", "v"), "biases on q, k, v"),
        (dict(attention_bias=True), ("q", "k", "v", "proj"), "biases on q, k, v, proj"),
        (dict(mlp_bias=True), ("gate", "up", "fc2"), "biases on gate, up, fc2"),
        (dict(attention_bias=True, mlp_bias=True), True, ""),
        ({}, False, "no biases"),
    ],
)
def test_llama_family_biases_are_counted_where_the_config_puts_them(
    keys: dict[str, object], biases: bool | tuple[str, ...], header: str
) -> None:
    shape = ModelShape.from_config({**LLAMA2_7B, **keys}, seq=8, batch=8)
    assert shape.biases == biases
    h, f = 4096, 11008
    widths = dict(q=h, k=h, v=h, proj=h, gate=f, up=f, fc2=h)
    named = widths if biases is True else {n: widths[n] for n in biases or ()}
    assert shape.parameters - 6_738_415_616 == 32 * sum(named.values())
    line = format_header(shape, 8, 2**30, Machine(1e12, 1e10, 1e-5), "fp32", "given")
    assert (header in line.splitlines()[0]) if header else "biases" not in line
    with pytest.raises(ConfigError, match=r"^biases must be one of qkv, q, k, v, proj, .* 'o'"):
        replace(shape, biases=("q", "o"))
    with pytest.raises(ConfigError, match=r"^biases must be True, False or a tuple .* 'qkv'"):
        replace(shape, biases="qkv")  # type: ignore[arg-type]


def test_repeated_key_value_heads_sum_their_gradients_over_tensor() -> None:
    """k and v whole on every rank: their gradient parts summed over TENSOR (once per step
    under the engine), none when the heads split."""
    shape = ModelShape.from_config(MISTRAL_7B, seq=128, batch=16)
    sums = [
        c
        for c in block_collectives(shape, Layout(1, 1, 16, "1d"), 16, FP32)
        if c.sum_over == "tensor"
    ]
    assert [(c.kind, c.group, c.nbytes) for c in sums] == [("all_reduce", 16, 4 * 4096 * 1024)] * 2
    assert not [c for c in block_collectives(shape, Layout(1, 1, 8, "1d"), 16, FP32) if c.sum_over]


def test_grouped_query_attention_per_rank() -> None:
    """Mistral's 8 key/value heads: split over 1d(8) like the query heads; over 1d(16) each
    repeated on two ranks, k and v then whole on every rank (tessera's RepeatedHeads)."""
    shape = ModelShape.from_config(MISTRAL_7B, seq=1024, batch=16)
    h, d, f = 4096, 128, 14336
    kv = 8 * d
    # 1d(8): q, k, v, gate, up by output features, o and down by input; RMSNorms whole
    assert block_parameters(shape, Layout(1, 1, 8, "1d")) == (
        (h * h + 2 * h * kv + h * h + 3 * h * f) // 8 + 2 * h
    )
    assert block_parameters(shape, Layout(1, 1, 16, "1d")) == (
        (h * h + h * h + 3 * h * f) // 16 + 2 * h * kv + 2 * h
    )
    # on a 4x4 mesh every weight in blocks, the norms split over the row
    assert block_parameters(shape, Layout(1, 1, 16, "2d")) == (
        (h * h + 2 * h * kv + h * h + 3 * h * f) // 16 + 2 * h // 4
    )
    # the gated MLP saves four [T, F] tensors, GeLU's two; k and v are 1/4 of q here
    fp16 = precision_for("fp16", 0)
    one = block_activation_bytes(shape, Layout(1, 1, 1, "none"), 1, fp16)
    tokens, scores = 1024, 32 * 1024 * 1024
    assert one == 2 * (tokens * (4 * h + (h + 2 * kv) + h + 4 * f) + scores) + 4 * 2 * tokens


@pytest.mark.parametrize(
    ("fields", "layout", "message"),
    [
        (
            dict(heads=12, kv_heads=3),
            Layout(1, 1, 2, "1d"),
            "kv_heads 3 % 2 = 1",
        ),
        (
            dict(heads=12, kv_heads=3),
            Layout(1, 1, 4, "1d"),
            "kv_heads 3 do not divide 4 (4 % 3 = 1)",
        ),
        (
            dict(heads=8, kv_heads=1, hidden=8 * 3),
            Layout(1, 1, 8, "3d"),
            "head_dim 3 % 2 = 1: 3d(8) repeats kv_heads 1 < 2",
        ),
    ],
)
def test_key_value_heads_tessera_cannot_split_are_named(
    fields: dict[str, int], layout: Layout, message: str
) -> None:
    shape = ModelShape(**{**dict(layers=2, hidden=96, seq=8, vocab=0, batch=8), **fields})
    assert any(message in problem for problem in layout_problems(shape, layout))
    assert any(
        message in problem for problem in layout_problems(replace(shape, fused_qkv=False), layout)
    )


@pytest.mark.parametrize("biases", [False, True])
def test_repeats_fused_with_the_query_heads_hold_the_whole_weight(biases: bool) -> None:
    # tessera's RepeatedHeads of a fused q/k/v (GPTBigCode, multi-query Falcon, Phi-3 with
    # few key/value heads) holds the whole weight, its query rows too; separate projections
    # keep q split: the difference is the query rows a split would not hold.
    h, d, p = 96, 12, 4
    fused = ModelShape(layers=2, hidden=h, heads=8, kv_heads=2, seq=8, vocab=0, batch=8)
    fused = replace(fused, biases=biases)
    layout = Layout(1, 1, p, "1d")
    assert layout_problems(fused, layout) == []
    (qkv,) = [x for x in fused.block_linears(p) if x.name == "qkv"]
    assert (qkv.n_out, qkv.repeated, qkv.held) == (h + 2 * d * p, True, h * (h + 2 * d * 2))
    separate = replace(fused, fused_qkv=False)
    query_rows = h * h - h * h // p + (h - h // p if biases else 0)
    assert block_parameters(fused, layout) - block_parameters(separate, layout) == query_rows


def test_bad_configs_name_the_key() -> None:
    with pytest.raises(ConfigError, match=r"^config has none of hidden_size, n_embd"):
        ModelShape.from_config({"model_type": "gpt2", "n_layer": 2}, seq=8, batch=8)
    # blocks the planner would count wrong: experts, other layouts, heads of another size
    for kind in ("mixtral", "gpt_bigcode", None):
        with pytest.raises(ConfigError, match=rf"^config model_type {kind!r} is not one"):
            ModelShape.from_config({**LLAMA2_7B, "model_type": kind}, seq=8, batch=8)
    with pytest.raises(ConfigError, match=r"^config head_dim 64 is not .* \(4096 / 32 = 128\)"):
        ModelShape.from_config({**LLAMA2_7B, "head_dim": 64}, seq=8, batch=8)
    with pytest.raises(ConfigError, match=r"^kv_heads 5 does not divide heads 32"):
        ModelShape.from_config({**LLAMA2_7B, "num_key_value_heads": 5}, seq=8, batch=8)
    with pytest.raises(ConfigError, match=r"^norm must be one of layernorm, rmsnorm"):
        ModelShape(layers=1, hidden=8, heads=2, seq=4, vocab=0, batch=2, norm="batchnorm")  # type: ignore[arg-type]


def test_cli_reads_a_transformers_config(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(MISTRAL_7B))
    argv = ["plan", "--config", str(path), "--seq", "4096", "--batch", "16", "--world", "16"]
    code, out, _ = _run([*argv, "--memory", "80GiB", "--dtype", "bf16", "--top", "3"])
    assert code == 0
    assert out.splitlines()[0] == (
        "model: 32 layers, hidden 4096, heads 32, seq 4096, vocab 32000, batch 16, ffn 14336, "
        "8 key/value heads, gated MLP, RMSNorm, rotary, no biases, untied head "
        "(7.24 B parameters), bf16, Adam"
    )
    code, out, _ = _run([*argv, "--layers", "2", "--memory", "80GiB"])  # a flag overrides
    assert code == 0 and out.startswith("model: 2 layers, hidden 4096")
    code, _, err = _run(["plan", "--seq", "8", "--batch", "8", "--world", "2", "--memory", "1GiB"])
    assert code == 2 and "error: --layers, --hidden, --heads, --vocab missing: give them" in err
    code, _, err = _run([*argv, "--ffn-multiple", "3", "--memory", "1GiB"])
    assert code == 2 and "--ffn-multiple with --config: the config gives the MLP's width" in err
    path.write_text(json.dumps({**MISTRAL_7B, "num_key_value_heads": 5}))
    code, _, err = _run([*argv, "--memory", "1GiB"])  # the config's key, no flag of that name
    assert code == 2 and "error: kv_heads 5 does not divide heads 32" in err
    path.write_text("[1, 2]")
    code, _, err = _run([*argv, "--memory", "1GiB"])
    assert code == 2 and f"--config {path} holds no JSON object" in err


# ------------------------------------------------------------------ torch-free arithmetic


def test_planner_modules_import_torch_only_inside_functions() -> None:
    import tessera.context.planner as planner

    folder = pathlib.Path(planner.__file__).parent
    for path in sorted(folder.glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in tree.body:  # module level only; calibrate() imports torch lazily
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            assert not any(n == "torch" or n.startswith("torch.") for n in names), path.name
