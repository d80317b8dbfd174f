"""2D, 2.5D and 3D tensor parallelism: tessera against Colossal-AI's legacy layers, side by side.

Colossal-AI (``colossalai`` from the package index, installed by ``nox -s bench`` into the bench
environment only) is the system whose 2D (Xu et al. 2021), 2.5D (Wang et al. 2021, Tesseract) and
3D (Bian et al. 2021) layers tessera reconstructs. Its ``colossalai.legacy.nn`` Linear2D /
Linear2p5D / Linear3D and LayerNorm2D / LayerNorm2p5D / LayerNorm3D run here on CPU + gloo by
the run-time patches of ``colossal_patches.py`` (this process only, nothing on disk).

Two blocks, each written once and built from each implementation's layers, batch 16 x seq 16,
fp32, one torch thread per rank, one training step = forward + backward + SGD step:

* ``mlp``: LayerNorm -> Linear h->4h -> GELU -> Linear 4h->h;
* ``block``: a pre-LN transformer block (LayerNorm, qkv Linear, softmax attention over the heads
  the rank holds, proj Linear, residual, LayerNorm, the MLP, residual), heads = hidden / 64.

Per mode (2D on 4 ranks, 2.5D on 8 ranks with depth 2, 3D on 8 ranks), in one set of processes:
tessera's layers of the mode, Colossal-AI's, tessera 1D on the same ranks and torch's DTensor
tensor parallelism (``parallelize_module``, ColwiseParallel / RowwiseParallel) on the same block.
Under 3D also tessera with ``keep_gathered_operands``: Colossal-AI's ``Linear3D`` saves the
input and weight it gathered for its backward, tessera by default only its own blocks (a third
of Colossal-AI's saved activations here) and gathers them again; kept, tessera makes the same
trade.
Colossal-AI's Linear2p5D omits the all-reduce of weight gradients over the depth layers (each
depth layer trains on its own share of the batch): the Colossal-AI side here adds it, one
all-reduce of all its gradients over the depth group after the backward, so both compute the same.
tessera's side sums them (and its LayerNorms' affine gradients, in every mode) as its engine
does, once per step and bucketed (``DeferredSumGradientHandler``), instead of one all-reduce
per layer inside autograd.

Before timing, every implementation is loaded with the same full weights (cut from one
single-process torch module: tessera through ``load_full_state_dict``, Colossal-AI's shards
cut here from its layers' documented layouts, torch TP by ``parallelize_module`` of the loaded
module), fed the same input, and its output, input gradient and every parameter gradient are
compared with the single-process reference (each rank's block against the same block of the
reference, max over ranks). An implementation further than 1e-4 relative from the reference is
not timed. Then the four alternate step by step (order rotating), medians over the steps (of
the slowest rank), printed as a table with the ratios (goal: tessera / Colossal-AI <= 0.8).

    python benchmarks/bench_colossal.py [--steps 10] [--hidden 512 1024] [--modes 2d 2.5d 3d]
                                        [--blocks mlp block]

Without colossalai installed it says so and exits 0.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from colossal_patches import available, init_legacy_context, legacy_nn
from meters import run_ranks
from torch import nn

BATCH, SEQ, HEAD_DIM = 16, 16, 64
TOLERANCE = 1e-4  # relative to the largest magnitude of the reference tensor
TIMEOUT = timedelta(seconds=300)
WARMUP = 2

#: mode -> (label, ranks, tessera / Colossal-AI tensor mode, depth)
MODES: dict[str, tuple[str, int, str, int | None]] = {
    "2d": ("2D", 4, "2d", None),
    "2.5d": ("2.5D", 8, "2.5d", 2),
    "3d": ("3D", 8, "3d", None),
}
BLOCKS = ("mlp", "block")
IMPLS = ("tessera", "colossal", "tessera-1d", "torch-tp")

Make = Callable[[int, int, str], nn.Module]  # (in, out, "col" | "row") -> a linear layer
Norm = Callable[[int], nn.Module]


# ---------------------------------------------------------------------------- the two blocks


class MLP(nn.Module):
    """LayerNorm -> Linear h->4h -> GELU -> Linear 4h->h."""

    def __init__(self, hidden: int, make: Make, norm: Norm) -> None:
        super().__init__()
        self.ln = norm(hidden)
        self.fc1 = make(hidden, 4 * hidden, "col")
        self.fc2 = make(4 * hidden, hidden, "row")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.fc2(F.gelu(self.fc1(self.ln(x))))
        return out


class Block(nn.Module):
    """A pre-LN transformer block; attention over the heads in this rank's qkv features.

    The qkv features are head-major (``[heads, 3, head_dim]``), so a split of them along the
    hidden dim (1D, DTensor TP, every 2D / 2.5D / 3D layout) hands each rank whole heads.
    Layers are built in forward order (Colossal-AI's 3D layers alternate their layout in that
    order).
    """

    def __init__(self, hidden: int, make: Make, norm: Norm) -> None:
        super().__init__()
        self.ln1 = norm(hidden)
        self.qkv = make(hidden, 3 * hidden, "col")
        self.proj = make(hidden, hidden, "row")
        self.ln2 = norm(hidden)
        self.fc1 = make(hidden, 4 * hidden, "col")
        self.fc2 = make(4 * hidden, hidden, "row")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(self.ln1(x))
        b, s, _ = qkv.shape
        q, k, v = qkv.view(b, s, -1, 3, HEAD_DIM).permute(3, 0, 2, 1, 4)  # [b, heads', s, d]
        probs = ((q @ k.transpose(-1, -2)) / HEAD_DIM**0.5).softmax(dim=-1)
        x = x + self.proj((probs @ v).transpose(1, 2).reshape(b, s, -1))
        out: torch.Tensor = x + self.fc2(F.gelu(self.fc1(self.ln2(x))))
        return out


def build(block: str, hidden: int, make: Make, norm: Norm) -> nn.Module:
    return MLP(hidden, make, norm) if block == "mlp" else Block(hidden, make, norm)


def reference(block: str, hidden: int) -> nn.Module:
    """The single-process module every implementation is loaded from (random LayerNorms too)."""
    torch.manual_seed(hidden + len(block))
    model = build(block, hidden, lambda i, o, _: nn.Linear(i, o), nn.LayerNorm)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith("ln"):
                p.add_(0.1 * torch.randn_like(p))
    return model


def full_tensors(hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The input and the loss weights ``g`` (loss = sum(output * g)), the same on every rank."""
    g = torch.Generator().manual_seed(hidden)
    shape = (BATCH, SEQ, hidden)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


# ---------------------------------------------------------------------------- implementations

Slicer = Callable[[torch.Tensor], torch.Tensor]


def _nothing() -> None:
    pass


def _local_grad(p: torch.Tensor) -> torch.Tensor:
    assert p.grad is not None
    return p.grad


@dataclass
class Impl:
    """One implementation of a block on this rank, and how to compare it with the reference.

    ``split`` maps a full activation to this rank's block; ``shards`` maps each parameter name
    to (full tensor -> this rank's shard, whether this rank's gradient of it is meaningful);
    ``grad`` reads a parameter's local gradient; ``before_forward`` runs before each forward and
    ``after_backward`` after each backward.
    """

    model: nn.Module
    split: Slicer
    shards: dict[str, tuple[Slicer, bool]]
    grad: Callable[[torch.Tensor], torch.Tensor] = _local_grad
    after_backward: Callable[[], None] = _nothing
    before_forward: Callable[[], None] = _nothing
    params: list[torch.Tensor] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.params = list(self.model.parameters())


def tessera_impl(
    block: str, hidden: int, ref: nn.Module, ctx: Any, *, keep_gathered: bool = False
) -> Impl:
    from tessera.context import get_shard_info
    from tessera.engine import DeferredSumGradientHandler
    from tessera.layers import (
        LayerNorm,
        Linear,
        keep_gathered_operands,
        load_full_state_dict,
        split_activation,
    )

    model = build(
        block,
        hidden,
        lambda i, o, kind: Linear(i, o, parallel=kind, context=ctx),
        lambda h: LayerNorm(h, context=ctx),
    )
    load_full_state_dict(model, ref.state_dict())
    if keep_gathered:  # 3D: the backward reuses the forward's gathered operands
        keep_gathered_operands(model)

    def shard(p: torch.Tensor) -> Slicer:
        info = get_shard_info(p)
        return (lambda t: t) if info is None else (lambda t: t[info.slices])

    shards = {name: (shard(p), True) for name, p in model.named_parameters()}
    # 2.5D's depth sums and the LayerNorms' affine sums as the engine runs them: once per
    # step, every layer in one bucket per group (DeferredSumGradientHandler), not one
    # all-reduce per layer inside autograd
    handler = DeferredSumGradientHandler(model, context=ctx)
    if not handler.sums:
        return Impl(model, lambda x: split_activation(x, context=ctx), shards)

    def after() -> None:
        handler.after_backward()  # what the backward started (overlap), then the rest
        handler.handle_gradient()

    return Impl(
        model,
        lambda x: split_activation(x, context=ctx),
        shards,
        after_backward=after,
        before_forward=functools.partial(handler.before_backward, True),
    )


def torch_tp_impl(block: str, hidden: int, ref: nn.Module, mesh: Any) -> Impl:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    model = build(block, hidden, lambda i, o, _: nn.Linear(i, o), nn.LayerNorm)
    model.load_state_dict(ref.state_dict())
    plan: dict[str, Any] = {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}
    if block == "block":
        plan.update(qkv=ColwiseParallel(), proj=RowwiseParallel())
    parallelize_module(model, mesh, plan)

    def grad(p: torch.Tensor) -> torch.Tensor:
        g = p.grad
        assert g is not None
        return g.full_tensor() if isinstance(g, DTensor) else g

    shards = {name: ((lambda t: t), True) for name, _ in model.named_parameters()}
    return Impl(model, lambda x: x, shards, grad=grad)


def colossal_impl(block: str, hidden: int, ref: nn.Module, mode: str) -> Impl:
    """Colossal-AI's layers of ``mode``, loaded with the reference's weights cut to its layouts.

    Layouts, from its layers' ``_load_from_global_state_dict`` and forward ops (a weight is
    stored transposed, ``[in/.., out/..]``):

    * 2D, rank ``(i, j)`` = (local rank in PARALLEL_2D_COL, in PARALLEL_2D_ROW): activation
      ``[b/q, s, h/q]`` block (i, j); weight block (i, j) of W^T; bias and LayerNorm vectors
      chunk j of q, then chunk i of q of that.
    * 2.5D, rank ``(i, j, k)`` with k the depth: activation batch block ``k q + i`` of ``d q``
      (the depth layers train on different rows), hidden block j; weight block (i, j) of W^T in
      every depth layer; bias and LayerNorm vectors chunk j of q, used from row i = 0 only
      (the others receive them by broadcast and get no gradient).
    * 3D, per Linear3D its (input, weight, output) groups at construction (they alternate from
      one layer to the next), ranks ``(a, w, c)``: weight rows block ``c q + w`` of q^2 and
      columns block a of W^T; bias chunk a; LayerNorm3D vectors chunk c of its output group;
      the block's input (and output) rows block ``w q + a`` of q^2, hidden block c (the first
      LayerNorm's groups).
    """
    legacy = legacy_nn()
    from colossalai.legacy.context import ParallelMode
    from colossalai.legacy.core import global_context as gpc

    suffix = {"2d": "2D", "2.5d": "2p5D", "3d": "3D"}[mode]
    linear_cls, norm_cls = getattr(legacy, "Linear" + suffix), getattr(legacy, "LayerNorm" + suffix)
    model = build(block, hidden, lambda i, o, _: linear_cls(i, o), lambda h: norm_cls(h, eps=1e-5))
    rank = gpc.get_local_rank
    shards: dict[str, tuple[Slicer, bool]] = {}
    after_backward: Callable[[], None] = _nothing
    if mode in ("2d", "2.5d"):
        col, row, dep = (
            (ParallelMode.PARALLEL_2D_COL, ParallelMode.PARALLEL_2D_ROW, None)
            if mode == "2d"
            else (
                ParallelMode.PARALLEL_2P5D_COL,
                ParallelMode.PARALLEL_2P5D_ROW,
                ParallelMode.PARALLEL_2P5D_DEP,
            )
        )
        i, j, q = rank(col), rank(row), gpc.get_world_size(row)
        k, d = (0, 1) if dep is None else (rank(dep), gpc.get_world_size(dep))
        for name, module in model.named_children():
            if mode == "2d":
                vector: tuple[Slicer, bool] = (lambda t: t.chunk(q)[j].chunk(q)[i], True)
            else:
                vector = (lambda t: t.chunk(q)[j], i == 0)
            shards[f"{name}.bias"] = vector
            shards[f"{name}.weight"] = (
                ((lambda t: t.t().chunk(q, 0)[i].chunk(q, 1)[j]), True)
                if isinstance(module, linear_cls)
                else vector
            )

        def split(x: torch.Tensor) -> torch.Tensor:
            return x.chunk(d * q, 0)[k * q + i].chunk(q, -1)[j]

        if dep is not None:
            after_backward = functools.partial(all_reduce_grads, model, gpc.get_group(dep))
    else:
        q = gpc.get_world_size(ParallelMode.PARALLEL_3D_INPUT)
        for name, module in model.named_children():
            a, c = rank(module.input_parallel_mode), rank(module.output_parallel_mode)
            if isinstance(module, linear_cls):
                w = rank(module.weight_parallel_mode)
                shards[f"{name}.weight"] = (
                    lambda t, a=a, w=w, c=c: t.t().chunk(q * q, 0)[c * q + w].chunk(q, 1)[a],
                    True,
                )
                shards[f"{name}.bias"] = (lambda t, a=a: t.chunk(q)[a], True)
            else:
                shards[f"{name}.weight"] = shards[f"{name}.bias"] = (
                    lambda t, c=c: t.chunk(q)[c],
                    True,
                )
        first = next(iter(model.children()))
        a0, w0 = rank(first.input_parallel_mode), rank(first.weight_parallel_mode)
        c0 = rank(first.output_parallel_mode)

        def split(x: torch.Tensor) -> torch.Tensor:
            return x.chunk(q * q, 0)[w0 * q + a0].chunk(q, -1)[c0]

    full = ref.state_dict()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(shards[name][0](full[name]))
    return Impl(model, split, shards, after_backward=after_backward)


def all_reduce_grads(model: nn.Module, group: Any) -> None:
    """Sum every gradient over ``group`` in one all-reduce (Colossal-AI's omitted depth sum)."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


# ---------------------------------------------------------------------------- check and time


def check(impl: Impl, ref: nn.Module, hidden: int) -> dict[str, float]:
    """Max abs and relative error of output, input gradient and parameter gradients (local)."""
    x_full, g_full = full_tensors(hidden)
    x_ref = x_full.clone().requires_grad_()
    y_ref = ref(x_ref)
    ref.zero_grad(set_to_none=True)
    (y_ref * g_full).sum().backward()
    x = impl.split(x_full).detach().clone().requires_grad_()
    impl.model.zero_grad(set_to_none=True)
    impl.before_forward()
    y = impl.model(x)
    (y * impl.split(g_full)).sum().backward()
    impl.after_backward()
    worst = {"out": 0.0, "grad": 0.0, "rel": 0.0}

    def compare(kind: str, got: torch.Tensor, want: torch.Tensor, full: torch.Tensor) -> None:
        err = float((got.detach() - want).abs().max())
        worst[kind] = max(worst[kind], err)
        worst["rel"] = max(worst["rel"], err / max(float(full.abs().max()), 1e-30))

    assert x_ref.grad is not None and x.grad is not None
    compare("out", y, impl.split(y_ref.detach()), y_ref.detach())
    compare("grad", x.grad, impl.split(x_ref.grad), x_ref.grad)
    ref_grads = {name: p.grad for name, p in ref.named_parameters()}
    for name, p in impl.model.named_parameters():
        cut, owned = impl.shards[name]
        full = ref_grads[name]
        assert full is not None and p.grad is not None, f"{name} has no gradient"
        if owned:
            compare("grad", impl.grad(p), cut(full), full)
    impl.model.zero_grad(set_to_none=True)
    return worst


def step(impl: Impl, opt: torch.optim.Optimizer, x: torch.Tensor, g: torch.Tensor) -> float:
    dist.barrier()
    start = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    impl.before_forward()
    (impl.model(x) * g).sum().backward()
    impl.after_backward()
    opt.step()
    dist.barrier()
    return time.perf_counter() - start


def time_impls(impls: dict[str, Impl], hidden: int, steps: int) -> dict[str, float]:
    """Median step time of each implementation, alternating step by step, order rotating."""
    x_full, g_full = full_tensors(hidden)
    inputs = {
        k: (im.split(x_full).detach().clone().requires_grad_(), im.split(g_full))
        for k, im in impls.items()
    }
    opts = {k: torch.optim.SGD(im.params, lr=1e-3) for k, im in impls.items()}
    times: dict[str, list[float]] = {k: [] for k in impls}
    names = list(impls)
    for n in range(WARMUP + steps):
        for k in names[n % len(names) :] + names[: n % len(names)]:
            t = step(impls[k], opts[k], *inputs[k])
            if n >= WARMUP:
                times[k].append(t)
    return {k: statistics.median(v) for k, v in times.items()}


def max_over_ranks(values: dict[str, float]) -> dict[str, float]:
    keys = sorted(values)
    t = torch.tensor([values[k] for k in keys], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return dict(zip(keys, t.tolist(), strict=True))


def worker(
    rank: int,
    world: int,
    port: int,
    mode: str,
    hiddens: list[int],
    blocks: list[str],
    steps: int,
) -> dict[str, Any]:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=TIMEOUT)
    from torch.distributed.device_mesh import init_device_mesh

    from tessera.context import create_context

    _, _, tensor_mode, depth = MODES[mode]
    tensor: dict[str, Any] = dict(size=world, mode=tensor_mode)
    if depth is not None:
        tensor["depth"] = depth

    def context(t: dict[str, Any]) -> Any:
        return create_context(
            dict(parallel=dict(tensor=t)), timeout=TIMEOUT, heartbeat_interval=None
        )

    ctx, ctx_1d = context(tensor), context(dict(size=world, mode="1d"))
    mesh = init_device_mesh("cpu", (world,))
    init_legacy_context(tensor_mode, world, depth)
    results: dict[str, Any] = {}
    for hidden in hiddens:
        for block in blocks:
            ref = reference(block, hidden)
            impls = {
                "tessera": tessera_impl(block, hidden, ref, ctx),
                "colossal": colossal_impl(block, hidden, ref, tensor_mode),
            }
            if tensor_mode == "3d":  # Colossal-AI's 3D layers keep their gathered operands
                impls["tessera-kept"] = tessera_impl(block, hidden, ref, ctx, keep_gathered=True)
            if block == "mlp" or (hidden // HEAD_DIM) % world == 0:  # 1D splits the heads
                impls["tessera-1d"] = tessera_impl(block, hidden, ref, ctx_1d)
                impls["torch-tp"] = torch_tp_impl(block, hidden, ref, mesh)
            errors = {k: max_over_ranks(check(im, ref, hidden)) for k, im in impls.items()}
            passed = [k for k in impls if errors[k]["rel"] <= TOLERANCE]
            if "tessera" in passed and "colossal" in passed:
                timed = {k: impls[k] for k in passed}
                times = max_over_ranks(time_impls(timed, hidden, steps))
            else:
                times = {}
            results[f"{block} {hidden}"] = {"errors": errors, "times": times}
            del impls
    ctx.destroy()
    ctx_1d.destroy()
    dist.destroy_process_group()
    return results


# ---------------------------------------------------------------------------- report


def ms(t: float | None) -> str:
    return "-" if t is None else f"{t * 1e3:.1f}"


def ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or b is None else f"{a / b:.2f}"


def report(mode: str, results: dict[str, Any], rows: list[str]) -> None:
    label, world, _, depth = MODES[mode]
    name = f"{label}({world}" + (f",d={depth})" if depth else ")")
    print(f"\n{name}: correctness against the single-process reference (max over ranks)")
    for key, result in results.items():
        for impl, e in result["errors"].items():
            verdict = "ok" if e["rel"] <= TOLERANCE else "DIFFERS: not timed"
            print(
                f"  {key:<11} {impl:<10} output {e['out']:.1e}  gradients {e['grad']:.1e}  "
                f"max relative {e['rel']:.1e}  {verdict}"
            )
        times: dict[str, float] = result["times"]
        ours, theirs = times.get("tessera"), times.get("colossal")
        one, tp, kept = times.get("tessera-1d"), times.get("torch-tp"), times.get("tessera-kept")
        block, hidden = key.split()
        rows.append(
            f"{name:<14} {block:<6} {hidden:>6} | {ms(ours):>8} {ms(theirs):>9} "
            f"{ratio(ours, theirs):>6} | {ms(kept):>6} {ratio(kept, theirs):>6} | "
            f"{ms(one):>7} {ratio(one, ours):>6} | {ms(tp):>7} {ratio(tp, ours):>6}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10, help="timed steps per implementation")
    parser.add_argument("--hidden", type=int, nargs="+", default=[512, 1024])
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    parser.add_argument("--blocks", nargs="+", choices=BLOCKS, default=list(BLOCKS))
    args, unknown = parser.parse_known_args()
    if unknown:  # nox -s bench hands every benchmark the same arguments
        print(f"bench_colossal: ignoring arguments for other benchmarks: {' '.join(unknown)}")
    missing = available()
    if missing is not None:
        print(
            f"bench_colossal: {missing}; skipping the Colossal-AI comparison "
            "(`nox -s bench` installs it into the bench environment)."
        )
        sys.exit(0)
    print(
        f"tessera against Colossal-AI (colossalai.legacy.nn), gloo on CPU, one thread per rank, "
        f"batch {BATCH} x seq {SEQ}, fp32, forward + backward + SGD step, {args.steps} steps "
        f"after {WARMUP} warm-up, implementations alternating step by step; heads = hidden/64."
    )
    print(
        "2.5D: Colossal-AI's Linear2p5D / LayerNorm2p5D omit the all-reduce of weight gradients "
        "over depth; the Colossal-AI side here adds it (one all-reduce of all its gradients "
        "over the depth group after each backward), so both compute the same step."
    )
    rows: list[str] = []
    for mode in args.modes:
        world = MODES[mode][1]
        ranks = run_ranks(worker, world, mode, args.hidden, args.blocks, args.steps)
        report(mode, ranks[0], rows)
    head = (
        f"{'mode':<14} {'block':<6} {'hidden':>6} | {'tessera':>8} {'colossal':>9} "
        f"{'ratio':>6} | {'kept':>6} {'kept/C':>6} | {'1D':>7} {'1D/t':>6} | {'torchTP':>7} "
        f"{'TP/t':>6}"
    )
    print("\nStep time, ms (median over steps, slowest rank)")
    print(head)
    print("-" * len(head))
    for row in rows:
        print(row)
    print(
        "ratio = tessera / Colossal-AI (goal <= 0.8); kept = tessera 3D with "
        "keep_gathered_operands (each backward reuses its forward's gathered operands, as "
        "Colossal-AI's Linear3D does, for more saved activations), kept/C its ratio; "
        "1D = tessera 1D (Megatron) and torchTP = "
        "torch DTensor parallelize_module (ColwiseParallel / RowwiseParallel) on the same ranks "
        "and block; 1D/t and TP/t = their time / tessera's time in the mode. '-': not run "
        "(heads not divisible by the ranks) or not timed (a correctness check failed)."
    )


if __name__ == "__main__":
    main()
