"""Failures: rank tracebacks, hangs turned into timeouts, dead workers, and recovery."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as tdist

from tessera.testing import DistributedRunner, RankError, RankTimeoutError


def _pid() -> int:
    return os.getpid()


def _raise_on_rank_one() -> None:
    if tdist.get_rank() == 1:
        raise ValueError("rank one refuses: shape [3, 5] != [5, 3]")
    tdist.all_reduce(torch.ones(1))  # the other ranks block here, waiting for rank 1


def _raise_everywhere() -> None:
    raise KeyError(f"missing key on rank {tdist.get_rank()}")


def _failing_assert(value: int) -> None:
    if tdist.get_rank() == 1:
        assert value == 3


def _rank_one_skips_all_reduce() -> int:
    if tdist.get_rank() != 1:
        _blocked_in_all_reduce()
    return tdist.get_rank()


def _blocked_in_all_reduce() -> None:
    tdist.all_reduce(torch.ones(1))


def _exit_on_rank_one() -> None:
    if tdist.get_rank() == 1:
        os._exit(3)


class _Unpicklable:
    def __reduce__(self) -> tuple[object, ...]:
        raise TypeError("not today")


def _return_unpicklable() -> _Unpicklable:
    return _Unpicklable()


class _Broken(Exception):
    def __reduce__(self) -> tuple[object, ...]:
        raise TypeError("exception cannot travel")


def _raise_unpicklable_exception() -> None:
    raise _Broken("broken exception")


def _destroy_default_group() -> None:
    tdist.destroy_process_group()


@pytest.mark.pinned_torch_only
def test_failing_rank_reports_its_traceback_fast(dist: DistributedRunner) -> None:
    pids = dist.run(_pid, world_size=4)
    start = time.monotonic()
    with pytest.raises(RankError) as info:
        dist.run(_raise_on_rank_one, world_size=4, timeout=100.0)
    # The others are blocked in all_reduce: the harness must not wait for the timeout.
    assert time.monotonic() - start < 60.0
    err = info.value
    message = str(err)
    assert "failed ranks: [1]" in message
    assert "--- rank 1 traceback ---" in message
    assert "_raise_on_rank_one" in message
    assert "ValueError: rank one refuses: shape [3, 5] != [5, 3]" in message
    assert sorted(err.failures) == [1]
    assert isinstance(err.exceptions[1], ValueError)
    assert err.unfinished == [0, 2, 3]
    # The pool was killed and is recreated: the next call works on new processes.
    assert dist.worker_pids(4) == []
    new_pids = dist.run(_pid, world_size=4)
    assert set(new_pids).isdisjoint(pids)


def test_every_failed_rank_is_reported() -> None:
    with DistributedRunner(failure_grace=60.0) as runner, pytest.raises(RankError) as info:
        runner.run(_raise_everywhere, world_size=2)
    err = info.value
    assert sorted(err.failures) == [0, 1]
    assert "KeyError: 'missing key on rank 0'" in str(err)
    assert "KeyError: 'missing key on rank 1'" in str(err)
    assert err.unfinished == []


def test_assertion_in_rank_shows_values(dist: DistributedRunner) -> None:
    with pytest.raises(RankError) as info:
        dist.run(_failing_assert, world_size=2, args=(2,))
    assert "assert 2 == 3" in str(info.value)
    assert sorted(info.value.failures) == [1]


@pytest.mark.pinned_torch_only
def test_hang_becomes_timeout_and_pool_recovers(dist: DistributedRunner) -> None:
    pids = dist.run(_pid, world_size=2)
    with pytest.raises(RankTimeoutError) as info:
        dist.run(_rank_one_skips_all_reduce, world_size=2, timeout=5.0)
    err = info.value
    assert isinstance(err, TimeoutError)
    assert err.unfinished == [0] and err.finished == [1]
    assert "did not finish within 5 s on ranks [0]" in str(err)
    if hasattr(__import__("signal"), "SIGUSR1"):
        assert "_blocked_in_all_reduce" in err.stacks[0]
    new_pids = dist.run(_pid, world_size=2)
    assert set(new_pids).isdisjoint(pids)
    assert dist.run(_pid, world_size=2) == new_pids


def test_dead_worker_is_reported(dist: DistributedRunner) -> None:
    with pytest.raises(RankError) as info:
        dist.run(_exit_on_rank_one, world_size=2)
    assert "rank 1 exited unexpectedly (exit code 3)" in str(info.value)
    assert len(dist.run(_pid, world_size=2)) == 2


def test_unpicklable_results_and_exceptions_become_errors(dist: DistributedRunner) -> None:
    with pytest.raises(RankError, match="cannot be pickled back"):
        dist.run(_return_unpicklable, world_size=1)
    with pytest.raises(RankError) as info:
        dist.run(_raise_unpicklable_exception, world_size=1)
    assert info.value.exceptions[0] == "_Broken('broken exception')"
    assert "broken exception" in str(info.value)


def test_destroying_the_harness_group_is_an_error(dist: DistributedRunner) -> None:
    with pytest.raises(RankError, match="destroyed the harness's default process group"):
        dist.run(_destroy_default_group, world_size=1)
    assert dist.run(_pid, world_size=1)[0] != os.getpid()


def test_bad_arguments_fail_before_any_process_starts(dist: DistributedRunner) -> None:
    with pytest.raises(TypeError, match="module-level function"):
        dist.run(lambda: 1, world_size=2)
    with pytest.raises(ValueError, match="world_size must be a positive int, got 0"):
        dist.run(_pid, world_size=0)
    with pytest.raises(ValueError, match="timeout must be > 0"):
        dist.run(_pid, world_size=1, timeout=0)


#: A test process of its own: a pool of 2 workers busy in a task that never returns soon.
_BUSY_PARENT = """
import os, sys, time
from tessera.testing import DistributedRunner

def busy(path):
    with open(f"{path}.{os.getpid()}", "w"):
        pass
    time.sleep(120)

if __name__ == "__main__":
    DistributedRunner().run(busy, world_size=2, args=(sys.argv[1],), timeout=150)
"""


def test_workers_exit_with_a_killed_test_process(tmp_path: Path) -> None:
    """A test process killed with SIGKILL (no atexit) leaves no worker behind, even one busy."""
    script = tmp_path / "busy_parent.py"
    script.write_text(_BUSY_PARENT)
    marker = tmp_path / "worker"
    parent = subprocess.Popen([sys.executable, str(script), str(marker)], cwd=tmp_path)
    try:
        deadline = time.monotonic() + 60
        while len(list(tmp_path.glob("worker.*"))) < 2:  # both workers inside the task
            assert parent.poll() is None, "the test process ended before its workers ran"
            assert time.monotonic() < deadline, "the workers never started"
            time.sleep(0.2)
        workers = [int(p.suffix[1:]) for p in tmp_path.glob("worker.*")]
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 10
        while any(_alive(pid) for pid in workers) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [pid for pid in workers if _alive(pid)], "workers outlived the test process"
    finally:
        if parent.poll() is None:
            parent.kill()


def _alive(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie awaiting its reaper counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ", 1)[1][0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc (macOS): signal 0 only says whether the pid exists
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
