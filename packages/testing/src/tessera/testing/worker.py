"""The body of one long-lived worker process (one rank of a pool).

A worker starts once per pool, optionally joins the default gloo process group, then serves
calls until it is told to stop or its pipe closes. Keeping the process (and its imported torch
and joined group) alive is what makes a multi-rank test cost milliseconds instead of the seconds
a fresh spawn costs on a small machine.

A worker never outlives the test process: a killed pytest (SIGTERM, SIGKILL, a CI runner's
timeout) gives its atexit handlers no chance to stop the pool, and a worker busy in a task (a
collective waiting for a peer) would not see its pipe close. So a watcher thread
(:mod:`tessera.testing.parent_watch`) exits the worker as soon as its parent is gone.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import pickle
import signal
import socket
import sys
import traceback
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import IO, Any

import torch
import torch.distributed as dist

from .assert_rewrite import import_rewritten
from .parent_watch import exit_with_parent
from .protocol import Failure, Ready, Stop, Success, Task
from .seeding import seed_all

__all__ = ["launcher_env", "worker_main"]

# Kept open for the life of the worker: faulthandler writes into it on SIGUSR1.
_DUMP_FILE: IO[str] | None = None


def launcher_env(rank: int, world_size: int, port: int) -> dict[str, str]:
    """The torchrun-style variables a rank on a single host sees."""
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world_size),
        "GROUP_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }


def _limit_threads() -> None:
    # Several ranks share few cores: one intra-op thread each avoids oversubscription, which on
    # a 2-core machine turns every matmul into a scheduling fight.
    torch.set_num_threads(1)
    with contextlib.suppress(RuntimeError):  # already fixed once inter-op work started
        torch.set_num_interop_threads(1)


def _prefer_loopback() -> None:
    # Gloo otherwise resolves the hostname to pick an interface, which fails in some sandboxes.
    if "GLOO_SOCKET_IFNAME" in os.environ:
        return
    names = (
        {name for _, name in socket.if_nameindex()} if hasattr(socket, "if_nameindex") else set()
    )
    for candidate in ("lo", "lo0"):
        if candidate in names:
            os.environ["GLOO_SOCKET_IFNAME"] = candidate
            return


def _install_stack_dump(dump_path: str | None) -> None:
    """Let the parent ask for this worker's Python stacks (SIGUSR1) before it kills a hang."""
    global _DUMP_FILE
    if dump_path is None or not hasattr(signal, "SIGUSR1"):
        return
    _DUMP_FILE = open(dump_path, "w")  # noqa: SIM115 - must outlive this function
    faulthandler.register(signal.SIGUSR1, file=_DUMP_FILE, all_threads=True, chain=False)


def _failure(exc: BaseException) -> Failure:
    tb = exc.__traceback__
    if tb is not None and tb.tb_frame.f_code is _execute.__code__ and tb.tb_next is not None:
        tb = tb.tb_next  # start at the user's frame: the harness's own frame is noise
    text = "".join(traceback.format_exception(type(exc), exc, tb))
    try:
        blob = pickle.dumps(exc)
    except Exception:
        blob = b""
    try:
        shown = repr(exc)
    except Exception:
        shown = f"<{type(exc).__name__} with a failing repr>"
    return Failure(traceback=text, exception=blob, exception_repr=shown)


def _send(conn: Connection, message: object) -> bool:
    try:
        conn.send_bytes(pickle.dumps(message))
    except (BrokenPipeError, EOFError, OSError):
        return False
    return True


def _merge_sys_path(parent_path: tuple[str, ...]) -> None:
    """Put the test process's ``sys.path`` first, keeping entries only this worker has."""
    seen = set(parent_path)
    sys.path[:] = list(parent_path) + [p for p in sys.path if p not in seen]


def _check_group_state(init_pg: bool) -> None:
    # A call must leave the default group exactly as it found it, otherwise the next test that
    # lands on this worker would fail (or hang) for a reason that is not its own.
    if init_pg and not dist.is_initialized():
        raise RuntimeError(
            "fn destroyed the harness's default process group; the harness owns it. "
            "Use run(..., init_process_group=False) to create and destroy groups yourself."
        )
    if not init_pg and dist.is_initialized():
        raise RuntimeError(
            "fn returned with a default process group still initialized; call "
            "torch.distributed.destroy_process_group() before returning "
            "(init_process_group=False mode)."
        )


def _execute(task: Task, init_pg: bool) -> Success | Failure:
    try:
        _merge_sys_path(task.sys_path)
        os.environ.update(task.env)
        if task.module_name is not None and task.module_file is not None:
            import_rewritten(task.module_name, task.module_file)
        seed_all(task.seed)
        fn, args, kwargs = pickle.loads(task.payload)
        value: Any = fn(*args, **kwargs)
        _check_group_state(init_pg)
        try:
            blob = pickle.dumps(value)
        except Exception as err:
            raise TypeError(
                f"fn returned a {type(value).__name__} that cannot be pickled back to the "
                f"test process: {err}"
            ) from err
        return Success(value=blob)
    except BaseException as exc:
        return _failure(exc)


def worker_main(
    rank: int,
    world_size: int,
    init_pg: bool,
    port: int,
    pg_timeout_s: float,
    conn: Connection,
    dump_path: str | None,
) -> None:
    """Run one rank: start up, report ``Ready`` (or a ``Failure``), then serve tasks.

    Args:
        rank: this worker's global rank.
        world_size: number of ranks in the pool.
        init_pg: whether to join the default gloo process group at start-up.
        port: rendezvous port of the default group (ignored when ``init_pg`` is false).
        pg_timeout_s: timeout of the default group's collectives, a backstop behind the
            harness's own per-call timeout.
        conn: this worker's end of its pipe to the test process.
        dump_path: file to which SIGUSR1 dumps the Python stacks, or ``None``.
    """
    # Ctrl-C reaches the whole foreground process group; the test process handles it and
    # tears the pool down, so workers must not die mid-message with their own tracebacks.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    exit_with_parent()
    _limit_threads()
    _install_stack_dump(dump_path)
    _prefer_loopback()
    os.environ.update(launcher_env(rank, world_size, port))
    try:
        if init_pg:
            dist.init_process_group(
                backend="gloo",
                init_method=f"tcp://127.0.0.1:{port}",
                rank=rank,
                world_size=world_size,
                timeout=timedelta(seconds=pg_timeout_s),
            )
    except BaseException as exc:
        _send(conn, _failure(exc))
        return
    if not _send(conn, Ready(pid=os.getpid())):
        return
    while True:
        try:
            raw = conn.recv_bytes()
        except (EOFError, OSError):  # the test process went away
            break
        message = pickle.loads(raw)
        if isinstance(message, Stop):
            if init_pg and dist.is_initialized():
                # Local for gloo (no collective), so it cannot hang; healthy pools only.
                dist.destroy_process_group()
            break
        reply = _execute(message, init_pg)
        # Flush before answering so the body's prints land in the current test's captured
        # output (workers share the test process's stdout/stderr file descriptors).
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        if not _send(conn, reply):
            break
    # Leave at once: an interpreter's orderly shutdown (torch's atexit handlers, a compiler's
    # worker threads, every module torn down) takes a second or more of CPU per worker, and a
    # closing pool's workers all shut down together on the machine's few cores.
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(0)
