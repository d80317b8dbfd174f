"""The planner's step-time ranking against measured step times, on the layouts 4 ranks can run.

One pre-LN transformer block (``bench_layers_memory_comm.Block``: batch 8, seq 16, heads 4, fp32,
gloo on CPU, one thread per rank) under four layouts of 4 ranks: pure data parallelism, 1D(4),
2D(4) and data 2 x 1D(2). Each step is forward + backward + SGD, the replicas' gradients summed
by one all-reduce over the data group (what the planner prices: one 25 MiB bucket), the layers'
own gradient sums (2D's LayerNorms) in autograd, without the engine (the planner's
``engine_sums=False``); the layouts' steps alternate, medians are taken.

The planner (``tessera.context.planner``) predicts each layout's step from a machine model,
measured two ways: (a) ``calibrate(ranks=4)``, the planner's own short run (4 threads of this
process multiplying at once, then all-reducing among them: the machine as 4 ranks sharing its
cores see it); (b) the same three numbers measured on the 4 worker ranks themselves, all at
once, before the timed steps. Both are gloo
machines (``Machine.backend``: 2D's blocks travel as pairwise sends, as they do here), so the
calls and bytes printed are what ``meters.TrafficCounter`` would count. Printed: predicted and
measured times, both rankings and Spearman's rank correlation. Prints, asserts nothing.

    python benchmarks/bench_planner.py [--steps 10] [--hidden 256 1024]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from bench_layers_memory_comm import BATCH, HEADS, SEQ, Block, full_input
from meters import run_ranks

from tessera.context.planner import Layout, Machine, ModelShape, calibrate, estimate_layout

WORLD = 4
TIMEOUT = timedelta(seconds=120)

#: name -> (tessera's parallel block, the planner's layout)
LAYOUTS: dict[str, tuple[dict[str, Any], Layout]] = {
    "data 4": ({"data": 4}, Layout(4, 1, 1, "none")),
    "1D(4)": ({"tensor": {"size": 4, "mode": "1d"}}, Layout(1, 1, 4, "1d")),
    "2D(4)": ({"tensor": {"size": 4, "mode": "2d"}}, Layout(1, 1, 4, "2d")),
    "data 2 x 1D(2)": ({"data": 2, "tensor": {"size": 2, "mode": "1d"}}, Layout(2, 1, 2, "1d")),
}


# ---------------------------------------------------------------------------- measuring


def build(h: int, context: Any) -> tuple[torch.nn.Module, torch.Tensor]:
    """The block and this rank's input: its replica's rows, split for the tensor mode."""
    from tessera.context import ParallelMode
    from tessera.layers import split_activation

    torch.manual_seed(0)
    block = Block(h, HEADS, context=context)
    rows = BATCH // context.data_size
    start = context.get_local_rank(ParallelMode.DATA) * rows
    x = full_input(h)[start : start + rows]
    return block, split_activation(x, context=context).detach().requires_grad_()


def train_step(
    block: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, context: Any
) -> None:
    from tessera.context import ParallelMode

    opt.zero_grad(set_to_none=True)
    block(x).pow(2).sum().backward()
    if context.data_size > 1:  # one bucket: every gradient in one all-reduce
        grads = [p.grad for p in block.parameters() if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=context.get_group(ParallelMode.DATA))
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
    opt.step()


def machine_on_ranks(seconds: float = 0.3) -> dict[str, float]:
    """This rank's matmul rate and world all-reduce times, every rank measuring at once."""
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    dist.barrier()
    count, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        a @ b
        count += 1
    found = {"flops": 2 * 256**3 * count / elapsed}
    for name, numel, repeats in (("small", 1, 30), ("large", 2**20, 8)):
        buffer, times = torch.zeros(numel), []
        for i in range(repeats + 2):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(buffer)
            if i >= 2:
                times.append(time.perf_counter() - start)
        found[name] = statistics.median(times)
    return found


def worker(rank: int, world: int, port: int, h: int, steps: int, warmup: int) -> dict[str, Any]:
    """The machine as the ranks see it, then the median step time of every layout.

    Steps alternate between the layouts (order flipped every round).
    """
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=TIMEOUT)
    from tessera.context import create_context

    machine = machine_on_ranks()

    contexts = {
        name: create_context({"parallel": parallel}, timeout=TIMEOUT)
        for name, (parallel, _) in LAYOUTS.items()
    }
    built = {name: build(h, ctx) for name, ctx in contexts.items()}
    opts = {k: torch.optim.SGD(m.parameters(), lr=1e-3) for k, (m, _) in built.items()}
    times: dict[str, list[float]] = {k: [] for k in built}
    names = list(built)
    for i in range(steps + warmup):
        for name in names if i % 2 == 0 else names[::-1]:
            block, x = built[name]
            dist.barrier()
            start = time.perf_counter()
            train_step(block, opts[name], x, contexts[name])
            dist.barrier()
            if i >= warmup:
                times[name].append(time.perf_counter() - start)
    for ctx in contexts.values():
        ctx.destroy()
    dist.destroy_process_group()
    return {"machine": machine, "times": {k: statistics.median(v) for k, v in times.items()}}


# ---------------------------------------------------------------------------- report


def ranks(values: list[float]) -> list[float]:
    """1-based ranks, ties sharing their mean rank."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    result = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            result[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return result


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation: Pearson's on the ranks."""
    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.mean(ra), statistics.mean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb, strict=True))
    sa = sum((x - ma) ** 2 for x in ra) ** 0.5
    sb = sum((y - mb) ** 2 for y in rb) ** 0.5
    return cov / (sa * sb) if sa and sb else float("nan")


def ranks_machine(per_rank: list[dict[str, Any]]) -> Machine:
    """(b): the slowest rank's numbers; a 4-rank all-reduce takes log2(4) = 2 latency rounds.

    Bandwidth from the large all-reduce: it sends 2 (n-1)/n S bytes per rank.
    """
    flops = min(r["machine"]["flops"] for r in per_rank)
    small = max(r["machine"]["small"] for r in per_rank)
    large = max(r["machine"]["large"] for r in per_rank)
    wire = 2 * (WORLD - 1) / WORLD * 4 * 2**20
    return Machine(flops, wire / max(large - small, 1e-9), small / 2, "gloo")


def predict(shape: ModelShape, machine: Machine) -> dict[str, float]:
    return {
        name: estimate_layout(
            shape, layout, memory_budget=2**40, machine=machine, engine_sums=False
        ).step_seconds
        for name, (_, layout) in LAYOUTS.items()
    }


def describe(machine: Machine) -> str:
    return (
        f"{machine.flops:.3g} flop/s, {machine.bandwidth:.3g} B/s, "
        f"{machine.latency * 1e6:.0f} us per 2-rank collective"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per layout")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument(
        "--hidden",
        type=int,
        nargs="+",
        default=[256, 1024],
        help="block sizes, one run each (default: 256, where Python overhead weighs, and 1024)",
    )
    args = parser.parse_args()
    for h in args.hidden:
        report(h, args.steps, args.warmup)


def report(h: int, steps: int, warmup: int) -> None:
    """Predict, measure and print the four layouts for one block of hidden size ``h``."""
    shape = ModelShape(layers=1, hidden=h, heads=HEADS, seq=SEQ, vocab=0, batch=BATCH)

    start = time.perf_counter()
    machine_a = calibrate(ranks=WORLD)
    took = time.perf_counter() - start
    cores = os.cpu_count() or 1

    per_rank = run_ranks(worker, WORLD, h, steps, warmup)
    measured = {name: max(r["times"][name] for r in per_rank) for name in LAYOUTS}
    machine_b = ranks_machine(per_rank)
    models = {"(a) calibrate()": machine_a, "(b) on the ranks": machine_b}
    predicted = {label: predict(shape, machine) for label, machine in models.items()}

    names = list(LAYOUTS)
    m = [measured[n] for n in names]
    print(
        f"\nOne transformer block, batch {BATCH}, seq {SEQ}, hidden {h}, heads {HEADS}, fp32, "
        f"{WORLD} gloo ranks on {cores} cores, forward + backward + SGD, median of "
        f"{steps} alternating steps"
    )
    print(f"Machine (a), calibrate(ranks={WORLD}) in {took:.1f} s: {describe(machine_a)}")
    print(f"Machine (b), measured on the {WORLD} ranks at once: {describe(machine_b)}")
    head = (
        f"{'layout':<16} {'calls':>5} {'comm KiB':>9} | {'(a) pred':>9} {'rank':>4} | "
        f"{'(b) pred':>9} {'rank':>4} | {'measured':>9} {'rank':>4}"
    )
    print(head)
    print("-" * len(head))
    rank_of = {label: ranks([p[n] for n in names]) for label, p in predicted.items()}
    rm = ranks(m)
    pa, pb = predicted["(a) calibrate()"], predicted["(b) on the ranks"]
    ra, rb = rank_of["(a) calibrate()"], rank_of["(b) on the ranks"]
    for i, name in enumerate(names):
        e = estimate_layout(
            shape, LAYOUTS[name][1], memory_budget=2**40, machine=machine_a, engine_sums=False
        )
        print(
            f"{name:<16} {e.collectives:>5} {e.comm_bytes / 1024:>9.1f} | "
            f"{pa[name] * 1e3:>7.2f}ms {ra[i]:>4g} | {pb[name] * 1e3:>7.2f}ms {rb[i]:>4g} | "
            f"{m[i] * 1e3:>7.2f}ms {rm[i]:>4g}"
        )
    print()
    for label, p in predicted.items():
        order = " < ".join(sorted(names, key=lambda n: p[n]))
        rho = spearman([p[n] for n in names], m)
        print(f"{label:<17} Spearman {rho:+.2f}; predicted order: {order}")
    print(f"{'measured':<17} order: {' < '.join(sorted(names, key=lambda n: measured[n]))}")
    print(
        "\nThe model prices compute at a matmul's rate and each collective as latency rounds + "
        "bytes / bandwidth, nothing overlapped; element-wise work and Python overhead are not "
        "in it, so its absolute times are low, the more so the smaller the block: the ranking "
        "is what it is for."
    )


if __name__ == "__main__":
    main()
