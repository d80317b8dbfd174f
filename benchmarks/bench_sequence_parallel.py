"""Sequence parallelism: per-rank activation memory against N, and ring against all-to-all.

An attention block, ``y = x + RingSelfAttention(LayerNorm(x))`` (pre-LN, non-causal, dropout
0), from tessera's dispatching ``LayerNorm`` and ``RingSelfAttention`` under
``tensor=dict(size=N, mode="sequence")``, each rank holding the sub-sequence ``[b, s/N, h]``.
One world of 4 gloo ranks serves N = 1, 2, 4 (data-parallel replicas fill the rest: ``data =
4 / N``; the layers never talk across them). Per rank and per step it measures:

* bytes saved for backward (``saved_tensors_hooks``, distinct storages, parameters left out;
  see ``meters.SavedTensorMeter``) for several sequence lengths, as a fraction of N = 1
  (goal: 1/N);
* bytes this rank contributes to the attention's communication (``meters.TrafficCounter``, a
  shim installed in the worker processes only), next to the formula;
* forward + backward time of ``impl="ring"`` (Li et al. 2021) against ``impl="all_to_all"``
  (DeepSpeed-Ulysses, Jacobs et al. 2023), the two alternating step by step, as a ratio.

The replicated parameters' gradients are partial per rank (the engine's sequence-parallel
gradient handler sums them); that all-reduce is the same for both kinds and not timed here.
Prints goals, asserts nothing.

    python benchmarks/bench_sequence_parallel.py [--steps 20] [--seqs 64 128 256]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist
from meters import SavedTensorMeter, TrafficCounter, run_ranks
from torch import nn

BATCH, HIDDEN, HEADS = 2, 64, 4
WORLD = 4
NS = (1, 2, 4)
Impl = Literal["ring", "all_to_all"]
IMPLS: tuple[Impl, ...] = ("ring", "all_to_all")
FP32 = 4
TIMEOUT = timedelta(seconds=120)


class AttentionBlock(nn.Module):
    """``x + attention(LayerNorm(x))`` on this rank's sub-sequence ``[b, s/N, h]``."""

    def __init__(self, impl: Impl, context: Any) -> None:
        super().__init__()
        from tessera.layers import LayerNorm, RingSelfAttention

        self.ln = LayerNorm(HIDDEN, context=context)
        self.attn = RingSelfAttention(HIDDEN, HEADS, impl=impl, context=context)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = x + self.attn(self.ln(x))
        return out


def build(impl: Impl, seq: int, context: Any) -> tuple[nn.Module, torch.Tensor]:
    """The block and this rank's chunk of the input (a leaf needing a gradient, as mid-network)."""
    from tessera.layers import split_activation

    torch.manual_seed(0)
    block = AttentionBlock(impl, context)
    full = torch.randn(BATCH, seq, HIDDEN, generator=torch.Generator().manual_seed(seq))
    return block, split_activation(full, context=context).detach().requires_grad_()


def fwd_bwd(block: nn.Module, x: torch.Tensor) -> None:
    block.zero_grad(set_to_none=True)
    block(x).pow(2).sum().backward()


def measure(block: nn.Module, x: torch.Tensor, counter: TrafficCounter) -> tuple[int, int, int]:
    """(saved bytes, comm bytes forward, comm bytes backward) of one step after a warm-up."""
    fwd_bwd(block, x)
    meter = SavedTensorMeter(exclude=list(block.parameters()))
    block.zero_grad(set_to_none=True)
    counter.reset()
    counter.enabled = True
    with meter.record():
        y = block(x)
    fwd = counter.total
    y.pow(2).sum().backward()
    counter.enabled = False
    return meter.total, fwd, counter.total - fwd


def time_pair(pair: dict[str, tuple[nn.Module, torch.Tensor]], steps: int) -> dict[str, float]:
    """Median forward + backward time of each block, alternating (order flipped each round)."""
    times: dict[str, list[float]] = {k: [] for k in pair}
    names = list(pair)
    for i in range(steps + 3):
        for name in names if i % 2 == 0 else names[::-1]:
            dist.barrier()
            start = time.perf_counter()
            fwd_bwd(*pair[name])
            dist.barrier()
            if i >= 3:
                times[name].append(time.perf_counter() - start)
    return {k: statistics.median(v) for k, v in times.items()}


def worker(rank: int, world: int, port: int, seqs: list[int], steps: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    counter = TrafficCounter()
    counter.install()  # before tessera.layers is imported
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=TIMEOUT)
    from tessera.context import create_context

    contexts = {
        n: create_context(
            dict(parallel=dict(tensor=dict(size=n, mode="sequence"))), timeout=TIMEOUT
        )
        for n in NS
    }
    memory = {
        (impl, n, seq): measure(*build(impl, seq, contexts[n]), counter)
        for impl in IMPLS
        for n in NS
        for seq in seqs
    }
    times = {
        n: time_pair({impl: build(impl, max(seqs), contexts[n]) for impl in IMPLS}, steps)
        for n in NS
        if n > 1
    }
    for ctx in contexts.values():
        ctx.destroy()
    dist.destroy_process_group()
    return {"memory": memory, "times": times}


# ---------------------------------------------------------------------------- formulas


def saved_formula(impl: str, n: int, seq: int) -> int:
    """Bytes saved per rank (see FORMULAS)."""
    t, h, scores = BATCH * seq, HIDDEN, BATCH * HEADS * seq * seq
    if impl == "ring":
        qkv = 3 * t * h if n > 1 else 2 * t * h  # k, v: views of the qkv output / copies
        return FP32 * (4 * t * h + qkv + 2 * t + scores) // n
    lse = BATCH * HEADS * seq
    out = 2 * t * h if n > 1 else t * h  # the kernel's output, and the proj input after it
    return FP32 * (2 * t * h + 3 * t * h + out + 2 * t + lse) // n


def comm_formula(impl: str, n: int, seq: int) -> tuple[int, int]:
    """Bytes contributed per rank (forward, backward) by the attention (see FORMULAS)."""
    chunk = FP32 * BATCH * seq * HIDDEN // n  # one of q, k, v on a rank: [b, heads, s/N, d]
    if impl == "ring":
        return 2 * (n - 1) * chunk, 4 * (n - 1) * chunk
    moved = 4 * chunk * (n - 1) // n
    return moved, moved


FORMULAS = """\
Formulas per rank (elements x 4 bytes): T = b*s tokens, A = b*heads*s^2 scores, N sequence ranks,
L = 2Th + 2T (LayerNorm input and output = qkv input; mean and rstd).
  saved   ring        (L + kv + Th + Th + A)/N: kv = 3Th for N > 1 (ring_qk / ring_av save k and
                      v as views of the fused qkv output, so its q third stays alive), 2Th for
                      N = 1 (torch.matmul saves contiguous copies); the scaled q; the proj input;
                      the softmax output, a rank's rows of the scores [b, heads, s/N, s] (Li et
                      al. 2021, section 3.1)
          all_to_all  (L + 3Th + out + b*heads*s)/N: q, k, v on [b, heads/N, s, d] and the
                      log-sum-exp of the CPU flash-attention kernel, no s^2 scores; out = 2Th for
                      N > 1 (the kernel's output and the all-to-all'd proj input), Th for N = 1
                      (the kernel's [b, s, heads, d]-strided output is the proj input itself)
  comm    ring        fwd 2(N-1) Th/N: every rank passes its key and value chunk N-1 hops
                      (ring_qk, ring_av); bwd 4(N-1) Th/N: the key and value chunks again (dQ, dP)
                      and the dK, dV accumulators, N-1 hops each (Li et al. 2021, section 3.1)
          all_to_all  fwd 4 (N-1)/N Th/N: q, k, v to the head split and the output back, each
                      rank keeping its own chunk; bwd the same reversed (Jacobs et al. 2023)
Contributed bytes: the bytes of this rank's data leaving it (see benchmarks/meters.py)."""


# ---------------------------------------------------------------------------- report


def kib(n: float) -> str:
    return f"{n / 1024:.1f}"


def report(seqs: list[int], ranks: list[dict[str, Any]]) -> None:
    def worst(key: tuple[str, int, int], i: int) -> int:
        return int(max(r["memory"][key][i] for r in ranks))

    print(
        f"\nAttention block x + RingSelfAttention(LayerNorm(x)), batch {BATCH}, hidden {HIDDEN}, "
        f"heads {HEADS}, fp32, {WORLD} gloo ranks; per rank, max over ranks."
    )
    print("Saved for backward (KiB at N=1; N * (bytes at N) / (bytes at N=1), goal 1.00):")
    head = f"{'impl':<11} {'seq':>5} | {'N=1 KiB':>8} | " + " | ".join(
        f"{f'N={n} KiB':>9} {'N*frac':>6} {'formula':>7}" for n in NS[1:]
    )
    print(head)
    print("-" * len(head))
    mismatches: list[str] = []
    for impl in IMPLS:
        for seq in seqs:
            base = worst((impl, 1, seq), 0)
            cells = []
            for n in NS[1:]:
                got = worst((impl, n, seq), 0)
                want = saved_formula(impl, n, seq) / saved_formula(impl, 1, seq)
                cells.append(f"{kib(got):>9} {n * got / base:>6.3f} {n * want:>7.3f}")
            print(f"{impl:<11} {seq:>5} | {kib(base):>8} | " + " | ".join(cells))
            for n in NS:
                got, want = worst((impl, n, seq), 0), saved_formula(impl, n, seq)
                if got != want:
                    mismatches.append(f"saved {impl} N={n} s={seq}: {got} B, formula {want} B")
    halves = [worst((impl, 4, seq), 0) / worst((impl, 2, seq), 0) for impl in IMPLS for seq in seqs]
    print(
        f"N=4 / N=2 per rank: {min(halves):.3f}..{max(halves):.3f} (1/N scaling between them: "
        "0.500). Above 1.000 at N=1 -> 2 (one [b, s/N, h] buffer, see the formulas): ring saves "
        "k and v as views of the fused qkv output, keeping its q third alive (saving the "
        "contiguous chunks that ring_ops' _around already makes would remove it); all_to_all "
        "keeps both the kernel's head-split output and the proj input, which at N=1 are one "
        "tensor (inherent: the output arrives from other ranks)."
    )
    print("\nAttention communication per step (KiB contributed, forward + backward):")
    head = f"{'impl':<11} {'seq':>5} | " + " | ".join(
        f"{f'N={n} meas':>10} {'formula':>8}" for n in NS[1:]
    )
    print(head)
    print("-" * len(head))
    for impl in IMPLS:
        for seq in seqs:
            cells = []
            for n in NS[1:]:
                fwd, bwd = worst((impl, n, seq), 1), worst((impl, n, seq), 2)
                pair = comm_formula(impl, n, seq)
                cells.append(f"{kib(fwd + bwd):>10} {kib(sum(pair)):>8}")
                if (fwd, bwd) != pair:
                    mismatches.append(
                        f"comm {impl} N={n} s={seq}: fwd {fwd} B, bwd {bwd} B, formula {pair}"
                    )
            print(f"{impl:<11} {seq:>5} | " + " | ".join(cells))
    print(
        "\nEvery figure equals its formula to the byte."
        if not mismatches
        else "\nMeasured against formula (bytes):\n  " + "\n  ".join(mismatches)
    )
    print(
        f"\nForward + backward time at seq {max(seqs)}, steps alternating (median, max over ranks):"
    )
    for n in NS[1:]:
        ring = max(r["times"][n]["ring"] for r in ranks)
        a2a = max(r["times"][n]["all_to_all"] for r in ranks)
        print(
            f"  N={n}: ring {ring * 1e3:.2f} ms, all_to_all {a2a * 1e3:.2f} ms, "
            f"ratio ring/all_to_all {ring / a2a:.2f}"
        )
    print("\n" + FORMULAS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seqs", type=int, nargs="+", default=[64, 128, 256])
    args = parser.parse_args()
    bad = [s for s in args.seqs if s % max(NS)]
    if bad:
        parser.error(f"sequence lengths {bad} are not divisible by N = {max(NS)}")
    report(args.seqs, run_ranks(worker, WORLD, args.seqs, args.steps))


if __name__ == "__main__":
    main()
