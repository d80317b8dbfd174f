"""Dropout streams across tensor ranks, and checkpointing that replays every stream."""

from __future__ import annotations

import pytest
import torch
from blocks import Block
from tp_reference import with_context

from tessera.context import ParallelContext
from tessera.layers import Dropout, Dropout1D, checkpoint, local_logits


def _masks(ctx: ParallelContext) -> dict[str, list[int]]:
    ctx.reseed()  # the default stream now agrees across tensor ranks
    x = torch.ones(64)
    shared = Dropout(0.5, context=ctx)
    sharded = Dropout(0.5, parallel_input=True, context=ctx)
    assert isinstance(shared, Dropout1D) and isinstance(sharded, Dropout1D)
    out = {
        "replicated": (shared(x) == 0).int().tolist(),
        "sharded": (sharded(x) == 0).int().tolist(),
    }
    shared.eval()
    assert torch.equal(shared(x), x)
    return out


def _masks_sp(ctx: ParallelContext) -> list[int]:
    ctx.reseed()
    drop = Dropout(0.5, context=ctx)  # sequence parallel: the input is split, masks differ
    assert isinstance(drop, Dropout1D) and drop.sharded_input
    return (drop(torch.ones(64)) == 0).int().tolist()


def _grads(block: Block, x: torch.Tensor, use_checkpoint: bool, ctx: ParallelContext) -> list:
    block.zero_grad()
    x = x.clone().requires_grad_()
    if use_checkpoint:
        y = checkpoint(block.attention, x, context=ctx)
        y = x + y
        y = y + checkpoint(block.mlp, y, context=ctx)
    else:
        y = block(x)
    (y * y).sum().backward()
    return [p.grad.clone() for p in block.parameters()] + [x.grad.clone()]


def _checkpoint(ctx: ParallelContext) -> bool:
    ctx.reseed()
    block = Block(16, 4, p=0.3, context=ctx)
    x = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(0))
    start = ctx.get_rng_state()
    plain = _grads(block, x, False, ctx)
    after_plain = torch.rand(8)
    ctx.set_rng_state(start)
    ckpt = _grads(block, x, True, ctx)
    after_ckpt = torch.rand(8)
    for a, b in zip(plain, ckpt, strict=True):
        assert torch.equal(a, b)
    # the streams end where they would have without checkpointing
    assert torch.equal(after_plain, after_ckpt)
    # and dropout was really on: a different RNG state gives different gradients
    other = _grads(block, x, True, ctx)
    return not all(torch.equal(a, b) for a, b in zip(plain, other, strict=True))


def _all(tp: int) -> dict:
    masks = with_context(tp, _masks)
    sp = with_context(tp, _masks_sp, sp=True)
    changed = with_context(tp, _checkpoint)
    return {"masks": masks, "sp": sp, "changed": changed}


@pytest.mark.parametrize("tp", [2, 4])
def test_dropout_streams_and_checkpoint(dist, tp: int) -> None:
    results = dist.run(_all, world_size=tp, args=(tp,), timeout=120.0)
    replicated = [r["masks"]["replicated"] for r in results]
    sharded = [r["masks"]["sharded"] for r in results]
    assert all(m == replicated[0] for m in replicated), "replicated dropout must agree"
    assert len({tuple(m) for m in sharded}) == tp, "sharded dropout must differ per rank"
    assert len({tuple(r["sp"]) for r in results}) == tp, "sequence-parallel dropout must differ"
    assert all(0 < sum(m) < 64 for m in replicated + sharded)
    assert all(r["changed"] for r in results)


def test_checkpoint_without_context_replays_torch_rng() -> None:
    block = Block(16, 4, p=0.3)
    x = torch.randn(2, 4, 16)
    state = torch.get_rng_state()
    y = block.attention(x)
    (y * y).sum().backward()
    plain = [p.grad.clone() for p in block.parameters() if p.grad is not None]
    block.zero_grad()
    torch.set_rng_state(state)
    y = checkpoint(block.attention, x)
    (y * y).sum().backward()
    ckpt = [p.grad.clone() for p in block.parameters() if p.grad is not None]
    assert len(plain) == len(ckpt) > 0
    assert all(torch.equal(a, b) for a, b in zip(plain, ckpt, strict=True))


def _samples_kept(tensor: dict[str, object]) -> list[tuple[int, int, int, bool]]:
    """``(call, module, sample, kept)`` of each drop path this rank ran, by the batch's rows."""
    import torch.distributed as dist
    from plain_models import DropPath, DropPathLM, StochasticDepth

    from tessera.context import create_context
    from tessera.layers import parallelize, split_batch

    ctx = create_context(dict(parallel=dict(tensor=tensor)), timeout=60.0)
    try:
        torch.manual_seed(0)
        plain = DropPathLM(drop=0.5)
        # torchvision's form: per row, and one number for the batch (paths 2 and 3)
        plain.blocks[1].drop1 = StochasticDepth(0.5, "row")
        plain.blocks[1].drop2 = StochasticDepth(0.5, "batch")
        model = parallelize(plain, context=ctx)
        samples = torch.arange(8)[:, None].expand(8, 16).contiguous()  # [b, s]: each its row
        rows = split_batch(samples, context=ctx)[:, 0].tolist()  # the samples this rank holds
        seen: list[tuple[int, int, int, bool]] = []
        calls = [0]
        paths = [m for m in model.modules() if isinstance(m, (DropPath, StochasticDepth))]
        assert len(paths) == 4
        for index, path in enumerate(paths):

            def record(module: object, args: tuple, out: torch.Tensor, index: int = index) -> None:
                dropped = out.flatten(1).eq(0).all(1)  # a sample's whole block is zero
                seen.extend(
                    (calls[0], index, row, not bool(d))
                    for row, d in zip(rows, dropped, strict=True)
                )

            path.register_forward_hook(record)
        ids = torch.randint(0, 32, (8, 16), generator=torch.Generator().manual_seed(2))
        torch.manual_seed(1)  # alike on every rank, as the context seeds it
        model(ids)
        calls[0] += 1
        model._tessera_rank_fork.streams_in_eager = True  # what a compiled forward draws
        model(ids)
        model._tessera_rank_fork.streams_in_eager = False
        for _ in range(6):  # the batch's one number: 2**-8 that 8 calls agree by chance
            calls[0] += 1
            model(ids)
        everyone: list[list[tuple[int, int, int, bool]]] = [
            [] for _ in range(dist.get_world_size())
        ]
        dist.all_gather_object(everyone, seen)
        _checkpointing_replays_drop_paths(model)
        if tensor["mode"] != "1d":  # 1D's residual stream is whole: drawn alike, allowed
            _noise_of_another_name_is_refused(ctx)
        _drop_path_on_another_layout(ctx, refused=tensor["mode"] == "1d")
        return [kept for rank in everyone for kept in rank]
    finally:
        ctx.destroy()


def _drop_path_on_another_layout(ctx: object, refused: bool) -> None:
    """A drop path on an MLP's hidden layer: under 1D a column output, cut by features where
    the activations between blocks are whole, refused by name on the first call; under the
    grids and 'sequence' laid out as an activation, it runs."""
    from plain_models import ColumnDropPathBlock, DropPath, DropPathLM

    from tessera.layers import parallelize

    torch.manual_seed(0)
    plain = DropPathLM(drop=0.5)
    plain.blocks = torch.nn.ModuleList(ColumnDropPathBlock(16, 4, 0.5) for _ in range(2))
    model = parallelize(plain, context=ctx)
    paths = [m for m in model.modules() if isinstance(m, DropPath)]
    for path in paths:  # a schedule starting at 0: the first call is checked all the same
        path.drop_prob = 0.0
    ids = torch.randint(0, 32, (8, 16), generator=torch.Generator().manual_seed(2))
    if refused:
        with pytest.raises(ValueError, match=r"drop path 'blocks\.0\.drop2' is given a \[8"):
            model(ids)
    else:
        model(ids)
        for path in paths:
            path.drop_prob = 0.5
        model(ids)


def _noise_of_another_name_is_refused(ctx: object) -> None:
    """Noise per row under a name tessera does not know, left out of the plan: its plain
    noise is refused on the first call."""
    from plain_models import DropPathLM, RowNoise

    from tessera.layers import parallelize

    torch.manual_seed(0)
    plain = DropPathLM(drop=0.5)
    plain.blocks[0].drop1 = RowNoise(0.5)
    model = parallelize(plain, context=ctx)
    with pytest.raises(ValueError, match=r"'blocks\.0\.drop1', a module the plan leaves out"):
        model(torch.randint(0, 32, (8, 16), generator=torch.Generator().manual_seed(2)))


def _checkpointing_replays_drop_paths(model: torch.nn.Module) -> None:
    """Recomputed under activation checkpointing, each drop path keeps the samples it kept."""
    from torch.utils.checkpoint import checkpoint as torch_checkpoint

    ids = torch.randint(0, 32, (8, 16), generator=torch.Generator().manual_seed(3))
    grads = []
    for checkpointed in (False, True):
        for block in model.blocks:
            if checkpointed:
                block.forward = lambda x, b=block: torch_checkpoint(
                    type(b).forward, b, x, use_reentrant=False
                )
        model.zero_grad()
        torch.manual_seed(4)  # alike on every rank
        local_logits(model(ids)).float().pow(2).mean().backward()  # 1d: this rank's classes
        grads.append([p.grad.clone() for p in model.parameters()])
    for plain, replayed in zip(*grads, strict=True):
        torch.testing.assert_close(replayed, plain, rtol=0, atol=0)


@pytest.mark.parametrize(
    "tensor",
    [dict(size=4, mode="2d"), dict(size=2, mode="sequence"), dict(size=2, mode="1d")],
    ids=["2d", "sequence", "1d"],
)
def test_drop_path_keeps_or_drops_each_sample_whole_on_every_rank(dist, tensor) -> None:
    """Stochastic depth draws per sample: every rank holding a part of a sample agrees, and
    activation checkpointing recomputes the same masks.

    Before conversion/drop_path.py, each rank's forked generator drew its own numbers, and a
    sample was dropped in some feature blocks (2d's columns) or token chunks ('sequence')
    and kept in others.
    """
    seen = dist.run(_samples_kept, world_size=tensor["size"], args=(tensor,), timeout=120.0)[0]
    decisions: dict[tuple[int, int, int], set[bool]] = {}
    for call, module, sample, kept in seen:
        decisions.setdefault((call, module, sample), set()).add(kept)
    assert all(len(kept) == 1 for kept in decisions.values()), decisions
    assert {next(iter(kept)) for kept in decisions.values()} == {True, False}
    batch = {}  # the path drawing one number for the batch: every sample alike, on every rank
    for (call, module, _), kept in decisions.items():
        if module == 3:
            batch.setdefault(call, set()).update(kept)
    assert len(batch) == 8 and all(len(kept) == 1 for kept in batch.values()), batch
    assert len(decisions) == 8 * 4 * 8  # eight calls, four drop paths, every sample
