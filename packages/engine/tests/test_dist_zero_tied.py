"""ZeRO-2/3 (FSDP2) on a language model whose head is tied to its token embedding.

Sharding each direct child failed on such a model (the tied weight belongs to two units);
the wrap policy shards each repeated block and leaves tied parameters to the root. Two data
ranks, each with its half of the batch, against one process with the whole batch.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as tdist
from torch import nn

from tessera.context import create_context
from tessera.engine import initialize
from tessera.engine.zero import fsdp_units

VOCAB, HIDDEN, SEQ = 16, 8, 6


class TiedLM(nn.Module):
    """Token embedding, two blocks in an ``nn.ModuleList``, a head sharing the embedding."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(HIDDEN), nn.Linear(HIDDEN, HIDDEN), nn.Tanh())
            for _ in range(2)
        )
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x).flatten(0, 1)  # [b * s, V]


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, VOCAB, (4, SEQ), generator=g)
    return ids, torch.randint(0, VOCAB, (4 * SEQ,), generator=g)


def _full(p: torch.Tensor) -> torch.Tensor:
    full = getattr(p, "full_tensor", None)
    return (full() if callable(full) else p).detach().clone()


def _train(stage: int) -> list[torch.Tensor]:
    ctx = create_context(dict(parallel={}), timeout=60)
    try:
        rank = tdist.get_rank()
        model = TiedLM()
        # a mark another package left on a parameter (tessera-layers' FullForm) survives FSDP2
        model.blocks[0][1].weight._tessera_mark = "kept"  # type: ignore[attr-defined]
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        engine, *_ = initialize(
            model, opt, nn.CrossEntropyLoss(), config={"zero": {"stage": stage}}, context=ctx
        )
        marked = dict(model.named_parameters())["blocks.0.1.weight"]
        assert getattr(marked, "_tessera_mark", None) == "kept", "the mark was lost"
        for step in range(2):
            ids, labels = _batch(step)
            rows = slice(2 * rank, 2 * rank + 2)
            engine.zero_grad()
            engine.backward(
                engine.criterion(engine(ids[rows]), labels.view(4, SEQ)[rows].flatten())
            )
            engine.step()
        return [_full(p) for p in engine.parameters()]
    finally:
        ctx.destroy()


def _reference() -> list[torch.Tensor]:
    model = TiedLM()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for step in range(2):
        ids, labels = _batch(step)
        opt.zero_grad()
        nn.CrossEntropyLoss()(model(ids), labels).backward()
        opt.step()
    return [p.detach() for p in model.parameters()]


def test_units_are_the_blocks_and_leave_tied_weights_to_the_root() -> None:
    model = TiedLM()
    assert fsdp_units(model) == list(model.blocks)
    flat = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    flat[1].weight = flat[0].weight  # tied across two children: neither is a unit
    assert fsdp_units(flat) == []


def test_a_list_inside_a_block_stays_in_the_block_unit() -> None:
    """StableLM keeps a norm per head in a list inside each block; a module converted by
    parallelize computes with their weights without calling them, so as units of their own
    FSDP2 would never gather them."""
    block = nn.ModuleDict(
        {"proj": nn.Linear(2, 2), "norms": nn.ModuleList(nn.LayerNorm(2) for _ in range(2))}
    )
    model = nn.ModuleDict({"layers": nn.ModuleList([block, copy.deepcopy(block)])})
    assert fsdp_units(model) == list(model["layers"])


@pytest.mark.parametrize("stage", [2, 3], ids=["zero2", "zero3"])
def test_zero_with_a_tied_head_matches_one_process(dist: Any, stage: int) -> None:
    results = dist.run(_train, world_size=2, args=(stage,), timeout=120.0)
    reference = _reference()
    for got in results:
        assert len(got) == len(reference)
        for a, b in zip(got, reference, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
