"""``ParallelContext``: the process groups of one job, queried by mode, and their RNG streams.

A context is built by ``create_context`` (on top of an initialized default process group) or by
a launcher (which also initializes that group). It owns every group it creates and nothing
else: two contexts in one process do not interfere, and ``destroy()`` releases exactly its own.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import Store  # type: ignore[attr-defined]  # re-exported from C++

from tessera.registry import Config, ConfigError

from . import current
from .abort import GroupAborter, store_port, tcp_inodes
from .config import ParallelConfig
from .failures import (
    DEFAULT_HEARTBEAT_INTERVAL,
    DEFAULT_PROGRESS_TIMEOUT,
    FailureBoard,
    FailureMonitor,
    default_store,
)
from .groups import Membership, ProcessGroups, build_groups
from .initializers import rank_groups
from .layouts import coordinates
from .mesh import device_mesh_of
from .modes import ModeLike, ParallelMode, mode_key
from .seeds import DEFAULT_STREAM, RngStreams, set_seed, stream_seed

__all__ = ["DEFAULT_TIMEOUT", "ConfigLike", "ParallelContext", "create_context", "load_config"]

#: Timeout of every collective when none is given. Dead and stopped ranks are caught by the
#: heartbeats within seconds, so this is the backstop for the rest: ranks alive but waiting in
#: different collectives, or one rank working alone (a first step that compiles, a checkpoint
#: one rank writes) while the others wait. Five minutes covers those in most jobs and surfaces
#: a real hang within minutes, not torch's half hour; pass ``timeout=`` for longer solo work.
DEFAULT_TIMEOUT = timedelta(minutes=5)

#: What a launcher accepts as configuration: the whole config (a dict, a Config or a file path).
ConfigLike = Mapping[str, Any] | str | os.PathLike[str]


def load_config(config: ConfigLike) -> Config:
    """Read the whole configuration; its ``parallel`` entry is optional.

    Raises:
        ConfigError: the config is not a mapping or a path, or the parallel keys sit at its
            top level instead of under ``parallel``.
    """
    if isinstance(config, Config):
        full = config
    elif isinstance(config, Mapping):
        full = Config(config)
    elif isinstance(config, (str, os.PathLike)):
        full = Config.from_file(Path(config))
    else:
        raise ConfigError(
            "config must be a dict, a tessera.registry.Config or the path of a config file, "
            f"got {type(config).__name__}"
        )
    if "parallel" not in full:
        misplaced = [key for key in ("tensor", "pipeline") if key in full]
        if misplaced:
            raise ConfigError(
                f"found {misplaced} at the top level of the configuration; the parallel "
                "layout belongs under 'parallel', e.g. parallel=dict(tensor=dict(size=2, "
                "mode='1d'))"
            )
    return full


def as_timedelta(timeout: float | timedelta | None) -> timedelta:
    """Seconds or a timedelta; ``None`` means DEFAULT_TIMEOUT."""
    if timeout is None:
        return DEFAULT_TIMEOUT
    if isinstance(timeout, timedelta):
        return timeout
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    return timedelta(seconds=float(timeout))


class ParallelContext:
    """The process groups of one job, and the RNG streams and failure monitor that go with them.

    Composed of three parts, each usable on its own: :attr:`groups` (this rank's process
    group of every mode, :class:`tessera.context.groups.ProcessGroups`), :attr:`rng` (the
    per-mode RNG streams, :class:`tessera.context.seeds.RngStreams`) and :attr:`failures` (the
    failure board, the heartbeats and the guards, :class:`tessera.context.failures.
    FailureMonitor`). The methods below are Colossal-AI's names for the questions asked most
    (``get_group``, ``get_local_rank``, ``seed``, ``guard``, ...), each one line over a part.

    Do not construct it directly: use ``create_context`` or a launcher, which create the groups
    on every rank in the same order.
    """

    def __init__(
        self,
        *,
        config: ParallelConfig,
        full_config: Config,
        groups: ProcessGroups,
        global_rank: int,
        backend: str,
        device: torch.device,
        seed: int,
        timeout: timedelta,
        owns_default_group: bool,
        monitor: FailureMonitor | None = None,
    ) -> None:
        self._config = config
        self._full_config = full_config
        self._groups = groups
        self._global_rank = global_rank
        self._backend = backend
        self._device = device
        self._seed = seed
        self._timeout = timeout
        self._owns_default_group = owns_default_group
        self._mesh: Any = None
        pipeline_rank = self.coordinates[1]
        self._rng = RngStreams(
            device, lambda name: stream_seed(seed, pipeline_rank, self.get_local_rank, name)
        )
        self._monitor = monitor if monitor is not None else FailureMonitor(None, None)

    def __repr__(self) -> str:
        c = self._config
        state = ", destroyed" if self.is_destroyed else ""
        return (
            f"ParallelContext(rank {self._global_rank}/{c.world_size}, data {c.data_size} x "
            f"pipeline {c.pipeline_size} x tensor {c.tensor_size} ({c.tensor_mode}), "
            f"backend {self._backend}, device {self._device}{state})"
        )

    # ------------------------------------------------------------------ the parts

    @property
    def groups(self) -> ProcessGroups:
        """This rank's process groups, by mode."""
        return self._groups

    @property
    def rng(self) -> RngStreams:
        """The RNG streams: the default one and one per mode."""
        return self._rng

    @property
    def failures(self) -> FailureMonitor:
        """The failure board, the heartbeats and the guards of this rank."""
        return self._monitor

    # ------------------------------------------------------------------ whole-job facts

    @property
    def config(self) -> ParallelConfig:
        """The validated parallel block."""
        return self._config

    @property
    def full_config(self) -> Config:
        """The whole configuration (empty when only a ParallelConfig was given)."""
        return self._full_config

    @property
    def global_rank(self) -> int:
        """This process's rank in the default group."""
        return self._global_rank

    @property
    def world_size(self) -> int:
        """Number of processes in the job."""
        return self._config.world_size

    @property
    def data_size(self) -> int:
        """Number of data-parallel ranks."""
        return self._config.data_size

    @property
    def pipeline_size(self) -> int:
        """Number of pipeline stages."""
        return self._config.pipeline_size

    @property
    def tensor_size(self) -> int:
        """Number of tensor-parallel ranks."""
        return self._config.tensor_size

    @property
    def device(self) -> torch.device:
        """``cuda:<local_rank>`` under NCCL, else ``cpu``."""
        return self._device

    @property
    def backend(self) -> str:
        """The backend of the groups (``'nccl'`` or ``'gloo'``)."""
        return self._backend

    @property
    def timeout(self) -> timedelta:
        """The timeout of every collective on this context's groups."""
        return self._timeout

    @property
    def base_seed(self) -> int:
        """The seed every RNG stream is derived from."""
        return self._seed

    @property
    def coordinates(self) -> tuple[int, int, int]:
        """This rank's (data_rank, pipeline_rank, tensor_rank)."""
        return coordinates(self._config, self._global_rank)

    @property
    def modes(self) -> list[str]:
        """The modes in which this rank has a group, in creation order."""
        return self._groups.modes

    @property
    def is_destroyed(self) -> bool:
        """Whether ``destroy()`` ran."""
        return self._groups.is_destroyed

    # ------------------------------------------------------------------ per-mode queries

    def _member(self, mode: ModeLike) -> Membership:
        if self.is_destroyed:
            raise RuntimeError(f"{self!r} was destroyed; its groups can no longer be used")
        return self._groups.of(mode)

    def is_initialized(self, mode: ModeLike) -> bool:
        """Whether this rank has a group of ``mode``."""
        return self._groups.is_initialized(mode)

    def get_group(self, mode: ModeLike) -> dist.ProcessGroup:
        """The process group of ``mode`` that holds this rank (backend: ``self.backend``)."""
        return self._member(mode).group

    def get_cpu_group(self, mode: ModeLike) -> dist.ProcessGroup:
        """A gloo group over the same ranks, for metadata and objects (same group under gloo)."""
        return self._member(mode).cpu_group

    def get_ranks_in_group(self, mode: ModeLike) -> list[int]:
        """The global ranks of this rank's group of ``mode``, ordered by local rank."""
        return list(self._member(mode).ranks)

    def get_local_rank(self, mode: ModeLike) -> int:
        """This rank's index in its group of ``mode``."""
        return self._member(mode).local_rank

    def get_world_size(self, mode: ModeLike) -> int:
        """The size of this rank's group of ``mode``."""
        return self._member(mode).size

    def is_first_rank(self, mode: ModeLike) -> bool:
        """Whether this rank has local rank 0 in ``mode``."""
        return self._member(mode).local_rank == 0

    def is_last_rank(self, mode: ModeLike) -> bool:
        """Whether this rank has the last local rank in ``mode``."""
        m = self._member(mode)
        return m.local_rank == m.size - 1

    def get_next_global_rank(self, mode: ModeLike) -> int:
        """The global rank of the next local rank in ``mode`` (wrapping around)."""
        return self._member(mode).neighbour(1)

    def get_prev_global_rank(self, mode: ModeLike) -> int:
        """The global rank of the previous local rank in ``mode`` (wrapping around)."""
        return self._member(mode).neighbour(-1)

    # ------------------------------------------------------------------ seeds

    @property
    def default_seed(self) -> int:
        """The seed of the default stream on this rank: ``base_seed + pipeline_rank``."""
        return stream_seed(self._seed, self.coordinates[1], self.get_local_rank, DEFAULT_STREAM)

    def reseed(self) -> None:
        """Seed python, numpy and torch with ``default_seed`` and restart every mode stream.

        Launchers call it; ``create_context`` does not (building a context never touches the
        global RNGs), so a test calls it when it needs the streams' guarantees.
        """
        set_seed(self.default_seed)
        self._rng.reset()

    @contextmanager
    def seed(self, mode: ModeLike | None) -> Iterator[None]:
        """Switch torch's RNG to the stream of ``mode`` inside the block.

        ``with ctx.seed(ParallelMode.TENSOR):`` draws differ across tensor ranks (dropout on
        sharded activations); outside every block the default stream draws the same on every
        tensor rank. ``mode=None`` selects the default stream (e.g. inside a TENSOR block).
        """
        if mode is None:
            name = DEFAULT_STREAM
        else:
            self._member(mode)
            name = mode_key(mode)
        with self._rng.use(name):
            yield

    def get_rng_state(self) -> dict[str, Any]:
        """The states of all RNG streams, python's and numpy's.

        Plain tensors, ints and dicts: ``torch.save`` them and load with ``weights_only=True``.
        """
        return self._rng.get_state()

    def set_rng_state(self, state: Mapping[str, Any]) -> None:
        """Restore what ``get_rng_state`` returned."""
        self._rng.set_state(state)

    # ------------------------------------------------------------------ torch interop

    def device_mesh(self) -> Any:
        """A ``torch.distributed.device_mesh.DeviceMesh`` with dims ("dp", "pp", "tp").

        Built from this context's DATA, PIPELINE and TENSOR groups (no new group is created),
        over the mesh ``arange(world_size).reshape(data, pipeline, tensor)``, i.e. the same
        global layout, for torch's FSDP2 / DTensor.
        """
        if self._mesh is None:
            modes = (ParallelMode.DATA, ParallelMode.PIPELINE, ParallelMode.TENSOR)
            groups = [self.get_group(m) for m in modes]
            self._mesh = device_mesh_of(self._config, groups, self._device)
        return self._mesh

    # ------------------------------------------------------------------ failures

    @property
    def failure_board(self) -> FailureBoard | None:
        """Where this context's ranks post failures (None: no store was reachable)."""
        return self._monitor.board

    @property
    def heartbeat_interval(self) -> float | None:
        """Seconds between heartbeats (None: heartbeats off)."""
        return self._monitor.heartbeat_interval

    @property
    def progress_timeout(self) -> float | None:
        """Seconds without a progress mark after which a rank others passed is named."""
        return self._monitor.progress_timeout

    def mark_progress(self) -> None:
        """Tell the watchers this rank's training thread moved on (one int increment).

        Guards (the engine's steps) and the engine's batch reads mark by themselves; call it
        inside long work of your own that one rank does while the others wait (a solo
        checkpoint write longer than ``progress_timeout``), so the rank is not named as stalled.
        """
        self._monitor.mark_progress()

    def guard(self, where: str) -> contextlib.AbstractContextManager[None]:
        """Fail fast across ranks around a step (a context manager, also a decorator).

        ``with ctx.guard("train step"):`` -- if the body raises on this rank, the error is
        posted to the failure board (rank, ``where``, type, message) and re-raised unchanged;
        if a collective in the body fails because of another rank (a timeout, a closed
        connection), this rank raises ``RankFailedError`` naming the rank that failed and where
        it was. Guards nest (the innermost ``where`` is reported; an error is posted once).
        Control flow (``StopIteration``, ``GeneratorExit``, ``KeyboardInterrupt``, a clean
        ``SystemExit``: ``is_control_flow``) and errors after ``destroy()`` are not posted.
        The engine's ``step``/``execute_schedule`` and the pipeline runner guard themselves;
        wrap your own loop body when you drive collectives yourself.
        """
        return self._monitor.guard(where)

    def check_failures(self, where: str = "-") -> None:
        """Raise ``RankFailedError`` now if another rank has posted a failure (no waiting)."""
        self._monitor.check(where)

    # ------------------------------------------------------------------ teardown

    def _adopt_default_group(self) -> None:
        """Make ``destroy()`` also destroy the default group (for contexts a launcher made)."""
        self._owns_default_group = True

    def destroy(self) -> None:
        """Destroy the groups this context created; idempotent.

        A context made by a launcher also destroys the default group. If this context is the
        current one, the current context is cleared.
        """
        if self.is_destroyed:
            return
        self._mesh = None
        self._monitor.close()
        self._groups.destroy()
        if self._owns_default_group and dist.is_initialized():
            dist.destroy_process_group()
        if current._current is self:
            current.set_context(None)


def _default_device(backend: str) -> torch.device:
    if "nccl" in backend and torch.cuda.is_available():
        local = os.environ.get("LOCAL_RANK")
        index = int(local) if local is not None else torch.cuda.current_device()
        return torch.device("cuda", index)
    return torch.device("cpu")


def create_context(
    config: ParallelConfig | ConfigLike,
    *,
    seed: int = 1024,
    timeout: float | timedelta | None = None,
    device: torch.device | str | None = None,
    store: Store | None = None,
    heartbeat_interval: float | None = DEFAULT_HEARTBEAT_INTERVAL,
    progress_timeout: float | None = DEFAULT_PROGRESS_TIMEOUT,
) -> ParallelContext:
    """Build every group the config describes on top of the initialized default group.

    Every rank must call it with the same config (groups are created collectively, in the
    order of ``rank_groups``). It does not make the context current and does not seed the
    global RNGs (call ``ctx.reseed()`` for that); the launchers do both.

    Args:
        config: A ParallelConfig, or the whole configuration (dict, Config or file path)
            whose optional ``parallel`` entry is read for the default group's world size.
        seed: Base seed of the RNG streams.
        timeout: Seconds or timedelta for every collective on the new groups
            (default DEFAULT_TIMEOUT).
        device: The device of this rank; default ``cuda:$LOCAL_RANK`` (or the current CUDA
            device) under NCCL, else ``cpu``.
        store: The key-value store of the failure board (see ``ParallelContext.guard``);
            default the default group's store. The launchers pass their rendezvous store.
        heartbeat_interval: Seconds between the heartbeats that let other ranks name a rank
            that died without raising; None or 0 turns them off.
        progress_timeout: Seconds a rank may go without a progress mark (a guard entered or
            left, a batch read) while another rank is past it, before every rank names it as
            stalled: a read hung on a dead file server keeps its heartbeat beating. None or
            0 turns it off (default ``DEFAULT_PROGRESS_TIMEOUT``, 240 s; keep it below ``timeout``).

    Raises:
        RuntimeError: the default process group is not initialized.
        ConfigError: the config is invalid or its world size differs from the default group's.
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "create_context needs an initialized default process group "
            "(torch.distributed.init_process_group); use tessera.context.launch(...) to do both"
        )
    world, rank = dist.get_world_size(), dist.get_rank()
    if isinstance(config, ParallelConfig):
        parallel, full = config, Config()
        if parallel.world_size != world:
            c = parallel
            raise ConfigError(
                f"the parallel config covers data {c.data_size} * pipeline {c.pipeline_size} * "
                f"tensor {c.tensor_size} = {c.world_size} ranks, but the default process "
                f"group has {world}"
            )
    else:
        full = load_config(config)
        parallel = ParallelConfig.from_dict(full.get("parallel"), world)
    # Pure and identical on every rank: any error is raised everywhere before a collective.
    layout = rank_groups(parallel)
    td = as_timedelta(timeout)
    _check_heartbeat_interval(heartbeat_interval)
    _check_heartbeat_interval(progress_timeout, "progress_timeout")
    backend = str(dist.get_backend())
    dev = torch.device(device) if device is not None else _default_device(backend)

    older_sockets = tcp_inodes()  # not this context's: an abort must leave them alone
    groups = build_groups(layout, rank, timeout=td, cpu_groups="gloo" not in backend)
    monitor = _failure_monitor(
        store, rank, world, heartbeat_interval, groups, backend, older_sockets, progress_timeout
    )
    return ParallelContext(
        config=parallel,
        full_config=full,
        groups=groups,
        global_rank=rank,
        backend=backend,
        device=dev,
        seed=seed,
        timeout=td,
        owns_default_group=False,
        monitor=monitor,
    )


def _check_heartbeat_interval(interval: float | None, name: str = "heartbeat_interval") -> None:
    if interval is not None and (
        isinstance(interval, bool) or not isinstance(interval, (int, float)) or interval < 0
    ):
        raise ValueError(
            f"{name} must be a non-negative number of seconds or None, got {interval!r}"
        )


def _failure_monitor(
    store: Store | None,
    rank: int,
    world: int,
    heartbeat_interval: float | None,
    groups: ProcessGroups,
    backend: str,
    older_sockets: frozenset[int] = frozenset(),
    progress_timeout: float | None = None,
) -> FailureMonitor:
    """The failure board of a new context, in a namespace of its own, and its group aborter.

    Contexts are created in the same order on every rank (their groups are collective), so the
    per-rank count of contexts built on one store names the same board on every rank without
    a collective; boards of earlier contexts on the same store (tests) stay apart. Every rank
    publishes its TCP endpoints now that its groups are connected, so that an abort can find
    the gloo links to its peers (see ``tessera.context.abort``).
    """
    store = store if store is not None else default_store()
    if store is None:
        return FailureMonitor(None, None)
    try:
        serial = store.add(f"tessera/contexts/{rank}", 1)
    except RuntimeError:
        return FailureMonitor(None, None)
    board = FailureBoard(store, f"tessera/failures/{serial}", rank, world)

    # Only what this context built: the default group (a launcher's, a test harness's) and
    # anything else the process connected before are not this context's to abort.
    aborter = GroupAborter(lambda: list(groups.created), backend, store_port(store), older_sockets)
    with contextlib.suppress(RuntimeError, OSError):
        board.publish_endpoints(aborter.endpoints())
    return FailureMonitor(
        board,
        float(heartbeat_interval) if heartbeat_interval else None,
        abort=lambda: aborter.abort(board.peer_endpoints()),
        progress_timeout=float(progress_timeout) if progress_timeout else None,
    )
