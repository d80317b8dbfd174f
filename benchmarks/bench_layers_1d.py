"""1D tensor parallelism: tessera's layers against torch's own (DTensor) tensor parallelism.

Same shapes, same SGD step, gloo on CPU, 2 and 4 ranks; the two implementations alternate
step by step in one run so they share the machine's conditions. Prints median step times and
the ratio tessera / torch (the goal is <= 0.8). Never asserts a time.

    python benchmarks/bench_layers_1d.py [--steps 15]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

HIDDEN, BATCH = 1024, 32
BLOCK_HIDDEN, BLOCK_HEADS, BLOCK_SEQ, BLOCK_BATCH = 256, 8, 64, 4


class Block(nn.Module):
    """A pre-LN transformer block; ``make(in, out, kind)`` builds its linears."""

    def __init__(self, make: Any, norm: Any) -> None:
        super().__init__()
        h = BLOCK_HIDDEN
        self.head_dim = h // BLOCK_HEADS
        self.ln1, self.ln2 = norm(h), norm(h)
        self.qkv, self.proj = make(h, 3 * h, "col"), make(h, h, "row")
        self.fc1, self.fc2 = make(h, 4 * h, "col"), make(4 * h, h, "row")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(self.ln1(x))
        b, s, _ = qkv.shape
        q, k, v = qkv.view(b, s, -1, 3, self.head_dim).permute(3, 0, 2, 1, 4)
        attn = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, s, -1))
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln2(x))))


def mlp(make: Any) -> nn.Module:
    layers: list[nn.Module] = []
    for i in range(4):
        layers.append(make(HIDDEN, HIDDEN, "col" if i % 2 == 0 else "row"))
        if i < 3:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def tessera_models(ctx: Any) -> dict[str, nn.Module]:
    from tessera.layers import LayerNorm, Linear

    def make(i: int, o: int, kind: str) -> nn.Module:
        return Linear(i, o, parallel=kind, context=ctx)

    return {"mlp": mlp(make), "block": Block(make, lambda h: LayerNorm(h, context=ctx))}


def torch_models(world: int) -> dict[str, nn.Module]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (world,))

    def make(i: int, o: int, kind: str) -> nn.Module:
        return nn.Linear(i, o)

    m = mlp(make)
    b = Block(make, nn.LayerNorm)
    # Alternating column / row layers, as tessera's `parallel=` arguments say.
    linears = [n for n, x in m.named_modules() if isinstance(x, nn.Linear)]
    mlp_plan = {
        n: ColwiseParallel() if k % 2 == 0 else RowwiseParallel() for k, n in enumerate(linears)
    }
    block_plan = {
        "qkv": ColwiseParallel(),
        "proj": RowwiseParallel(),
        "fc1": ColwiseParallel(),
        "fc2": RowwiseParallel(),
    }
    return {
        "mlp": parallelize_module(m, mesh, mlp_plan),
        "block": parallelize_module(b, mesh, block_plan),
    }


def inputs(name: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    if name == "mlp":
        return torch.randn(BATCH, HIDDEN, generator=g)
    return torch.randn(BLOCK_BATCH, BLOCK_SEQ, BLOCK_HIDDEN, generator=g)


def step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> float:
    dist.barrier()
    start = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    model(x).float().pow(2).mean().backward()
    opt.step()
    dist.barrier()
    return time.perf_counter() - start


def worker(rank: int, world: int, port: int, steps: int, queue: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from tessera.context import create_context

    ctx = create_context(dict(parallel=dict(tensor=dict(size=world, mode="1d"))))
    ours, theirs = tessera_models(ctx), torch_models(world)
    result: dict[str, tuple[float, float]] = {}
    for name in ("mlp", "block"):
        x = inputs(name)
        pair = {"tessera": ours[name], "torch": theirs[name]}
        opts = {k: torch.optim.SGD(m.parameters(), lr=1e-3) for k, m in pair.items()}
        times: dict[str, list[float]] = {"tessera": [], "torch": []}
        for i in range(steps + 3):
            order = ("tessera", "torch") if i % 2 == 0 else ("torch", "tessera")
            for k in order:
                t = step(pair[k], opts[k], x)
                if i >= 3:
                    times[k].append(t)
        result[name] = (statistics.median(times["tessera"]), statistics.median(times["torch"]))
    if rank == 0:
        queue.put(result)
    ctx.destroy()
    dist.destroy_process_group()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    print(f"{'ranks':>5} {'model':>6} {'tessera ms':>11} {'torch TP ms':>12} {'ratio':>6}")
    for world in args.worlds:
        queue = ctx.SimpleQueue()
        mp.start_processes(
            worker,
            args=(world, free_port(), args.steps, queue),
            nprocs=world,
            join=True,
            start_method="spawn",
        )
        for name, (ours, theirs) in queue.get().items():
            print(
                f"{world:>5} {name:>6} {ours * 1e3:>11.2f} {theirs * 1e3:>12.2f} "
                f"{ours / theirs:>6.2f}"
            )
    print("ratio = tessera step time / torch parallelize_module step time (goal <= 0.8)")


if __name__ == "__main__":
    main()
