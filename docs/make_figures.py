"""Draws the user guide's figures into docs/figures/ (commit the PNGs).

    python docs/make_figures.py            # every figure
    python docs/make_figures.py --out DIR  # somewhere else

The largest-model figure plots what ``benchmarks/bench_largest_model.py --search --json
docs/figures/largest_model.json`` measured, beside the planner's curve for the same ladder on
the machine the run recorded (its backend and the runtime's own memory it counted).

Rank layouts are read from ``tessera.context.rank_groups`` (the same pure arithmetic the
launchers use), so a picture cannot disagree with the code; pipeline timelines come from
``tessera.pipeline.simulate`` and ``plot_timeline``.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
from collections.abc import Callable, Sequence
from dataclasses import replace

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.patches import FancyArrowPatch, Rectangle

from tessera.context import ParallelConfig, ParallelMode, rank_groups
from tessera.context.planner import (
    DEFAULT_MACHINE,
    Layout,
    Machine,
    ModelShape,
    estimate_layout,
    layout_problems,
)
from tessera.pipeline import (
    GPipeSchedule,
    InterleavedPipelineSchedule,
    PipelineSchedule,
    ZeroBubbleSchedule,
    plot_timeline,
    simulate,
)

HERE = pathlib.Path(__file__).resolve().parent
COLORS = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7")


def groups_of(parallel: dict[str, object], world: int, mode: ParallelMode) -> list[tuple[int, ...]]:
    """The rank groups of ``mode`` for a ``parallel`` block on ``world`` ranks."""
    return list(rank_groups(ParallelConfig.from_dict(parallel, world))[mode])


def group_index(groups: Sequence[tuple[int, ...]]) -> dict[int, tuple[int, int]]:
    """Rank -> (which group, local rank in it)."""
    return {r: (g, i) for g, group in enumerate(groups) for i, r in enumerate(group)}


def box(ax: Axes, x: float, y: float, w: float, h: float, color: str, text: str) -> None:
    """A labelled rectangle."""
    ax.add_patch(Rectangle((x, y), w, h, facecolor=color, edgecolor="black", alpha=0.85))
    ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=8, color="black")


def finish(fig: plt.Figure, ax: Axes, path: pathlib.Path, title: str) -> None:
    """Title, hide the axes, save."""
    fig.suptitle(title, fontsize=10)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.autoscale_view()
    fig.tight_layout(rect=(0, 0, 1, 0.9))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def light(i: int) -> str:
    """Colour ``i`` of the palette, translucent."""
    return COLORS[i % len(COLORS)] + "99"


def draw_data(out: pathlib.Path) -> None:
    """4 replicas: every rank the whole model, a quarter of the batch."""
    groups = groups_of({}, 4, ParallelMode.DATA)
    fig, ax = plt.subplots(figsize=(7, 2.4))
    for local, rank in enumerate(groups[0]):
        box(ax, local * 1.6, 1.0, 1.4, 1.0, light(0), f"rank {rank}\nfull model W")
        box(
            ax,
            local * 1.6,
            0.0,
            1.4,
            0.8,
            light(local + 1),
            f"batch rows\n[{local}b/4, {local + 1}b/4)",
        )
    ax.text(3.1, 2.25, "DATA group (0, 1, 2, 3): gradients averaged by all-reduce", ha="center")
    finish(fig, ax, out / "layout-data.png", "data parallel, 4 ranks")


def draw_1d(out: pathlib.Path) -> None:
    """Megatron-LM: fc1 split by output columns, fc2 by input rows."""
    groups = groups_of({"tensor": {"size": 4, "mode": "1d"}}, 4, ParallelMode.PARALLEL_1D)
    fig, ax = plt.subplots(figsize=(8, 4.2))
    for t, rank in enumerate(groups[0]):
        box(ax, 0.0, 3 - t * 0.9, 3.6, 0.8, light(t), f"fc1 rows block {t}: rank {rank}")
        box(ax, 4.4 + t * 1.1, 0.3, 1.0, 3.5, light(t), f"fc2\ncols\nblock {t}\n\nrank\n{rank}")
    ax.text(1.8, 4.0, "Linear(h, 4h, parallel='col')\nweight [4h, h]: split dim 0", ha="center")
    ax.text(6.55, 4.0, "Linear(4h, h, parallel='row')\nweight [h, 4h]: split dim 1", ha="center")
    finish(
        fig,
        ax,
        out / "layout-1d.png",
        "1D tensor parallel, tensor size 4 (PARALLEL_1D = (0, 1, 2, 3))",
    )


def draw_2d(out: pathlib.Path) -> None:
    """Q x q mesh; the Linear weight block each rank holds."""
    q = 3
    parallel = {"tensor": {"size": q * q, "mode": "2d"}}
    rows = group_index(groups_of(parallel, q * q, ParallelMode.PARALLEL_2D_ROW))
    cols = group_index(groups_of(parallel, q * q, ParallelMode.PARALLEL_2D_COL))
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4.4))
    for rank in range(q * q):
        i, j = cols[rank][1], rows[rank][1]  # row = local rank in COL, col = in ROW
        # rank (i, j) holds W[out block j, in block i]: dim 0 over ROW, dim 1 over COL
        box(left, j, q - 1 - i, 0.95, 0.95, light(i), f"rank {rank}\n(row {i}, col {j})")
        box(right, i, q - 1 - j, 0.95, 0.95, light(i), f"rank {rank}\nW[out_{j}, in_{i}]")
    left.set_title("2D mesh, tensor size 9 (q = 3): t = row * q + col", fontsize=10)
    right.set_title("Linear weight [out, in]: rank (i, j) holds [out/q, in/q]", fontsize=10)
    for ax in (left, right):
        ax.set_aspect("equal")
        ax.axis("off")
        ax.autoscale_view()
    right.text(-0.2, q / 2, "out", rotation=90, va="center")
    right.text(q / 2, -0.2, "in", ha="center")
    fig.tight_layout()
    fig.savefig(out / "layout-2d.png", dpi=110)
    plt.close(fig)


def draw_2p5d(out: pathlib.Path) -> None:
    """Depth stacked q x q meshes; each holds the same weight blocks, another batch block."""
    q, depth = 2, 2
    parallel = {"tensor": {"size": q * q * depth, "mode": "2.5d", "depth": depth}}
    world = q * q * depth
    rows = group_index(groups_of(parallel, world, ParallelMode.PARALLEL_2P5D_ROW))
    cols = group_index(groups_of(parallel, world, ParallelMode.PARALLEL_2P5D_COL))
    deps = group_index(groups_of(parallel, world, ParallelMode.PARALLEL_2P5D_DEP))
    fig, ax = plt.subplots(figsize=(9, 3.6))
    for rank in range(world):
        i, j, k = cols[rank][1], rows[rank][1], deps[rank][1]
        x, y = k * (q + 0.8) + j, q - 1 - i
        box(
            ax,
            x,
            y,
            0.95,
            0.95,
            light(k),
            f"rank {rank}\n({i},{j},{k})\nW[out_{j}, in_{i}]\nbatch {k * q + i}",
        )
    for k in range(depth):
        ax.text(k * (q + 0.8) + q / 2, q + 0.15, f"depth layer k = {k}", ha="center")
    finish(
        fig,
        ax,
        out / "layout-2p5d.png",
        "2.5D, tensor size 8 = q*q*depth (q = 2, depth 2): rank (row i, col j, depth k)",
    )


def draw_3d(out: pathlib.Path) -> None:
    """q^3 cube drawn as q layers of the output axis z."""
    q = 2
    parallel = {"tensor": {"size": q**3, "mode": "3d"}}
    world = q**3
    wx = group_index(groups_of(parallel, world, ParallelMode.PARALLEL_3D_WEIGHT))
    iy = group_index(groups_of(parallel, world, ParallelMode.PARALLEL_3D_INPUT))
    oz = group_index(groups_of(parallel, world, ParallelMode.PARALLEL_3D_OUTPUT))
    fig, ax = plt.subplots(figsize=(9, 3.8))
    for rank in range(world):
        x, y, z = wx[rank][1], iy[rank][1], oz[rank][1]
        text = (
            f"rank {rank}\n(x{x}, y{y}, z{z})\nW[out_{z * q + x}, in_{y}]\nX[b_{z * q + x}, h_{y}]"
        )
        box(ax, z * (q + 0.8) + x * 1.05, (q - 1 - y) * 1.05, 1.0, 1.0, light(z), text)
    for z in range(q):
        ax.text(z * (q + 0.8) + q / 2, q * 1.05 + 0.15, f"output axis z = {z}", ha="center")
    finish(
        fig,
        ax,
        out / "layout-3d.png",
        "3D cube, tensor size 8 (q = 2): x weight, y input, z output axis",
    )


def draw_sequence(out: pathlib.Path) -> None:
    """Each rank a chunk of the tokens; keys and values travel around the ring."""
    groups = groups_of({"tensor": {"size": 4, "mode": "sequence"}}, 4, ParallelMode.SEQUENCE)
    fig, ax = plt.subplots(figsize=(8, 2.6))
    for r, rank in enumerate(groups[0]):
        box(
            ax,
            r * 1.8,
            0.0,
            1.6,
            1.2,
            light(r),
            f"rank {rank}\ntokens\n[{r}s/4, {r + 1}s/4)\nall weights",
        )
        nxt = (r + 1) % 4
        ax.add_patch(
            FancyArrowPatch(
                (r * 1.8 + 1.2, 1.25),
                (nxt * 1.8 + 0.4, 1.25),
                connectionstyle="arc3,rad=-0.35" if nxt else "arc3,rad=0.2",
                arrowstyle="->",
                mutation_scale=10,
            )
        )
    ax.text(
        3.5,
        -0.35,
        "ring self-attention: key / value chunks pass around the ring (N - 1 hops)",
        ha="center",
    )
    finish(
        fig,
        ax,
        out / "layout-sequence.png",
        "sequence parallel, tensor size 4 (SEQUENCE = (0, 1, 2, 3))",
    )


def draw_pipeline(out: pathlib.Path) -> None:
    """Data 2 x pipeline 2 x tensor 2: the global rank formula."""
    parallel = {"data": 2, "pipeline": 2, "tensor": {"size": 2, "mode": "1d"}}
    data = group_index(groups_of(parallel, 8, ParallelMode.DATA))
    pipe = group_index(groups_of(parallel, 8, ParallelMode.PIPELINE))
    tens = group_index(groups_of(parallel, 8, ParallelMode.TENSOR))
    fig, ax = plt.subplots(figsize=(9, 3.4))
    for rank in range(8):
        d, p, t = data[rank][1], pipe[rank][1], tens[rank][1]
        x, y = d * 4.6 + p * 2.2, 1 - t
        box(ax, x, y * 1.1, 2.0, 1.0, light(p), f"rank {rank}\ndata {d}, stage {p}, tensor {t}")
    for d in range(2):
        ax.text(d * 4.6 + 2.1, 2.3, f"replica (data rank) {d}: stage 0 -> stage 1", ha="center")
    finish(
        fig,
        ax,
        out / "layout-pipeline.png",
        "data 2 x pipeline 2 x tensor 2: rank = data*4 + stage*2 + tensor",
    )


def draw_schedules(out: pathlib.Path) -> None:
    """Simulated timelines, p = 4 ranks, m = 8 microbatches."""
    p, m = 4, 8
    runs: list[tuple[str, object, dict[str, float] | None]] = [
        ("schedule-gpipe.png", GPipeSchedule(m), None),
        ("schedule-1f1b.png", PipelineSchedule(m), None),
        ("schedule-interleaved.png", InterleavedPipelineSchedule(m, 2), None),
        ("schedule-zb-h1.png", ZeroBubbleSchedule(m), {"F": 1, "B": 1, "W": 1}),
    ]
    for name, schedule, costs in runs:
        result = simulate(schedule, num_stages=p, costs=costs)  # type: ignore[arg-type]
        title = (
            f"{type(schedule).__name__}, p={p}, m={m}: bubble {result.bubble_fraction:.2f}, "
            f"peak activations {max(result.peak_activations):g}"
        )
        plot_timeline(result, out / name, title=title)


#: The paper's Figure 3 points under 2D (Bian et al. 2021 / Xu et al. 2021): parameters on
#: ranks of 16 GB, at batch 16 without ZeRO or offload.
PAPER_2D = ((4, 3e9), (16, 12e9))
PAPER_MEMORY = 16 * 2**30


def recorded_machine(found: dict[str, object]) -> Machine:
    """The planner's machine a run of the benchmark used: its backend and runtime memory.

    The runtime's own memory is a base (``runtime``) and a term per block
    (``runtime_per_block``; a run that recorded only ``runtime`` counted one figure). Without
    them the planner's curve would not be the one the run's ``planned`` figures follow.
    """
    runtime, per_block = found.get("runtime", 0), found.get("runtime_per_block", 0)
    backend = found["backend"]
    assert isinstance(runtime, int) and isinstance(per_block, int) and isinstance(backend, str)
    return replace(DEFAULT_MACHINE, backend=backend, runtime=runtime, runtime_per_block=per_block)


def planner_largest(ladder: dict[str, int], layout: Layout, budget: int, machine: Machine) -> int:
    """Parameters of the largest ladder step the planner says fits ``budget`` (0: none)."""
    best = 0
    for k in range(1, 129):
        shape = ModelShape(
            layers=ladder["depth"] * k,
            hidden=ladder["hidden"] * k,
            heads=ladder["heads"],
            seq=ladder["seq"],
            vocab=ladder["vocab"],
            batch=ladder["batch"],
            tied_head=False,
        )
        if layout_problems(shape, layout):
            continue  # does not divide at this size; a larger one may
        if estimate_layout(shape, layout, budget, machine=machine).memory.total > budget:
            break
        best = shape.parameters
    return best


#: Each mode's layout on ``w`` ranks (``None`` where it has none), for the planner's curves.
CURVES: dict[str, tuple[str, Callable[[int], Layout | None]]] = {
    "1D": ("1d", lambda w: Layout(1, 1, w, "1d")),
    "2D": ("2d", lambda w: Layout(1, 1, w, "2d") if math.isqrt(w) ** 2 == w else None),
    "2.5D, depth 2": (
        "2.5d",
        lambda w: Layout(1, 1, w, "2.5d", depth=2) if math.isqrt(w // 2) ** 2 * 2 == w else None,
    ),
    "3D": ("3d", lambda w: Layout(1, 1, w, "3d") if round(w ** (1 / 3)) ** 3 == w else None),
    "ZeRO-3": ("none", lambda w: Layout(w, 1, 1, "none", zero=3)),
}


def draw_largest_model(out: pathlib.Path) -> None:
    """The paper's Figure 3, measured: the largest model each layout trains per rank budget."""
    found = json.loads((HERE / "figures" / "largest_model.json").read_text())
    budget, ladder, machine = found["budget"], found["ladder"], recorded_machine(found)
    fig, ax = plt.subplots(figsize=(8, 5))
    worlds = [4, 8, 16, 32, 64]
    markers = "os^Dv"
    for i, (name, (mode, layout_of)) in enumerate(CURVES.items()):
        color = COLORS[i]
        curve = [
            (w, n)
            for w in worlds
            if (layout := layout_of(w)) is not None
            and (n := planner_largest(ladder, layout, budget, machine))
        ]  # a mode's layout exists on these ranks and the ladder divides under it
        ax.plot(*zip(*curve, strict=True), "--", color=color, alpha=0.6, label=f"{name}: planner")
        measured = sorted(
            (run["world"] * (1 + 0.03 * (i - 2)), run["parameters"])  # side by side, not hidden
            for run in found["layouts"].values()
            if run["mode"] == mode and not run["checkpoint"]
        )
        if measured:
            ax.plot(
                *zip(*measured, strict=True),
                markers[i],
                color=color,
                markeredgecolor="black",
                label=f"{name}: measured",
            )
    scale = budget / PAPER_MEMORY
    ax.plot(
        [w for w, _ in PAPER_2D],
        [n * scale for _, n in PAPER_2D],
        "*",
        color="black",
        markersize=12,
        label=f"the paper's 2D, x {budget / 2**20:.0f} MiB / 16 GiB",
    )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(worlds, [str(w) for w in worlds])
    ax.set_xlabel("ranks")
    ax.set_ylabel("largest trainable model (parameters)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, ncol=2)
    title = f"Largest GPT each layout trains, {budget / 2**20:.0f} MiB per rank (fp32, Adam)"
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(out / "largest-model.png", dpi=110)
    plt.close(fig)


FIGURES: dict[str, Callable[[pathlib.Path], None]] = {
    "data": draw_data,
    "1d": draw_1d,
    "2d": draw_2d,
    "2.5d": draw_2p5d,
    "3d": draw_3d,
    "sequence": draw_sequence,
    "pipeline": draw_pipeline,
    "schedules": draw_schedules,
    "largest model": draw_largest_model,
}


def main() -> None:
    """Draw every figure into ``--out``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=HERE / "figures")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for name, draw in FIGURES.items():
        draw(args.out)
        print(f"drew {name}")


if __name__ == "__main__":
    main()
