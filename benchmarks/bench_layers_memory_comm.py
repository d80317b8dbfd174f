"""Per-rank memory and communication of one block: none, 1D(4), 2D(4), 2.5D(8,d=2), 3D(8).

``3D(8) kept`` is 3D with ``keep_gathered_operands``: each backward reuses what its forward
gathered (more saved activations, fewer gathers).

One pre-LN block (LayerNorm, qkv, softmax attention, proj, LayerNorm, fc1, GeLU, fc2, dropout
p=0 so no masks are saved) written once with tessera's dispatching layers, the same global
shapes under every mode, gloo on CPU. Per rank it measures, for one training step:

(a) parameter bytes;
(b) bytes of tensors saved for backward (``saved_tensors_hooks``, distinct storages, parameters
    left out: see ``meters.SavedTensorMeter``);
(c) bytes this rank contributes to collectives in the forward and the backward (a counting
    shim around ``torch.distributed``'s functions, installed in the worker processes only:
    see ``meters.TrafficCounter`` for what "contributes" means per collective);

and prints each next to its formula (stated at the end of the output): the papers' for
parameters and activations, for communication the algorithms tessera runs (2D/2.5D: the
variant of SUMMA that ``tessera.layers.choose_algorithm`` picks for each Linear; 3D: the
variant of the cube product that ``tessera.layers.choose_cube_algorithm`` picks; both
printed), as a fraction of the single-process figure. Every rank is compared with the formula
of its position (a 2D/2.5D rank on the mesh diagonal sends less). Then the step time of 2D(4)
against 1D(4) on the same block, steps alternating. Prints goals, asserts nothing.

The 4-rank modes run in one set of 4 processes, the 8-rank ones (2.5D, 3D) in one set of 8;
``--modes`` picks some (``none`` is always measured: it is the base of the fractions).

    python benchmarks/bench_layers_memory_comm.py [--steps 20] [--hidden 128] [--modes '3D(8)' ...]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from fractions import Fraction
from typing import Any

import torch
import torch.distributed as dist
from meters import SavedTensorMeter, TrafficCounter, run_ranks
from torch import nn

BATCH, SEQ, HEADS = 8, 16, 4
FP32 = 4  # bytes per element
TIMEOUT = timedelta(seconds=120)

#: name -> (tensor config, P, q, depth); q = depth = 0 for 1D / none; 3D: q = cube side.
MODES: dict[str, tuple[dict[str, Any] | None, int, int, int]] = {
    "none": (None, 1, 0, 0),
    "1D(4)": (dict(size=4, mode="1d"), 4, 0, 0),
    "2D(4)": (dict(size=4, mode="2d"), 4, 2, 1),
    "2.5D(8,d=2)": (dict(size=8, mode="2.5d", depth=2), 8, 2, 2),
    "3D(8)": (dict(size=8, mode="3d"), 8, 2, 1),
    "3D(8) kept": (dict(size=8, mode="3d"), 8, 2, 1),
}


def keeps(mode: str) -> bool:
    """Whether ``mode``'s Linear3D layers keep their gathered operands for the backward."""
    return mode.endswith(" kept")


def is_cube(mode: str) -> bool:
    """Whether ``mode`` is 3D (a q x q x q cube rather than a q x q mesh)."""
    config = MODES[mode][0]
    return config is not None and config["mode"] == "3d"


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
LINEAR_NAMES = ("qkv", "proj", "fc1", "fc2")


def variant(rows: int, in_block: int) -> str:
    """The 2D/2.5D Linear's variant in training, restated from ``choose_algorithm``.

    The weights stay when they would send more than the outputs (``2 m out/q < 3 in out/q^2``,
    i.e. ``2m < 3 in/q``); otherwise SUMMA moves them (see ``tessera.layers.mesh_linear()``).
    """
    return "stationary" if 2 * rows < 3 * in_block else "summa"


def cube_variant(rows: int, in_block: int, out_block: int, q: int, keep: bool = False) -> str:
    """The 3D Linear's variant in training, restated from ``choose_cube_algorithm``.

    With ``n`` rows, ``k = in/q`` features and ``o = out/q^2`` weight rows per rank the
    weights stay when ``3 q n k + 2 n o < 3 o k`` (the elements each variant sends in a step,
    ``(q^2 - 1)(3nk + 2no)`` against ``(q - 1)(3nk + 2noq + 3ok)``, divided by ``q - 1``,
    bias gradients aside); otherwise the operands travel (see ``tessera.layers.cube_linear``).
    Keeping the gathered operands (no gathers again in the backward): ``q n k + n o < o k``.
    """
    n, k, o = rows, in_block, out_block
    if keep:
        return "stationary" if q * n * k + n * o < o * k else "gathered"
    return "stationary" if 3 * q * n * k + 2 * n * o < 3 * o * k else "gathered"


def on_diagonal(mode: str, rank: int) -> bool:
    """Whether tensor rank ``rank`` sits at mesh position ``(i, i)`` (row == col)."""
    _, _, q, _ = MODES[mode]
    if q == 0 or is_cube(mode):  # every rank of the cube sends the same
        return False
    t = rank % (q * q)  # 2D: row * q + col; 2.5D: dep * q^2 + row * q + col
    return t // q == t % q


def formula(mode: str, h: int, diagonal: bool = False) -> Figures:
    """The per-rank figures of ``mode`` from its algorithms (elements * 4 bytes); see FORMULAS.

    ``diagonal``: the rank sits at mesh position ``(i, i)``, which sends one input block fewer
    in each of the weights-stay variant's point-to-point exchanges (one of the ranks its block
    goes to is itself). The other ranks are the busiest.
    """
    _, p, q, d = MODES[mode]
    t, a = BATCH * SEQ, BATCH * HEADS * SEQ * SEQ  # tokens, attention-score elements
    if mode == "none":
        return Figures(FP32 * (12 * h * h + 13 * h), FP32 * (16 * t * h + a + 4 * t), 0, 0)
    if q == 0:  # 1D, Megatron-LM
        params = 12 * h * h // p + 7 * h // p + 6 * h
        saved = 4 * t * h + 4 * t + (12 * t * h + a) // p
        return Figures(FP32 * params, FP32 * saved, FP32 * 2 * t * h, FP32 * 2 * t * h)
    if is_cube(mode):
        return cube_formula(h, p, q, keeps(mode))
    m = t // (d * q)  # rows of a rank's activation block
    params = 12 * h * h // (q * q) + 13 * h // q
    saved = (16 * t * h + a) // p + 2 * m
    fwd = bwd = 0
    for i, o in LINEARS:
        n_in, n_out = i * h, o * h
        x, y = m * n_in // q, m * n_out // q  # input and output blocks
        w, b = n_in * n_out // (q * q), n_out // q  # weight and bias blocks
        if variant(m, n_in // q) == "stationary":
            c = q - 1 if diagonal else q  # the ranks of mesh row j, less this one
            fwd += c * x + (q - 1) * y  # X to the ranks multiplying it; partial Y scattered
            bwd += (q - 1) * y + 2 * c * x  # dY gathered; X sent again; partial dX sent back
        else:  # SUMMA: every exchange over q ranks sends q - 1 blocks
            fwd += (q - 1) * (x + w)  # X gathered along the row, W along the column
            bwd += (q - 1) * (w + x)  # both gathered again
            bwd += (q - 1) * (w + b) + (q - 1) * x  # dW (db packed) and dX reduce-scattered
        if d > 1:
            bwd += w + b  # dW and db summed over depth in one all-reduce
    for _ in range(2):  # LayerNorms
        fwd += (q - 1) * 2 * m  # (mean, M2) [m, 2] gathered over the row
        bwd += 2 * m + 2 * h // q  # row sums [m, 2] over the row; dweight, dbias over batch
    return Figures(FP32 * params, FP32 * saved, FP32 * fwd, FP32 * bwd)


def cube_formula(h: int, p: int, q: int, keep: bool = False) -> Figures:
    """3D's per-rank figures (every rank alike); see FORMULAS.

    ``keep``: each Linear also saves what its forward gathered (the weights staying: the input
    plane's rows ``q^2 n k``; the operands travelling: the rows and the weight ``q (nk + ok)``),
    and its backward gathers none of it again.
    """
    t, a = BATCH * SEQ, BATCH * HEADS * SEQ * SEQ
    n = t // (q * q)  # rows of a rank's activation block
    params = 12 * h * h // p + 13 * h // q
    saved = (16 * t * h + a) // p + 2 * n
    fwd = bwd = 0
    for i, o in LINEARS:
        k, r = i * h // q, o * h // (q * q)  # input features, weight rows per rank
        x, w, y = n * k, r * k, n * q * r  # input, weight and output blocks
        again = 0 if keep else 1  # the backward gathers the forward's operands again
        if cube_variant(n, k, r, q, keep) == "stationary":
            plane = q * q - 1  # the other ranks of the input (output) plane
            fwd += plane * (x + n * r)  # X gathered over the input plane; partials all-to-all
            bwd += plane * (n * r + (1 + again) * x)  # dY back; X again; partial dX scattered
            bwd += (q - 1) * r  # the complete bias slices gathered over WEIGHT
            saved += 0 if again else q * q * x  # the input plane's rows
        else:  # operands travel: every exchange over q ranks sends q - 1 blocks
            fwd += (q - 1) * (x + w + y)  # X over the batch axis, W over WEIGHT; Y scattered
            bwd += (q - 1) * (y + again * (w + x))  # dY (W and X) gathered again
            bwd += (q - 1) * x + (q - 1) * (w + q * r)  # dX; dW with db [out/q] in each chunk
            saved += 0 if again else q * (x + w)  # the gathered rows and weight
    for _ in range(2):  # LayerNorms: hidden axis of q ranks, batch group of q^2
        fwd += (q - 1) * 2 * n
        bwd += 2 * n + 2 * h // q
    return Figures(FP32 * params, FP32 * saved, FP32 * fwd, FP32 * bwd)


FORMULAS = """\
Formulas (elements; x4 bytes). T = b*s tokens, A = b*heads*s^2 scores, P ranks, 2D/2.5D mesh
q x q (x d), m = T/(d*q) rows per rank; 3D cube q x q x q, n = T/q^2 rows per rank. Block:
12h^2 weights, 13h biases + LayerNorm vectors.
  params   none 12h^2 + 13h
           1D   12h^2/P + 7h/P + 6h: qkv/fc1 split by output with their biases, proj/fc2 by
                input, their biases and both LayerNorms replicated (Shoeybi et al. 2019,
                Megatron-LM, section 3)
           2D   12h^2/q^2 + 13h/q: every weight in q x q blocks, [h] vectors split over the
                mesh row, replicated over the column (Xu et al. 2021, "An Efficient 2D Method
                for Training Super-Large Deep Learning Models", section 3)
           2.5D the same per depth layer, weights replicated over depth: P = q^2 d ranks hold
                d copies (Wang et al. 2021, "Tesseract", section 3)
           3D   12h^2/P + 13h/q: weights [out/q^2, in/q], a distinct 1/P on every rank, [h]
                vectors split over one cube axis, replicated over the other two (Bian et al.
                2021, "Maximizing Parallelism in Distributed Training for Huge Neural
                Networks", section 3)
  saved    none 16Th + A + 4T: LN inputs 2Th, qkv/fc1 inputs 2Th, contiguous q,k,v 3Th,
                proj input Th, GeLU input 4Th, fc2 input 4Th, softmax output A, LN mean+rstd 4T
           1D   4Th + 4T + (12Th + A)/P: outside the column/row-parallel regions (LayerNorm
                inputs, qkv/fc1 inputs) activations are replicated (Megatron-LM; counted as in
                Korthikanti et al. 2022, section 4.2.1, "tensor parallel" case)
           2D, 2.5D (16Th + A)/P + 2m: every activation in [T/(dq), h/q] blocks (Xu et al.,
                Wang et al.); tessera's LayerNorm saves x-hat [m, h/q] and rstd [m]
           3D   (16Th + A)/P + 2n: every activation in [T/q^2, h/q] blocks (Bian et al.), the
                LayerNorm as 2D; at q = 2, 2n = 4T/P: exactly single-process / P
  comm     1D   fwd 2Th, bwd 2Th: all-reduce after proj and fc2 (g), and of the input
                gradients of qkv and fc1 (f) (Megatron-LM, section 3, Figure 4)
           2D   per Linear(in, out), blocks X = m*in/q (input), Y = m*out/q (output),
                W = in*out/q^2 (weight), b = out/q (bias). tessera.layers.mesh_linear runs the
                variant of SUMMA (van de Geijn and Watts 1997) that sends less: the weights
                stay when 2m < 3 in/q (choose_algorithm in training), else they travel. On
                gloo a gather or reduce-scatter over q ranks sends each of the other q-1 its
                block (one exchange: a gloo all-to-all), q-1 blocks.
                weights stay: fwd c*X + (q-1)*Y (this rank's X block to the c ranks of mesh
                row j that multiply it, c = q, or q-1 at a diagonal rank (i, i); the partial
                outputs reduce-scattered over the column); bwd (q-1)*Y + 2c*X (dY gathered
                over the column, X sent again, the partial dX sent back); dW, db complete.
                weights travel (SUMMA, Xu et al. 2021): fwd (q-1)(X + W) (X gathered along
                the row, W along the column); bwd (q-1)(W + X) (gathered again), (q-1)(W + b)
                (dW with db packed into each chunk, reduce-scattered over the column), (q-1)X
                (dX reduce-scattered over the row).
                per LayerNorm fwd (q-1)*2m ((mean, M2) [m, 2] gathered over the row, merged
                as Chan et al. 1979), bwd 2m + 2h/q (one all-reduce of the row sums [m, 2]
                over the row, one of the weight and bias gradients over the batch group)
           2.5D the same on each depth layer with m = T/(dq), plus W + b per Linear in the
                backward: weight and bias gradients summed over depth in one all-reduce
                (Wang et al. 2021, section 3)
           3D   per Linear(in, out), n rows, k = in/q features, o = out/q^2 weight rows per
                rank; blocks X = n*k (input), W = o*k (weight), Y = n*q*o (output [n, out/q]).
                tessera.layers.cube_linear runs the variant that sends less: the weights stay
                when 3qnk + 2no < 3ok (choose_cube_algorithm in training), else the operands
                travel. On gloo every gather, scatter and all-to-all over w ranks sends w-1
                blocks (one exchange: a gloo all-to-all).
                operands travel (Bian et al. 2021): fwd (q-1)(X + W + Y) (X gathered over the
                other batch axis, W over WEIGHT, the partial [qn, out/q] reduce-scattered over
                the hidden axis); bwd (q-1)(Y + W + X) (gathered again), (q-1)X (dX reduce-
                scattered), (q-1)(W + q*o) (dW reduce-scattered over WEIGHT, each chunk
                carrying the partial db [out/q]).
                weights stay: fwd (q^2-1)(X + n*o) (X gathered over the input plane, the q^2
                ranks of its batch group; the partials [q^2, n, o] all-to-all over the output
                plane); bwd (q^2-1)(n*o + 2X) (dY all-to-all back, X gathered again, the
                partial dX reduce-scattered over the input plane), (q-1)*o (the complete db
                slices gathered over WEIGHT); dW complete where it is.
                per LayerNorm as 2D with n rows: fwd (q-1)*2n, bwd 2n + 2h/q (over the hidden
                axis, q ranks; the weight and bias gradients over the batch group, q^2)
           3D kept (keep_gathered_operands): the weights stay when qnk + no < ok; the
                backward gathers nothing again (operands travel: no (q-1)(W + X); weights
                stay: no (q^2-1)X), and each Linear saves q(X + W) (the gathered rows and
                weight) or q^2 X (the input plane's rows) more
Contributed bytes: the bytes of this rank's own data entering a call (whole buffer of an
all-reduce / reduce / reduce-scatter, input chunk of an all-gather, the source's buffer of a
broadcast, the tensors an exchange or a batch_isend_irecv sends); see benchmarks/meters.py."""


# ---------------------------------------------------------------------------- measuring


def full_input(h: int) -> torch.Tensor:
    return torch.randn(BATCH, SEQ, h, generator=torch.Generator().manual_seed(0))


def build(h: int, context: Any, keep: bool = False) -> tuple[nn.Module, torch.Tensor]:
    """The block and this rank's block of the input, a leaf that needs a gradient.

    The input needs a gradient as a block in the middle of a network does, so the backward
    computes (and communicates) the input gradient too. ``keep``: its Linear3D layers keep
    their gathered operands.
    """
    from tessera.layers import keep_gathered_operands, split_activation

    torch.manual_seed(0)
    block = Block(h, HEADS, context=context)
    if keep:
        keep_gathered_operands(block)
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
    built = {m: build(h, ctx, keeps(m)) for m, ctx in contexts.items()}
    result: dict[str, Any] = {m: measure(*built[m], counter) for m in modes}
    if steps > 0:  # main asks for it with modes == ["1D(4)", "2D(4)"] only
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
        for rank, got in enumerate(figs):  # every rank against the formula of its position
            exp = formula(mode, h, on_diagonal(mode, rank))
            for name in ("params", "saved", "comm_fwd", "comm_bwd"):
                g, e = getattr(got, name), getattr(exp, name)
                if g != e:
                    where = f"{mode} rank {rank} {name.replace('_', ' ')}"
                    notes.append(f"{where}: measured {g} B, formula {e} B ({g - e:+d} B)")
    print(
        "\nGoals: saved activations of 2D and 2.5D <= 1.15 x (single-process / P), of 3D "
        "= single-process / P (the /(1/P) column); 1D keeps full activations outside its "
        "parallel regions; communication = the formula (meas/formula 1.000)."
    )
    for mode in ("2D(4)", "2.5D(8,d=2)", "3D(8)"):
        if mode in measured:
            p = MODES[mode][1]
            most = max(r["figures"]["saved"] for r in measured[mode])
            x = most / (base.saved / p)
            if is_cube(mode):
                exact = most * p == base.saved
                verdict = (
                    "met (to the byte)" if exact else f"MISSED ({most * p - base.saved:+d} B x P)"
                )
            else:
                verdict = "met" if x <= 1.15 else "MISSED"
            print(f"  {mode}: saved = {x:.3f} x (single-process / P): {verdict}")
    print(
        "\nMeasured against formula, exactly (bytes):"
        if notes
        else "\nEvery figure equals its formula to the byte."
    )
    for note in notes:
        print("  " + note)
    print(variants_note(h, list(measured)))
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


def variants_note(h: int, modes: list[str]) -> str:
    """Which variant each Linear runs under the mesh and cube modes, and whether tessera agrees."""
    from tessera.layers import choose_algorithm, choose_cube_algorithm

    lines = [
        "\nLinear variants (2D/2.5D: m rows per rank against in/q, weights stay when 2m < 3 "
        "in/q;\n3D: n rows, k = in/q, o = out/q^2 per rank, weights stay when 3qnk + 2no < 3ok,"
        "\nkept: when qnk + no < ok):"
    ]
    for mode in modes:
        _, _, q, d = MODES[mode]
        if q == 0:
            continue
        if is_cube(mode):
            n = BATCH * SEQ // (q * q)
            blocks = [(i * h // q, o * h // (q * q)) for i, o in LINEARS]
            keep = keeps(mode)
            picked = [cube_variant(n, k, o, q, keep) for k, o in blocks]
            tessera = [
                choose_cube_algorithm(n, k, o, q, backward=True, keep=keep) for k, o in blocks
            ]
            a, b = (1, 1) if keep else (3, 2)  # keeping: qnk + no < ok
            text = ", ".join(
                f"{name} {v} ({a * q * n * k + b * n * o} "
                f"{'<' if v == 'stationary' else '>='} {a * o * k})"
                for name, v, (k, o) in zip(LINEAR_NAMES, picked, blocks, strict=True)
            )
            agree = "as tessera.layers.choose_cube_algorithm"
            lines.append(
                f"  {mode:<12} n = {n}: {text}\n{'':<15}("
                + (agree if picked == tessera else "choose_cube_algorithm DIFFERS")
                + ")"
            )
            continue
        m = BATCH * SEQ // (d * q)
        picked = [variant(m, i * h // q) for i, _ in LINEARS]
        agree = picked == [choose_algorithm(m, i * h // q, backward=True) for i, _ in LINEARS]
        text = ", ".join(f"{n} {v}" for n, v in zip(LINEAR_NAMES, picked, strict=True))
        lines.append(
            f"  {mode:<12} m = {m}: {text} ("
            + ("as tessera.layers.choose_algorithm" if agree else "choose_algorithm DIFFERS")
            + ")"
        )
    return "\n".join(lines)


def two_d_elements(h: int, q: int) -> Fraction:
    """Elements the busiest rank of a q x q 2D mesh sends per block, LayerNorms aside.

    Per Linear, weights staying: ``3q X + 2(q-1) Y = 3 T in/q + 2(q-1) T out/q^2``; SUMMA:
    ``(q-1)(3X + 3W + b)``. With ``m = T/q`` the choice ``2m < 3 in/q`` is ``T < 1.5 in``.
    """
    t, total = BATCH * SEQ, Fraction(0)
    for i, o in LINEARS:
        n_in, n_out = i * h, o * h
        if variant(t, n_in) == "stationary":
            total += Fraction(3 * t * n_in, q) + Fraction(2 * (q - 1) * t * n_out, q * q)
        else:
            total += Fraction((q - 1) * 3 * (t * n_in + n_in * n_out), q * q)
            total += Fraction((q - 1) * n_out, q)
    return total


def volume_note(h: int) -> str:
    """2D(4)'s bytes against 1D(4)'s, from the formulas (no measurement involved)."""
    t, q = BATCH * SEQ, MODES["2D(4)"][2]
    two, one = formula("2D(4)", h).comm, formula("1D(4)", h).comm
    stay = [n for n, (i, _) in zip(LINEAR_NAMES, LINEARS, strict=True) if 2 * t < 3 * i * h]
    below = next((s for s in range(2, 1025) if two_d_elements(h, s) < 4 * t * h), None)
    cross = f"less from q = {below} on" if below else "more for every q up to 1024"
    kept = "all four" if len(stay) == len(LINEARS) else ", ".join(stay) or "none"
    return (
        f"\nVolume: 2D(4) contributes {two / one:.2f}x the bytes of 1D(4) (T = b*s = {t}, "
        f"h = {h}). In 2D m = T/q, so a Linear keeps its weights exactly when T < 1.5 in, "
        f"whatever q (here: {kept}). Then "
        "the busiest rank sends 3q input blocks and 2(q-1) output blocks, 3T in/q + "
        "2(q-1) T out/q^2, and no weight; under SUMMA (q-1)(3T in + 3 in out)/q^2 + "
        "(q-1) out/q, the weights travelling. Summed over the block (LayerNorm statistics "
        f"aside) against 1D's 4Th: {float(two_d_elements(h, q) / (4 * t * h)):.2f}x at q = {q}, "
        f"{cross}."
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--steps", type=int, default=20, help="timed steps of 1D(4) and 2D(4) (0: no timing)"
    )
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument(
        "--modes",
        nargs="+",
        choices=[m for m in MODES if m != "none"],
        default=[m for m in MODES if m != "none"],
        help="the tensor modes to measure (default: all); none is always measured",
    )
    args = parser.parse_args()
    h = args.hidden
    torch.set_num_threads(1)
    block, x = build(h, None)
    measured: dict[str, list[dict[str, Any]]] = {"none": [measure(block, x, None)]}
    times: dict[str, float] = {}
    for world in sorted({MODES[m][1] for m in args.modes}):  # one set of processes per size
        modes = [m for m in MODES if m in args.modes and MODES[m][1] == world]
        timed = args.steps if world == 4 and modes == ["1D(4)", "2D(4)"] else 0
        ranks = run_ranks(worker, world, modes, h, timed)
        for mode in modes:
            measured[mode] = [r[mode] for r in ranks]
        if timed:
            times = {k: max(r["time"][k] for r in ranks) for k in ("1D(4)", "2D(4)")}
    report(h, measured, times)


if __name__ == "__main__":
    main()
