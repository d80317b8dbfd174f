"""Launchers: start torch.distributed, build a ParallelContext, make it current.

All four launchers end in ``launch``; the others only read the rank, the world size and the
local rank from the environment their process manager sets (torchrun, SLURM, Open MPI).

The rendezvous uses a ``TCPStore`` directly rather than a ``tcp://host:port`` URL, so an IPv6
address needs no brackets and a host name (``localhost``) is resolved by the store. Before the
default group is created every process announces its rank in the store; this turns the two
classic launch mistakes into clear errors instead of a silent hang: a rank launched twice, and a
world size larger than the number of processes (reported with the missing ranks when the
timeout expires). Each rank also leaves a summary of its parallel layout there, and the ranks
compare them before the first group is built: ranks launched with different layouts would
otherwise wait in mismatched ``new_group`` calls until the timeout.
"""

from __future__ import annotations

import contextlib
import os
import time
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, Store, TCPStore  # type: ignore[attr-defined]  # from C++

from tessera.registry import ConfigError

from . import current
from .config import ParallelConfig
from .context import (
    ConfigLike,
    ParallelContext,
    _check_heartbeat_interval,
    as_timedelta,
    create_context,
    load_config,
)
from .launch_options import LaunchKeywords, LaunchOptions

if TYPE_CHECKING:  # PEP 692 keywords (typing.Unpack is 3.11+); only the type checker reads it
    from typing_extensions import Unpack

__all__ = ["launch", "launch_from_openmpi", "launch_from_slurm", "launch_from_torch"]

_JOIN_PREFIX = "tessera/launch"

#: How long the rendezvous waits for every rank when neither ``rendezvous_timeout`` nor
#: ``timeout`` is given: the processes of a big job may start many minutes apart.
DEFAULT_RENDEZVOUS_TIMEOUT = timedelta(minutes=30)


def layout_summary(parallel: ParallelConfig) -> str:
    """The layout as ``parallel=dict(...)``, equal on two ranks exactly when their layouts are."""
    tensor = f"size={parallel.tensor_size}, mode={parallel.tensor_mode!r}"
    for key, value in sorted(parallel.tensor_args.items()):
        tensor += f", {key}={value!r}"
    extra = ""
    if parallel.extra:
        names = [e.type if isinstance(e.type, str) else e.type.__qualname__ for e in parallel.extra]
        extra = f", extra={names!r}"
    return (
        f"parallel=dict(data={parallel.data_size}, pipeline={parallel.pipeline_size}, "
        f"tensor=dict({tensor}){extra})"
    )


def _rank_ranges(ranks: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``'ranks 0-2, 5'``; ``[3]`` -> ``'rank 3'``."""
    spans: list[str] = []
    start = prev = ranks[0]
    for r in [*ranks[1:], None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        spans.append(f"{start}-{prev}" if prev > start else str(start))
        if r is not None:
            start = prev = r
    return ("ranks " if len(ranks) > 1 else "rank ") + ", ".join(spans)


def _check_not_launched() -> None:
    if current.has_context():
        raise RuntimeError(
            f"a ParallelContext is already current ({current.get_context()!r}); call its "
            "destroy() before launching again"
        )
    if dist.is_available() and dist.is_initialized():
        raise RuntimeError(
            "torch.distributed's default process group is already initialized; destroy it "
            "(torch.distributed.destroy_process_group()) before launching, or build the context "
            "on it with create_context(...)"
        )


def _rendezvous(
    host: str,
    port: int,
    rank: int,
    world_size: int,
    timeout: timedelta,
    *,
    agent_store: bool,
    attempt: str,
    layout: str = "",
) -> TCPStore:
    """Connect to the store, wait until every rank has announced itself, compare layouts.

    Rank 0 hosts the store, unless torchrun's agent already does (then all ranks are clients).

    Raises:
        ConfigError: the ranks hold different layouts (the same message on every rank).
    """
    where = f"{host}:{port}"
    try:
        store = TCPStore(
            host,
            port,
            world_size,
            is_master=rank == 0 and not agent_store,
            timeout=timeout,
            wait_for_workers=False,
        )
    except (RuntimeError, OSError) as exc:
        role = "host" if rank == 0 and not agent_store else "reach"
        raise RuntimeError(
            f"rank {rank} could not {role} the rendezvous store at {where} within "
            f"{timeout.total_seconds():g} s: {exc}"
        ) from exc
    prefix = f"{_JOIN_PREFIX}/{attempt}"
    # Written before the announcement: once every rank has joined, every layout is readable.
    store.set(f"{prefix}/layout/{rank}", layout)
    if store.add(f"{prefix}/rank/{rank}", 1) > 1:
        raise RuntimeError(
            f"rank {rank} was launched twice at {where}; every process needs its own rank in "
            f"0..{world_size - 1}"
        )
    keys = [f"{prefix}/rank/{r}" for r in range(world_size)]
    deadline = time.monotonic() + timeout.total_seconds()
    delay = 0.01
    missing = list(range(world_size))  # until the first look at the store says otherwise
    while True:
        try:
            if store.check(keys):
                _compare_layouts(store, prefix, rank, world_size, layout, deadline, where)
                return store
            missing = [r for r, key in enumerate(keys) if not store.check([key])]
        except (RuntimeError, OSError) as exc:
            # The host gave up first (its own deadline passed) and closed the store.
            raise RuntimeError(
                f"{_missing_message(world_size, missing, where, timeout)} The store's host "
                f"closed it while rank {rank} waited ({exc}). Does world_size match the "
                "number of processes started?"
            ) from exc
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"{_missing_message(world_size, missing, where, timeout)} Does world_size "
                "match the number of processes started?"
            )
        time.sleep(delay)
        delay = min(delay * 2, 0.5)


def _compare_layouts(
    store: TCPStore,
    prefix: str,
    rank: int,
    world_size: int,
    layout: str,
    deadline: float,
    where: str,
) -> None:
    """Raise the same ConfigError on every rank when the ranks' layouts differ.

    One read per rank when they agree (rank 0's layout, a counter, a wait); the whole table
    is read only to write the error.
    """
    if bytes(store.get(f"{prefix}/layout/0")).decode() != layout:
        store.add(f"{prefix}/layout_differs", 1)
    store.set(f"{prefix}/layout_checked/{rank}", "1")
    if store.add(f"{prefix}/layout_count", 1) == world_size:
        store.set(f"{prefix}/layout_done", "1")
    _wait(store, [f"{prefix}/layout_done"], deadline, rank, world_size, where, prefix)
    if store.add(f"{prefix}/layout_differs", 0) == 0:
        return
    held: dict[str, list[int]] = {}
    for r in range(world_size):
        held.setdefault(bytes(store.get(f"{prefix}/layout/{r}")).decode(), []).append(r)
    # The host of the store keeps it open until every rank has read the table.
    if store.add(f"{prefix}/layout_read", 1) == world_size:
        store.set(f"{prefix}/layout_read_done", "1")
    with contextlib.suppress(RuntimeError, OSError):
        remaining = max(deadline - time.monotonic(), 0.1)
        store.wait([f"{prefix}/layout_read_done"], timedelta(seconds=remaining))
    table = "; ".join(f"{_rank_ranges(ranks)} hold {text}" for text, ranks in held.items())
    raise ConfigError(
        f"the ranks were launched with different parallel layouts: {table}. Every rank must "
        "get the same configuration (is an old config file left on some nodes?)"
    )


def _wait(
    store: TCPStore,
    keys: list[str],
    deadline: float,
    rank: int,
    world_size: int,
    where: str,
    prefix: str,
) -> None:
    """``store.wait`` until the deadline; on timeout name the ranks that did not compare."""
    remaining = deadline - time.monotonic()
    try:
        store.wait(keys, timedelta(seconds=max(remaining, 0.1)))
    except (RuntimeError, OSError) as exc:
        try:
            missing = [
                r for r in range(world_size) if not store.check([f"{prefix}/layout_checked/{r}"])
            ]
        except (RuntimeError, OSError):
            missing = []
        raise RuntimeError(
            f"rank {rank}: ranks {missing} joined the rendezvous at {where} but did not compare "
            f"their parallel layouts in time (did they die?): {exc}"
        ) from exc


def _missing_message(world_size: int, missing: list[int], where: str, timeout: timedelta) -> str:
    return (
        f"only {world_size - len(missing)} of world size {world_size} processes joined the "
        f"rendezvous at {where} within {timeout.total_seconds():g} s; missing ranks {missing}."
    )


def launch(
    config: ConfigLike,
    rank: int,
    world_size: int,
    host: str,
    port: int,
    options: LaunchOptions | None = None,
    *,
    local_rank: int | None = None,
    **keywords: Unpack[LaunchKeywords],
) -> ParallelContext:
    """Initialize torch.distributed, build the context, seed, and make the context current.

    Args:
        config: The whole configuration (dict, Config or file path); ``parallel`` optional.
        rank: This process's global rank, ``0 <= rank < world_size``.
        world_size: Number of processes in the job.
        host: Address of rank 0: IPv4 (``127.0.0.1``), IPv6 (``::1``) or a host name.
        port: Free TCP port on ``host`` for the rendezvous store.
        options: Backend, seed, timeouts and heartbeats (:class:`LaunchOptions`); the same
            fields may be given as keywords, which win.
        local_rank: Index of this process on its node (picks ``cuda:<local_rank>``); default
            ``rank % torch.cuda.device_count()``.
        **keywords: Fields of :class:`LaunchOptions` (``backend``, ``seed``, ``timeout``,
            ``heartbeat_interval``, ``progress_timeout``, ``rendezvous_timeout``).

    Raises:
        ConfigError: invalid configuration (before any network traffic), or ranks launched
            with different parallel layouts (at the rendezvous, before any group exists).
        ValueError: rank, world size, port or a launch option out of range.
        TypeError: an unknown keyword, or options that are not a LaunchOptions.
        RuntimeError: already launched, or the rendezvous failed (with the missing ranks).
    """
    return _launch(
        config,
        rank,
        world_size,
        host,
        port,
        local_rank,
        LaunchOptions.resolve(options, keywords, "launch"),
        agent_store=False,
        attempt="0",
    )


def _launch(
    config: ConfigLike,
    rank: int,
    world_size: int,
    host: str,
    port: int,
    local_rank: int | None,
    options: LaunchOptions,
    *,
    agent_store: bool,
    attempt: str,
    local_world_size: int | None = None,
) -> ParallelContext:
    backend, seed, timeout = options.backend, options.seed, options.timeout
    heartbeat_interval, rendezvous_timeout = options.heartbeat_interval, options.rendezvous_timeout
    full = load_config(config)
    parallel = ParallelConfig.from_dict(full.get("parallel"), world_size)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank!r} is outside 0..{world_size - 1} (world size {world_size})")
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 2**16:
        raise ValueError(f"port must be an int in 1..65535, got {port!r}")
    if not isinstance(host, str) or not host:
        raise ValueError(f"host must be an address or host name, got {host!r}")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    _check_not_launched()
    td = as_timedelta(timeout)
    # Processes of a big job start minutes apart, while a collective should fail in seconds
    # when a peer is gone: the two waits have their own limits.
    if rendezvous_timeout is not None:
        rendezvous_td = as_timedelta(rendezvous_timeout)
    else:
        rendezvous_td = td if timeout is not None else DEFAULT_RENDEZVOUS_TIMEOUT
    _check_heartbeat_interval(heartbeat_interval)

    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if "nccl" in backend:
        if not torch.cuda.is_available():
            raise ConfigError(f"backend {backend!r} needs CUDA, which is not available")
        if local_rank is None:
            local_rank = rank % torch.cuda.device_count()
        _check_gpu_of(local_rank, local_world_size, rank, backend)
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")

    joined = _rendezvous(
        host,
        port,
        rank,
        world_size,
        rendezvous_td,
        agent_store=agent_store,
        attempt=attempt,
        layout=layout_summary(parallel),
    )
    # torchrun's agent store outlives a failed attempt: the keys of the dead processes (their
    # gloo/NCCL addresses) are still there when the restarted ones meet. A prefix per restart
    # attempt keeps each attempt's process-group keys and failure board apart.
    store: Store = PrefixStore(f"tessera/attempt_{attempt}", joined) if agent_store else joined
    # With device_id NCCL binds the communicator to this rank's GPU at once (no guessing of the
    # device at the first collective) and lets new_group split it instead of a new rendezvous.
    dist.init_process_group(
        backend,
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=td,
        device_id=device if device.type == "cuda" else None,
    )
    try:
        context = create_context(
            parallel,
            seed=seed,
            timeout=td,
            device=device,
            store=store,
            heartbeat_interval=heartbeat_interval,
            progress_timeout=options.progress_timeout,
        )
    except BaseException:
        dist.destroy_process_group()
        raise
    # create_context saw only the ParallelConfig; keep the whole configuration reachable.
    context._full_config = full
    context._adopt_default_group()
    context.reseed()
    current.set_context(context)
    return context


def _env_int(name: str, launcher: str) -> int:
    value = os.environ.get(name)
    if value is None:
        raise RuntimeError(
            f"{launcher}: environment variable {name} is not set; start the processes with the "
            "matching launcher or call launch(...) with explicit ranks"
        )
    try:
        return int(value)
    except ValueError:
        raise RuntimeError(f"{launcher}: {name}={value!r} is not an integer") from None


def _check_gpu_of(local_rank: int, local_world_size: int | None, rank: int, backend: str) -> None:
    """This process's GPU must exist: NCCL runs one process per GPU.

    Without the check, ``set_device`` fails with "invalid device ordinal", or, where the
    local rank wraps onto a GPU another process holds, NCCL fails at the first collective
    with "Duplicate GPU detected". Where the launcher says how many processes share the node
    (torchrun's ``LOCAL_WORLD_SIZE``), every one of them raises, the ones with a GPU too, so
    none is left waiting at the rendezvous for the others.

    Raises:
        ConfigError: ``local_rank`` is not the index of a GPU this process sees, or the node
            runs more processes than it has GPUs.
    """
    count = torch.cuda.device_count()
    if local_world_size is not None and local_world_size > count:
        raise ConfigError(
            f"rank {rank}: {local_world_size} processes on this node but it has {count} CUDA "
            f"device(s), and backend {backend!r} needs one GPU per process; start at most "
            f"{count} process(es) per node (torchrun --nproc-per-node {count}), or pass "
            "backend='gloo' to run every rank on the CPU"
        )
    if not 0 <= local_rank < count:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        seen = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
        raise ConfigError(
            f"rank {rank}: local rank {local_rank} has no GPU: this process sees {count} CUDA "
            f"device(s){seen}, and backend {backend!r} needs one GPU per process; start at "
            f"most {count} process(es) per node, pass local_rank= the index of this "
            "process's GPU among those it sees, or pass backend='gloo' to run on the CPU"
        )


def launch_from_torch(
    config: ConfigLike,
    options: LaunchOptions | None = None,
    **keywords: Unpack[LaunchKeywords],
) -> ParallelContext:
    """Launch from torchrun's environment: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT.

    ``options`` and ``keywords`` as for :func:`launch`.
    """
    name = "launch_from_torch"
    resolved = LaunchOptions.resolve(options, keywords, name)
    host = os.environ.get("MASTER_ADDR")
    if host is None:
        raise RuntimeError(f"{name}: environment variable MASTER_ADDR is not set (use torchrun)")
    return _launch(
        config,
        rank=_env_int("RANK", name),
        world_size=_env_int("WORLD_SIZE", name),
        host=host,
        port=_env_int("MASTER_PORT", name),
        local_rank=_env_int("LOCAL_RANK", name),
        local_world_size=(
            _env_int("LOCAL_WORLD_SIZE", name) if "LOCAL_WORLD_SIZE" in os.environ else None
        ),
        options=resolved,
        # torchrun's agent already hosts a store on MASTER_PORT: every rank is a client of it,
        # and keys are kept apart per restart.
        agent_store=os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
        attempt=os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"),
    )


def launch_from_slurm(
    config: ConfigLike,
    host: str,
    port: int,
    options: LaunchOptions | None = None,
    **keywords: Unpack[LaunchKeywords],
) -> ParallelContext:
    """Launch from srun's environment: SLURM_PROCID, SLURM_NPROCS, SLURM_LOCALID.

    ``options`` and ``keywords`` as for :func:`launch`.
    """
    size_var = "SLURM_NPROCS" if "SLURM_NPROCS" in os.environ else "SLURM_NTASKS"
    resolved = LaunchOptions.resolve(options, keywords, "launch_from_slurm")
    variables = ("SLURM_PROCID", size_var, "SLURM_LOCALID")
    return _launch_from_env("launch_from_slurm", variables, config, host, port, resolved)


def launch_from_openmpi(
    config: ConfigLike,
    host: str,
    port: int,
    options: LaunchOptions | None = None,
    **keywords: Unpack[LaunchKeywords],
) -> ParallelContext:
    """Launch from mpirun's environment: OMPI_COMM_WORLD_RANK/_SIZE/_LOCAL_RANK.

    ``options`` and ``keywords`` as for :func:`launch`.
    """
    resolved = LaunchOptions.resolve(options, keywords, "launch_from_openmpi")
    variables = ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK")
    return _launch_from_env("launch_from_openmpi", variables, config, host, port, resolved)


def _launch_from_env(
    name: str,
    variables: tuple[str, str, str],
    config: ConfigLike,
    host: str,
    port: int,
    options: LaunchOptions,
) -> ParallelContext:
    """``launch`` with rank, world size and local rank read from a scheduler's variables."""
    rank_var, size_var, local_var = variables
    return launch(
        config,
        rank=_env_int(rank_var, name),
        world_size=_env_int(size_var, name),
        host=host,
        port=port,
        options=options,
        local_rank=_env_int(local_var, name),
    )
