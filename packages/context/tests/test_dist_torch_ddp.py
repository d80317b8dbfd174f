"""``DistributedDataParallel`` around tessera's split parameters: over the data replicas only.

By default DDP's group is the world, which holds the other tensor ranks: DDP would broadcast
rank 0's block of a split weight over theirs, and average the gradients of different blocks.
Refused, naming the group to pass (``torch_ddp``).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from tessera.context import ParallelMode, ShardInfo, create_context, set_shard_info


def _ddp_over_groups() -> list[float]:
    ctx = create_context(dict(parallel=dict(tensor=dict(size=2, mode="1d"))), timeout=60)
    try:
        rank = ctx.get_local_rank(ParallelMode.PARALLEL_1D)
        torch.manual_seed(rank)  # each tensor rank its own block
        model = nn.Linear(4, 2)
        info = ShardInfo.from_split((4, 4), {0: [(ParallelMode.PARALLEL_1D, rank, 2)]})
        set_shard_info(model.weight, info)
        block = model.weight.detach().clone()
        model.context = ctx  # as tessera's layers hold it (no context is current here)
        with pytest.raises(ValueError, match=r"holding ranks \[\d, \d\] of this rank's tensor"):
            DistributedDataParallel(model)  # the world: the other tensor rank too
        assert torch.equal(model.weight, block)  # refused before its broadcast
        # built by accelerate (transformers' Trainer): the message says the Trainer cannot
        accelerate = {"__name__": "accelerate.accelerator", "DDP": DistributedDataParallel}
        with pytest.raises(ValueError, match=r"transformers' Trainer \(through accelerate\)"):
            eval("DDP(model)", {**accelerate, "model": model})
        DistributedDataParallel(model, process_group=ctx.get_group(ParallelMode.DATA))
        DistributedDataParallel(nn.Linear(4, 2))  # nothing split: torch's, over the world
        return [float(model.weight.sum())]
    finally:
        ctx.destroy()


def test_ddp_over_other_tensor_ranks_is_refused(dist: Any) -> None:
    sums = dist.run(_ddp_over_groups, world_size=4, timeout=120)
    assert sums[0] != sums[1]  # the tensor ranks kept their own blocks
    assert sums[0] == sums[2]  # the data replicas (ranks 0 and 2) agree
