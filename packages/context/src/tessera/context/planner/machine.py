"""The machine model that prices a step, and a short run that measures it.

A step's time is estimated with the alpha-beta model of collectives (Hockney 1994; Thakur,
Rabenseifner and Gropp 2005): a collective call among ``n`` ranks costs a latency ``alpha`` per
round of a tree or recursive-doubling algorithm, ``ceil(log2 n)`` rounds (one between two
ranks, and one for a batch of sends posted together), every byte a rank sends
``1 / bandwidth``, and compute costs ``flops / rate``. Nothing overlaps in the model (tessera's
layers post some communication before an independent matmul; the model does not credit it).
The model ranks layouts; it does not promise their absolute time.

:func:`calibrate` measures the three numbers on this machine, as the ranks of a job running on
it see them: a matmul's rate while every rank multiplies, and the latency and bandwidth of a
gloo all-reduce among them. Ranks beyond the cores share them, and then every number is worse
than one idle rank's (on 2 cores: a quarter of the flop rate and twice the latency per round at
8 ranks against 2). It imports torch inside the function only, so the planner's arithmetic runs
without it.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

from tessera.registry import ConfigError

from .comm import BACKENDS, Collective

__all__ = ["DEFAULT_MACHINE", "Machine", "calibrate"]


@dataclass(frozen=True)
class Machine:
    """What one rank can do per second.

    Attributes:
        flops: Floating-point operations per second of one rank in a matmul.
        bandwidth: Bytes per second one rank sends in a collective.
        latency: Seconds a collective call between two ranks costs regardless of its size
            (``ceil(log2 n)`` times that among ``n`` ranks).
        backend: ``"nccl"`` or ``"gloo"``: how tessera moves a group's blocks there
            (all-gathers and reduce-scatters, or pairwise sends; ``comm.py``), which sets the
            kinds of call and the bytes contributed, not the bytes on the wire.
        runtime: Bytes each rank's runtime holds beyond its tensors once it has trained a
            step, whatever the model (the math library's cached buffers, the allocator's
            heap), added to every rank's peak; 0 counts none.
        runtime_per_block: Bytes that runtime memory grows by per block the rank holds: each
            tensor of a block (its parameters, their gradients and optimizer state, what it
            saves) brings the framework's objects and the heap's small blocks beside its
            storage, so a deep model's runtime holds more than a shallow one's (0.34 MiB per
            block per CPU rank over a base of 0.57 MiB, fitted to ``benchmarks/memory_trial.py``'s
            runs; one figure overstated a shallow model's and understated a deep one's by
            half). 0 counts none.

    Raises:
        ConfigError: a number is not finite and positive (latency may be 0), a runtime is
            not a whole number of bytes >= 0, or the backend is unknown; the message starts
            with its name.
    """

    flops: float
    bandwidth: float
    latency: float
    backend: str = "nccl"
    runtime: int = 0
    runtime_per_block: int = 0

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ConfigError(f"backend {self.backend!r} is not one of {', '.join(BACKENDS)}")
        for name in ("runtime", "runtime_per_block"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"{name} must be a number of bytes >= 0, got {value!r}")
        for name in ("flops", "bandwidth", "latency"):
            value = getattr(self, name)
            low_ok = value >= 0 if name == "latency" else value > 0
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ConfigError(f"{name} must be a number, got {value!r}")
            if not (math.isfinite(value) and low_ok):
                kind = ">= 0" if name == "latency" else "> 0"
                raise ConfigError(f"{name} must be finite and {kind}, got {value!r}")

    def compute_seconds(self, flops: float) -> float:
        """Seconds to compute ``flops`` operations."""
        return flops / self.flops

    def collective_seconds(self, collective: Collective) -> float:
        """``calls * rounds * latency + wire bytes / bandwidth``, ``rounds = ceil(log2 n)``."""
        rounds = max(1, math.ceil(math.log2(collective.group)))
        return collective.calls * rounds * self.latency + collective.wire / self.bandwidth


#: A nominal accelerator node, used when neither the numbers nor ``--calibrate`` are given:
#: 50 Tflop/s reached in matmuls, 50 GB/s per rank in collectives, 20 us per call, NCCL.
DEFAULT_MACHINE = Machine(flops=5e13, bandwidth=5e10, latency=2e-5)


def calibrate(
    collectives: bool = True, threads: int = 1, seconds: float = 0.5, ranks: int | None = None
) -> Machine:
    """Measure this machine as ``ranks`` ranks of a job on it see it, all working at once.

    Each rank multiplies while every other does (ranks beyond the cores share them, as a
    job's processes would), then, with ``collectives``, the ranks all-reduce together: a few
    bytes for the latency, 4 MiB for the bandwidth. The flop rate is the slowest rank's, the
    times the slowest rank's; the latency is per round (a ``ranks``-rank all-reduce takes
    ``ceil(log2 ranks)``), the bandwidth what one rank sends (``2 (n - 1) / n`` of the
    buffer) per second. So the machine prices a job of ``ranks`` ranks here, oversubscribed
    or not; by default an idle pair (one rank without ``collectives``).

    The machine it returns has backend ``"gloo"`` (what it measured) with ``collectives``,
    else ``DEFAULT_MACHINE``'s. Takes about ``seconds`` for the matmul and, with
    ``collectives``, well under a second more at a few ranks (plus importing torch, if
    nothing has). The ranks are threads of this process, each with its own
    ``ProcessGroupGloo`` on a private store: no process is started (importing torch again
    would take longer than the measurement) and the caller's default process group, if any,
    is left alone. A matmul runs on CPU in fp32 with ``threads`` torch threads, as one rank
    of the benchmarks does.

    Args:
        collectives: Also time the all-reduce; otherwise bandwidth and latency are
            ``DEFAULT_MACHINE``'s.
        threads: torch threads for the matmul.
        seconds: How long to time the matmul.
        ranks: Ranks measuring at once (at least 2 with ``collectives``); default 2, or 1
            without ``collectives``.

    Raises:
        ConfigError: ``ranks`` is below 1, or below 2 with ``collectives``.
        RuntimeError: the all-reduce failed or hung (30 s).
    """
    low = 2 if collectives else 1
    ranks = low if ranks is None else ranks
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < low:
        raise ConfigError(f"ranks must be an integer >= {low}, got {ranks!r}")
    found = _measure_ranks(ranks, threads, seconds, collectives)
    flops = min(f.flops for f in found)
    if not collectives:
        base = DEFAULT_MACHINE
        return Machine(flops, base.bandwidth, base.latency, base.backend)
    small, large = (max(getattr(f, size) for f in found) for size in ("small", "large"))
    rounds = math.ceil(math.log2(ranks))
    wire = 2 * (ranks - 1) / ranks * _LARGE  # bytes one rank sends in the large all-reduce
    return Machine(flops, wire / max(large - small, 1e-9), small / rounds, "gloo")


@dataclass
class _Found:
    """What one rank measured: its flop rate, and its all-reduce seconds (small, large)."""

    flops: float = 0.0
    small: float = 0.0
    large: float = 0.0


#: All-reduce sizes in bytes: a small one for the latency, a large one for the bandwidth.
_SMALL, _LARGE = 4, 4 * 1024 * 1024


def _measure_ranks(
    ranks: int, threads: int, seconds: float, collectives: bool, timeout: float = 30.0
) -> list[_Found]:
    """Every rank's numbers, the ranks threads started together (see :func:`calibrate`)."""
    import threading
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torch.distributed import PrefixStore, TCPStore  # type: ignore[attr-defined]  # from C++

    wait = timedelta(seconds=timeout)
    server = (
        TCPStore("127.0.0.1", 0, ranks, True, timeout=wait, wait_for_workers=False)
        if collectives
        else None
    )
    found = [_Found() for _ in range(ranks)]
    failures: list[BaseException] = []
    together = threading.Barrier(ranks, timeout=timeout)

    def rank(index: int) -> None:
        try:
            found[index].flops = _matmul_rate(seconds, together)
            if server is None:
                return
            store = (
                server
                if index == 0
                else TCPStore("127.0.0.1", server.port, ranks, False, timeout=wait)
            )
            group = dist.ProcessGroupGloo(PrefixStore("calibrate", store), index, ranks, wait)
            found[index].small = _time_all_reduce(group, _SMALL, together)
            found[index].large = _time_all_reduce(group, _LARGE, together)
        except BaseException as error:  # reported below, on the caller's thread
            failures.append(error)
            together.abort()

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        workers = [threading.Thread(target=rank, args=(i,), daemon=True) for i in range(ranks)]
        for t in workers:
            t.start()
        deadline = time.monotonic() + timeout + seconds + 5  # one limit for them all
        for t in workers:
            t.join(max(0.0, deadline - time.monotonic()))
    finally:
        torch.set_num_threads(previous)
    if failures or any(t.is_alive() for t in workers):
        raise RuntimeError(
            f"calibrate: measuring {ranks} ranks at once (a matmul each"
            f"{', then a gloo all-reduce' if collectives else ''}) failed or hung; give the "
            "machine's numbers instead (--flops, --bandwidth, --latency): "
            f"{failures[0] if failures else 'timeout'}"
        )
    return found


def _matmul_rate(seconds: float, together: Any, n: int = 256) -> float:
    """Flop/s of ``[n, n] @ [n, n]`` on this thread, started with the other ranks'."""
    import torch

    a, b = torch.randn(n, n), torch.randn(n, n)
    for _ in range(3):
        a @ b  # warm-up
    together.wait()
    count, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        for _ in range(8):
            a @ b
        count += 8
    return 2 * n**3 * count / elapsed


def _time_all_reduce(group: Any, nbytes: int, together: Any, repeats: int = 20) -> float:
    """Median seconds of an all-reduce of ``nbytes`` on ``group``, the ranks started together."""
    import statistics

    import torch

    buffer = torch.zeros(max(1, nbytes // 4))
    times = []
    for i in range(repeats + 2):
        together.wait()
        start = time.perf_counter()
        group.allreduce([buffer]).wait()
        if i >= 2:  # the first calls connect and warm up
            times.append(time.perf_counter() - start)
    return statistics.median(times)
