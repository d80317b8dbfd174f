"""Messages exchanged between the test process and its worker processes.

Every message is pickled by hand and sent with ``send_bytes`` rather than ``Connection.send``:
the worker must be able to update ``sys.path`` *before* it unpickles the user's function, so
the function and its arguments travel as an inner pickle (``Task.payload``) that the worker
opens only once the outer message (plain data) has been read.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Failure", "Ready", "Stop", "Success", "Task"]


@dataclass(frozen=True)
class Task:
    """One call of the user's function on one rank.

    Attributes:
        payload: ``pickle.dumps((fn, args, kwargs))``.
        sys_path: the test process's ``sys.path``; installed before ``payload`` is opened so
            test modules that pytest imported by rootdir-relative path are importable.
        env: environment variables to set before the call (torchrun-style launcher variables).
        seed: the seed for this rank (base seed + rank).
        module_name: name of ``fn``'s module when pytest rewrote its asserts, so the worker can
            rewrite them too and failures show compared values; ``None`` otherwise.
        module_file: that module's source file.
    """

    payload: bytes
    sys_path: tuple[str, ...]
    env: dict[str, str]
    seed: int
    module_name: str | None = None
    module_file: str | None = None


@dataclass(frozen=True)
class Stop:
    """Ask a worker to leave its loop and exit cleanly."""


@dataclass(frozen=True)
class Ready:
    """A worker finished start-up (process group joined, if requested)."""

    pid: int


@dataclass(frozen=True)
class Success:
    """The function returned; ``value`` is its pickled return value."""

    value: bytes


@dataclass(frozen=True)
class Failure:
    """The function (or the worker's start-up) raised.

    Attributes:
        traceback: the formatted remote traceback.
        exception: the pickled exception, or ``b""`` when it could not be pickled.
        exception_repr: ``repr`` of the exception, the fallback when unpickling fails.
    """

    traceback: str
    exception: bytes = field(default=b"", repr=False)
    exception_repr: str = ""
