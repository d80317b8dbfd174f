"""Full state dicts: load gives each rank its block, gather returns the exact full tensors."""

from __future__ import annotations

import io

import pytest
import torch
import torch.distributed as dist
from blocks import Block
from torch import nn
from tp_reference import randomize, with_context

from tessera.context import ParallelContext, get_shard_info
from tessera.layers import (
    Classifier,
    Embedding,
    PatchEmbedding,
    gather_full_state_dict,
    load_full_state_dict,
)


class Model(nn.Module):
    def __init__(self, context: ParallelContext | None = None) -> None:
        super().__init__()
        self.patch = PatchEmbedding(4, 2, 3, 8, context=context)
        self.emb = Embedding(16, 8, context=context)
        self.vemb = Embedding(16, 8, vocab_parallel=True, context=context)
        self.block = Block(8, 2, context=context)
        self.head = Classifier(8, 16, weight=self.emb.weight, context=context)
        self.vhead = Classifier(8, 16, vocab_parallel=True, context=context)
        self.register_buffer("steps", torch.zeros(3))


def _round_trip(ctx: ParallelContext) -> int:
    ref = Model()
    randomize(ref, 0)
    full = ref.state_dict()
    par = Model(ctx)
    load_full_state_dict(par, full)
    sharded = [n for n, p in par.named_parameters() if (i := get_shard_info(p)) and i.is_sharded]
    assert len(sharded) >= 10
    for name, p in par.named_parameters():
        assert get_shard_info(p) is not None, f"{name} carries no ShardInfo"
    gathered = gather_full_state_dict(par)
    assert list(gathered) == list(full)
    for name, t in full.items():
        assert torch.equal(gathered[name], t), name
    assert gathered["head.weight"].data_ptr() != gathered["emb.weight"].data_ptr()
    # the round trip in the other direction changes nothing
    before = {n: t.detach().clone() for n, t in par.state_dict().items()}
    load_full_state_dict(par, gathered)
    assert all(torch.equal(before[n], t) for n, t in par.state_dict().items())
    # bad input: checked before anything is copied
    bad = dict(full)
    bad["block.fc1.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match=r"block\.fc1\.weight.*\[3, 3\].*\[32, 8\]"):
        load_full_state_dict(par, bad)
    missing = dict(full)
    del missing["vhead.bias"]
    with pytest.raises(KeyError, match=r"vhead\.bias"):
        load_full_state_dict(par, missing)
    load_full_state_dict(par, missing, strict=False)
    _rank_zeros_file_refused(par, ctx)
    return len(sharded)


def _rank_zeros_file_refused(par: nn.Module, ctx: ParallelContext) -> None:
    """``torch.save(module.state_dict())`` on rank 0, loaded on every rank (the plain habit):
    the other ranks refuse rank 0's blocks, for a model of one's own and for one of its
    submodules; each rank's own file loads (shared/block_tags)."""
    for module in (par, par.block):
        buffer = io.BytesIO()
        torch.save(module.state_dict(), buffer)
        files = [buffer.getvalue()]
        dist.broadcast_object_list(files, src=0)
        rank_zeros = torch.load(io.BytesIO(files[0]))
        if dist.get_rank() == 0:
            module.load_state_dict(rank_zeros)
        else:
            with pytest.raises(ValueError, match=r"\.weight' holds the block .* another rank"):
                module.load_state_dict(rank_zeros)
        module.load_state_dict(torch.load(io.BytesIO(buffer.getvalue())))


def _all(tp: int) -> int:
    return with_context(tp, _round_trip)


@pytest.mark.parametrize("tp", [2, 4])
def test_full_state_dict_round_trip(dist, tp: int) -> None:
    counts = dist.run(_all, world_size=tp, args=(tp,), timeout=120.0)
    assert len(set(counts)) == 1


def test_plain_model_round_trip_without_context() -> None:
    model = Model()
    randomize(model, 1)
    full = {n: t.clone() for n, t in model.state_dict().items()}
    gathered = gather_full_state_dict(model)
    assert all(torch.equal(gathered[n], t) for n, t in full.items())
