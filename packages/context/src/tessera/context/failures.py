"""Fail fast across ranks: a failure board on the rendezvous store, heartbeats, ``guard``.

A collective only knows that its peer did not answer: gloo reports "Timed out waiting 1800000ms
for recv" or "Connection closed by peer [10.0.0.7]:41234", NCCL hangs until its watchdog fires.
Neither says *which* rank failed or *why*. The rank that failed knows both, so it writes them
down where every other rank can read them without a collective: the key-value store the job
rendezvoused on (the TCPStore every torch.distributed job already has).

- ``ParallelContext.guard(where)`` wraps a step. When the body raises on this rank, the
  exception is posted to the board as ``{rank, where, type, message}`` and re-raised unchanged.
  When the body raises a *communication* error (a collective timed out or a peer closed its
  connection), the guard reads the board and raises :class:`RankFailedError` naming the rank
  that failed and where, chained to the original error.
- A rank that dies without raising (``os._exit``, a segfault, the OOM killer) posts nothing. A
  daemon thread per rank increments a heartbeat counter in the store every
  ``heartbeat_interval`` seconds, with the name of the innermost guard it is in; a rank whose
  counter stands still for three intervals is reported as dead, with its last known place.

The time to detection is bounded by the collective timeout (``ParallelContext.timeout``): a
rank waiting on a failed peer gets the timeout error (or, under gloo, a closed connection at
once when the peer's process is gone) and turns it into a ``RankFailedError``. Blocked
collectives cannot be interrupted portably, so the board is read when the collective returns,
not by interrupting it. Only the error path touches the store: a step that succeeds costs
nothing but a ``try`` block.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch.distributed import Store  # type: ignore[attr-defined]  # re-exported from C++

__all__ = [
    "DEFAULT_HEARTBEAT_INTERVAL",
    "FailureBoard",
    "FailureMonitor",
    "FailureReport",
    "RankFailedError",
    "default_store",
    "is_communication_error",
]

#: Seconds between heartbeats: one tiny store write per rank, so cheap for thousands of ranks;
#: a dead rank is named about three intervals after its peers notice the failure.
DEFAULT_HEARTBEAT_INTERVAL = 2.0

#: Heartbeat intervals without a beat after which a rank counts as dead.
_SILENT_INTERVALS = 3.0

#: Without heartbeats: how long a rank whose collective failed waits for the failed rank's post.
_POST_GRACE = 1.0

#: Characters of an exception message kept on the board.
_MAX_MESSAGE = 2000

#: Lower-case fragments of the RuntimeError messages of gloo, NCCL and c10d on a failed peer.
_COMMUNICATION_MARKERS = (
    "gloo/",
    "nccl",
    "timed out",
    "timeout",
    "connection closed",
    "connection reset",
    "broken pipe",
    "processgroup",
    "watchdog",
)

#: Attribute set on an exception once a guard has posted it (nested guards post once).
_POSTED = "_tessera_failure_posted"


def default_store() -> Store | None:
    """The store of torch.distributed's default group, or None where it cannot be reached.

    ``torch.distributed.distributed_c10d._get_default_store`` is private; this is the only
    place tessera calls it, so a torch release that moves it costs the failure board (a
    context then works without one), not the job.
    """
    getter = getattr(dist.distributed_c10d, "_get_default_store", None)
    if getter is None or not dist.is_initialized():
        return None
    try:
        store = getter()
    except (RuntimeError, ValueError, AttributeError, KeyError):
        return None
    return store if isinstance(store, Store) else None


def is_communication_error(exc: BaseException) -> bool:
    """Whether ``exc`` says a collective failed because of a peer (timeout, closed link)."""
    if isinstance(exc, RankFailedError):
        return False
    dist_error = getattr(dist, "DistError", None)
    if dist_error is not None and isinstance(exc, dist_error):
        return True
    if not isinstance(exc, RuntimeError):
        return False
    text = str(exc).lower()
    return any(marker in text for marker in _COMMUNICATION_MARKERS)


def _summary(exc: BaseException) -> str:
    text = str(exc).strip() or repr(exc)
    return text if len(text) <= _MAX_MESSAGE else text[: _MAX_MESSAGE - 3] + "..."


@dataclass(frozen=True)
class FailureReport:
    """What a failed rank wrote on the board."""

    rank: int
    where: str
    error: str
    message: str
    time: float

    def describe(self) -> str:
        """One line: ``rank 1 failed in 'engine.step': ValueError: boom``."""
        return f"rank {self.rank} failed in {self.where!r}: {self.error}: {self.message}"

    def to_json(self) -> str:
        """The stored form."""
        return json.dumps(
            {
                "rank": self.rank,
                "where": self.where,
                "error": self.error,
                "message": self.message,
                "time": self.time,
            }
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> FailureReport:
        """Inverse of ``to_json``."""
        data = json.loads(text)
        return cls(
            int(data["rank"]),
            str(data["where"]),
            str(data["error"]),
            str(data["message"]),
            float(data["time"]),
        )


class RankFailedError(RuntimeError):
    """This rank stopped because another rank failed (raised, died or stopped answering).

    Attributes:
        rank: The global rank that failed first, or None when no rank could be named.
        where: Where that rank was (its innermost guard), or None when unknown.
        reports: Every failure on the board when this rank looked, in posting order.
        observer: The rank raising this error.
        observed_where: Where the observer was when its communication failed.
    """

    def __init__(
        self,
        message: str,
        *,
        rank: int | None,
        where: str | None,
        reports: Sequence[FailureReport] = (),
        observer: int | None = None,
        observed_where: str | None = None,
    ) -> None:
        super().__init__(message)
        self.rank = rank
        self.where = where
        self.reports = tuple(reports)
        self.observer = observer
        self.observed_where = observed_where

    def __reduce__(self) -> tuple[Any, ...]:
        # Keyword-only attributes: rebuild through a helper so the error pickles (it crosses
        # process boundaries in test harnesses and multiprocessing pools).
        return (
            _rebuild_rank_failed,
            (
                str(self),
                self.rank,
                self.where,
                self.reports,
                self.observer,
                self.observed_where,
            ),
        )


def _rebuild_rank_failed(
    message: str,
    rank: int | None,
    where: str | None,
    reports: Sequence[FailureReport],
    observer: int | None,
    observed_where: str | None,
) -> RankFailedError:
    return RankFailedError(
        message,
        rank=rank,
        where=where,
        reports=reports,
        observer=observer,
        observed_where=observed_where,
    )


class FailureBoard:
    """Failure reports and heartbeats of one context, in its own namespace of a store.

    Keys (under ``namespace``): ``count`` (number of posts, via ``add``), ``post/<i>`` (the
    i-th report as JSON), ``beat/<rank>`` (heartbeat counter), ``where/<rank>`` (the innermost
    guard the rank was last seen in). Every read uses ``check``/``add``, never a blocking
    ``get`` of a missing key, so reading the board cannot hang.
    """

    def __init__(self, store: Store, namespace: str, rank: int, world_size: int) -> None:
        self.store = store
        self.namespace = namespace
        self.rank = rank
        self.world_size = world_size

    def _key(self, *parts: object) -> str:
        return "/".join([self.namespace, *(str(p) for p in parts)])

    def post(self, where: str, exc: BaseException) -> FailureReport:
        """Write this rank's failure; returns the report."""
        report = FailureReport(self.rank, where, type(exc).__name__, _summary(exc), time.time())
        index = self.store.add(self._key("count"), 1)
        self.store.set(self._key("post", index), report.to_json())
        return report

    def reports(self) -> list[FailureReport]:
        """Every report posted so far, in posting order."""
        count = self.store.add(self._key("count"), 0)
        found: list[FailureReport] = []
        for index in range(1, count + 1):
            key = self._key("post", index)
            # `add` came before `set`: a post in flight is picked up on the next read.
            if self.store.check([key]):
                found.append(FailureReport.from_json(self.store.get(key)))
        return found

    def beat(self, where: str | None = None) -> None:
        """One heartbeat, and (when given) where this rank is now."""
        self.store.add(self._key("beat", self.rank), 1)
        if where is not None:
            self.store.set(self._key("where", self.rank), where)

    def beats(self) -> list[int]:
        """Every rank's heartbeat counter (0: never beat)."""
        return [self.store.add(self._key("beat", r), 0) for r in range(self.world_size)]

    def last_where(self, rank: int) -> str | None:
        """Where ``rank`` said it was in its last heartbeat, if it said."""
        key = self._key("where", rank)
        if not self.store.check([key]):
            return None
        return bytes(self.store.get(key)).decode()

    def stopped_ranks(self, before: Sequence[int], after: Sequence[int]) -> list[int]:
        """Ranks that beat before but not between two readings (dead or frozen)."""
        return [
            r
            for r, (b, a) in enumerate(zip(before, after, strict=True))
            if r != self.rank and b > 0 and a == b
        ]


class _Heartbeat(threading.Thread):
    """Daemon thread: ``board.beat(where)`` every ``interval`` seconds until stopped."""

    def __init__(self, monitor: FailureMonitor, board: FailureBoard, interval: float) -> None:
        super().__init__(name=f"tessera-heartbeat-rank{board.rank}", daemon=True)
        self.monitor = monitor
        self.board = board
        self.interval = interval
        self.stop_event = threading.Event()

    def run(self) -> None:
        sent: str | None = None
        while not self.stop_event.is_set():
            where = self.monitor.where
            try:
                self.board.beat(where if where != sent else None)
            except Exception:  # the store went away (job ending): stop beating quietly
                return
            sent = where
            self.stop_event.wait(self.interval)


class FailureMonitor:
    """The board, the heartbeat and the stack of guards of one context on one rank.

    Args:
        board: Where failures are posted (None: guards only re-raise, nothing is detected).
        heartbeat_interval: Seconds between heartbeats; None or 0 disables them (a dead rank is
            then reported as "a rank probably died", without its number).
    """

    def __init__(self, board: FailureBoard | None, heartbeat_interval: float | None) -> None:
        self.board = board
        self.heartbeat_interval = heartbeat_interval or None
        self._where: list[str] = []
        self._thread: _Heartbeat | None = None
        if board is not None and self.heartbeat_interval is not None and board.world_size > 1:
            self._thread = _Heartbeat(self, board, self.heartbeat_interval)
            self._thread.start()

    @property
    def where(self) -> str:
        """The innermost guard this rank is in (``'-'`` outside every guard)."""
        return self._where[-1] if self._where else "-"

    def stop(self) -> None:
        """Stop the heartbeat (before the store and groups go away)."""
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.stop_event.set()
            thread.join(timeout=5.0)

    @contextmanager
    def guard(self, where: str) -> Iterator[None]:
        """See ``ParallelContext.guard``."""
        self._where.append(where)
        try:
            yield
        except RankFailedError:
            raise
        except BaseException as exc:
            replacement = self._on_failure(exc, where)
            if replacement is not None:
                raise replacement from exc
            raise
        finally:
            self._where.pop()

    def check(self, where: str = "-") -> None:
        """Raise ``RankFailedError`` if another rank has posted a failure (no waiting).

        Call it between steps to stop early instead of waiting for the next collective's
        timeout, e.g. in a loop that does long local work.
        """
        board = self.board
        if board is None:
            return
        others = [r for r in board.reports() if r.rank != board.rank]
        if others:
            raise self._error(others, where, None)

    # -- the error path -------------------------------------------------------------------------

    def _on_failure(self, exc: BaseException, where: str) -> RankFailedError | None:
        board = self.board
        if board is None or getattr(exc, _POSTED, False):
            return None
        try:
            if not is_communication_error(exc):
                self._post(board, exc, where)
                return None
            return self._diagnose(board, exc, where)
        except Exception as store_error:  # the store itself is gone
            if not is_communication_error(exc):
                return None
            return RankFailedError(
                f"rank {board.rank} stopped in {where!r}: a collective failed ({_summary(exc)}) "
                f"and the rendezvous store could not be read ({store_error}); the rank that "
                "hosts the store (rank 0 under tessera.context.launch, else the torchrun "
                "agent) probably died",
                rank=None,
                where=None,
                observer=board.rank,
                observed_where=where,
            )

    def _post(self, board: FailureBoard, exc: BaseException, where: str) -> None:
        board.post(where, exc)
        # An exception type with __slots__ cannot be marked: nested guards then post twice.
        with contextlib.suppress(AttributeError):
            setattr(exc, _POSTED, True)

    def _diagnose(self, board: FailureBoard, exc: BaseException, where: str) -> RankFailedError:
        interval = self.heartbeat_interval
        window = _SILENT_INTERVALS * interval if interval is not None else _POST_GRACE
        before = board.beats() if interval is not None else []
        deadline = time.monotonic() + window
        while True:
            others = [r for r in board.reports() if r.rank != board.rank]
            if others:
                return self._error(others, where, exc)
            if time.monotonic() >= deadline:
                break
            time.sleep(min(0.05, window / 10))
        stopped = board.stopped_ranks(before, board.beats()) if interval is not None else []
        # Nobody else posted: this failure is the first news of a problem; tell the others.
        self._post(board, exc, where)
        if stopped:
            first = stopped[0]
            last = board.last_where(first)
            place = f" (last seen in {last!r})" if last is not None else ""
            return RankFailedError(
                f"rank {first} stopped responding{place}: no heartbeat for "
                f"{window:.1f} s, so its process probably exited, crashed or was killed; "
                f"silent ranks {stopped}. Rank {board.rank} noticed in {where!r}: "
                f"{_summary(exc)}",
                rank=first,
                where=last,
                observer=board.rank,
                observed_where=where,
            )
        alive = "every rank still beats" if interval is not None else "no heartbeats"
        return RankFailedError(
            f"rank {board.rank}: a collective failed in {where!r} and no rank reported an "
            f"error ({alive}); ranks may be waiting in different collectives, or one is stuck "
            f"outside a guard: {_summary(exc)}",
            rank=None,
            where=None,
            observer=board.rank,
            observed_where=where,
        )

    def _error(
        self, reports: Sequence[FailureReport], where: str, exc: BaseException | None
    ) -> RankFailedError:
        first = reports[0]
        rank = self.board.rank if self.board is not None else "?"
        seen = f" when its collective failed ({_summary(exc)})" if exc is not None else ""
        more = ""
        if len(reports) > 1:
            more = "; also " + "; ".join(r.describe() for r in reports[1:4])
        return RankFailedError(
            f"{first.describe()}{more}. Rank {rank} stopped in {where!r}{seen}",
            rank=first.rank,
            where=first.where,
            reports=reports,
            observer=self.board.rank if self.board is not None else None,
            observed_where=where,
        )
