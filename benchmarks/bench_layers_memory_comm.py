"""Memory and communication per rank of one transformer block: none, 1D(4), 2D(4), 2.5D(8, d=2).

One pre-LN block (LayerNorm, qkv, softmax attention, proj, LayerNorm, fc1, GeLU, fc2, dropout
p=0 so no masks are saved) written once with tessera's dispatching layers, the same global
shapes under every mode, gloo on CPU. Per rank it measures, for one training step:

(a) parameter bytes;
(b) bytes of tensors saved for backward (``saved_tensors_hooks``, distinct storages, parameters
    left out: see ``meters.SavedTensorMeter``);
(c) bytes this rank contributes to collectives in the forward and the backward (a counting
    shim around ``torch.distributed``'s functions, installed in the worker processes only:
    see ``meters.TrafficCounter`` for what "contributes" means per collective);

and prints each next to the formula of the paper behind the mode (stated at the end of the
output), as a fraction of the single-process figure. Then the step time of 2D(4) against 1D(4)
on the same block, steps alternating. Prints goals, asserts nothing.

    python benchmarks/bench_layers_memory_comm.py [--steps 20] [--hidden 128]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from meters import SavedTensorMeter, TrafficCounter, run_ranks
from torch import nn

BATCH, SEQ, HEADS = 8, 16, 4
FP32 = 4  # bytes per element
TIMEOUT = timedelta(seconds=120)

#: name -> (tensor config, P, q, depth); q = depth = 0 for 1D / none.
MODES: dict[str, tuple[dict[str, Any] | None, int, int, int]] = {
    "none": (None, 1, 0, 0),
    "1D(4)": (dict(size=4, mode="1d"), 4, 0, 0),
    "2D(4)": (dict(size=4, mode="2d"), 4, 2, 1),
    "2.5D(8,d=2)": (dict(size=8, mode="2.5d", depth=2), 8, 2, 2),
}


class Block(nn.Module):
    """A pre-LN transformer block from the dispatching layers (plain torch without a context)."""

    def __init__(self, hidden: int, heads: int, context: Any = None) -> None:
        super().__init__()
        from tessera.layers import Dropout, LayerNorm, Linear

        self.head_dim = hidden // heads
        self.ln1 = LayerNorm(hidden, context=context)
        self.qkv = Linear(hidden, 3 * hidden, parallel="col", context=context)
        self.attn_drop = Dropout(0.0, parallel_input=True, context=context)
        self.proj = Linear(hidden, hidden, parallel="row", context=context)
        self.ln2 = LayerNorm(hidden, context=context)
        self.fc1 = Linear(hidden, 4 * hidden, parallel="col", context=context)
        self.fc2 = Linear(4 * hidden, hidden, parallel="row", context=context)
        self.drop = Dropout(0.0, context=context)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(self.ln1(x))  # [b', s, 3h'], head-major: [heads', 3, d]
        b, s, _ = qkv.shape
        q, k, v = qkv.view(b, s, -1, 3, self.head_dim).permute(3, 0, 2, 1, 4)  # [b', n', s, d]
        probs = self.attn_drop(((q @ k.transpose(-1, -2)) / self.head_dim**0.5).softmax(-1))
        x = x + self.drop(self.proj((probs @ v).transpose(1, 2).reshape(b, s, -1)))
        out: torch.Tensor = x + self.drop(self.fc2(torch.nn.functional.gelu(self.fc1(self.ln2(x)))))
        return out


# ---------------------------------------------------------------------------- formulas


@dataclass(frozen=True)
class Figures:
    """Per-rank figures of one step, in bytes."""

    params: int
    saved: int
    comm_fwd: int
    comm_bwd: int

    @property
    def comm(self) -> int:
        return self.comm_fwd + self.comm_bwd


LINEARS = ((1, 3), (1, 1), (1, 4), (4, 1))  # (in, out) in units of h: qkv, proj, fc1, fc2


def formula(mode: str, h: int) -> Figures:
    """The papers' per-rank figures for ``mode`` (elements * 4 bytes); see FORMULAS."""
    _, p, q, d = MODES[mode]
    t, a = BATCH * SEQ, BATCH * HEADS * SEQ * SEQ  # tokens, attention-score elements
    if mode == "none":
        return Figures(FP32 * (12 * h * h + 13 * h), FP32 * (16 * t * h + a + 4 * t), 0, 0)
    if q == 0:  # 1D, Megatron-LM
        params = 12 * h * h // p + 7 * h // p + 6 * h
        saved = 4 * t * h + 4 * t + (12 * t * h + a) // p
        return Figures(FP32 * params, FP32 * saved, FP32 * 2 * t * h, FP32 * 2 * t * h)
    m = t // (d * q)  # rows of a rank's activation block
    params = 12 * h * h // (q * q) + 13 * h // q
    saved = (16 * t * h + a) // p + 2 * m
    fwd = bwd = 0
    for i, o in LINEARS:
        n_in, n_out = i * h, o * h
        w = n_in * n_out // (q * q)  # one weight block
        fwd += m * n_in // q + w  # summa_ab: own X block along the row, own W block along the col
        bwd += w + m * n_in  # dX = summa_abt: own W block; q reduces of [m, in/q]
        bwd += m * n_in // q + q * w  # dW = summa_atb: own X block; q reduces of [in/q, out/q]
        bwd += n_out // q + (w if d > 1 else 0)  # bias over the batch group; W over depth
    for _ in range(2):  # LayerNorms: mean and variance [m] forward, [m, 2] backward, over ROW
        fwd += 2 * m
        bwd += 2 * m + 2 * h // q  # + weight and bias [h/q] over the batch group
    return Figures(FP32 * params, FP32 * saved, FP32 * fwd, FP32 * bwd)


FORMULAS = """\
Formulas (elements; x4 bytes). T = b*s tokens, A = b*heads*s^2 scores, P ranks, 2D/2.5D mesh
q x q (x d), m = T/(d*q) rows per rank. Block: 12h^2 weights, 13h biases + LayerNorm vectors.
  params   none 12h^2 + 13h
           1D   12h^2/P + 7h/P + 6h: qkv/fc1 split by output with their biases, proj/fc2 by
                input, their biases and both LayerNorms replicated (Shoeybi et al. 2019,
                Megatron-LM, section 3)
           2D   12h^2/q^2 + 13h/q: every weight in q x q blocks, [h] vectors split over the
                mesh row, replicated over the column (Xu et al. 2021, "An Efficient 2D Method
                for Training Super-Large Deep Learning Models", section 3)
           2.5D the same per depth layer, weights replicated over depth: P = q^2 d ranks hold
                d copies (Wang et al. 2021, "Tesseract", section 3)
  saved    none 16Th + A + 4T: LN inputs 2Th, qkv/fc1 inputs 2Th, contiguous q,k,v 3Th,
                proj input Th, GeLU input 4Th, fc2 input 4Th, softmax output A, LN mean+rstd 4T
           1D   4Th + 4T + (12Th + A)/P: outside the column/row-parallel regions (LayerNorm
                inputs, qkv/fc1 inputs) activations are replicated (Megatron-LM; counted as in
                Korthikanti et al. 2022, section 4.2.1, "tensor parallel" case)
           2D, 2.5D (16Th + A)/P + 2m: every activation in [T/(dq), h/q] blocks (Xu et al.,
                Wang et al.); tessera's LayerNorm saves x-hat [m, h/q] and rstd [m]
  comm     1D   fwd 2Th, bwd 2Th: all-reduce after proj and fc2 (g), and of the input
                gradients of qkv and fc1 (f) (Megatron-LM, section 3, Figure 4)
           2D   per Linear(in, out), W block w = in*out/q^2: fwd m*in/q + w (SUMMA Y = XW: this
                rank's X block broadcast along its row once, its W block along its column once);
                bwd w + m*in (dX = dY W^T: W block broadcast once, q reduces of [m, in/q] along
                the row) + m*in/q + q*w (dW = X^T dY: X block broadcast once, q reduces of a
                W block along the column) + out/q (bias gradient all-reduced over the batch
                group); per LayerNorm fwd 2m, bwd 2m + 2h/q (Xu et al. 2021, section 3)
           2.5D the same on each depth layer with m = T/(dq), plus w per Linear in the backward:
                the weight gradient all-reduced over depth (Wang et al. 2021, section 3)
Contributed bytes: the bytes of this rank's own data entering a call (whole buffer of an
all-reduce / reduce / reduce-scatter, input chunk of an all-gather, the source's buffer of a
broadcast); see benchmarks/meters.py."""


# ---------------------------------------------------------------------------- measuring


def full_input(h: int) -> torch.Tensor:
    return torch.randn(BATCH, SEQ, h, generator=torch.Generator().manual_seed(0))


def build(h: int, context: Any) -> tuple[nn.Module, torch.Tensor]:
    """The block and this rank's block of the input, a leaf that needs a gradient.

    The input needs a gradient as a block in the middle of a network does, so the backward
    computes (and communicates) the input gradient too.
    """
    from tessera.layers import split_activation

    torch.manual_seed(0)
    block = Block(h, HEADS, context=context)
    x = split_activation(full_input(h), context=context).detach().requires_grad_()
    return block, x


def train_step(block: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    opt.zero_grad(set_to_none=True)
    block(x).pow(2).sum().backward()  # the global loss is the sum over ranks of local losses
    opt.step()


def measure(block: nn.Module, x: torch.Tensor, counter: TrafficCounter | None) -> dict[str, Any]:
    """One counted step (after one warm-up step): the figures and the per-collective counts."""
    opt = torch.optim.SGD(block.parameters(), lr=1e-3)
    train_step(block, opt, x)
    params = list(block.parameters())
    meter = SavedTensorMeter(exclude=params)
    opt.zero_grad(set_to_none=True)
    if counter is not None:
        counter.reset()
        counter.enabled = True
    with meter.record():
        y = block(x)
    fwd = counter.total if counter is not None else 0
    y.pow(2).sum().backward()
    opt.step()
    total = counter.total if counter is not None else 0
    calls = {}
    if counter is not None:
        counter.enabled = False
        calls = {k: (counter.calls[k], counter.bytes[k]) for k in counter.calls}
    figures = Figures(
        sum(p.numel() * p.element_size() for p in params), meter.total, fwd, total - fwd
    )
    return {"figures": asdict(figures), "calls": calls}  # plain data: pickled across processes


def time_steps(
    pair: dict[str, tuple[nn.Module, torch.Tensor]], steps: int, warmup: int = 3
) -> dict[str, float]:
    """Median step time of each model, the models alternating step by step (order flipped)."""
    opts = {k: torch.optim.SGD(m.parameters(), lr=1e-3) for k, (m, _) in pair.items()}
    times: dict[str, list[float]] = {k: [] for k in pair}
    names = list(pair)
    for i in range(steps + warmup):
        for name in names if i % 2 == 0 else names[::-1]:
            model, x = pair[name]
            dist.barrier()
            start = time.perf_counter()
            train_step(model, opts[name], x)
            dist.barrier()
            if i >= warmup:
                times[name].append(time.perf_counter() - start)
    return {k: statistics.median(v) for k, v in times.items()}


def worker(rank: int, world: int, port: int, modes: list[str], h: int, steps: int) -> Any:
    torch.set_num_threads(1)
    counter = TrafficCounter()
    counter.install()  # before tessera.layers is imported
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=TIMEOUT)
    from tessera.context import create_context

    contexts = {
        m: create_context(dict(parallel=dict(tensor=MODES[m][0])), timeout=TIMEOUT) for m in modes
    }
    built = {m: build(h, ctx) for m, ctx in contexts.items()}
    result: dict[str, Any] = {m: measure(*built[m], counter) for m in modes}
    if steps > 0 and len(modes) == 2:
        result["time"] = time_steps(built, steps)
    for ctx in contexts.values():
        ctx.destroy()
    dist.destroy_process_group()
    return result


# ---------------------------------------------------------------------------- report


def kib(n: float) -> str:
    return f"{n / 1024:.1f}"


def per_rank(values: list[int]) -> str:
    """One value if every rank agrees, else min..max."""
    lo, hi = min(values), max(values)
    return kib(lo) if lo == hi else f"{kib(lo)}..{kib(hi)}"


def report(h: int, measured: dict[str, list[dict[str, Any]]], times: dict[str, float]) -> None:
    base = Figures(**measured["none"][0]["figures"])
    print(
        f"\nOne transformer block, batch {BATCH}, seq {SEQ}, hidden {h}, heads {HEADS}, fp32, "
        "per rank, one SGD step (KiB; frac = fraction of the single-process figure)"
    )
    head = (
        f"{'mode':<12} {'P':>2} | {'params':>7} {'frac':>6} {'formula':>7} | {'saved':>7} "
        f"{'frac':>6} {'formula':>7} {'/(1/P)':>6} | {'comm fwd':>8} {'bwd':>8} {'formula':>8} "
        f"{'meas/formula':>12}"
    )
    print(head)
    print("-" * len(head))
    notes: list[str] = []
    for mode, ranks in measured.items():
        p = MODES[mode][1]
        figs = [Figures(**r["figures"]) for r in ranks]
        want = formula(mode, h)
        params, saved = max(f.params for f in figs), max(f.saved for f in figs)
        comm = max(f.comm for f in figs)
        ratio = "-" if want.comm == 0 else f"{comm / want.comm:.3f}"
        print(
            f"{mode:<12} {p:>2} | {per_rank([f.params for f in figs]):>7} "
            f"{params / base.params:>6.3f} {want.params / formula('none', h).params:>7.3f} | "
            f"{per_rank([f.saved for f in figs]):>7} {saved / base.saved:>6.3f} "
            f"{want.saved / formula('none', h).saved:>7.3f} {saved / (base.saved / p):>6.2f} | "
            f"{per_rank([f.comm_fwd for f in figs]):>8} {per_rank([f.comm_bwd for f in figs]):>8} "
            f"{kib(want.comm):>8} {ratio:>12}"
        )
        for name, got, exp in (
            ("params", params, want.params),
            ("saved", saved, want.saved),
            ("comm fwd", max(f.comm_fwd for f in figs), want.comm_fwd),
            ("comm bwd", max(f.comm_bwd for f in figs), want.comm_bwd),
        ):
            if got != exp:
                notes.append(f"{mode} {name}: measured {got} B, formula {exp} B ({got - exp:+d} B)")
    print(
        "\nGoals: saved activations of 2D and 2.5D <= 1.15 x (single-process / P) "
        "(the /(1/P) column); 1D keeps full activations outside its parallel regions; "
        "communication = the formula (meas/formula 1.000)."
    )
    for mode in ("2D(4)", "2.5D(8,d=2)"):
        if mode in measured:
            p = MODES[mode][1]
            x = max(r["figures"]["saved"] for r in measured[mode]) / (base.saved / p)
            verdict = "met" if x <= 1.15 else "MISSED"
            print(f"  {mode}: saved = {x:.3f} x (single-process / P): {verdict}")
    print(
        "\nMeasured against formula, exactly (bytes):"
        if notes
        else "\nEvery figure equals its formula to the byte."
    )
    for note in notes:
        print("  " + note)
    print("\nCollectives per step, rank 0 (calls, KiB contributed):")
    for mode, ranks in measured.items():
        calls = ranks[0]["calls"]
        if calls:
            text = ", ".join(f"{k} {n} calls {kib(b)}" for k, (n, b) in sorted(calls.items()))
            print(f"  {mode:<12} {text}")
    if "1D(4)" in measured and "2D(4)" in measured:
        print(volume_note(h))
    if times:
        one, two = times["1D(4)"], times["2D(4)"]
        print(
            f"\nStep time on the same block, 4 gloo ranks, steps alternating (median): "
            f"1D(4) {one * 1e3:.2f} ms, 2D(4) {two * 1e3:.2f} ms, ratio 2D/1D {two / one:.2f}"
        )
    print("\n" + FORMULAS)


def volume_note(h: int) -> str:
    """Why 2D(4) sends more than 1D(4) here, from the formulas (no measurement involved)."""
    t, q = BATCH * SEQ, MODES["2D(4)"][2]
    two, one = formula("2D(4)", h).comm, formula("1D(4)", h).comm
    weights = FP32 * 12 * h * h * (q + 2) // (q * q)
    return (
        f"\nVolume: 2D(4) contributes {two / one:.2f}x the bytes of 1D(4). Summing the 2D "
        "formula over the block gives (q+2)/q^2 * (12h^2 + 7Th) plus LayerNorm and bias "
        f"vectors, against 1D's 4Th; the weight term is {weights / two:.0%} of it here "
        f"(T = b*s = {t}, h = {h}). At q = 2 it always exceeds 4Th; it falls as 1/q while "
        "1D's stays 4Th, so 2D sends less than 1D from q = 4 on once T > 3.3h (Xu et al.'s "
        "case: large meshes)."
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=20, help="timed steps of 1D(4) and 2D(4)")
    parser.add_argument("--hidden", type=int, default=128)
    args = parser.parse_args()
    h = args.hidden
    torch.set_num_threads(1)
    block, x = build(h, None)
    measured: dict[str, list[dict[str, Any]]] = {"none": [measure(block, x, None)]}
    four = run_ranks(worker, 4, ["1D(4)", "2D(4)"], h, args.steps)
    for mode in ("1D(4)", "2D(4)"):
        measured[mode] = [r[mode] for r in four]
    eight = run_ranks(worker, 8, ["2.5D(8,d=2)"], h, 0)
    measured["2.5D(8,d=2)"] = [r["2.5D(8,d=2)"] for r in eight]
    times = {k: max(r["time"][k] for r in four) for k in ("1D(4)", "2D(4)")}
    report(h, measured, times)


if __name__ == "__main__":
    main()
