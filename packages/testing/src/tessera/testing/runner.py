"""``DistributedRunner``: run a function on N gloo ranks in reusable worker pools."""

from __future__ import annotations

import atexit
import os
import pickle
import sys
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from types import TracebackType
from typing import Any, TypeVar

from .pool import WorkerPool
from .ports import free_port
from .protocol import Task
from .worker import launcher_env

__all__ = [
    "DEFAULT_SEED",
    "DEFAULT_TIMEOUT",
    "DistributedRunner",
    "MAX_POOLS_ENV",
    "TIMEOUT_ENV",
]

_T = TypeVar("_T")

DEFAULT_TIMEOUT = 120.0
"""Seconds a call may take when neither the call, the runner nor the environment says."""
DEFAULT_SEED = 1234
"""Base seed: rank ``r`` is seeded with ``DEFAULT_SEED + r`` before every call."""
TIMEOUT_ENV = "TESSERA_TEST_TIMEOUT"
"""Environment variable overriding the default call timeout (seconds), e.g. on slow CI."""
MAX_POOLS_ENV = "TESSERA_TEST_MAX_POOLS"
"""Environment variable capping how many pools stay alive at once (least recently used go)."""

_DEFAULT_MAX_POOLS = 4
_DEFAULT_PG_TIMEOUT = 300.0

_LIVE: weakref.WeakSet[DistributedRunner] = weakref.WeakSet()


def _close_all() -> None:
    for runner in list(_LIVE):
        runner.close()


# Runs before multiprocessing's own exit handler (atexit is last-in, first-out), so workers are
# asked to stop cleanly, and killed if they do not, before the interpreter goes away.
atexit.register(_close_all)


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number of seconds") from None
    if value <= 0:
        raise ValueError(f"{name}={raw!r} must be > 0 seconds")
    return value


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer") from None
    if value < 1:
        raise ValueError(f"{name}={raw!r} must be >= 1")
    return value


def _describe(fn: Callable[..., Any]) -> str:
    module = getattr(fn, "__module__", None)
    name = getattr(fn, "__qualname__", None) or repr(fn)
    return f"{module}.{name}" if module else name


def _rewritable_module(fn: Callable[..., Any]) -> tuple[str | None, str | None]:
    """``fn``'s module name and file when pytest rewrote its asserts in this process."""
    name = getattr(fn, "__module__", None)
    module = sys.modules.get(name) if isinstance(name, str) else None
    if module is None:
        return None, None
    loader = getattr(module, "__loader__", None)
    path = getattr(module, "__file__", None)
    if type(loader).__name__ != "AssertionRewritingHook" or not isinstance(path, str):
        return None, None
    return name, path


class DistributedRunner:
    """Runs a function on every rank of a CPU/gloo world, in worker processes kept alive.

    One pool of workers exists per ``(world_size, init_process_group)`` and serves every call
    with that shape, so only the first call pays for spawning processes and importing torch.
    A call that fails (a rank raises or dies) or times out kills its pool; the next call with
    that shape starts a fresh one.

    Thread-safe (calls are serialized); close it, use it as a context manager, or let the
    interpreter's exit close it.

    Args:
        timeout: default seconds a call may take; else ``$TESSERA_TEST_TIMEOUT``, else 120.
        seed: base seed; rank ``r`` is seeded with ``seed + r`` before every call.
        max_pools: how many pools stay alive at once (least recently used are closed); else
            ``$TESSERA_TEST_MAX_POOLS``, else 4. Each worker holds a whole torch import.
        startup_timeout: seconds the workers of a new pool may take to become ready.
        failure_grace: after the first rank fails, seconds to wait for the others' own
            failures before the pool is killed and the error raised.
        pg_timeout: timeout (s) of the default process group's collectives inside the workers;
            a backstop behind the call timeout.

    Example:
        >>> def body(scale):
        ...     t = torch.ones(2) * (dist.get_rank() + 1) * scale
        ...     dist.all_reduce(t)
        ...     return t.tolist()
        >>> with DistributedRunner() as runner:  # doctest: +SKIP
        ...     runner.run(body, world_size=2, args=(10,))
        [[30.0, 30.0], [30.0, 30.0]]
    """

    def __init__(
        self,
        *,
        timeout: float | None = None,
        seed: int = DEFAULT_SEED,
        max_pools: int | None = None,
        startup_timeout: float = 180.0,
        failure_grace: float = 1.0,
        pg_timeout: float = _DEFAULT_PG_TIMEOUT,
    ) -> None:
        if timeout is not None and timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        self.timeout = timeout
        self.seed = seed
        self.max_pools = (
            max_pools if max_pools is not None else _env_int(MAX_POOLS_ENV, _DEFAULT_MAX_POOLS)
        )
        if self.max_pools < 1:
            raise ValueError(f"max_pools must be >= 1, got {self.max_pools}")
        self.startup_timeout = startup_timeout
        self.failure_grace = failure_grace
        self.pg_timeout = pg_timeout
        self._pools: OrderedDict[tuple[int, bool], WorkerPool] = OrderedDict()
        self._lock = threading.Lock()
        _LIVE.add(self)

    def __enter__(self) -> DistributedRunner:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def run(
        self,
        fn: Callable[..., _T],
        world_size: int,
        *,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
        timeout: float | None = None,
        init_process_group: bool = True,
        seed: int | None = None,
    ) -> list[_T]:
        """Call ``fn(*args, **kwargs)`` on ranks ``0 .. world_size-1`` and return the results.

        With ``init_process_group=True`` the default gloo group of ``world_size`` ranks is
        already initialized when ``fn`` runs; ``fn`` must not destroy it. With ``False`` there
        is no default group and ``fn`` finds ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
        ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` (127.0.0.1) and ``MASTER_PORT`` (fresh for this
        call) in ``os.environ``, as under torchrun; it must destroy any group it creates.

        Args:
            fn: a module-level (picklable) function, run on every rank.
            world_size: number of ranks, >= 1.
            args: positional arguments, pickled and sent to every rank.
            kwargs: keyword arguments, pickled and sent to every rank.
            timeout: seconds the whole call may take on every rank; default: the runner's,
                else ``$TESSERA_TEST_TIMEOUT``, else 120.
            init_process_group: whether the workers hold an initialized default group.
            seed: base seed for this call; rank ``r`` gets ``seed + r``.

        Returns:
            ``fn``'s return values, indexed by rank.

        Raises:
            RankError: one or more ranks raised (or died); the message holds each failed
                rank's traceback. The pool is restarted on next use.
            RankTimeoutError: some ranks did not finish in time (a ``TimeoutError`` naming
                them). The pool is restarted on next use.
            TypeError: ``fn`` or its arguments cannot be pickled.
            ValueError: ``world_size`` or ``timeout`` is out of range.
        """
        __tracebackhide__ = True  # pytest: failures point at the test, not at the harness
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {world_size!r}")
        limit = self._resolve_timeout(timeout)
        name = _describe(fn)
        try:
            payload = pickle.dumps((fn, tuple(args), dict(kwargs or {})))
        except Exception as err:
            raise TypeError(
                f"cannot send {name} and its arguments to the worker processes: {err}. "
                "fn must be a module-level function (not a lambda, closure or local "
                "function) and args/kwargs must be picklable."
            ) from err
        module_name, module_file = _rewritable_module(fn)
        base_seed = self.seed if seed is None else seed
        path = tuple(sys.path)
        port = 0 if init_process_group else free_port()
        with self._lock:
            pool = self._pool(world_size, init_process_group)
            if init_process_group:
                port = pool.port
            tasks = [
                Task(
                    payload=payload,
                    sys_path=path,
                    env=launcher_env(rank, world_size, port),
                    seed=base_seed + rank,
                    module_name=module_name,
                    module_file=module_file,
                )
                for rank in range(world_size)
            ]
            try:
                blobs = pool.call(name, tasks, limit)
            except BaseException:
                self._pools.pop((world_size, init_process_group), None)
                raise
        results: list[_T] = []
        for rank, blob in enumerate(blobs):
            try:
                results.append(pickle.loads(blob))
            except Exception as err:
                raise RuntimeError(
                    f"rank {rank}'s return value of {name} could not be unpickled in the "
                    f"test process: {err}"
                ) from err
        return results

    def worker_pids(self, world_size: int, init_process_group: bool = True) -> list[int]:
        """PIDs of the live pool for this shape, by rank; empty when there is none."""
        with self._lock:
            pool = self._pools.get((world_size, init_process_group))
            return pool.pids if pool is not None and pool.healthy() else []

    def close(self) -> None:
        """Stop every worker of every pool (idempotent)."""
        with self._lock:
            pools = list(self._pools.values())
            self._pools.clear()
            for pool in pools:
                pool.request_stop()
            for pool in pools:
                pool.close()

    def _resolve_timeout(self, timeout: float | None) -> float:
        if timeout is None:
            timeout = self.timeout
        if timeout is None:
            timeout = _env_float(TIMEOUT_ENV, DEFAULT_TIMEOUT)
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        return float(timeout)

    def _pool(self, world_size: int, init_process_group: bool) -> WorkerPool:
        """The live pool for this shape, started (or restarted) when needed. Lock held."""
        key = (world_size, init_process_group)
        pool = self._pools.get(key)
        if pool is not None and not pool.healthy():
            # A worker died between calls (e.g. killed from outside): start afresh.
            pool.close(graceful=False)
            del self._pools[key]
            pool = None
        if pool is None:
            while len(self._pools) >= self.max_pools:
                _, old = self._pools.popitem(last=False)
                old.close()
            pool = WorkerPool(
                world_size,
                init_process_group,
                pg_timeout=self.pg_timeout,
                startup_timeout=self.startup_timeout,
                failure_grace=self.failure_grace,
            )
            pool.start()
            self._pools[key] = pool
        self._pools.move_to_end(key)
        return pool
