"""Fail fast across ranks: a failure board on the rendezvous store, heartbeats, ``guard``.

A collective only knows that its peer did not answer: gloo reports "Timed out waiting 1800000ms
for recv" or "Connection closed by peer [10.0.0.7]:41234", NCCL hangs until its watchdog fires.
Neither says *which* rank failed or *why*. The rank that failed knows both, so it writes them
down where every other rank can read them without a collective: the key-value store the job
rendezvoused on (the TCPStore every torch.distributed job already has).

- ``ParallelContext.guard(where)`` wraps a step. When the body raises on this rank, the
  exception is posted to the board as ``{rank, where, type, message}`` and re-raised unchanged.
  Control flow is not failure (``is_control_flow``): ``StopIteration`` at the end of an epoch,
  ``GeneratorExit``, ``KeyboardInterrupt``, a clean ``SystemExit``, and anything raised after
  the context's ``destroy()`` are re-raised and never posted.
  When the body raises a *communication* error (a collective timed out or a peer closed its
  connection), the guard reads the board and raises :class:`RankFailedError` naming the rank
  that failed and where, chained to the original error.
- A rank that dies without raising (``os._exit``, a segfault, the OOM killer) posts nothing. A
  daemon thread per rank increments a heartbeat counter in the store every
  ``heartbeat_interval`` seconds, with the name of the innermost guard it is in; a rank whose
  counter stands still for three intervals is reported as dead, with its last known place.
- Each rank also watches its two ring neighbours' counters (the next and the previous rank
  that have not left: constant store traffic per rank at any scale, and every rank watched
  twice, so one watcher that is itself stuck or starved cannot hide a dead rank). A neighbour
  silent for three intervals is declared on the board; every rank sees the declaration within
  one interval and aborts its groups (``tessera.context.abort``), so a collective blocked on a
  stopped rank (SIGSTOP, a hung NFS read) raises at once instead of at its timeout.

- Liveness is not progress: a training thread blocked in a read on a dead NFS server releases
  the GIL, so its heartbeat thread keeps beating. Each rank therefore counts *progress marks*
  (every guard entered and left, every batch the engine reads: ``mark_progress``), and its
  heartbeat publishes the count. A watcher that sees its neighbour's count stand still for
  ``progress_timeout`` seconds while another rank is already past that count (the others went
  on and wait for it) declares it stalled, like a silent rank. Ranks that all wait together
  (a slow step, one rank's long solo work that no other rank passed) are never declared.

The board holds three kinds of post. ``failed``: a rank's own error (the cause). ``silent``: a
rank declared dead by its watcher. ``affected``: a rank whose collective failed, telling the
others it was hit; it is never read as the cause, so a rank hit late does not blame an early
victim. A victim names the first ``failed`` post, else the first ``silent`` one, else a rank
whose heartbeat stopped (victims excluded), and then aborts its own groups so that ranks still
blocked on it stop waiting too. Only the error path reads the board: a step that succeeds costs
nothing but a ``try`` block.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch.distributed import Store  # type: ignore[attr-defined]  # re-exported from C++

__all__ = [
    "DEFAULT_HEARTBEAT_INTERVAL",
    "DEFAULT_PROGRESS_TIMEOUT",
    "FailureBoard",
    "FailureMonitor",
    "FailureReport",
    "RankFailedError",
    "default_store",
    "is_communication_error",
    "is_control_flow",
]

#: Seconds between heartbeats: one tiny store write per rank, so cheap for thousands of ranks;
#: a dead rank is named about three intervals after its peers notice the failure.
DEFAULT_HEARTBEAT_INTERVAL = 2.0

#: Seconds a rank may go without a progress mark, while another rank is past it, before it is
#: declared stalled: generous, so a slow step, data read or one rank's long checkpoint write
#: is not taken for a hang (work longer than the collective timeout fails anyway: the others
#: wait in a collective), and shorter than the 5-minute collective timeout by more than two
#: heartbeats, so the stalled rank is named before the collectives time out.
DEFAULT_PROGRESS_TIMEOUT = 240.0

#: Heartbeat intervals without a beat after which a rank counts as dead.
_SILENT_INTERVALS = 3.0

#: ... and never less than this many seconds. A declaration aborts the job, so a live rank
#: whose heartbeat thread was starved for a moment (an overloaded host, a long call holding
#: the GIL) must not be declared dead by a short interval (tests use 0.2 s).
_MIN_SILENCE = 2.0

#: Consecutive failed store calls after which a heartbeat thread stops (the store is gone).
_STORE_RETRIES = 3

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

#: Kinds of post: a rank's own error, a rank declared dead by its watcher, a victim's note.
FAILED, SILENT, AFFECTED = "failed", "silent", "affected"

#: The error name of a ``silent`` post for a rank that beats but made no progress.
NO_PROGRESS = "NoProgress"


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


def is_control_flow(exc: BaseException) -> bool:
    """Whether ``exc`` ends a loop or the process on purpose, so no rank is at fault.

    ``StopIteration`` (a loader without ``len()`` ends its epoch through ``execute_schedule``),
    ``StopAsyncIteration``, ``GeneratorExit`` (a generator closed early), ``KeyboardInterrupt``
    (Ctrl-C reaches every rank of the terminal's process group; a user's stop is no rank's
    failure) and ``SystemExit`` with status 0 or ``None`` (a clean ``sys.exit()``). Posting
    them would make ``check_failures()`` raise on a healthy job and blame the next real
    failure on the wrong rank. A rank that stops alone this way while its peers wait is still
    named by its stopped heartbeat.
    """
    if isinstance(exc, SystemExit):
        return exc.code is None or exc.code == 0
    return isinstance(exc, StopIteration | StopAsyncIteration | GeneratorExit | KeyboardInterrupt)


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


def _described(exc: BaseException) -> str:
    """``ValueError: bad batch``, kept short."""
    return f"{type(exc).__name__}: {_summary(exc)}"


def _summary(exc: BaseException) -> str:
    text = str(exc).strip() or repr(exc)
    return text if len(text) <= _MAX_MESSAGE else text[: _MAX_MESSAGE - 3] + "..."


@dataclass(frozen=True)
class FailureReport:
    """One post on the board: a failure (``kind`` ``failed``), a silent rank, a victim's note.

    For a ``silent`` post, ``rank`` is the rank declared dead (not the poster) and ``where`` its
    last known place.
    """

    rank: int
    where: str
    error: str
    message: str
    time: float
    kind: str = FAILED

    def describe(self) -> str:
        """One line: ``rank 1 failed in 'engine.step': ValueError: boom``."""
        if self.kind == SILENT and self.error == NO_PROGRESS:
            return (
                f"rank {self.rank} made no progress (last seen in {self.where!r}): {self.message}"
            )
        if self.kind == SILENT:
            return (
                f"rank {self.rank} stopped responding (last seen in {self.where!r}): {self.message}"
            )
        verb = "was affected" if self.kind == AFFECTED else "failed"
        return f"rank {self.rank} {verb} in {self.where!r}: {self.error}: {self.message}"

    def to_json(self) -> str:
        """The stored form."""
        return json.dumps(
            {
                "rank": self.rank,
                "where": self.where,
                "error": self.error,
                "message": self.message,
                "time": self.time,
                "kind": self.kind,
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
            str(data.get("kind", FAILED)),
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
    guard the rank was last seen in), ``silent`` (number of ranks declared dead), ``left/<rank>``
    (the rank stopped its heartbeat on purpose), ``endpoints/<rank>`` (its TCP endpoints, for
    aborting gloo). Every read uses ``check``/``add``, never a blocking ``get`` of a missing
    key, so reading the board cannot hang.
    """

    def __init__(self, store: Store, namespace: str, rank: int, world_size: int) -> None:
        self.store = store
        self.namespace = namespace
        self.rank = rank
        self.world_size = world_size

    def _key(self, *parts: object) -> str:
        return "/".join([self.namespace, *(str(p) for p in parts)])

    def post(self, where: str, exc: BaseException, kind: str = FAILED) -> FailureReport:
        """Write this rank's failure (or, kind ``affected``, that it was hit); returns it."""
        report = FailureReport(
            self.rank, where, type(exc).__name__, _summary(exc), time.time(), kind
        )
        self._write(report)
        return report

    def _write(self, report: FailureReport) -> None:
        index = self.store.add(self._key("count"), 1)
        self.store.set(self._key("post", index), report.to_json())

    def declare_silent(self, rank: int, seconds: float) -> FailureReport:
        """Post that ``rank``'s heartbeat stood still for ``seconds``, and raise the flag."""
        where = self.last_where(rank) or "-"
        message = f"no heartbeat for {seconds:.1f} s (noticed by rank {self.rank})"
        report = FailureReport(rank, where, "NoHeartbeat", message, time.time(), SILENT)
        self._write(report)
        self.raise_silent_flag()
        return report

    def raise_silent_flag(self) -> None:
        """Tell every rank that a rank was declared dead (their heartbeats then abort)."""
        self.store.add(self._key("silent"), 1)

    def silent_declared(self) -> bool:
        """Whether any rank has been declared dead (one store round trip)."""
        return self.store.add(self._key("silent"), 0) > 0

    def leave(self, raising: str = "") -> None:
        """Say that this rank's heartbeat stops on purpose (its context was destroyed).

        Args:
            raising: The error propagating while the context was destroyed (``finally``
                after an error outside any guard, which was never posted), ``""`` for a
                normal finish: a peer left waiting then names it rightly.
        """
        self.store.set(self._key("left", self.rank), raising or "1")

    def left_raising(self, rank: int) -> str | None:
        """The error ``rank`` left the job with (``""``: none, a normal finish; None: not left)."""
        key = self._key("left", rank)
        if not self.store.check([key]):
            return None
        text = bytes(self.store.get(key)).decode()
        return "" if text == "1" else text

    def has_left(self, rank: int) -> bool:
        """Whether ``rank`` stopped its heartbeat on purpose."""
        return bool(self.store.check([self._key("left", rank)]))

    def publish_endpoints(self, endpoints: Sequence[str]) -> None:
        """Record this rank's TCP endpoints (see ``tessera.context.abort``)."""
        self.store.set(self._key("endpoints", self.rank), json.dumps(list(endpoints)))

    def peer_endpoints(self) -> list[str]:
        """Every other rank's published endpoints."""
        found: list[str] = []
        for r in range(self.world_size):
            key = self._key("endpoints", r)
            if r != self.rank and self.store.check([key]):
                found.extend(json.loads(self.store.get(key)))
        return found

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

    def add_progress(self, marks: int) -> None:
        """Publish ``marks`` more progress marks of this rank (from its heartbeat thread)."""
        self.store.add(self._key("progress", self.rank), marks)

    def progress_count(self, rank: int) -> int:
        """One rank's published progress marks (0: none yet)."""
        return int(self.store.add(self._key("progress", rank), 0))

    def ranks_past(self, rank: int, marks: int) -> list[int]:
        """Ranks still in the job whose progress count exceeds ``marks`` (O(world) reads)."""
        return [
            r
            for r in range(self.world_size)
            if r != rank and self.progress_count(r) > marks and not self.has_left(r)
        ]

    def declare_stalled(self, rank: int, seconds: float, past: Sequence[int]) -> FailureReport:
        """Post that ``rank`` beats but made no progress for ``seconds``; raise the flag."""
        where = self.last_where(rank) or "-"
        message = (
            f"no progress mark for {seconds:.1f} s while its heartbeat still beats (its "
            f"training thread is blocked: a data read, a C call, a collective the others are "
            f"not in), and ranks {list(past)} are past it (noticed by rank {self.rank})"
        )
        report = FailureReport(rank, where, NO_PROGRESS, message, time.time(), SILENT)
        self._write(report)
        self.raise_silent_flag()
        return report

    def beats(self) -> list[int]:
        """Every rank's heartbeat counter (0: never beat)."""
        return [self.beat_count(r) for r in range(self.world_size)]

    def beat_count(self, rank: int) -> int:
        """One rank's heartbeat counter (0: never beat)."""
        return int(self.store.add(self._key("beat", rank), 0))

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
        published = 0
        limit = self.monitor.progress_timeout
        watches = [_Watch(self.board, self.interval, step, limit) for step in (1, -1)]
        if watches[0].target == watches[1].target:  # two ranks: one neighbour, watched once
            watches.pop()
        failures = 0
        while not self.stop_event.is_set():
            where = self.monitor.where
            try:
                self.board.beat(where if where != sent else None)
                sent = where
                marks = self.monitor.progress
                if marks != published:
                    self.board.add_progress(marks - published)
                    published = marks
                if not self.monitor.aborted:
                    for watch in watches:
                        watch.step()
                    if self.board.silent_declared():
                        self.monitor.abort()
                failures = 0
            except Exception:
                # one failed store call (a busy host) must not end failure detection for the
                # rest of the job; the store gone for good (the job ending) does, quietly
                failures += 1
                if failures >= _STORE_RETRIES:
                    return
                for watch in watches:  # a stalled store stalls every beat: no one is silent
                    watch.restart()
            self.stop_event.wait(self.interval)


class _Watch:
    """One rank's watch over a ring neighbour's heartbeat.

    ``direction`` 1 watches the next rank that has not left, -1 the previous one. Watching two
    neighbours keeps the store traffic per rank constant at any world size; every rank is
    watched as long as one of its neighbours in the ring lives. Time is measured from the last
    *observed* change, so a slow watcher never declares a live neighbour dead.
    """

    def __init__(
        self,
        board: FailureBoard,
        interval: float,
        direction: int = 1,
        progress_limit: float | None = None,
    ) -> None:
        self.board = board
        self.direction = direction
        self.limit = max(_SILENT_INTERVALS * interval, _MIN_SILENCE)
        self.progress_limit = progress_limit
        self.target: int | None = self._after(board.rank)
        self.count = -1
        self.changed = time.monotonic()
        self.progress = -1
        self.progressed = self.changed

    def _after(self, rank: int) -> int | None:
        nxt = (rank + self.direction) % self.board.world_size
        return None if nxt == self.board.rank else nxt

    def restart(self) -> None:
        """Count the silence afresh from now (after this watcher could not read the store)."""
        self.changed = self.progressed = time.monotonic()

    def _check_progress(self, target: int, now: float) -> None:
        """A beating neighbour: declare it stalled if its progress stood still past the bound.

        Only when another rank is past its count: ranks that all wait together (a slow step)
        are not stalled, and the victims of a stalled rank, which went further, never are.
        """
        if self.progress_limit is None:
            return
        marks = self.board.progress_count(target)
        if marks != self.progress:
            self.progress, self.progressed = marks, now
            return
        if now - self.progressed < self.progress_limit:
            return
        past = self.board.ranks_past(target, marks)
        if not past or self.board.has_left(target):
            self.progressed = now  # ask the other ranks again only after another bound
            return
        if not any(r.kind == SILENT and r.rank == target for r in self.board.reports()):
            self.board.declare_stalled(target, now - self.progressed, past)
        else:
            self.board.raise_silent_flag()
        self.target = None

    def step(self) -> None:
        target = self.target
        if target is None:
            return
        count = self.board.beat_count(target)
        now = time.monotonic()
        if count != self.count:
            self.count, self.changed = count, now
            self._check_progress(target, now)
            return
        if count == 0 or now - self.changed < self.limit:
            return  # not started yet, or not silent long enough
        if self.board.has_left(target):
            self.target, self.count, self.changed = self._after(target), -1, now
            return
        # the other neighbour's watch may have been first: one post per silent rank, and the
        # flag raised either way (a post whose flag failed to go up is completed here)
        if any(r.kind == SILENT and r.rank == target for r in self.board.reports()):
            self.board.raise_silent_flag()
        else:
            self.board.declare_silent(target, now - self.changed)
        self.target = None


class FailureMonitor:
    """The board, the heartbeat and the stack of guards of one context on one rank.

    Args:
        board: Where failures are posted (None: guards only re-raise, nothing is detected).
        heartbeat_interval: Seconds between heartbeats; None or 0 disables them (a dead rank is
            then reported as "a rank probably died", without its number).
        abort: Called once, from the heartbeat thread when a rank is declared dead or from a
            guard that raises ``RankFailedError``, to make this rank's blocked collectives
            return (see ``tessera.context.abort``); None: collectives run to their timeout.
        progress_timeout: Seconds a neighbour may go without a progress mark while another
            rank is past it before this rank's watcher declares it stalled; None or 0: only
            liveness is watched. Needs heartbeats (they publish the marks).
    """

    def __init__(
        self,
        board: FailureBoard | None,
        heartbeat_interval: float | None,
        abort: Callable[[], object] | None = None,
        progress_timeout: float | None = None,
    ) -> None:
        self.board = board
        self.heartbeat_interval = heartbeat_interval or None
        self.progress_timeout = progress_timeout or None
        self.progress = 0  # marks so far: bumped by the training thread, read by the heartbeat
        self._where: list[str] = []
        self._thread: _Heartbeat | None = None
        self._abort = abort
        self._aborted = False
        self._abort_lock = threading.Lock()
        self._closed = False
        if board is not None and self.heartbeat_interval is not None and board.world_size > 1:
            self._thread = _Heartbeat(self, board, self.heartbeat_interval)
            self._thread.start()
            _RUNNING.add(self)

    @property
    def aborted(self) -> bool:
        """Whether this rank's groups were aborted (they cannot be used any more)."""
        return self._aborted

    def abort(self) -> None:
        """Abort this rank's groups once (idempotent, thread-safe, never raises)."""
        with self._abort_lock:
            if self._aborted:
                return
            self._aborted = True
        if self._abort is not None:
            with contextlib.suppress(Exception):
                self._abort()

    def mark_progress(self) -> None:
        """The training thread passed a point (a step, a batch read): one int increment.

        Guards mark on entry and exit by themselves; the heartbeat publishes the count.
        """
        self.progress += 1

    @property
    def where(self) -> str:
        """The innermost guard this rank is in (``'-'`` outside every guard)."""
        return self._where[-1] if self._where else "-"

    def stop(self, raising: str = "") -> None:
        """Stop the heartbeat (before the store and groups go away), saying so on the board.

        The ``left`` mark keeps this rank's watcher from declaring it dead when ranks finish
        at different times; the diagnosis of a failed collective still counts a rank that
        left mid-job as a candidate, since its peers were still waiting for it, and says
        whether it finished normally or was raising ``raising`` (see ``FailureBoard.leave``).
        """
        thread, self._thread = self._thread, None
        _RUNNING.discard(self)
        if thread is not None:
            thread.stop_event.set()
            thread.join(timeout=5.0)
            if self.board is not None:
                with contextlib.suppress(Exception):
                    self.board.leave(raising)

    def close(self) -> None:
        """Stop for good (``ParallelContext.destroy``): later errors are teardown, not failures.

        What a guard sees after its context was destroyed (a collective on a destroyed group)
        is this rank's own orderly exit, so it is re-raised and not posted. Called from a
        ``finally`` while an error propagates, the ``left`` mark carries that error.
        """
        self._closed = True
        error = sys.exc_info()[1]
        raising = "" if error is None or is_control_flow(error) else _described(error)
        self.stop(raising)

    @contextmanager
    def guard(self, where: str) -> Iterator[None]:
        """See ``ParallelContext.guard``."""
        self._where.append(where)
        self.progress += 1
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
            self.progress += 1

    def check(self, where: str = "-") -> None:
        """Raise ``RankFailedError`` if another rank has posted a failure (no waiting).

        Call it between steps to stop early instead of waiting for the next collective's
        timeout, e.g. in a loop that does long local work.
        """
        board = self.board
        if board is None:
            return
        reports = board.reports()
        cause = _cause(reports, board.rank)
        if cause is not None:
            raise self._error(reports, cause, where, None)
        victims = _victims(reports, board.rank)
        if victims:
            raise self._unattributed(reports, where, None, "")

    # -- the error path -------------------------------------------------------------------------

    def _on_failure(self, exc: BaseException, where: str) -> RankFailedError | None:
        board = self.board
        if board is None or getattr(exc, _POSTED, False):
            return None
        if is_control_flow(exc) or self._closed:
            return None  # re-raised unchanged, posted nowhere
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
        error = self._name_the_cause(board, exc, where)
        # This rank's groups are broken: leave them, so peers still blocked on it fail now.
        self.abort()
        return error

    def _name_the_cause(
        self, board: FailureBoard, exc: BaseException, where: str
    ) -> RankFailedError:
        interval = self.heartbeat_interval
        window = _SILENT_INTERVALS * interval if interval is not None else _POST_GRACE
        reports = board.reports()
        cause = _cause(reports, board.rank)
        if cause is None:
            # Tell the others this rank was hit, as a victim: never read as a cause.
            board.post(where, exc, kind=AFFECTED)
            with contextlib.suppress(AttributeError):
                setattr(exc, _POSTED, True)
        before = board.beats() if interval is not None else []
        deadline = time.monotonic() + window
        while cause is None and time.monotonic() < deadline:
            time.sleep(min(0.05, window / 10))
            reports = board.reports()
            cause = _cause(reports, board.rank)
        if cause is not None:
            return self._error(reports, cause, where, exc)
        victims = {r.rank for r in _victims(reports, board.rank)}
        stopped = [
            r
            for r in (board.stopped_ranks(before, board.beats()) if interval is not None else [])
            if r not in victims
        ]
        how = {r: board.left_raising(r) for r in stopped}
        left = [r for r in stopped if how[r] is not None]
        if left:  # a rank that ended its part on purpose is no crash: say what it did
            first = left[0]
            last = board.last_where(first)
            place = f" (last seen in {last!r})" if last not in (None, "-") else ""
            ended = (
                f"it destroyed its context while raising {how[first]} outside any guard"
                if how[first]
                else "it finished normally (destroyed its context, or its process ended) "
                "and posted no error"
            )
            return RankFailedError(
                f"rank {first} left the job{place}: {ended}, while rank {board.rank} still "
                f"waited for it in {where!r}; the ranks ran different numbers of steps or "
                f"collectives (uneven data? compare the loaders' lengths); ranks that left "
                f"{left}: {_summary(exc)}{_also(_victims(reports, board.rank))}",
                rank=first,
                where=last,
                reports=reports,
                observer=board.rank,
                observed_where=where,
            )
        if stopped:
            first = stopped[0]
            last = board.last_where(first)
            place = f" (last seen in {last!r})" if last is not None else ""
            return RankFailedError(
                f"rank {first} stopped responding{place}: no heartbeat for "
                f"{window:.1f} s, so its process probably exited, crashed or was killed; "
                f"silent ranks {stopped}. Rank {board.rank} noticed in {where!r}: "
                f"{_summary(exc)}{_also(_victims(reports, board.rank))}",
                rank=first,
                where=last,
                reports=reports,
                observer=board.rank,
                observed_where=where,
            )
        own = [r for r in reports if r.kind == SILENT and r.rank == board.rank]
        if own:
            return RankFailedError(
                f"{own[0].describe()}: this rank was declared dead and its peers left their "
                f"collectives. Rank {board.rank} stopped in {where!r}: {_summary(exc)}",
                rank=board.rank,
                where=own[0].where,
                reports=reports,
                observer=board.rank,
                observed_where=where,
            )
        alive = "every rank still beats" if interval is not None else "no heartbeats"
        return self._unattributed(reports, where, exc, f" ({alive})")

    def _unattributed(
        self,
        reports: Sequence[FailureReport],
        where: str,
        exc: BaseException | None,
        detail: str,
    ) -> RankFailedError:
        rank = self.board.rank if self.board is not None else None
        hit = _also(_victims(reports, rank))
        seen = f": {_summary(exc)}" if exc is not None else ""
        return RankFailedError(
            f"rank {rank}: a collective failed in {where!r} and no rank reported an "
            f"error{detail}; ranks may be waiting in different collectives, or one is stuck "
            f"outside a guard{seen}{hit}",
            rank=None,
            where=None,
            reports=reports,
            observer=rank,
            observed_where=where,
        )

    def _error(
        self,
        reports: Sequence[FailureReport],
        cause: FailureReport,
        where: str,
        exc: BaseException | None,
    ) -> RankFailedError:
        rank = self.board.rank if self.board is not None else "?"
        seen = f" when its collective failed ({_summary(exc)})" if exc is not None else ""
        rest = [r for r in reports if r is not cause and r.rank != rank]
        more = "; also " + "; ".join(r.describe() for r in rest[:3]) if rest else ""
        return RankFailedError(
            f"{cause.describe()}{more}. Rank {rank} stopped in {where!r}{seen}",
            rank=cause.rank,
            where=cause.where,
            reports=reports,
            observer=self.board.rank if self.board is not None else None,
            observed_where=where,
        )


def _cause(reports: Sequence[FailureReport], me: int | None) -> FailureReport | None:
    """The first other rank's own failure, else the first rank declared dead; never a victim."""
    for kind in (FAILED, SILENT):
        for report in reports:
            if report.kind == kind and report.rank != me:
                return report
    return None


def _also(reports: Sequence[FailureReport]) -> str:
    """``; also rank 0 was affected in ...`` for up to four posts."""
    return "; also " + "; ".join(r.describe() for r in reports[:4]) if reports else ""


def _victims(reports: Sequence[FailureReport], me: int | None) -> list[FailureReport]:
    """Other ranks' notes that they were hit."""
    return [r for r in reports if r.kind == AFFECTED and r.rank != me]


#: Monitors whose heartbeat runs: a process that ends without destroying its context still
#: says it left, so its watcher does not declare it dead while the others finish.
_RUNNING: weakref.WeakSet[FailureMonitor] = weakref.WeakSet()


def _stop_running() -> None:
    for monitor in list(_RUNNING):
        monitor.stop()


atexit.register(_stop_running)
