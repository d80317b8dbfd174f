"""One training run of a GPT under one layout, each rank held to a memory budget the OS enforces.

``run_trial(layout, size, budget)`` forks ``layout.world`` ranks of this process. Each joins a
gloo group, creates tessera's context, then takes its baseline: resident memory after imports
and process-group setup (torch's libraries, gloo's buffers), the part of a process no layout
changes. From there on:

* the operating system holds the rank to ``budget`` bytes more: ``RLIMIT_DATA``, which since
  Linux 4.7 counts every private writable mapping (the heap and every ``mmap`` of the
  allocator), is set to the baseline's data size plus the budget, so an allocation past it
  fails in torch's allocator (``RuntimeError: ... can't allocate memory``) and the run does not
  fit;
* the peak resident memory is reset (``/proc/self/clear_refs``) and read after the steps
  (``VmHWM``): the measured peak is its rise over the baseline.

The model is examples/gpt's (token and position embeddings, pre-LN blocks, LayerNorm and an
untied vocabulary-parallel head, tessera's vocabulary-parallel cross-entropy): the planner's
``ModelShape`` with ``tied_head=False``. It is built in the layout directly (each rank
allocates its own shards) and trained with Adam through tessera's engine (``initialize``),
ZeRO and all; activation checkpointing wraps each block in ``tessera.layers.checkpoint``.

glibc's allocator is pinned so that resident memory follows live tensors: one arena and a
fixed 64 KiB mmap threshold (every tensor past it is its own mapping, returned on free). The
variables are read when a process starts, so :func:`pin_allocator` re-executes the script
with them once. Linux only.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import resource
import sys
import tempfile
import traceback
import warnings
from dataclasses import dataclass, field, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from tessera.context.planner import DEFAULT_MACHINE, Layout, ModelShape, estimate_layout

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "gpt"))

__all__ = [
    "MACHINE",
    "RUNTIME",
    "RUNTIME_PER_BLOCK",
    "Size",
    "Trial",
    "pin_allocator",
    "planned_peak",
    "run_trial",
    "shape_of",
    "untensored",
]

TIMEOUT = timedelta(seconds=300)
ALLOCATOR = {"MALLOC_ARENA_MAX": "1", "MALLOC_MMAP_THRESHOLD_": "65536"}
MIB = 2**20
#: Where the ranks' own stderr goes (a rank's error reaches the report through its queue).
RANKS_LOG = os.path.join(tempfile.gettempdir(), "tessera-memory-trial-ranks.log")


@dataclass(frozen=True)
class Size:
    """The model and its global batch: examples/gpt's ``build_gpt`` arguments."""

    hidden: int
    depth: int
    heads: int = 8
    seq: int = 128
    vocab: int = 1024
    batch: int = 16


@dataclass
class Trial:
    """What one run under one layout did, per rank.

    Attributes:
        fits: Every rank finished its steps inside the budget.
        peaks: Each rank's peak resident bytes over its baseline during the training steps
            (0 where it failed): what the planner predicts.
        built: Each rank's peak while the model was built and handed to ``initialize``
            (every rank builds the whole model before ZeRO-3 shards it).
        errors: Each failing rank's error (``""`` where it finished).
        runtime: Each rank's resident bytes over its baseline after the steps that no tensor
            holds (:func:`untensored`): the runtime's own memory.
    """

    fits: bool
    peaks: list[int] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    built: list[int] = field(default_factory=list)
    runtime: list[int] = field(default_factory=list)


def pin_allocator() -> None:
    """Re-execute this script with glibc's allocator pinned (see the module's docstring)."""
    if any(os.environ.get(k) != v for k, v in ALLOCATOR.items()):
        os.environ.update(ALLOCATOR)
        os.execv(sys.executable, [sys.executable, *sys.argv])


def shape_of(size: Size) -> ModelShape:
    """The planner's shape of examples/gpt's model at ``size``."""
    return ModelShape(
        layers=size.depth,
        hidden=size.hidden,
        heads=size.heads,
        seq=size.seq,
        vocab=size.vocab,
        batch=size.batch,
        tied_head=False,
    )


#: The planner's machine here: gloo, whose pairwise exchanges hold more blocks than NCCL's.
GLOO = replace(DEFAULT_MACHINE, backend="gloo")

#: The runtime's own memory per rank on this machine: what a rank holds beyond its tensors
#: once it has trained a step, over its baseline (:attr:`Trial.runtime`): MKL's cached GEMM
#: buffers and glibc's heap, a base, and torch's and Python's objects and the heap's small
#: blocks of each tensor, which grow with the blocks. :data:`RUNTIME` ``+ depth *``
#: :data:`RUNTIME_PER_BLOCK` is the least-squares line through 105 runs (every layout of
#: bench_largest_model.py, with and without checkpointing, depth 1-14, hidden 64-448:
#: docs/figures/largest_model.json and hidden 128 at depths 1, 2, 4 and 8), 0.57 MiB + 0.34
#: MiB per block; the runs scatter about it by 0.5 MiB (1D holds the least, ZeRO-3 the most).
RUNTIME = 588 * 1024
RUNTIME_PER_BLOCK = 352 * 1024

#: The planner's machine here, the runtime's memory included.
MACHINE = replace(GLOO, runtime=RUNTIME, runtime_per_block=RUNTIME_PER_BLOCK)


def planned_peak(layout: Layout, size: Size) -> int:
    """The planner's peak bytes per rank for ``size`` under ``layout`` (fp32, Adam, gloo).

    With this machine's runtime memory (:data:`MACHINE`: ``MemoryBreakdown.runtime``).
    """
    return estimate_layout(shape_of(size), layout, memory_budget=0, machine=MACHINE).memory.total


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def untensored() -> int:
    """Resident bytes of this process that no tensor's storage holds.

    The resident size less every distinct storage of the tensors the garbage collector
    finds: what the runtime keeps for itself (the math library's cached buffers, the
    allocator's heap, the framework's objects). Read it after the peak: walking the objects
    allocates.
    """
    storages: dict[int, int] = {}
    with warnings.catch_warnings():  # isinstance() on torch's deprecated module attributes
        warnings.simplefilter("ignore")
        tensors = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
    for o in tensors:
        try:
            storage = o.untyped_storage()
            if storage.device.type == "cpu":
                storages[storage.data_ptr()] = storage.nbytes()
        except (RuntimeError, NotImplementedError):  # none of its own (meta, DTensor, freed)
            continue
    return _status("VmRSS") - sum(storages.values())


def _parallel(layout: Layout) -> dict[str, Any]:
    parallel: dict[str, Any] = {"data": layout.data}
    if layout.mode != "none":
        tensor: dict[str, Any] = {"size": layout.tensor, "mode": layout.mode}
        if layout.mode == "2.5d":
            tensor["depth"] = layout.depth
        parallel["tensor"] = tensor
    return parallel


class _Checkpointed(torch.nn.Module):
    """A block whose activations are recomputed in the backward."""

    def __init__(self, block: torch.nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from tessera.layers import checkpoint

        out: torch.Tensor = checkpoint(self.block, x)
        return out


def _train(layout: Layout, size: Size, steps: int) -> tuple[int, int, int]:
    """Build the model in this rank's layout and take ``steps`` Adam steps.

    Returns:
        The peak resident bytes while building, the steps' peak resident bytes (measured
        from there on), and the resident bytes no tensor holds after the steps
        (:func:`untensored`).
    """
    from model import GPTLoss, build_gpt

    from tessera.context import ParallelMode, get_context
    from tessera.engine import initialize

    ctx = get_context()
    torch.manual_seed(0)
    model = build_gpt(size.vocab, size.seq, size.hidden, size.depth, size.heads)
    if layout.checkpoint:
        for i in range(1, len(model) - 1):
            model[i] = _Checkpointed(model[i])
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    config: dict[str, Any] = {"parallel": _parallel(layout)}
    if layout.zero:
        config["zero"] = {"stage": layout.zero}
    engine, *_ = initialize(model, optimizer, GPTLoss(), config=config)
    built = _status("VmHWM")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the steps' peak from here
    rows = size.batch // layout.data
    start = ctx.get_local_rank(ParallelMode.DATA) * rows if layout.data > 1 else 0
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(size.vocab, (size.batch, size.seq + 1), generator=generator)
    ids = ids[start : start + rows]
    engine.train()
    for _ in range(steps):
        engine.zero_grad()
        loss = engine.criterion(engine(ids[:, :-1]), ids[:, 1:])
        engine.backward(loss)
        engine.step()
    peak = _status("VmHWM")
    # walking the objects allocates: not against the budget, and after the peak was read
    resource.setrlimit(resource.RLIMIT_DATA, (resource.RLIM_INFINITY,) * 2)
    return built, peak, untensored()


def _rank(
    rank: int, layout: Layout, size: Size, budget: int, steps: int, port: int, out: Any
) -> None:
    import torch.distributed as dist

    # A rank past its budget leaves its peers to be ended by the parent, and they complain
    # (c10d's store warnings, stack traces): their stderr goes to RANKS_LOG, not the report.
    with open(RANKS_LOG, "a") as log:
        os.dup2(log.fileno(), 2)
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    peak, built, runtime, error = 0, 0, 0, ""
    try:
        dist.init_process_group("gloo", rank=rank, world_size=layout.world, timeout=TIMEOUT)
        from tessera.context import create_context, set_context

        # no heartbeats: on a busy machine a starved heartbeat thread gets a live rank
        # declared dead, and a rank past its budget is ended by the parent anyway
        ctx = create_context(
            {"parallel": _parallel(layout)}, timeout=TIMEOUT, heartbeat_interval=None
        )
        set_context(ctx)
        # The framework's fixed cost, outside the budget: a warm-up step of one short block
        # imports the modules and faults in the kernels' code (torch's libraries are large).
        _train(layout, replace(size, depth=1, seq=8), steps=1)
        gc.collect()
        dist.barrier()
        baseline = _status("VmRSS")
        runtime_before = untensored()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the resident size now
        limit = _status("VmData") + budget
        resource.setrlimit(resource.RLIMIT_DATA, (limit, resource.RLIM_INFINITY))
        built, peak, runtime = _train(layout, size, steps)
        built, peak, runtime = built - baseline, peak - baseline, runtime - runtime_before
        resource.setrlimit(resource.RLIMIT_DATA, (resource.RLIM_INFINITY,) * 2)
        dist.barrier()
    except BaseException as e:  # reported, the parent ends the others
        error = f"{type(e).__name__}: {e}".splitlines()[0][:300]
        if not _is_out_of_memory(e):
            error += "\n" + traceback.format_exc()
    # the queue's writer is a thread, whose stack counts against RLIMIT_DATA: lift it first
    resource.setrlimit(resource.RLIMIT_DATA, (resource.RLIM_INFINITY,) * 2)
    out.put((rank, peak, built, runtime, error))
    out.close()
    out.join_thread()  # the queue writes from a thread: flush it before leaving
    os._exit(0)  # skip teardown: the others may be gone


def _is_out_of_memory(e: BaseException) -> bool:
    return isinstance(e, MemoryError) or "can't allocate memory" in str(e)


def run_trial(layout: Layout, size: Size, budget: int, steps: int = 2) -> Trial:
    """Train ``size`` under ``layout`` for ``steps`` with every rank held to ``budget`` bytes.

    Raises:
        RuntimeError: a rank failed for another reason than memory (its traceback).
    """
    from meters import free_port

    fork = mp.get_context("fork")
    out = fork.Queue()
    port = free_port()
    ranks = [
        fork.Process(target=_rank, args=(r, layout, size, budget, steps, port, out))
        for r in range(layout.world)
    ]
    for p in ranks:
        p.start()
    peaks, built, errors = [0] * layout.world, [0] * layout.world, [""] * layout.world
    runtime = [0] * layout.world
    seen = 0
    try:
        while seen < layout.world:
            try:
                rank, peak, building, held, error = out.get(timeout=TIMEOUT.total_seconds())
            except Exception:  # a rank died without reporting (killed past its budget)
                errors = [e or "no report (killed?)" for e in errors]
                break
            seen += 1
            peaks[rank], built[rank], errors[rank] = peak, building, error
            runtime[rank] = held
            if error:
                break
    finally:
        for p in ranks:
            if p.is_alive():
                p.kill()
            p.join()
    failures = [e for e in errors if e and "\n" in e]
    if failures:
        raise RuntimeError(f"a rank failed for another reason than memory:\n{failures[0]}")
    return Trial(fits=not any(errors), peaks=peaks, errors=errors, built=built, runtime=runtime)
