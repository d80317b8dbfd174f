"""What a module a plan leaves out costs under DTensor, against the same module converted.

``parallelize`` runs a module of the model's own that no plan names (and that holds no
parameters, and is not elementwise) under DTensor, so it computes on the whole tensor's
numbers instead of reading this rank's block as the whole (conversion/left_out.py). This
times the price: one transformer (2 blocks, hidden 256, 8 heads, sequence 64, batch 8) whose
norms are ``nn.LayerNorm(h, elementwise_affine=False)``, parallelized twice under each mode:

* ``converted``: the plan names the norms (``"norm"``): tessera's own norm layer of the mode;
* ``left out``: the plan leaves them out: each of the 5 norms runs under DTensor.

Both compute the same numbers (the maximal difference of the outputs is printed). One
forward + backward + SGD step each, the two alternating in one run; prints medians, left out /
converted and the cost of one left-out call (the difference over the 5 calls). Under 1D the
norms see whole activations, so nothing runs under DTensor. Never asserts a time.

    python benchmarks/bench_left_out.py [--steps 10] [--modes 1d 2d 3d]
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
import torch.nn.functional as F
from meters import run_ranks
from torch import nn

HIDDEN, HEADS, LAYERS, VOCAB = 256, 8, 2, 512
BATCH, SEQ = 8, 64
LAYOUTS: dict[str, dict[str, Any]] = {
    "1d": dict(size=2, mode="1d"),
    "2d": dict(size=4, mode="2d"),
    "3d": dict(size=8, mode="3d"),
}


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.n_head = HEADS  # the rank's share after parallelize
        self.q, self.k, self.v, self.o = (nn.Linear(HIDDEN, HIDDEN) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (
            p(x).view(b, s, self.n_head, -1).transpose(1, 2) for p in (self.q, self.k, self.v)
        )
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [b, heads, s, d]
        return self.o(out.transpose(1, 2).reshape(b, s, -1))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(HIDDEN, elementwise_affine=False)
        self.ln2 = nn.LayerNorm(HIDDEN, elementwise_affine=False)
        self.attn = Attention()
        self.fc1, self.fc2 = nn.Linear(HIDDEN, 4 * HIDDEN), nn.Linear(4 * HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class LM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok_emb, self.pos_emb = nn.Embedding(VOCAB, HIDDEN), nn.Embedding(SEQ, HIDDEN)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(HIDDEN, elementwise_affine=False)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(ids) + self.pos_emb(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        logits: torch.Tensor = self.head(self.ln_f(x))  # [b, s, V]
        return logits


#: The plan without its norms; ``converted`` adds them.
RULES = {
    "tok_emb": "embedding",
    "pos_emb": "position_embedding",
    "blocks.*.attn": "attention",
    "blocks.*.attn.q": "col",
    "blocks.*.attn.k": "col",
    "blocks.*.attn.v": "col",
    "blocks.*.attn.o": "row",
    "blocks.*.fc1": "col",
    "blocks.*.fc2": "row",
    "head": "head",
}
NORMS = {"blocks.*.ln*": "norm", "ln_f": "norm"}
LEFT_OUT_CALLS = 2 * LAYERS + 1


def plan(norms: bool) -> Any:
    from tessera.layers import Plan

    rules = {**RULES, **NORMS} if norms else RULES
    span = ("blocks.0", "blocks.-1")
    return Plan(rules, boundary="tokens", sequence_span=span, causal_lm=True)


def step(model: nn.Module, opt: torch.optim.Optimizer, ids: torch.Tensor, ctx: Any) -> float:
    from tessera.layers import causal_lm_loss

    start = time.perf_counter()
    causal_lm_loss(model(ids), ids, context=ctx).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def worker(rank: int, world: int, port: int, tensor: dict[str, Any], steps: int) -> Any:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from tessera.context import create_context
    from tessera.layers import gather_logits, parallelize

    ctx = create_context(dict(parallel=dict(tensor=tensor)))
    torch.manual_seed(0)
    plain = LM()
    pair = {
        "converted": parallelize(copy.deepcopy(plain), plan(norms=True), context=ctx),
        "left out": parallelize(copy.deepcopy(plain), plan(norms=False), context=ctx),
    }
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = (gather_logits(m(ids), context=ctx) for m in pair.values())
    gap = float((ours - theirs).abs().max())
    opts = {k: torch.optim.SGD(m.parameters(), lr=1e-3) for k, m in pair.items()}
    times: dict[str, list[float]] = {k: [] for k in pair}
    for i in range(steps + 2):
        for k in list(pair) if i % 2 == 0 else list(pair)[::-1]:
            t = step(pair[k], opts[k], ids, ctx)
            if i >= 2:
                times[k].append(t)
    ctx.destroy()
    dist.destroy_process_group()
    return statistics.median(times["converted"]), statistics.median(times["left out"]), gap


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--modes", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    args = parser.parse_args()
    print(f"norms left out of the plan (under DTensor) vs converted, {LEFT_OUT_CALLS} per step")
    print(
        f"{'mode':>5} {'ranks':>5} {'converted ms':>13} {'left out ms':>12} {'ratio':>6} "
        f"{'ms per call':>12} {'max |diff|':>11}"
    )
    for mode in args.modes:
        tensor = LAYOUTS[mode]
        converted, left_out, gap = run_ranks(worker, tensor["size"], tensor, args.steps)[0]
        per_call = (left_out - converted) / LEFT_OUT_CALLS
        print(
            f"{mode:>5} {tensor['size']:>5} {converted * 1e3:>13.1f} {left_out * 1e3:>12.1f} "
            f"{left_out / converted:>6.2f} {per_call * 1e3:>12.2f} {gap:>11.2e}"
        )


if __name__ == "__main__":
    main()
