"""get_dataloader under pipeline and tensor parallelism: only the data rank picks the shard."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils.data import TensorDataset

from tessera.context import ParallelMode, create_context
from tessera.engine import get_dataloader

M = ParallelMode


def _batches(parallel: dict[str, Any]) -> dict[str, Any]:
    ctx = create_context(dict(parallel=parallel), timeout=60)
    try:
        loader = get_dataloader(
            TensorDataset(torch.arange(12)), shuffle=True, seed=7, batch_size=3, context=ctx
        )
        loader.sampler.set_epoch(1)  # type: ignore[attr-defined]
        return {
            "data_rank": ctx.get_local_rank(M.DATA),
            "batches": [[int(i) for i in batch] for (batch,) in loader],
        }
    finally:
        ctx.destroy()


LAYOUTS = {
    "dp2_pp2": (dict(pipeline=2), 4, 2),
    "dp4": ({}, 4, 4),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_pipeline_and_tensor_ranks_of_a_data_rank_read_the_same_batches(
    dist: Any, layout: str
) -> None:
    parallel, world, data_size = LAYOUTS[layout]
    results = dist.run(_batches, world_size=world, args=(parallel,), timeout=120)
    by_data: dict[int, list[list[int]]] = {}
    for r in results:
        assert by_data.setdefault(r["data_rank"], r["batches"]) == r["batches"]
    assert sorted(by_data) == list(range(data_size))
    shards = [[i for batch in by_data[d] for i in batch] for d in range(data_size)]
    assert all(len(s) == 12 // data_size for s in shards)
    # disjoint shards that together cover the dataset
    assert sorted(i for shard in shards for i in shard) == list(range(12))
    assert shards[0] != sorted(shards[0])  # shuffled
