"""``init_process_group=False``: torchrun-style environment, the body owns its groups."""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as tdist

from tessera.testing import DistributedRunner, RankError

_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _env_and_group() -> tuple[dict[str, str], bool]:
    return {k: os.environ[k] for k in _KEYS}, tdist.is_initialized()


def _own_group_all_reduce() -> float:
    tdist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=30))
    try:
        t = torch.tensor([float(tdist.get_rank() + 1)])  # [1]
        tdist.all_reduce(t)
        return float(t.item())
    finally:
        tdist.destroy_process_group()


def _forget_to_destroy() -> None:
    tdist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=30))


def test_env_vars_are_torchrun_like(dist: DistributedRunner) -> None:
    first = dist.run(_env_and_group, world_size=2, init_process_group=False)
    ports = {env["MASTER_PORT"] for env, _ in first}
    assert len(ports) == 1
    for rank, (env, initialized) in enumerate(first):
        assert not initialized
        assert env["RANK"] == env["LOCAL_RANK"] == str(rank)
        assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == "2"
        assert env["MASTER_ADDR"] == "127.0.0.1"
        assert 0 < int(env["MASTER_PORT"]) < 65536
    second = dist.run(_env_and_group, world_size=2, init_process_group=False)
    assert second[0][0]["MASTER_PORT"] != first[0][0]["MASTER_PORT"], "port must be fresh"


def test_body_can_create_and_destroy_its_own_group(dist: DistributedRunner) -> None:
    pids = dist.worker_pids(2, init_process_group=False)
    assert dist.run(_own_group_all_reduce, world_size=2, init_process_group=False) == [3.0, 3.0]
    # Twice on the same workers: the group really was destroyed in between.
    assert dist.run(_own_group_all_reduce, world_size=2, init_process_group=False) == [3.0, 3.0]
    if pids:
        assert dist.worker_pids(2, init_process_group=False) == pids


def test_leaking_a_group_is_reported(dist: DistributedRunner) -> None:
    with pytest.raises(RankError, match="destroy_process_group"):
        dist.run(_forget_to_destroy, world_size=2, init_process_group=False)
    assert dist.run(_own_group_all_reduce, world_size=2, init_process_group=False) == [3.0, 3.0]
