"""Fail fast across ranks: the failure board, heartbeats and ``ParallelContext.guard``.

Unit tests drive the board on an in-process ``HashStore``; the multi-rank tests launch real
gloo jobs with a 4 s collective timeout and check that every surviving rank stops within a
few seconds with an error naming the rank that failed and where.
"""

from __future__ import annotations

import os
import pickle
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as tdist

from tessera.context import (
    FailureBoard,
    FailureReport,
    ParallelMode,
    RankFailedError,
    create_context,
    is_communication_error,
    launch,
)
from tessera.context.failures import FailureMonitor
from tessera.testing import DistributedRunner, RankError

TIMEOUT = 4.0  # collective timeout of the fault tests (s): a healthy step on busy cores fits
BEAT = 0.2  # heartbeat interval of the fault tests (s)
# Detection must come within the collective timeout plus the heartbeat window plus slack for
# two shared CPU cores; a hang would take the harness's 60 s.
BOUND = TIMEOUT + 3 * BEAT + 8.0
# A stopped rank: collectives would wait STOPPED_TIMEOUT; the heartbeats must end them sooner.
STOPPED_TIMEOUT = 12.0
STOPPED_BOUND = max(3 * BEAT, 2.0) + 3.0  # silence to declare it (at least 2 s), + slack

GLOO_TIMEOUT = RuntimeError(
    "[third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 2000ms for "
    "recv operation to complete"
)


# ---------------------------------------------------------------- board and monitor, one process


def _board(rank: int, world: int = 2, store: Any = None) -> FailureBoard:
    return FailureBoard(store if store is not None else tdist.HashStore(), "ns", rank, world)


def test_board_posts_and_reads_in_order() -> None:
    store = tdist.HashStore()
    one, two = _board(1, 3, store), _board(2, 3, store)
    assert one.reports() == []
    one.post("forward", ValueError("bad shape [2, 3]"))
    two.post("step", KeyError("w"))
    reports = _board(0, 3, store).reports()
    assert [(r.rank, r.where, r.error) for r in reports] == [
        (1, "forward", "ValueError"),
        (2, "step", "KeyError"),
    ]
    assert reports[0].message == "bad shape [2, 3]"
    assert reports[0].describe() == "rank 1 failed in 'forward': ValueError: bad shape [2, 3]"
    assert FailureReport.from_json(reports[1].to_json()) == reports[1]


def test_namespaces_do_not_mix() -> None:
    store = tdist.HashStore()
    FailureBoard(store, "a", 1, 2).post("x", ValueError("old"))
    assert FailureBoard(store, "b", 0, 2).reports() == []


def test_communication_errors_are_recognized() -> None:
    assert is_communication_error(GLOO_TIMEOUT)
    assert is_communication_error(RuntimeError("Connection closed by peer [127.0.0.1]:4"))
    assert is_communication_error(tdist.DistBackendError("NCCL error"))
    assert not is_communication_error(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_communication_error(ValueError("timed out"))
    assert not is_communication_error(RankFailedError("x", rank=1, where="y"))


def test_rank_failed_error_pickles() -> None:
    report = FailureReport(1, "step", "ValueError", "boom", 0.0)
    err = RankFailedError("msg", rank=1, where="step", reports=[report], observer=0)
    back = pickle.loads(pickle.dumps(err))
    assert isinstance(back, RankFailedError)
    assert (str(back), back.rank, back.where, back.reports, back.observer) == (
        "msg",
        1,
        "step",
        (report,),
        0,
    )


def test_guard_posts_own_error_and_reraises_it_unchanged() -> None:
    store = tdist.HashStore()
    monitor = FailureMonitor(_board(1, 2, store), None)
    with pytest.raises(ValueError, match="boom"), monitor.guard("outer"), monitor.guard("inner"):
        raise ValueError("boom")
    (report,) = _board(0, 2, store).reports()  # nested guards post once, the innermost place
    assert (report.rank, report.where, report.message) == (1, "inner", "boom")


def test_guard_turns_a_timeout_into_the_failed_ranks_error() -> None:
    store = tdist.HashStore()
    _board(1, 2, store).post("engine.step", ValueError("loss is nan"))
    monitor = FailureMonitor(_board(0, 2, store), None)
    with pytest.raises(RankFailedError) as info, monitor.guard("all_reduce grads"):
        raise GLOO_TIMEOUT
    err = info.value
    assert (err.rank, err.where, err.observer, err.observed_where) == (
        1,
        "engine.step",
        0,
        "all_reduce grads",
    )
    assert "rank 1 failed in 'engine.step': ValueError: loss is nan" in str(err)
    assert "Rank 0 stopped in 'all_reduce grads'" in str(err)
    assert err.__cause__ is GLOO_TIMEOUT
    assert [r.rank for r in _board(1, 2, store).reports()] == [1]  # the observer posts nothing


def test_guard_names_a_rank_whose_heartbeat_stopped() -> None:
    store = tdist.HashStore()
    dead = _board(1, 3, store)
    dead.beat("pipeline step")  # beat once, then never again
    alive = _board(2, 3, store)
    monitor = FailureMonitor(_board(0, 3, store), 0.05)
    monitor.stop()  # drive rank 0's beats by hand: only rank 2 keeps beating
    stop = time.monotonic() + 0.5

    def beat_rank_2() -> None:
        while time.monotonic() < stop:
            alive.beat()
            time.sleep(0.01)

    thread = threading.Thread(target=beat_rank_2)
    thread.start()
    start = time.monotonic()
    try:
        with pytest.raises(RankFailedError) as info, monitor.guard("step"):
            raise RuntimeError("Connection closed by peer [127.0.0.1]:5555")
    finally:
        thread.join()
    assert time.monotonic() - start < 1.0
    assert (info.value.rank, info.value.where) == (1, "pipeline step")
    assert "rank 1 stopped responding (last seen in 'pipeline step')" in str(info.value)
    # Nobody had posted: the observer tells the others what it saw.
    assert [(r.rank, r.where) for r in _board(2, 3, store).reports()] == [(0, "step")]


@pytest.mark.parametrize("raising", [False, True], ids=["finished", "raised_outside_guards"])
def test_a_rank_that_left_is_not_reported_as_crashed(raising: bool) -> None:
    # a pipeline stage whose loader ran out first destroys its context; its peer waits on it
    store = tdist.HashStore()
    left = FailureMonitor(_board(1, 2, store), 0.05)  # its heartbeat runs, so it can leave
    with left.guard("engine.execute_schedule"):
        while _board(0, 2, store).last_where(1) is None:
            time.sleep(0.01)
    if raising:
        try:
            raise OSError("bad sector")  # outside any guard: never posted
        except OSError:
            left.close()
    else:
        left.close()
    monitor = FailureMonitor(_board(0, 2, store), 0.05)
    monitor.stop()  # drive rank 0's beats by hand
    with pytest.raises(RankFailedError) as info, monitor.guard("pipeline rank 0 of 2"):
        raise RuntimeError("Connection closed by peer [127.0.0.1]:5555")
    message = str(info.value)
    assert info.value.rank == 1 and "probably exited" not in message, message
    assert "rank 1 left the job: it " in message  # outside its guards: no place named
    assert "still waited for it in 'pipeline rank 0 of 2'" in message
    ended = "while raising OSError: bad sector outside any guard" if raising else "normally"
    assert ended in message


def test_guard_without_news_raises_an_unattributed_error() -> None:
    monitor = FailureMonitor(_board(0, 2), None)
    start = time.monotonic()
    with (
        pytest.raises(RankFailedError, match="no rank reported an error") as info,
        monitor.guard("step"),
    ):
        raise GLOO_TIMEOUT
    assert info.value.rank is None
    assert time.monotonic() - start < 3.0


def test_check_failures_raises_without_a_collective() -> None:
    store = tdist.HashStore()
    monitor = FailureMonitor(_board(0, 2, store), None)
    monitor.check("between steps")
    _board(1, 2, store).post("data loading", OSError("disk full"))
    with pytest.raises(RankFailedError, match="rank 1 failed in 'data loading': OSError"):
        monitor.check("between steps")


@pytest.mark.parametrize(
    "exc",
    [StopIteration(), StopAsyncIteration(), GeneratorExit(), KeyboardInterrupt(), SystemExit(0)],
    ids=lambda e: type(e).__name__,
)
def test_control_flow_through_a_guard_is_not_a_failure(exc: BaseException) -> None:
    # an IterableDataset's epoch ends by StopIteration out of execute_schedule's guard
    store = tdist.HashStore()
    monitor = FailureMonitor(_board(1, 2, store), None)
    with pytest.raises(type(exc)), monitor.guard("engine.execute_schedule"):
        raise exc
    assert _board(0, 2, store).reports() == []
    FailureMonitor(_board(0, 2, store), None).check("next step")  # a peer sees no failure
    # ... and a real failure afterwards is still posted and blamed on the right rank
    with pytest.raises(ValueError), monitor.guard("engine.step"):
        raise ValueError("loss is nan")
    with pytest.raises(RankFailedError, match=r"rank 1 failed in 'engine\.step': ValueError"):
        FailureMonitor(_board(0, 2, store), None).check("next step")


def test_a_failing_exit_and_errors_after_destroy() -> None:
    store = tdist.HashStore()
    monitor = FailureMonitor(_board(1, 2, store), None)
    with pytest.raises(SystemExit), monitor.guard("main"):
        raise SystemExit(3)  # a non-zero exit is a failure
    assert [r.error for r in _board(0, 2, store).reports()] == ["SystemExit"]
    monitor.close()  # what destroy() does: what its teardown raises is no failure
    with pytest.raises(RuntimeError), monitor.guard("engine.step"):
        raise RuntimeError("the process group was destroyed")
    assert len(_board(0, 2, store).reports()) == 1


def test_guard_without_a_board_only_reraises() -> None:
    monitor = FailureMonitor(None, None)
    with pytest.raises(RuntimeError, match="Timed out"), monitor.guard("step"):
        raise GLOO_TIMEOUT


class _FlakyBoard(FailureBoard):
    """A board whose second heartbeat fails, as one store call on a busy host may."""

    calls = 0

    def beat(self, where: str | None = None) -> None:
        self.calls += 1
        if self.calls == 2:
            raise RuntimeError("store call timed out")
        super().beat(where)


def test_one_failed_store_call_does_not_end_the_heartbeat() -> None:
    store = tdist.HashStore()
    monitor = FailureMonitor(_FlakyBoard(store, "ns", 0, 2), 0.01)
    try:
        deadline = time.monotonic() + 5.0
        while _board(1, 2, store).beats()[0] < 4:
            assert time.monotonic() < deadline, "the heartbeat stopped after one failed call"
            time.sleep(0.01)
    finally:
        monitor.stop()


def test_a_silent_rank_is_declared_by_either_neighbour_once() -> None:
    from tessera.context.failures import _Watch

    store = tdist.HashStore()
    _board(1, 3, store).beat()  # rank 1 beats once, then stops
    before, after = _Watch(_board(2, 3, store), 0.01, -1), _Watch(_board(0, 3, store), 0.01, 1)
    assert before.target == 1 == after.target
    before.step()
    after.step()  # both saw the beat
    time.sleep(2.1)  # the shortest silence that declares a rank (_MIN_SILENCE)
    before.step()  # rank 0's watch over rank 1 is stuck: rank 2's declares it
    assert [(r.rank, r.kind) for r in _board(0, 3, store).reports()] == [(1, "silent")]
    after.step()  # late, and not twice
    assert len(_board(0, 3, store).reports()) == 1 and after.target is None
    assert _board(0, 3, store).silent_declared()


def test_a_watch_restarted_after_a_store_stall_declares_no_one() -> None:
    from tessera.context.failures import _Watch

    store = tdist.HashStore()
    _board(1, 3, store).beat()
    watch = _Watch(_board(0, 3, store), 0.01, 1)
    watch.step()
    time.sleep(2.1)  # silent long enough, but this watcher could not read the store meanwhile
    watch.restart()
    watch.step()
    assert _board(0, 3, store).reports() == [] and watch.target == 1


def test_a_beating_rank_without_progress_is_declared_only_when_others_are_past_it() -> None:
    from tessera.context.failures import _Watch

    store = tdist.HashStore()
    stuck, ahead = _board(1, 3, store), _board(2, 3, store)
    stuck.add_progress(3)  # entered its step, then blocked in a read: 3 marks and no more
    ahead.add_progress(3)
    watch = _Watch(_board(0, 3, store), 0.01, 1, progress_limit=0.2)
    for beats in range(30):  # rank 1 beats throughout (its heartbeat thread runs)
        stuck.beat("engine.execute_schedule")
        watch.step()
        if beats == 10:
            ahead.add_progress(2)  # rank 2 read its batch and went on to wait for rank 1
        time.sleep(0.02)
    (report,) = _board(2, 3, store).reports()
    assert (report.rank, report.kind, report.where) == (1, "silent", "engine.execute_schedule")
    assert report.describe().startswith(
        "rank 1 made no progress (last seen in 'engine.execute_schedule'): no progress mark for"
    )
    assert "ranks [2] are past it" in report.message and watch.target is None


def test_ranks_waiting_together_are_not_stalled() -> None:
    # a slow step: every rank at the same count for longer than the bound, none behind
    from tessera.context.failures import _Watch

    store = tdist.HashStore()
    for rank in range(3):
        _board(rank, 3, store).add_progress(5)
    watch = _Watch(_board(0, 3, store), 0.01, 1, progress_limit=0.1)
    for _ in range(20):
        _board(1, 3, store).beat()
        watch.step()
        time.sleep(0.02)
    assert _board(0, 3, store).reports() == [] and watch.target == 1


def test_heartbeat_thread_beats_and_stops() -> None:
    store = tdist.HashStore()
    monitor = FailureMonitor(_board(0, 2, store), 0.01)
    try:
        with monitor.guard("forward"):
            deadline = time.monotonic() + 5.0
            while _board(1, 2, store).beats()[0] < 3 and time.monotonic() < deadline:
                time.sleep(0.01)
            while _board(1, 2, store).last_where(0) != "forward":
                assert time.monotonic() < deadline
                time.sleep(0.01)
    finally:
        monitor.stop()
    count = _board(1, 2, store).beats()[0]
    assert count >= 3
    time.sleep(0.05)
    assert _board(1, 2, store).beats()[0] == count  # stopped


# ---------------------------------------------------------------- real jobs


def _launch_short() -> Any:
    return launch(
        {"parallel": {}},
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        host="127.0.0.1",
        port=int(os.environ["MASTER_PORT"]),
        timeout=TIMEOUT,
        heartbeat_interval=BEAT,
    )


def _raise_mid_step(failing: int) -> dict[str, Any]:
    """Rank ``failing`` raises before the step's all-reduce; the others wait in it."""
    ctx = _launch_short()
    start = time.monotonic()
    try:
        with ctx.guard("train step"):
            grads = torch.ones(3)  # [3]
            if ctx.global_rank == failing:
                raise ValueError(f"batch on rank {failing} has NaNs")
            tdist.all_reduce(grads, group=ctx.get_group(ParallelMode.DATA))
        return {"outcome": "finished"}
    except RankFailedError as err:
        return {
            "outcome": "RankFailedError",
            "rank": err.rank,
            "where": err.where,
            "message": str(err),
            "seconds": time.monotonic() - start,
        }
    except ValueError as err:
        return {"outcome": "ValueError", "message": str(err)}
    finally:
        ctx.destroy()


def test_a_rank_that_raises_stops_the_others_in_bounded_time(dist: Any) -> None:
    results = dist.run(_raise_mid_step, world_size=4, args=(1,), init_process_group=False)
    assert results[1] == {"outcome": "ValueError", "message": "batch on rank 1 has NaNs"}
    for rank in (0, 2, 3):
        got = results[rank]
        assert got["outcome"] == "RankFailedError", got
        assert (got["rank"], got["where"]) == (1, "train step")
        assert (
            "rank 1 failed in 'train step': ValueError: batch on rank 1 has NaNs"
            in (got["message"])
        )
        assert got["seconds"] < BOUND


def _guarded_context_error(_: int) -> str:
    """create_context on the harness's default group finds the default store."""
    ctx = create_context({"parallel": {}}, timeout=TIMEOUT, heartbeat_interval=0)
    try:
        assert ctx.failure_board is not None
        assert ctx.heartbeat_interval is None
        try:
            with ctx.guard("probe"):
                if ctx.global_rank == 1:
                    raise KeyError("missing weight")
        except KeyError:
            pass
        tdist.barrier(group=ctx.get_cpu_group(ParallelMode.GLOBAL))
        return "; ".join(r.describe() for r in ctx.failure_board.reports())
    finally:
        ctx.destroy()


def test_create_context_uses_the_default_store_with_a_fresh_board(dist: Any) -> None:
    first = dist.run(_guarded_context_error, world_size=2, args=(0,))
    assert first == ["rank 1 failed in 'probe': KeyError: 'missing weight'"] * 2
    # A second context on the same store reads a board of its own.
    assert dist.run(_guarded_context_error, world_size=2, args=(1,)) == first


def _exit_mid_step() -> None:
    ctx = _launch_short()
    start = time.monotonic()
    try:
        with ctx.guard("forward of stage 1"):
            if ctx.global_rank == 1:
                time.sleep(3 * BEAT)  # beat a few times, then vanish
                os._exit(17)
            tdist.all_reduce(torch.ones(2), group=ctx.get_group(ParallelMode.GLOBAL))
    except RankFailedError as err:
        err.args = (f"{err.args[0]} [after {time.monotonic() - start:.2f} s]",)
        raise
    finally:
        ctx.destroy()


@pytest.fixture(scope="module")
def patient_runner() -> Iterator[DistributedRunner]:
    """A runner that waits for the survivors' own errors after a rank died."""
    with DistributedRunner(timeout=60.0, failure_grace=30.0) as runner:
        yield runner


def test_a_rank_that_exits_is_named_in_bounded_time(patient_runner: DistributedRunner) -> None:
    start = time.monotonic()
    with pytest.raises(RankError) as info:
        patient_runner.run(_exit_mid_step, world_size=2, init_process_group=False)
    elapsed = time.monotonic() - start
    err = info.value.exceptions[0]
    assert isinstance(err, RankFailedError), info.value
    assert err.rank == 1
    assert err.where == "forward of stage 1"
    assert "rank 1 stopped responding" in str(err)
    seconds = float(str(err).rsplit("[after ", 1)[1].split(" s]")[0])
    assert seconds < BOUND
    assert 1 in info.value.failures  # the harness saw rank 1 die
    assert elapsed < 60.0


# ---------------------------------------------------------------- the right rank is named


def _rank_1_fails(how: str) -> None:
    """Rank 1 fails outside any guard (raises, exits, is killed) while the others all-reduce."""
    ctx = _launch_short()
    start = time.monotonic()
    try:
        if ctx.global_rank == 1:
            time.sleep(3 * BEAT)  # beat a few times first
            if how == "raise":
                raise ValueError("bad batch on rank 1")
            if how == "exit":
                os._exit(0)
            os.kill(os.getpid(), signal.SIGKILL)
        with ctx.guard("train step"):
            tdist.all_reduce(torch.ones(2), group=ctx.get_group(ParallelMode.GLOBAL))
    except RankFailedError as err:
        err.args = (f"{err.args[0]} [after {time.monotonic() - start:.2f} s]",)
        raise
    finally:
        ctx.destroy()


@pytest.mark.parametrize("how", ["raise", "exit", "kill"])
def test_every_survivor_names_the_rank_that_failed(
    patient_runner: DistributedRunner, how: str
) -> None:
    """Victims post 'affected', never 'failed': ranks hit late do not blame an early victim."""
    with pytest.raises(RankError) as info:
        patient_runner.run(_rank_1_fails, world_size=4, args=(how,), init_process_group=False)
    errors = info.value.exceptions
    for rank in (0, 2, 3):
        err = errors.get(rank)
        assert isinstance(err, RankFailedError), (rank, info.value)
        assert err.rank == 1, (rank, str(err))
        assert float(str(err).rsplit("[after ", 1)[1].split(" s]")[0]) < BOUND
    if how == "raise":
        assert isinstance(errors[1], ValueError)


def test_diagnosis_skips_victims_posts() -> None:
    """A post that only says 'my collective failed' is never read as the cause."""
    store = tdist.HashStore()
    _board(0, 4, store).post("step", GLOO_TIMEOUT, kind="affected")
    dead = _board(1, 4, store)
    dead.beat("step")
    monitor = FailureMonitor(_board(3, 4, store), 0.05)
    monitor.stop()
    alive = _board(2, 4, store)
    stop = time.monotonic() + 0.5

    def others_beat() -> None:
        while time.monotonic() < stop:
            alive.beat()
            _board(0, 4, store).beat()
            time.sleep(0.01)

    thread = threading.Thread(target=others_beat)
    thread.start()
    try:
        with pytest.raises(RankFailedError) as info, monitor.guard("step"):
            raise RuntimeError("Connection closed by peer [127.0.0.1]:5555")
    finally:
        thread.join()
    assert info.value.rank == 1
    assert "affected" in str(info.value) and "rank 0" in str(info.value)


# ---------------------------------------------------------------- a stopped rank


class _RecordingGroup:
    def __init__(self) -> None:
        self.aborted = False

    def abort(self) -> None:
        self.aborted = True


def test_nccl_groups_are_aborted_and_gloo_groups_only_cut() -> None:
    from tessera.context.abort import GroupAborter, tcp_inodes

    for backend, called in (("nccl", True), ("cpu:gloo,cuda:nccl", True), ("gloo", False)):
        group = _RecordingGroup()
        # every socket of this test process is spared: nothing here may be cut
        aborter = GroupAborter(lambda g=group: [g], backend, None, tcp_inodes())  # type: ignore[misc]
        assert aborter.abort([]) == 0
        assert group.aborted is called, backend


def _stop_rank_1() -> dict[str, Any]:
    """Rank 1 freezes (SIGSTOP) before the all-reduce; the others must leave it in time."""
    ctx = launch(
        {"parallel": {}},
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        host="127.0.0.1",
        port=int(os.environ["MASTER_PORT"]),
        timeout=STOPPED_TIMEOUT,
        heartbeat_interval=BEAT,
    )
    pids: list[int] = [0] * ctx.world_size
    tdist.all_gather_object(pids, os.getpid(), group=ctx.get_cpu_group(ParallelMode.GLOBAL))
    start = time.monotonic()
    try:
        with ctx.guard("all_reduce grads"):
            if ctx.global_rank == 1:
                os.kill(os.getpid(), signal.SIGSTOP)
            tdist.all_reduce(torch.ones(2), group=ctx.get_group(ParallelMode.GLOBAL))
        return {"outcome": "finished"}
    except RankFailedError as err:
        return {"outcome": "RankFailedError", "rank": err.rank, "message": str(err),
                "seconds": time.monotonic() - start}  # fmt: skip
    except RuntimeError as err:
        return {"outcome": type(err).__name__, "message": str(err)}
    finally:
        if ctx.global_rank == 0:
            os.kill(pids[1], signal.SIGCONT)  # let the stopped rank finish and clean up
        ctx.destroy()


def test_a_stopped_rank_is_left_within_the_heartbeat_window(dist: Any) -> None:
    results = dist.run(_stop_rank_1, world_size=3, init_process_group=False, timeout=60)
    for rank in (0, 2):
        got = results[rank]
        assert got["outcome"] == "RankFailedError", got
        assert got["rank"] == 1, got
        assert "rank 1 stopped responding" in got["message"]
        # Named by the heartbeats (3 beats), far inside the collective timeout.
        assert got["seconds"] < STOPPED_BOUND, got
    assert results[1]["outcome"] != "finished"


PROGRESS_TIMEOUT = 1.0  # the bound of the hung-read test (s); the default is 240 s


def _hang_in_a_read() -> dict[str, Any]:
    """Rank 1's training thread blocks in a "read" that releases the GIL (its heartbeat beats)."""
    ctx = launch(
        {"parallel": {}},
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        host="127.0.0.1",
        port=int(os.environ["MASTER_PORT"]),
        timeout=STOPPED_TIMEOUT,
        heartbeat_interval=BEAT,
        progress_timeout=PROGRESS_TIMEOUT,
    )
    start = time.monotonic()
    try:
        with ctx.guard("engine.execute_schedule"):
            if ctx.global_rank == 1:
                deadline = time.monotonic() + STOPPED_TIMEOUT
                while not ctx.failures.aborted and time.monotonic() < deadline:
                    time.sleep(0.05)  # a read hung on a dead NFS server, until the job aborts
                # A hung read never reaches the collective: joining it here would race rank
                # 0's abort and could let its all-reduce finish (what the test first did).
                return {"outcome": "aborted" if ctx.failures.aborted else "read timed out"}
            else:
                ctx.mark_progress()  # its batch was read; it waits for rank 1 in the all-reduce
            tdist.all_reduce(torch.ones(2), group=ctx.get_group(ParallelMode.GLOBAL))
        return {"outcome": "finished", "seconds": time.monotonic() - start}
    except RankFailedError as err:
        return {"outcome": "RankFailedError", "rank": err.rank, "message": str(err),
                "seconds": time.monotonic() - start}  # fmt: skip
    except RuntimeError as err:
        return {"outcome": type(err).__name__, "message": str(err)}
    finally:
        ctx.destroy()


def test_a_rank_blocked_in_a_read_is_named_after_the_progress_timeout(dist: Any) -> None:
    results = dist.run(_hang_in_a_read, world_size=2, init_process_group=False, timeout=60)
    got = results[0]
    assert got["outcome"] == "RankFailedError", got
    assert got["rank"] == 1, got
    assert "rank 1 made no progress (last seen in 'engine.execute_schedule')" in got["message"]
    # the bound, up to two intervals to see it, one to abort, slack for two busy cores; the
    # collective timeout (and rank 1's "read") would have ended it at 12 s
    assert got["seconds"] < PROGRESS_TIMEOUT + 6.0 < STOPPED_TIMEOUT, got
    assert results[1]["outcome"] != "finished"
