"""The largest GPT each layout trains with every rank held to the same memory budget.

The paper's Figure 3 (Bian et al. 2021, "Colossal-AI", section 5.1): under one memory budget
per device, 2D trains a larger model than 1D, because 1D keeps the activations outside its
column/row-parallel regions whole on every rank. Here it is measured, not computed: each
layout trains examples/gpt's model (Adam, fp32, the global batch fixed) for two steps on
forked gloo ranks, each rank held by the operating system to ``--budget`` bytes above its
baseline (:mod:`memory_trial`), and the largest size that completes is found by search.

Sizes form a ladder: size ``k`` has hidden ``32 k`` and depth ``k`` (8 heads, sequence 128,
batch 16, vocabulary 1024), so its parameters grow as ``k^3``. The search starts from the
planner's guess and steps up while a size fits, down until one does: real runs decide.

Printed per layout: the largest size that fits and its parameter count, the measured peak per
rank of its training steps there (largest rank), the planner's prediction for it and the ratio
(the planner is validated to 10%), the runtime's own memory measured there (resident bytes no
tensor holds, :func:`memory_trial.untensored`), and the parameters as a multiple of 1D(4)'s.
Building the model counts against the budget too: every rank builds the whole model before
ZeRO-3 shards it, which is then the limit (printed where it is). Then, at one size where
activations dominate, each layout's peak against one process's / P (the paper's claim: 2D,
2.5D and 3D hold ``1/P`` of everything).

    python benchmarks/bench_largest_model.py                  # the short version (nox -s bench)
    python benchmarks/bench_largest_model.py --search         # the full search (~30 min)
    python benchmarks/bench_largest_model.py --search --below 3   # and 3 steps smaller each
    python benchmarks/bench_largest_model.py --search --budget 512MiB --layouts "2D(4)" "1D(4)"
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path

from memory_trial import (
    MIB,
    RANKS_LOG,
    RUNTIME,
    RUNTIME_PER_BLOCK,
    Size,
    Trial,
    pin_allocator,
    planned_peak,
    run_trial,
    shape_of,
)

from tessera.context.planner import Layout, layout_problems, parse_bytes

#: name -> layout, the ones 8 ranks can run (2.5D at depth 2, 3D as a 2 x 2 x 2 cube).
LAYOUTS: dict[str, Layout] = {
    "1D(4)": Layout(1, 1, 4, "1d"),
    "1D(8)": Layout(1, 1, 8, "1d"),
    "2D(4)": Layout(1, 1, 4, "2d"),
    "2.5D(8)": Layout(1, 1, 8, "2.5d", depth=2),
    "3D(8)": Layout(1, 1, 8, "3d"),
    "ZeRO-3(4)": Layout(4, 1, 1, "none", zero=3),
    "ZeRO-3(8)": Layout(8, 1, 1, "none", zero=3),
}
SINGLE = Layout(1, 1, 1, "none")
#: A size where activations dominate (4,096 tokens a step at hidden 256: nine tenths of one
#: process's peak), for the paper's claim that 2D, 2.5D and 3D hold 1/P of one process.
ACTIVATIONS_DOMINATE = Size(hidden=128, depth=4, seq=256)
#: The largest ladder step tried.
TOP = 32


def ladder(k: int) -> Size:
    """Size ``k`` of the ladder (see the module docstring)."""
    return Size(hidden=32 * k, depth=k)


def with_checkpointing(name: str, layout: Layout) -> tuple[str, Layout]:
    """The same layout with every block's activations recomputed."""
    return f"{name} ckpt", Layout(
        layout.data, 1, layout.tensor, layout.mode, layout.depth, layout.zero, checkpoint=True
    )


def runnable(layout: Layout, k: int) -> bool:
    """Whether tessera would build size ``k`` under ``layout`` (divisibility)."""
    return not layout_problems(shape_of(ladder(k)), layout)


def planner_guess(layout: Layout, budget: int) -> int:
    """The largest ladder step the planner says fits ``budget``, 1 at least."""
    fitting = [k for k in range(1, TOP + 1) if planned_peak(layout, ladder(k)) <= budget]
    return max(fitting, default=1)


@dataclass
class Largest:
    """The outcome of the search for one layout."""

    k: int
    trial: Trial | None
    tried: dict[int, bool]
    runs: dict[int, Trial]


def largest(layout: Layout, budget: int, trials: int = TOP) -> Largest:
    """The largest ladder step that completes under ``budget``, from at most ``trials`` runs.

    With few trials the answer is a bound: the largest size seen to fit.
    """
    tried: dict[int, bool] = {}
    runs: dict[int, Trial] = {}

    def fits(k: int) -> bool:
        if k not in tried:
            if len(runs) >= trials:
                return False
            if not runnable(layout, k):
                tried[k] = False
                return False
            runs[k] = run_trial(layout, ladder(k), budget)
            tried[k] = runs[k].fits
        return tried[k]

    # walk from the planner's guess: up while it fits, else down until it does
    k = planner_guess(layout, budget)
    if fits(k):
        while k < TOP and fits(k + 1):
            k += 1
    else:
        while k > 0 and not fits(k):
            k -= 1
    return Largest(k, runs.get(k), tried, runs)


def parameters(k: int) -> int:
    """Parameters of ladder step ``k``."""
    return shape_of(ladder(k)).parameters


def fmt_params(n: int) -> str:
    return f"{n / 1e6:.2f}M"


def search(
    names: list[str], budget: int, checkpoint: bool, trials: int = TOP
) -> dict[str, tuple[Layout, Largest]]:
    """The search for each layout named (with checkpointing too), ``trials`` runs at most."""
    layouts = {n: LAYOUTS[n] for n in names}
    if checkpoint:
        layouts |= dict(with_checkpointing(n, lay) for n, lay in LAYOUTS.items() if n in names)
    found: dict[str, tuple[Layout, Largest]] = {}
    print(f"budget per rank: {budget / MIB:.0f} MiB above the baseline", flush=True)
    print(f"(the ranks' own stderr: {RANKS_LOG})", flush=True)
    header = f"{'layout':<16}{'size':>5}{'params':>10}{'peak MiB':>10}{'planned':>9}"
    header += f"{'planned/peak':>14}{'runtime':>9}{'x 1D(4)':>9}{'tried':>20}"
    print(header, flush=True)
    for name, layout in layouts.items():
        start = time.perf_counter()
        result = largest(layout, budget, trials)
        found[name] = layout, result
        base = found.get("1D(4)", (layout, None))[1]
        ratio = parameters(result.k) / parameters(base.k) if base and base.k else float("nan")
        peak = max(result.trial.peaks) if result.trial else 0
        built = max(result.trial.built) if result.trial else 0
        runtime = max(result.trial.runtime) if result.trial else 0
        planned = planned_peak(layout, ladder(result.k)) if result.k else 0
        tried = " ".join(f"{k}{'+' if ok else '-'}" for k, ok in sorted(result.tried.items()))
        print(
            f"{name:<16}{result.k:>5}{fmt_params(parameters(result.k)) if result.k else '-':>10}"
            f"{peak / MIB:>10.1f}{planned / MIB:>9.1f}"
            f"{planned / peak if peak else float('nan'):>14.2f}{runtime / MIB:>9.1f}"
            f"{ratio:>9.2f}{tried:>20}"
            f"   ({time.perf_counter() - start:.0f} s)"
            + (f"  building the model: {built / MIB:.1f} MiB" if built > peak else ""),
            flush=True,
        )
    return found


def below(found: dict[str, tuple[Layout, Largest]], steps: int, budget: int) -> None:
    """Also run each layout ``steps`` ladder steps below its largest size, for the planner.

    At a smaller size the runtime's own memory and the buffers weigh more: the planner is
    validated there too. The runs join each layout's ``runs`` (and the JSON).
    """
    print(f"\n{steps} ladder steps below the largest: the planner against the measured peak")
    print(
        f"{'layout':<16}{'size':>5}{'peak MiB':>10}{'planned':>9}{'planned/peak':>14}{'runtime':>9}"
    )
    for name, (layout, result) in found.items():
        k = result.k - steps
        if k < 1 or k in result.runs or not runnable(layout, k):
            continue
        trial = run_trial(layout, ladder(k), budget)
        result.runs[k], result.tried[k] = trial, trial.fits
        if not trial.fits:
            print(f"{name:<16}{k:>5}  did not fit", flush=True)
            continue
        peak, planned = max(trial.peaks), planned_peak(layout, ladder(k))
        print(
            f"{name:<16}{k:>5}{peak / MIB:>10.1f}{planned / MIB:>9.1f}{planned / peak:>14.2f}"
            f"{max(trial.runtime) / MIB:>9.1f}",
            flush=True,
        )


def against_single(names: list[str], size: Size) -> dict[str, dict[str, float]]:
    """Each layout's peak per rank at ``size`` against one process's / P, and the planner's."""
    unlimited = 64 * 2**30
    single = max(run_trial(SINGLE, size, unlimited).peaks)
    print(
        f"\n{fmt_params(shape_of(size).parameters)} parameters (hidden {size.hidden}, depth "
        f"{size.depth}, sequence {size.seq}, batch {size.batch}): one process "
        f"{single / MIB:.1f} MiB (planned {planned_peak(SINGLE, size) / MIB:.1f})"
    )
    columns = ("peak MiB", 10), ("x single/P", 12), ("ranks spread", 14), ("planned/peak", 14)
    print(f"{'layout':<16}" + "".join(f"{c:>{w}}" for c, w in columns))
    rows: dict[str, dict[str, float]] = {}
    for name in names:
        layout = LAYOUTS[name]
        if layout_problems(shape_of(size), layout):
            continue
        trial = run_trial(layout, size, unlimited)
        peak, low = max(trial.peaks), min(trial.peaks)
        planned = planned_peak(layout, size)
        rows[name] = {
            "peak": peak,
            "runtime": max(trial.runtime),
            "x_single_over_p": peak / (single / layout.world),
            "spread": peak / low - 1,
            "planned_over_peak": planned / peak,
        }
        r = rows[name]
        print(
            f"{name:<16}{peak / MIB:>10.1f}{r['x_single_over_p']:>12.2f}"
            f"{r['spread']:>13.1%}{r['planned_over_peak']:>14.2f}",
            flush=True,
        )
    return rows


def record(layout: Layout, found: Largest) -> dict[str, object]:
    """What the search found for one layout, every run with the planner's figure, as JSON."""
    return {
        "world": layout.world,
        "mode": layout.mode,
        "checkpoint": layout.checkpoint,
        "k": found.k,
        "parameters": parameters(found.k) if found.k else 0,
        "runs": {
            k: {
                "fits": run.fits,
                "peak": max(run.peaks),
                "peaks": run.peaks,
                "built": max(run.built),
                "runtime": max(run.runtime),
                "planned": planned_peak(layout, ladder(k)),
                "parameters": parameters(k),
            }
            for k, run in sorted(found.runs.items())
        },
    }


def main() -> None:
    pin_allocator()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", default="96MiB", help="bytes per rank above its baseline")
    parser.add_argument(
        "--search", action="store_true", help="search every layout to the end (~30 min)"
    )
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--no-checkpointing", action="store_true")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument(
        "--below",
        type=int,
        default=0,
        metavar="N",
        help="also run each layout N ladder steps below its largest size (the planner's check)",
    )
    args = parser.parse_args()
    budget = parse_bytes(args.budget)
    base = ladder(1)
    results: dict[str, object] = {
        "budget": budget,
        "backend": "gloo",
        # the runtime's own memory per rank the planner's figures count: ``runtime`` plus
        # ``runtime_per_block`` per block (memory_trial.RUNTIME, RUNTIME_PER_BLOCK)
        "runtime": RUNTIME,
        "runtime_per_block": RUNTIME_PER_BLOCK,
        # size k of the ladder: hidden ``hidden * k``, depth ``depth * k`` (docs/make_figures.py)
        "ladder": {
            "hidden": base.hidden,
            "depth": base.depth,
            "heads": base.heads,
            "seq": base.seq,
            "vocab": base.vocab,
            "batch": base.batch,
        },
    }
    # the short version: two sizes per layout (the planner's guess and the next one up)
    trials = TOP if args.search else 2
    found = search(args.layouts, budget, args.search and not args.no_checkpointing, trials)
    if args.below:
        below(found, args.below, budget)
    results["layouts"] = {name: record(*found[name]) for name in found}
    results["at_size"] = against_single(args.layouts, ACTIVATIONS_DOMINATE)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
