"""tessera-pipeline against torch.distributed.pipelining, and 1F1B's activation memory vs GPipe.

A 4-layer MLP (hidden 1024, Linear + ReLU per layer), batch 32, 8 microbatches, on 4 and on 2
pipeline ranks (gloo, CPU, one process per rank spawned here). Each pair of schedules runs on
the same split, alternating tessera and torch in rounds within one run; the script prints the
median step times and the ratio tessera / torch (lower is better for tessera). No assertions
on time: the numbers depend on the machine.

Interleaved schedules need 2 chunks per rank: with 4 ranks that is 8 virtual stages for 4
layers, so there each layer's Linear and ReLU are separate modules (an uneven split, the same
for both sides). tessera's zero bubble is ZB-H1 on one chunk per rank; torch's
ScheduleInterleavedZeroBubble runs on the same one-chunk split.

Usage: python benchmarks/bench_pipeline.py [--steps N] [--rounds R]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

HIDDEN, BATCH, MICRO, LAYERS = 1024, 32, 8, 4


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def modules(split_relu: bool) -> list[nn.Module]:
    torch.manual_seed(0)
    out: list[nn.Module] = []
    for _ in range(LAYERS):
        if split_relu:
            out += [nn.Linear(HIDDEN, HIDDEN), nn.ReLU()]
        else:
            out.append(nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.ReLU()))
    return out


def mse(output: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    return ((output - label) ** 2).mean()


def chunk_modules(layers: list[nn.Module], rank: int, p: int, chunks: int) -> list[nn.Sequential]:
    """Uniform contiguous split; chunk c of rank r is virtual stage c * p + r (both sides)."""
    per = len(layers) // (p * chunks)
    return [
        nn.Sequential(*layers[(c * p + rank) * per : (c * p + rank + 1) * per])
        for c in range(chunks)
    ]


def tessera_runner(kind: str, rank: int, p: int, ctx: Any) -> Any:
    from tessera.pipeline import (
        InterleavedPipelineSchedule,
        PipelineRunner,
        PipelineSchedule,
        ZeroBubbleSchedule,
        build_pipeline_model,
    )

    chunks = 2 if kind == "interleaved" else 1
    layers = modules(split_relu=chunks * p > LAYERS)
    stage = build_pipeline_model(layers, chunks, method="uniform", context=ctx)
    schedule = {
        "1f1b": lambda: PipelineSchedule(MICRO),
        "interleaved": lambda: InterleavedPipelineSchedule(MICRO, 2),
        "zero_bubble": lambda: ZeroBubbleSchedule(MICRO),
    }[kind]()
    runner = PipelineRunner(schedule, context=ctx)
    stages = stage if isinstance(stage, list) else [stage]

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        runner.train_step(stage, iter([(x, y)]), mse, keep_outputs=False)
        for s in stages:
            s.zero_grad(set_to_none=True)

    return step


def torch_runner(kind: str, rank: int, p: int) -> Any:
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleInterleaved1F1B,
        ScheduleInterleavedZeroBubble,
    )

    chunks = 2 if kind == "interleaved" else 1
    layers = modules(split_relu=chunks * p > LAYERS)
    subs = chunk_modules(layers, rank, p, chunks)
    cpu = torch.device("cpu")
    stages = [PipelineStage(sub, c * p + rank, p * chunks, cpu) for c, sub in enumerate(subs)]
    if kind == "1f1b":
        schedule: Any = Schedule1F1B(stages[0], MICRO, loss_fn=mse)
    elif kind == "interleaved":
        schedule = ScheduleInterleaved1F1B(stages, MICRO, loss_fn=mse)
    else:
        schedule = ScheduleInterleavedZeroBubble(stages, MICRO, loss_fn=mse)
    first, last = rank == 0, rank == p - 1

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        if first and last:
            schedule.step(x, target=y, losses=[])
        elif first:
            schedule.step(x)
        elif last:
            schedule.step(target=y, losses=[])
        else:
            schedule.step()
        for sub in subs:
            sub.zero_grad(set_to_none=True)

    return step


def timed(step: Any, x: torch.Tensor, y: torch.Tensor, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        step(x, y)
        dist.barrier()
        times.append(time.perf_counter() - start)
    return times


def worker(rank: int, p: int, port: int, steps: int, rounds: int, queue: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=p)
    from tessera.context import create_context

    ctx = create_context(dict(parallel=dict(pipeline=p)), timeout=120)
    try:
        g = torch.Generator().manual_seed(1)
        x, y = torch.randn(BATCH, HIDDEN, generator=g), torch.randn(BATCH, HIDDEN, generator=g)
        kinds = ("1f1b", "interleaved", "zero_bubble")
        runners = {}
        for kind in kinds:
            runners[("tessera", kind)] = tessera_runner(kind, rank, p, ctx)
            runners[("torch", kind)] = torch_runner(kind, rank, p)
        for run in runners.values():  # warm-up: shape exchange / inference, allocator
            timed(run, x, y, 2)
        times: dict[tuple[str, str], list[float]] = {key: [] for key in runners}
        for _ in range(rounds):
            for kind in kinds:
                for side in ("tessera", "torch"):
                    times[(side, kind)] += timed(runners[(side, kind)], x, y, steps)
        memory = measure_memory(rank, p, ctx, x, y)
        if rank == 0:
            queue.put({"times": times, "memory": memory})
        else:
            queue.put({"memory": memory})
    finally:
        ctx.destroy()
        dist.destroy_process_group()


def measure_memory(rank: int, p: int, ctx: Any, x: torch.Tensor, y: torch.Tensor) -> Any:
    """Peak bytes saved for backward on this rank: tessera GPipe vs 1F1B on the same split."""
    from tessera.pipeline import (
        GPipeSchedule,
        PipelineRunner,
        PipelineSchedule,
        build_pipeline_model,
    )

    stage = build_pipeline_model(modules(split_relu=False), 1, method="uniform", context=ctx)
    out: dict[str, Any] = {"rank": rank}
    for name, schedule in (("gpipe", GPipeSchedule(MICRO)), ("1f1b", PipelineSchedule(MICRO))):
        runner = PipelineRunner(schedule, context=ctx)
        runner.train_step(stage, iter([(x, y)]), mse, keep_outputs=False, track_memory=True)
        record = runner.last_run
        assert record is not None
        out[name] = (record.peak_activation_bytes, record.peak_live)
        stage.zero_grad(set_to_none=True)
    return out


def run(p: int, steps: int, rounds: int) -> None:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=worker, args=(r, p, port, steps, rounds, queue)) for r in range(p)]
    for proc in procs:
        proc.start()
    results = [queue.get(timeout=600) for _ in range(p)]
    for proc in procs:
        proc.join(timeout=60)
        if proc.exitcode != 0:
            raise SystemExit(f"a rank failed (exit code {proc.exitcode})")
    times = next(r["times"] for r in results if "times" in r)
    print(f"\n== {p} pipeline stages: MLP {LAYERS}x{HIDDEN}, batch {BATCH}, {MICRO} microbatches")
    print(f"{'schedule':<14}{'tessera ms':>12}{'torch ms':>12}{'tessera/torch':>15}")
    pairs = {"1f1b": "Schedule1F1B", "interleaved": "ScheduleInterleaved1F1B"}
    pairs["zero_bubble"] = "ScheduleInterleavedZeroBubble"
    for kind, torch_name in pairs.items():
        ours = statistics.median(times[("tessera", kind)]) * 1e3
        theirs = statistics.median(times[("torch", kind)]) * 1e3
        print(f"{kind:<14}{ours:>12.2f}{theirs:>12.2f}{ours / theirs:>15.2f}   vs {torch_name}")
    print("peak activation memory (bytes saved for backward, tessera executor), per rank:")
    for memory in sorted((r["memory"] for r in results), key=lambda m: m["rank"]):
        rank = memory["rank"]
        (g_bytes, g_live), (o_bytes, o_live) = memory["gpipe"], memory["1f1b"]
        print(
            f"  rank {rank}: GPipe {g_bytes / 2**20:.2f} MiB ({g_live} microbatches), "
            f"1F1B {o_bytes / 2**20:.2f} MiB ({o_live}); 1F1B/GPipe = {o_bytes / g_bytes:.2f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds")
    args = parser.parse_args()
    start = time.perf_counter()
    for p in (4, 2):
        run(p, args.steps, args.rounds)
    print(f"\n(total {time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
