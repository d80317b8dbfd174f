"""``torch.compile`` of a parallelized GPT-2: graph breaks per layout, compiled step vs eager.

For 1D (2 ranks), 2D (4 ranks) and 3D (8 ranks): transformers' ``GPT2LMHeadModel`` (2 blocks,
hidden 128, 4 heads, sequence 64, batch 8, dropout 0.1 as GPT-2 trains, ``--dropout 0`` for
none) converted by ``parallelize``. With dropout, a traced split region draws from counter
streams per rank (``shared/rank_draws.py``) where eager runs fork the generator. First the
graph breaks of one forward and loss, as Dynamo's ``explain`` counts them, with the file of
each break (the goal: none in tessera's code); then the step (forward, ``causal_lm_loss``,
backward, SGD) eager and compiled with Inductor, alternating, after the compiled one's warm-up:
medians and compiled / eager. On this machine (gloo, 2 cores, many ranks) the compiled step
mostly saves Python overhead; on GPUs Inductor also fuses the elementwise work between the
matmuls and overlaps the functional collectives with them. Never asserts a time.

    python benchmarks/bench_compile.py [--steps 5] [--layouts 1d 2d] [--dropout 0.1]
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
from meters import run_ranks

LAYOUTS: dict[str, dict[str, Any]] = {
    "1d": dict(size=2, mode="1d"),
    "2d": dict(size=4, mode="2d"),
    "3d": dict(size=8, mode="3d"),
}
CONFIG = dict(n_layer=2, n_embd=128, n_head=4, n_positions=64, vocab_size=512)
BATCH, SEQ = 8, 64


def _rank(
    rank: int, world: int, port: int, tensor: dict[str, Any], steps: int, dropout: float
) -> dict[str, Any]:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from transformers import GPT2Config, GPT2LMHeadModel

    from tessera.context import create_context
    from tessera.layers import causal_lm_loss, parallelize

    ctx = create_context(dict(parallel=dict(tensor=tensor)))
    torch.manual_seed(0)
    drop = dict(resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout)
    plain = GPT2LMHeadModel(GPT2Config(**CONFIG, **drop, bos_token_id=0, eos_token_id=0))
    models = {  # create_context makes no context current: each call names it
        "eager": parallelize(copy.deepcopy(plain), context=ctx),
        "compiled": parallelize(plain, context=ctx),
    }
    ids = torch.randint(0, CONFIG["vocab_size"], (BATCH, SEQ), generator=torch.Generator())
    optimizers = {k: torch.optim.SGD(m.parameters(), lr=1e-3) for k, m in models.items()}

    def forward(kind: str) -> torch.Tensor:
        return causal_lm_loss(models[kind](ids).logits, ids, context=ctx)

    for kind in models:  # the first call's one-time input checks, eagerly
        forward(kind)
    explained = torch._dynamo.explain(lambda: forward("compiled"))()
    breaks = [
        str(reason.user_stack[-1].filename) if reason.user_stack else "?"
        for reason in explained.break_reasons
    ]
    torch._dynamo.reset()
    compiled = torch.compile(lambda: forward("compiled"))

    def step(kind: str) -> float:
        start = time.perf_counter()
        optimizers[kind].zero_grad()
        loss = compiled() if kind == "compiled" else forward("eager")
        loss.backward()
        optimizers[kind].step()
        dist.barrier()
        return time.perf_counter() - start

    warm_up = step("compiled")  # Inductor's compilation
    times: dict[str, list[float]] = {"eager": [], "compiled": []}
    for _ in range(steps):
        for kind in times:
            times[kind].append(step(kind))
    ctx.destroy()
    return dict(
        graphs=explained.graph_count,
        breaks=breaks,
        compile_s=warm_up,
        eager=statistics.median(times["eager"]),
        compiled=statistics.median(times["compiled"]),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--dropout", type=float, default=0.1)
    args = parser.parse_args()
    print(
        f"{'layout':<8}{'ranks':>6}{'graphs':>8}{'breaks':>8}{'in tessera':>12}"
        f"{'compile s':>11}{'eager ms':>10}{'compiled ms':>13}{'compiled/eager':>16}"
    )
    for name in args.layouts:
        tensor = LAYOUTS[name]
        r = run_ranks(_rank, tensor["size"], tensor, args.steps, args.dropout)[0]
        ours = sum("/tessera/" in path for path in r["breaks"])
        print(
            f"{name:<8}{tensor['size']:>6}{r['graphs']:>8}{len(r['breaks']):>8}{ours:>12}"
            f"{r['compile_s']:>11.1f}{1e3 * r['eager']:>10.1f}{1e3 * r['compiled']:>13.1f}"
            f"{r['compiled'] / r['eager']:>16.2f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
