"""get_dataloader: one shard per data rank, the same batches on every tensor rank."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils.data import TensorDataset

from tessera.context import ParallelMode, create_context
from tessera.engine import get_dataloader


def _indices(shuffle: bool, drop_last: bool) -> dict[str, Any]:
    ctx = create_context(dict(parallel=dict(tensor=dict(size=2, mode="1d"))), timeout=60)
    try:
        dataset = TensorDataset(torch.arange(10))
        loader = get_dataloader(
            dataset, shuffle=shuffle, batch_size=2, drop_last=drop_last, context=ctx
        )
        epochs = []
        for epoch in range(2):
            loader.sampler.set_epoch(epoch)  # type: ignore[attr-defined]
            epochs.append([int(i) for (batch,) in loader for i in batch])
        return {"data_rank": ctx.get_local_rank(ParallelMode.DATA), "epochs": epochs}
    finally:
        ctx.destroy()


@pytest.mark.parametrize("shuffle", [False, True])
def test_shards_follow_the_data_rank_only(dist: Any, shuffle: bool) -> None:
    results = dist.run(_indices, world_size=4, args=(shuffle, False), timeout=120)
    by_data: dict[int, list[list[int]]] = {}
    for r in results:
        # tensor ranks of one data rank see exactly the same batches
        assert by_data.setdefault(r["data_rank"], r["epochs"]) == r["epochs"]
    assert sorted(by_data) == [0, 1]
    for epoch in range(2):
        a, b = by_data[0][epoch], by_data[1][epoch]
        assert len(a) == len(b) == 5
        assert set(a).isdisjoint(b)
        assert sorted(a + b) == list(range(10))
    if shuffle:
        assert by_data[0][0] != by_data[0][1]  # set_epoch reshuffles
    else:
        assert by_data[0][0] == [0, 2, 4, 6, 8]


def test_drop_last_and_bad_kwargs(dist: Any) -> None:
    results = dist.run(_indices, world_size=4, args=(False, True), timeout=120)
    for r in results:
        assert len(r["epochs"][0]) == 4  # 5 per rank, the incomplete last batch dropped
    with pytest.raises(ValueError, match="sampler"):
        get_dataloader(TensorDataset(torch.arange(4)), sampler=None)


def test_without_context_reads_everything() -> None:
    loader = get_dataloader(TensorDataset(torch.arange(6)), batch_size=4)
    assert [len(b) for (b,) in loader] == [4, 2]
