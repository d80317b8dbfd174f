"""``parallelize`` on a transformers GPT-2: step time against torch, saved activations per mode.

1. Step time, 1D on 2 and 4 ranks: the same ``GPT2Model`` (2 blocks, hidden 256, 8 heads,
   sequence 64, batch 4) converted by ``tessera.layers.parallelize`` and by torch's
   ``parallelize_module`` (DTensor). torch rejects GPT-2's ``Conv1D``, so its copy gets the
   same conversion tessera does by itself: each ``Conv1D`` becomes an ``nn.Linear``, the fused
   q/k/v rows are regrouped so each rank's contiguous block holds its heads of q, k and v, and
   the attention's head counts become the rank's share. Both split the token embedding by
   vocabulary. One forward + backward + SGD step, the two alternating in one run; prints
   medians and tessera / torch (the goal is <= 0.8). Never asserts a time.
2. Saved activations (what autograd keeps for backward, parameters excluded) of one forward of
   a parallelized ``GPT2Model`` under 2D (4 ranks), 2.5D (8 ranks, depth 2) and 3D (8 ranks),
   per rank, as a multiple of the single-process figure / P (the goal is <= 1.15).

    python benchmarks/bench_parallelize.py [--steps 10] [--worlds 2 4] [--skip-memory]
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from meters import SavedTensorMeter, run_ranks
from torch import nn

TIME_CONFIG = dict(n_layer=2, n_embd=256, n_head=8, n_positions=64, vocab_size=512)
TIME_BATCH, TIME_SEQ = 4, 64
MEMORY_CONFIG = dict(n_layer=2, n_embd=256, n_head=8, n_positions=32, vocab_size=512)
MEMORY_BATCH, MEMORY_SEQ = 8, 32
MEMORY_LAYOUTS = {
    "2d": dict(size=4, mode="2d"),
    "2.5d": dict(size=8, mode="2.5d", depth=2),
    "3d": dict(size=8, mode="3d"),
}


def gpt2(config: dict[str, Any]) -> nn.Module:
    """A ``GPT2Model`` without dropout, eager attention, weights from a fixed seed."""
    from transformers import GPT2Config, GPT2Model

    torch.manual_seed(0)
    cfg = GPT2Config(
        **config,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=None,
        eos_token_id=None,
    )
    cfg._attn_implementation = "eager"
    return GPT2Model(cfg)


def ids(batch: int, seq: int, vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(1))


def torch_tp(model: nn.Module, world: int) -> nn.Module:
    """``model`` under torch's ``parallelize_module``, after the conversion it needs."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    for block in model.h:
        attn = block.attn
        for parent, name in (
            (attn, "c_attn"),
            (attn, "c_proj"),
            (block.mlp, "c_fc"),
            (block.mlp, "c_proj"),
        ):
            conv = getattr(parent, name)
            linear = nn.Linear(*conv.weight.shape)
            with torch.no_grad():
                weight = conv.weight.t()  # [out, in]
                if name == "c_attn" and parent is attn:  # [3, p, h/p, in] -> [p, 3, h/p, in]
                    out, inp = weight.shape
                    weight = weight.reshape(3, world, out // (3 * world), inp).transpose(0, 1)
                    bias = conv.bias.reshape(3, world, -1).transpose(0, 1).reshape(-1)
                else:
                    bias = conv.bias
                linear.weight.copy_(weight.reshape(linear.weight.shape))
                linear.bias.copy_(bias)
            setattr(parent, name, linear)
        attn.num_heads //= world
        attn.split_size //= world
        attn.embed_dim //= world
    mesh = init_device_mesh("cpu", (world,))
    plan: dict[str, Any] = {"wte": RowwiseParallel(input_layouts=Replicate())}
    for i in range(len(model.h)):
        plan |= {
            f"h.{i}.attn.c_attn": ColwiseParallel(),
            f"h.{i}.attn.c_proj": RowwiseParallel(),
            f"h.{i}.mlp.c_fc": ColwiseParallel(),
            f"h.{i}.mlp.c_proj": RowwiseParallel(),
        }
    return parallelize_module(model, mesh, plan)


def step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> float:
    dist.barrier()
    start = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    model(x).last_hidden_state.pow(2).mean().backward()
    opt.step()
    dist.barrier()
    return time.perf_counter() - start


def time_worker(rank: int, world: int, port: int, steps: int) -> tuple[float, float, float]:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from tessera.context import create_context
    from tessera.layers import parallelize

    ctx = create_context(dict(parallel=dict(tensor=dict(size=world, mode="1d"))))
    plain = gpt2(TIME_CONFIG)
    pair = {
        "tessera": parallelize(copy.deepcopy(plain), context=ctx),
        "torch": torch_tp(plain, world),
    }
    x = ids(TIME_BATCH, TIME_SEQ, TIME_CONFIG["vocab_size"])
    with torch.no_grad():  # both compute the same thing before timing
        ours, theirs = (m(x).last_hidden_state for m in pair.values())
    gap = float((ours - theirs).abs().max())
    opts = {k: torch.optim.SGD(m.parameters(), lr=1e-3) for k, m in pair.items()}
    times: dict[str, list[float]] = {"tessera": [], "torch": []}
    for i in range(steps + 2):
        for k in ("tessera", "torch") if i % 2 == 0 else ("torch", "tessera"):
            t = step(pair[k], opts[k], x)
            if i >= 2:
                times[k].append(t)
    ctx.destroy()
    dist.destroy_process_group()
    return statistics.median(times["tessera"]), statistics.median(times["torch"]), gap


def saved_bytes(model: nn.Module, x: torch.Tensor) -> int:
    meter = SavedTensorMeter(exclude=list(model.parameters()))
    with meter.record():
        model(x).last_hidden_state.sum().backward()
    return meter.total


def memory_worker(rank: int, world: int, port: int, tensor: dict[str, Any]) -> int:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from tessera.context import create_context
    from tessera.layers import parallelize

    ctx = create_context(dict(parallel=dict(tensor=tensor)))
    model = parallelize(gpt2(MEMORY_CONFIG), context=ctx)
    total = saved_bytes(model, ids(MEMORY_BATCH, MEMORY_SEQ, MEMORY_CONFIG["vocab_size"]))
    ctx.destroy()
    dist.destroy_process_group()
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--skip-memory", action="store_true")
    args = parser.parse_args()
    print("transformers GPT2Model, 1D: tessera parallelize vs torch parallelize_module")
    print(f"{'ranks':>5} {'tessera ms':>11} {'torch TP ms':>12} {'ratio':>6} {'max |diff|':>11}")
    for world in args.worlds:
        ours, theirs, gap = run_ranks(time_worker, world, args.steps)[0]
        ms = f"{ours * 1e3:>11.2f} {theirs * 1e3:>12.2f}"
        print(f"{world:>5} {ms} {ours / theirs:>6.2f} {gap:>11.2e}")
    print("ratio = tessera step time / torch step time (goal <= 0.8)")
    if args.skip_memory:
        return
    single = saved_bytes(
        gpt2(MEMORY_CONFIG), ids(MEMORY_BATCH, MEMORY_SEQ, MEMORY_CONFIG["vocab_size"])
    )
    print(f"\nsaved activations per rank, one forward (single process: {single / 1024:.0f} KiB)")
    print(f"{'mode':>5} {'ranks':>5} {'KiB':>8} {'x single/P':>11}")
    for mode, tensor in MEMORY_LAYOUTS.items():
        world = int(tensor["size"])
        per_rank = max(run_ranks(memory_worker, world, tensor))
        print(f"{mode:>5} {world:>5} {per_rank / 1024:>8.0f} {per_rank / (single / world):>11.2f}")
    print("goal: <= 1.15 x single/P")


if __name__ == "__main__":
    main()
