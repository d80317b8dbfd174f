"""Launchers: real rendezvous on 2 processes, host forms, environments, and launch errors."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tessera.context import (
    ConfigError,
    LaunchOptions,
    ParallelMode,
    get_context,
    has_context,
    launch,
    launch_from_openmpi,
    launch_from_slurm,
    launch_from_torch,
)

CONFIG = {"parallel": {"tensor": {"size": 2, "mode": "1d"}}, "model": {"type": "Tiny"}}


def _check_and_destroy(ctx: Any) -> dict[str, Any]:
    """What every launcher must provide; destroys the context (and the default group)."""
    try:
        t = torch.tensor([float(ctx.global_rank + 1)])
        dist.all_reduce(t, group=ctx.get_group(ParallelMode.PARALLEL_1D))
        out = {
            "current": get_context() is ctx,
            "rank": ctx.global_rank,
            "world": ctx.world_size,
            "sum": t.item(),
            "backend": ctx.backend,
            "device": str(ctx.device),
            "model": ctx.full_config["model"]["type"],
            "draw": torch.rand(2).tolist(),  # launch seeds the default stream
        }
    finally:
        ctx.destroy()
    out["cleared"] = not has_context() and not dist.is_initialized()
    return out


def _launch_at(host: str) -> dict[str, Any]:
    ctx = launch(
        CONFIG,
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        host=host,
        port=int(os.environ["MASTER_PORT"]),
        options=LaunchOptions(seed=11, timeout=600),
        timeout=60,  # a keyword wins over the options
    )
    assert ctx.timeout.total_seconds() == 60
    return _check_and_destroy(ctx)


def _ipv6_loopback_works() -> bool:
    if not socket.has_ipv6:
        return False
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
    except OSError:
        return False
    return True


HOSTS = ["127.0.0.1", "localhost"] + (["::1"] if _ipv6_loopback_works() else [])


@pytest.mark.parametrize("host", HOSTS)
def test_launch_with_each_host_form(dist: Any, host: str) -> None:
    results = dist.run(
        _launch_at, world_size=2, args=(host,), init_process_group=False, timeout=120
    )
    for rank, r in enumerate(results):
        assert r["current"] and r["cleared"]
        assert (r["rank"], r["world"], r["sum"]) == (rank, 2, 3.0)
        assert (r["backend"], r["device"]) == ("gloo", "cpu")
        assert r["model"] == "Tiny"
    assert results[0]["draw"] == results[1]["draw"]  # both tensor ranks: seed 11


def _launch_twice() -> str:
    env = os.environ
    args = dict(rank=int(env["RANK"]), world_size=2, host="127.0.0.1", port=int(env["MASTER_PORT"]))
    ctx = launch({}, timeout=60, **args)  # type: ignore[arg-type]
    try:
        launch({}, timeout=60, **args)  # type: ignore[arg-type]
    except RuntimeError as exc:
        return str(exc)
    finally:
        ctx.destroy()
    return "no error"


def test_second_launch_without_destroy_is_an_error(dist: Any) -> None:
    for message in dist.run(_launch_twice, world_size=2, init_process_group=False, timeout=120):
        assert "already current" in message and "destroy()" in message


def _launch_too_many() -> str:
    try:
        launch(
            {},
            rank=int(os.environ["RANK"]),
            world_size=3,  # but only 2 processes exist
            host="127.0.0.1",
            port=int(os.environ["MASTER_PORT"]),
            timeout=600,  # collectives; the rendezvous has its own, short limit
            rendezvous_timeout=3,
        )
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def test_world_size_larger_than_the_processes_is_reported(dist: Any) -> None:
    for message in dist.run(_launch_too_many, world_size=2, init_process_group=False, timeout=60):
        assert "only 2 of world size 3 processes joined" in message
        assert "missing ranks [2]" in message
        assert "within 3 s" in message  # rendezvous_timeout, not the collective timeout


def test_rank_outside_the_world_is_an_error_before_any_network() -> None:
    with pytest.raises(ValueError, match=r"rank 2 is outside 0\.\.1 \(world size 2\)"):
        launch({}, rank=2, world_size=2, host="127.0.0.1", port=1)


def test_config_errors_come_before_any_network() -> None:
    with pytest.raises(ConfigError, match="not a perfect square"):
        launch(
            {"parallel": {"tensor": {"size": 2, "mode": "2d"}}},
            rank=0,
            world_size=2,
            host="127.0.0.1",
            port=1,
        )
    with pytest.raises(ValueError, match=r"port must be an int in 1\.\.65535"):
        launch({}, rank=0, world_size=1, host="127.0.0.1", port=0)


def test_launch_reads_a_config_file(tmp_path: Path) -> None:
    path = tmp_path / "cfg.py"
    path.write_text("parallel = dict(tensor=dict(size=2, mode='3d'))\n")
    with pytest.raises(ConfigError, match="2 is not a perfect cube"):
        launch(path, rank=0, world_size=2, host="127.0.0.1", port=1)


def test_launch_from_torch_needs_its_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(RuntimeError, match="launch_from_torch: environment variable RANK"):
        launch_from_torch({})


def _launch_from_scheduler(kind: str) -> dict[str, Any]:
    env = os.environ
    if kind == "slurm":
        env.update(SLURM_PROCID=env["RANK"], SLURM_NPROCS="2", SLURM_LOCALID=env["LOCAL_RANK"])
        ctx = launch_from_slurm(CONFIG, "127.0.0.1", int(env["MASTER_PORT"]), timeout=60)
    else:
        env.update(
            OMPI_COMM_WORLD_RANK=env["RANK"],
            OMPI_COMM_WORLD_SIZE="2",
            OMPI_COMM_WORLD_LOCAL_RANK=env["LOCAL_RANK"],
        )
        ctx = launch_from_openmpi(CONFIG, "localhost", int(env["MASTER_PORT"]), timeout=60)
    return _check_and_destroy(ctx)


@pytest.mark.parametrize("kind", ["slurm", "openmpi"])
def test_launch_from_scheduler_environments(dist: Any, kind: str) -> None:
    results = dist.run(
        _launch_from_scheduler, world_size=2, args=(kind,), init_process_group=False, timeout=120
    )
    assert [(r["rank"], r["sum"], r["cleared"]) for r in results] == [
        (0, 3.0, True),
        (1, 3.0, True),
    ]


SCRIPT = """
import torch
import torch.distributed as dist
from tessera.context import ParallelMode, get_context, launch_from_torch

ctx = launch_from_torch({"parallel": {"tensor": {"size": 2, "mode": "1d"}}}, timeout=60)
t = torch.tensor([float(ctx.global_rank + 1)])
dist.all_reduce(t, group=get_context().get_group(ParallelMode.TENSOR))
print(f"rank {ctx.global_rank} of {ctx.world_size} sum {t.item():g}", flush=True)
ctx.destroy()
"""


def test_torchrun_launch(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    command = [
        sys.executable, "-m", "torch.distributed.run",
        "--standalone", "--nnodes", "1", "--nproc-per-node", "2", str(script),
    ]  # fmt: skip
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=180, env=env, cwd=tmp_path
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "rank 0 of 2 sum 3" in done.stdout
    assert "rank 1 of 2 sum 3" in done.stdout


class _Stop(Exception):
    pass


@pytest.mark.parametrize(("cuda", "expected"), [(True, "cuda:0"), (False, None)])
def test_nccl_binds_the_communicator_to_the_rank_device(
    monkeypatch: pytest.MonkeyPatch, cuda: bool, expected: str | None
) -> None:
    """Under NCCL init_process_group gets device_id (eager communicator); never under gloo."""
    seen: dict[str, Any] = {}

    def fake_init(backend: str, **kwargs: Any) -> None:
        seen.update(kwargs, backend=backend)
        raise _Stop

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(dist, "init_process_group", fake_init)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(_Stop):
        launch({}, rank=0, world_size=1, host="127.0.0.1", port=port, timeout=30)
    assert seen["backend"] == ("nccl" if cuda else "gloo")
    device = seen["device_id"]
    assert (str(device) if device is not None else None) == expected


@pytest.mark.parametrize(
    ("local_rank", "local_world", "match"),
    [
        (1, None, "local rank 1 has no GPU: this process sees 1 CUDA device"),
        (0, "2", "2 processes on this node but it has 1 CUDA device"),  # rank 0 too
    ],
)
def test_more_processes_than_gpus_is_a_clear_error_before_the_rendezvous(
    monkeypatch: pytest.MonkeyPatch, local_rank: int, local_world: str | None, match: str
) -> None:
    """NCCL runs one process per GPU: say so before set_device or NCCL fails, or ranks wait."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("reached the GPU or the network")

    monkeypatch.setattr(torch.cuda, "set_device", refuse)
    monkeypatch.setattr(dist, "init_process_group", refuse)
    env = {"RANK": str(local_rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(local_rank)}
    env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}  # nothing listens: never dialled
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    if local_world is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local_world)
    with pytest.raises(ConfigError, match=match) as caught:
        launch_from_torch({})
    assert "backend='gloo'" in str(caught.value)


def _launch_mixed_layouts() -> str:
    """Ranks 0-1 get a 1D layout, ranks 2-3 a 2D one: a clear error, not a hang in new_group."""
    rank = int(os.environ["RANK"])
    tensor = {"size": 2, "mode": "1d"} if rank < 2 else {"size": 4, "mode": "2d"}
    try:
        ctx = launch(
            {"parallel": {"tensor": tensor}},
            rank=rank,
            world_size=4,
            host="127.0.0.1",
            port=int(os.environ["MASTER_PORT"]),
            timeout=5,
        )
    except ConfigError as exc:
        return str(exc)
    ctx.destroy()
    return "no error"


def test_ranks_with_different_layouts_fail_at_the_rendezvous(dist: Any) -> None:
    messages = dist.run(_launch_mixed_layouts, world_size=4, init_process_group=False, timeout=60)
    assert len(set(messages)) == 1, messages  # the same error on every rank
    assert (
        "ranks 0-1 hold parallel=dict(data=2, pipeline=1, tensor=dict(size=2, mode='1d')); "
        "ranks 2-3 hold parallel=dict(data=1, pipeline=1, tensor=dict(size=4, mode='2d'))"
    ) in messages[0]
    assert not dist.run(_initialized, world_size=4, init_process_group=False)[0]


def _initialized() -> bool:
    return dist.is_initialized() or has_context()


def test_launch_options_are_checked_once_for_every_launcher() -> None:
    """One options object for the four launchers; bad values and keywords fail before launching."""
    assert LaunchOptions().seed == 1024
    with pytest.raises(ValueError, match=r"heartbeat_interval must be a non-negative number"):
        LaunchOptions(heartbeat_interval=-1.0)
    with pytest.raises(ValueError, match=r"timeout must be a positive number of seconds, got 0"):
        LaunchOptions(timeout=0)
    with pytest.raises(ValueError, match=r"rendezvous_timeout must be a positive number"):
        LaunchOptions(rendezvous_timeout=-3)
    with pytest.raises(ValueError, match=r"seed must be an int, got 1.5"):
        LaunchOptions(seed=1.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"unexpected keyword arguments \['sed'\]; the launch"):
        launch({}, 0, 1, "127.0.0.1", 1, sed=3)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match=r"options must be a LaunchOptions, got 'gloo'"):
        launch({}, 0, 1, "127.0.0.1", 1, "gloo")  # type: ignore[arg-type]
