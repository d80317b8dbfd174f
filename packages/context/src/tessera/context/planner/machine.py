"""The machine model that prices a step, and a short run that measures it.

A step's time is estimated with the alpha-beta model of collectives (Hockney 1994; Thakur,
Rabenseifner and Gropp 2005): a collective call among ``n`` ranks costs a latency ``alpha`` per
round of a tree or recursive-doubling algorithm, ``ceil(log2 n)`` rounds (one between two
ranks, and one for a batch of sends posted together), every byte a rank sends
``1 / bandwidth``, and compute costs ``flops / rate``. Nothing overlaps in the model (tessera's
layers post some communication before an independent matmul; the model does not credit it).
The model ranks layouts; it does not promise their absolute time.

:func:`calibrate` measures the three numbers on this machine: a matmul's rate, and the latency
and bandwidth of a 2-rank gloo all-reduce. It imports torch inside the function only, so the
planner's arithmetic runs without it.
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

    Raises:
        ConfigError: a number is not finite and positive (latency may be 0), or the backend
            is unknown; the message starts with its name.
    """

    flops: float
    bandwidth: float
    latency: float
    backend: str = "nccl"

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ConfigError(f"backend {self.backend!r} is not one of {', '.join(BACKENDS)}")
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


def calibrate(collectives: bool = True, threads: int = 1, seconds: float = 0.5) -> Machine:
    """Measure this machine: a matmul's flop rate and a gloo all-reduce's latency, bandwidth.

    The machine it returns has backend ``"gloo"`` (what it measured) with ``collectives``,
    else ``DEFAULT_MACHINE``'s. Takes about ``seconds`` for the matmul and, with
    ``collectives``, well under a second more (plus importing torch, if nothing has). The
    matmul runs on CPU in fp32 with ``threads`` threads, as one rank of the benchmarks does.

    Args:
        collectives: Also time the all-reduce; otherwise bandwidth and latency are
            ``DEFAULT_MACHINE``'s.
        threads: torch threads for the matmul.
        seconds: How long to time the matmul.

    Raises:
        RuntimeError: the all-reduce failed or hung (30 s).
    """
    flops = _matmul_rate(threads, seconds)
    if not collectives:
        base = DEFAULT_MACHINE
        return Machine(flops, base.bandwidth, base.latency, base.backend)
    latency, bandwidth = _all_reduce_costs()
    return Machine(flops, bandwidth, latency, "gloo")


def _matmul_rate(threads: int, seconds: float, n: int = 256) -> float:
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = torch.randn(n, n), torch.randn(n, n)
        for _ in range(3):
            a @ b  # warm-up
        count, start = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - start) < seconds:
            for _ in range(8):
                a @ b
            count += 8
        return 2 * n**3 * count / elapsed
    finally:
        torch.set_num_threads(previous)


#: All-reduce sizes in bytes: a small one for the latency, a large one for the bandwidth.
_SMALL, _LARGE = 4, 4 * 1024 * 1024


def _all_reduce_costs(timeout: float = 30.0) -> tuple[float, float]:
    """``(latency s, bandwidth B/s)`` of a 2-rank gloo all-reduce over loopback TCP.

    The two ranks are threads of this process, each with its own ``ProcessGroupGloo`` on a
    private store: no process is started (importing torch twice more would take longer than
    the measurement) and the caller's default process group, if any, is left alone.
    """
    import threading
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed import PrefixStore, TCPStore  # type: ignore[attr-defined]  # from C++

    wait = timedelta(seconds=timeout)
    server = TCPStore("127.0.0.1", 0, 2, True, timeout=wait, wait_for_workers=False)
    medians: dict[int, list[float]] = {}
    failures: list[BaseException] = []
    together = threading.Barrier(2, timeout=timeout)

    def rank(index: int) -> None:
        try:
            store = (
                server if index == 0 else TCPStore("127.0.0.1", server.port, 2, False, timeout=wait)
            )
            group = dist.ProcessGroupGloo(PrefixStore("calibrate", store), index, 2, wait)
            medians[index] = [_time_all_reduce(group, size, together) for size in (_SMALL, _LARGE)]
        except BaseException as error:  # reported below, on the caller's thread
            failures.append(error)
            together.abort()

    threads = [threading.Thread(target=rank, args=(i,), daemon=True) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 5)
    if failures or len(medians) != 2:
        raise RuntimeError(
            "calibrate: the 2-rank gloo all-reduce failed or hung; give the machine's numbers "
            f"instead (--bandwidth, --latency): {failures[0] if failures else 'timeout'}"
        )
    small, large = (max(m[i] for m in medians.values()) for i in (0, 1))
    # Two ranks: an all-reduce sends 2 (n-1)/n S = S bytes per rank.
    return small, _LARGE / max(large - small, 1e-9)


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
