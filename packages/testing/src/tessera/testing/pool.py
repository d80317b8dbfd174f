"""A pool of long-lived worker processes: one per rank, for one world size.

Spawning a process that imports torch and joins a gloo group costs seconds on a small machine;
reusing the same processes across tests brings a multi-rank call down to milliseconds. The price
is that a pool whose call went wrong (a rank raised, died or hung) may be stuck inside a
collective, so such a pool is killed outright and a fresh one is started on next use.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import pickle
import re
import signal
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess

from . import parent_watch as _parent_watch_module
from . import worker as _worker_module
from .errors import RankError, RankTimeoutError
from .ports import free_port
from .protocol import Failure, Ready, Stop, Success, Task
from .worker import worker_main

__all__ = ["WorkerPool"]

_STACK_DUMP_WAIT_S = 3.0
_JOIN_TIMEOUT_S = 5.0
_GRACEFUL_EXIT_S = 5.0
_WORKER_FILE = f'"{_worker_module.__file__}"'
_WATCH_FILE = f'"{_parent_watch_module.__file__}"'


@dataclass
class _Gathered:
    """What came back from the ranks before everyone answered, the deadline or the grace."""

    replies: dict[int, object] = field(default_factory=dict)
    dead: dict[int, int | None] = field(default_factory=dict)
    pending: list[int] = field(default_factory=list)

    def failed(self) -> bool:
        return bool(self.dead) or any(isinstance(m, Failure) for m in self.replies.values())


def _exception_of(failure: Failure) -> BaseException | str:
    if failure.exception:
        try:
            exc = pickle.loads(failure.exception)
        except Exception:
            return failure.exception_repr
        if isinstance(exc, BaseException):
            return exc
    return failure.exception_repr


def _death_text(rank: int, exitcode: int | None) -> str:
    how = f"exit code {exitcode}"
    if exitcode is not None and exitcode < 0:
        with contextlib.suppress(ValueError):
            how = f"killed by {signal.Signals(-exitcode).name}"
    return (
        f"worker process of rank {rank} exited unexpectedly ({how}); it may have run out of "
        "memory, crashed in native code or called os._exit()"
    )


def _user_frames(dump: str) -> str:
    """The test's own frames of a faulthandler dump.

    Each thread's frames are cut where the harness's own begin (the worker loop), and the
    harness's parent-watching thread is left out.
    """
    threads = re.split(r"(?m)^(?=(?:Current thread|Thread) 0x)", dump)
    kept = []
    for thread in threads:
        if _WATCH_FILE in thread:
            continue
        lines = []
        for line in thread.splitlines():
            if _WORKER_FILE in line:
                break
            lines.append(line)
        kept.extend(lines)
    return "\n".join(kept)


class WorkerPool:
    """``world_size`` spawned worker processes serving calls of one function at a time.

    Args:
        world_size: number of ranks (processes).
        init_process_group: whether workers join a default gloo group at start-up.
        pg_timeout: timeout (s) of the default group's collectives; a backstop only.
        startup_timeout: how long (s) the workers may take to start and rendezvous.
        failure_grace: after the first rank fails, how long (s) to wait for the others to
            report their own failures before the pool is killed. Short, because the others
            are usually blocked in a collective with the failed rank.
    """

    def __init__(
        self,
        world_size: int,
        init_process_group: bool,
        *,
        pg_timeout: float,
        startup_timeout: float,
        failure_grace: float,
    ) -> None:
        self.world_size = world_size
        self.init_process_group = init_process_group
        self.pg_timeout = pg_timeout
        self.startup_timeout = startup_timeout
        self.failure_grace = failure_grace
        self.port = 0
        self._procs: list[BaseProcess] = []
        self._conns: list[Connection] = []
        self._dump_paths: list[str] = []
        self._stop_requested = False

    @property
    def pids(self) -> list[int]:
        """Process ids of the workers, indexed by rank (empty when the pool is not running)."""
        return [p.pid for p in self._procs if p.pid is not None]

    def healthy(self) -> bool:
        """Whether the pool is running and every worker is alive."""
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    # ----------------------------------------------------------------- start-up

    def start(self) -> None:
        """Spawn the workers and wait until each reports ready.

        Retries once with a new port, since the probed free port can be taken in between.

        Raises:
            RuntimeError: both attempts failed; the message holds every rank's error.
        """
        problems: list[str] = []
        for _attempt in range(2):
            try:
                problem = self._start_once()
            except BaseException:  # e.g. KeyboardInterrupt while waiting: leave no process
                self.close(graceful=False)
                raise
            if problem is None:
                return
            problems.append(problem)
            self.close(graceful=False)
        joined = "\n".join(problems)
        raise RuntimeError(
            f"could not start {self.world_size} worker process(es) "
            f"(init_process_group={self.init_process_group}):\n{joined}"
        )

    def _start_once(self) -> str | None:
        ctx = multiprocessing.get_context("spawn")
        self.port = free_port() if self.init_process_group else 0
        for rank in range(self.world_size):
            parent_conn, child_conn = ctx.Pipe(duplex=True)
            fd, dump_path = tempfile.mkstemp(prefix=f"tessera-rank{rank}-", suffix=".stack")
            os.close(fd)
            proc = ctx.Process(
                target=worker_main,
                args=(
                    rank,
                    self.world_size,
                    self.init_process_group,
                    self.port,
                    self.pg_timeout,
                    child_conn,
                    dump_path,
                ),
                name=f"tessera-worker-{rank}-of-{self.world_size}",
                daemon=True,
            )
            self._procs.append(proc)
            self._conns.append(parent_conn)
            self._dump_paths.append(dump_path)
            proc.start()
            child_conn.close()
        gathered = self._gather(time.monotonic() + self.startup_timeout)
        lines: list[str] = []
        for rank, message in sorted(gathered.replies.items()):
            if isinstance(message, Failure):
                lines.append(f"rank {rank} failed to start:\n{message.traceback.rstrip()}")
            elif not isinstance(message, Ready):
                lines.append(f"rank {rank} sent {message!r} instead of Ready")
        lines += [_death_text(rank, code) for rank, code in sorted(gathered.dead.items())]
        if gathered.pending:
            lines.append(
                f"ranks {gathered.pending} were not ready after {self.startup_timeout:g} s"
            )
        return "\n".join(lines) if lines else None

    # ----------------------------------------------------------------- calls

    def call(self, fn_name: str, tasks: Sequence[Task], timeout: float) -> list[bytes]:
        """Run one task per rank and return each rank's pickled return value.

        On any failure, death or timeout the pool is killed before the error is raised.

        Raises:
            RankError: a rank raised or its process died.
            RankTimeoutError: some rank did not answer within ``timeout`` seconds.
        """
        __tracebackhide__ = True  # pytest: show the rank's traceback, not the harness's
        try:
            return self._call(fn_name, tasks, timeout)
        except BaseException:
            # Includes KeyboardInterrupt: workers may be mid-call, so they cannot be reused.
            self.close(graceful=False)
            raise

    def _call(self, fn_name: str, tasks: Sequence[Task], timeout: float) -> list[bytes]:
        __tracebackhide__ = True
        deadline = time.monotonic() + timeout
        gathered = _Gathered()
        for rank, (conn, task) in enumerate(zip(self._conns, tasks, strict=True)):
            try:
                conn.send_bytes(pickle.dumps(task))
            except (BrokenPipeError, EOFError, OSError):
                self._procs[rank].join(_JOIN_TIMEOUT_S)
                gathered.dead[rank] = self._procs[rank].exitcode
        if not gathered.dead:
            gathered = self._gather(deadline)
        if gathered.failed():
            failures: dict[int, str] = {}
            exceptions: dict[int, BaseException | str] = {}
            for rank, message in gathered.replies.items():
                if isinstance(message, Failure):
                    failures[rank] = message.traceback
                    exceptions[rank] = _exception_of(message)
            for rank, code in gathered.dead.items():
                failures[rank] = _death_text(rank, code)
            unfinished = [r for r in range(self.world_size) if r not in failures]
            unfinished = [r for r in unfinished if r not in gathered.replies]
            raise RankError(
                fn_name,
                self.world_size,
                failures,
                exceptions,
                unfinished,
                self._dump_stacks(unfinished),
            )
        if gathered.pending:
            raise RankTimeoutError(
                fn_name,
                self.world_size,
                timeout,
                gathered.pending,
                self._dump_stacks(gathered.pending),
            )
        values: list[bytes] = []
        for rank in range(self.world_size):
            message = gathered.replies[rank]
            if not isinstance(message, Success):
                raise RuntimeError(f"rank {rank} sent {message!r} instead of a call result")
            values.append(message.value)
        return values

    def _gather(self, deadline: float) -> _Gathered:
        """Read one message from every rank, until the deadline or a failure's grace ends."""
        gathered = _Gathered()
        pending = set(range(self.world_size))
        grace_end: float | None = None
        while pending:
            limit = deadline if grace_end is None else min(deadline, grace_end)
            remaining = limit - time.monotonic()
            if remaining <= 0:
                break
            owners: dict[object, int] = {}
            handles: list[Connection | int] = []
            for rank in pending:
                conn, sentinel = self._conns[rank], self._procs[rank].sentinel
                owners[conn] = owners[sentinel] = rank
                handles += [conn, sentinel]
            ready = wait(handles, timeout=remaining)
            for rank in sorted({owners[handle] for handle in ready}):
                pending.discard(rank)
                message = self._receive(rank)
                if message is None:
                    gathered.dead[rank] = self._procs[rank].exitcode
                else:
                    gathered.replies[rank] = message
                if grace_end is None and (message is None or isinstance(message, Failure)):
                    grace_end = time.monotonic() + self.failure_grace
        gathered.pending = sorted(pending)
        return gathered

    def _receive(self, rank: int) -> object | None:
        """The next message from ``rank``, or ``None`` when its process is gone."""
        conn = self._conns[rank]
        try:
            if conn.poll():
                message: object = pickle.loads(conn.recv_bytes())
                return message
        except (EOFError, OSError):
            pass
        self._procs[rank].join(_JOIN_TIMEOUT_S)
        return None

    def _dump_stacks(self, ranks: Sequence[int]) -> dict[int, str]:
        """Ask unfinished workers for their Python stacks (SIGUSR1 + faulthandler)."""
        if not ranks or not hasattr(signal, "SIGUSR1"):
            return {}
        asked = []
        for rank in ranks:
            proc = self._procs[rank]
            if proc.pid is not None and proc.is_alive():
                with contextlib.suppress(OSError):
                    os.kill(proc.pid, signal.SIGUSR1)
                    asked.append(rank)
        stacks: dict[int, str] = {}
        seen: dict[int, str] = {}  # the last read of each dump still being written
        end = time.monotonic() + _STACK_DUMP_WAIT_S
        while asked and time.monotonic() < end:
            for rank in list(asked):
                with contextlib.suppress(OSError):
                    with open(self._dump_paths[rank]) as handle:
                        text = handle.read()
                    # faulthandler writes the innermost frame first and the worker loop last:
                    # the dump is complete once the loop's frames are in, or it stopped growing.
                    if text.strip() and (_WORKER_FILE in text or seen.get(rank) == text):
                        stacks[rank] = _user_frames(text)
                        asked.remove(rank)
                    seen[rank] = text
            time.sleep(0.05)
        for rank in asked:  # out of time: what was written so far
            if seen.get(rank, "").strip():
                stacks[rank] = _user_frames(seen[rank])
        return stacks

    # ----------------------------------------------------------------- shutdown

    def request_stop(self) -> None:
        """Ask every worker to exit cleanly, without waiting (see :meth:`close`).

        Lets a caller stop several pools at once and then wait for all of them together:
        a torch process takes about a second to exit, which adds up when done one by one.
        """
        if self._stop_requested:
            return
        self._stop_requested = True
        for conn in self._conns:
            with contextlib.suppress(BrokenPipeError, EOFError, OSError):
                conn.send_bytes(pickle.dumps(Stop()))

    def close(self, graceful: bool = True) -> None:
        """Stop every worker; never leaves a process behind.

        Args:
            graceful: ask idle workers to exit first (they leave the group cleanly); workers
                that do not exit within a few seconds, or all of them when false, are killed.
        """
        if graceful:
            self.request_stop()
            end = time.monotonic() + _GRACEFUL_EXIT_S
            for proc in self._procs:
                with contextlib.suppress(ValueError, AssertionError):
                    proc.join(max(0.0, end - time.monotonic()))
        for proc in self._procs:
            with contextlib.suppress(ValueError, AssertionError, OSError):
                if proc.is_alive():
                    proc.kill()
        for proc in self._procs:
            with contextlib.suppress(ValueError, AssertionError):
                proc.join(_JOIN_TIMEOUT_S)
                proc.close()
        for conn in self._conns:
            with contextlib.suppress(OSError):
                conn.close()
        for path in self._dump_paths:
            with contextlib.suppress(OSError):
                os.unlink(path)
        self._procs, self._conns, self._dump_paths = [], [], []
        self._stop_requested = False
