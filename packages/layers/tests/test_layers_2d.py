"""2D (4 ranks) and 2.5D (4 ranks depth 1, 8 ranks depth 2) against the torch reference.

Each check is its own test (one ``dist.run`` on a fresh context, the worker pool reused):
each layer's output and gradients, the SUMMA products, the paper's Listing 1, a transformer
block from the dispatching layers, the losses and metrics, the state-dict round trip, the
activation maps and the size errors.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from blocks import Block
from mesh_reference import CONFIGS, block, check_mesh, mesh, sum_deferred, with_mesh
from torch import nn
from tp_reference import TOL, BiasAdded, check_returned_bias, randomize

import tessera.layers as L
from tessera.context import (
    ParallelContext,
    ParallelMode,
    defer_gradient_sums,
    get_shard_info,
    set_context,
)
from tessera.layers import (
    Accuracy,
    Classifier,
    CrossEntropyLoss,
    Dropout,
    Embedding,
    LayerNorm,
    Linear,
    PatchEmbedding,
    SerialClassifier,
    SerialPatchEmbedding,
    gather_activation,
    gather_full_state_dict,
    load_full_state_dict,
    split_activation,
    split_batch,
    summa_ab,
    summa_abt,
    summa_atb,
)

B, S, H = 4, 3, 8  # a batch of 4 splits over depth * q = 4 ranks


def _cls(name: str, ctx: ParallelContext) -> Any:
    """The class ``name`` + ``2D`` / ``2p5D`` for the context's mode."""
    return getattr(L, name + mesh(ctx).suffix)


def _mesh_coordinates(ctx: ParallelContext) -> None:
    m = mesh(ctx)
    t = ctx.get_local_rank(ParallelMode.TENSOR)
    dep = 0 if m.dep is None else m.dep.rank
    assert t == dep * m.q * m.q + m.col.rank * m.q + m.row.rank
    assert m.batch.rank == dep * m.q + m.col.rank and m.batch.world_size == m.depth * m.q


@contextlib.contextmanager
def _counting_gathers() -> Iterator[list[tuple[int, ...]]]:
    """The shapes of the blocks SUMMA gathers while the block runs."""
    from tessera.layers.mesh import summa

    shapes: list[tuple[int, ...]] = []
    original = summa.gather_blocks

    def counted(block: torch.Tensor, group: Any) -> Any:
        shapes.append(tuple(block.shape))
        return original(block, group)

    summa.gather_blocks = counted  # type: ignore[assignment]
    try:
        yield shapes
    finally:
        summa.gather_blocks = original  # type: ignore[assignment]


def _summa(ctx: ParallelContext) -> None:
    """The three products and their gradients, per depth layer, against torch."""
    m = mesh(ctx)
    g = torch.Generator().manual_seed(7)
    a, b = torch.randn(6, 8, generator=g), torch.randn(8, 4, generator=g)
    bt, c = b.t().contiguous(), torch.randn(6, 4, generator=g)
    i, j, q = m.col.rank, m.row.rank, m.q

    def blk(x: torch.Tensor) -> torch.Tensor:
        return x.chunk(q, 0)[i].chunk(q, 1)[j].clone().requires_grad_()

    cases = [
        (summa_ab, lambda x, y: x @ y, a, b),
        (summa_abt, lambda x, y: x @ y.t(), a, bt),
        (summa_atb, lambda x, y: x.t() @ y, a, c),
    ]
    for fn, ref_fn, x, y in cases:
        xr, yr = x.clone().requires_grad_(), y.clone().requires_grad_()
        out_ref = ref_fn(xr, yr)
        xp, yp = blk(x), blk(y)
        # B as a transposed view: the broadcast buffers must not inherit its strides
        out = fn(xp, yp.t().contiguous().t(), m.row, m.col)
        w = torch.randn(out_ref.shape, generator=g)
        (out_ref * w).sum().backward()
        name = fn.__name__
        with _counting_gathers() as gathers:
            (out * blk(w).detach()).sum().backward()
        # each gradient product gathers one operand; one both need (the output gradient's
        # panels in abt's and atb's backward) is gathered once
        assert len(gathers) == 2, (name, gathers)
        torch.testing.assert_close(out, blk(out_ref.detach()).detach(), **TOL, msg=name)
        assert xr.grad is not None and yr.grad is not None
        torch.testing.assert_close(xp.grad, blk(xr.grad).detach(), **TOL, msg=f"{name} dA")
        torch.testing.assert_close(yp.grad, blk(yr.grad).detach(), **TOL, msg=f"{name} dB")


def _mesh_linear(ctx: ParallelContext) -> None:
    """Every variant of the linear product, with and without bias and input gradient."""
    m = mesh(ctx)
    i, j, q = m.col.rank, m.row.rank, m.q
    g = torch.Generator().manual_seed(11)
    x, w, b = torch.randn(8, 8, generator=g), torch.randn(12, 8, generator=g), torch.randn(12)
    dy = torch.randn(8, 12, generator=g)

    def rows(t: torch.Tensor) -> torch.Tensor:  # batch block k*q + i, feature block j
        return t.chunk(m.batch.world_size, 0)[m.batch.rank].chunk(q, 1)[j]

    for algorithm, bias, input_grad in [
        ("summa", True, True),
        ("streamed", True, True),
        ("stationary", True, True),
        ("summa", False, False),
        ("streamed", False, True),
        ("stationary", False, False),
    ]:
        xr, wr, br = (t.clone().requires_grad_() for t in (x, w, b))
        (F.linear(xr, wr, br if bias else None) * dy).sum().backward()
        xp = rows(x).clone().requires_grad_(input_grad)
        wp = w.chunk(q, 0)[j].chunk(q, 1)[i].clone().requires_grad_()  # W[out_j, in_i]
        bp = b.chunk(q)[j].clone().requires_grad_() if bias else None
        out = L.mesh_linear(xp, wp, bp, m, algorithm)
        (out * rows(dy)).sum().backward()
        name = f"{algorithm} bias={bias}"
        torch.testing.assert_close(out, rows(F.linear(x, w, b if bias else None)), **TOL, msg=name)
        assert wr.grad is not None and wp.grad is not None
        torch.testing.assert_close(wp.grad, wr.grad.chunk(q, 0)[j].chunk(q, 1)[i], **TOL)
        if bias:
            assert br.grad is not None and bp is not None and bp.grad is not None
            torch.testing.assert_close(bp.grad, br.grad.chunk(q)[j], **TOL, msg=name)
        if input_grad:
            assert xr.grad is not None
            torch.testing.assert_close(xp.grad, rows(xr.grad), **TOL, msg=name)
        else:
            assert xp.grad is None
    # Under autocast both variants compute in bf16, and the gradients come back in fp32.
    for algorithm in ("summa", "streamed", "stationary"):
        wp = w.chunk(q, 0)[j].chunk(q, 1)[i].clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = L.mesh_linear(rows(x), wp, None, m, algorithm)
        assert out.dtype == torch.bfloat16
        (out.float() * rows(dy)).sum().backward()
        assert wp.grad is not None and wp.grad.dtype == torch.float32
        want = (dy.t() @ x).chunk(q, 0)[j].chunk(q, 1)[i]
        torch.testing.assert_close(wp.grad, want, atol=0.3, rtol=0.05)
    assert L.choose_algorithm(8, 4, backward=True) == "summa"
    assert L.choose_algorithm(5, 4, backward=True) == "stationary"
    assert L.choose_algorithm(4, 4, backward=False) == "summa"


def _layers(ctx: ParallelContext) -> int:
    checks = _layer_cases(ctx)
    for n, (name, ref, par, inp, in_layout, out_layout) in enumerate(checks):
        assert type(par).__name__.endswith(mesh(ctx).suffix), name
        check_mesh(name, ref, par, inp, ctx, in_layout=in_layout, out_layout=out_layout, seed=n)
    # skip_bias_add returns the bias block; adding it gives the output
    ref = nn.Linear(H, 12)
    randomize(ref, 40)
    par = _cls("Linear", ctx)(H, 12, skip_bias_add=True, context=ctx)
    load_full_state_dict(par, ref.state_dict())
    y, bias = par(block(x_of(), ctx, "act"))
    torch.testing.assert_close(y + bias, block(ref(x_of()), ctx, "act"), **TOL)
    return len(checks)


def x_of() -> torch.Tensor:
    """The ``[B, S, H]`` input of the layer checks."""
    return torch.randn(B, S, H, generator=torch.Generator().manual_seed(1))


Case = tuple[str, nn.Module, nn.Module, torch.Tensor, str | None, str | None]


def _layer_cases(ctx: ParallelContext) -> list[Case]:
    """Each mesh layer with its torch reference, input and layouts."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(B, S, H, generator=g)
    x2 = torch.randn(B, H, generator=g)
    ids = torch.randint(0, 16, (B, S), generator=g)
    ids[0, 0] = 3  # the padding row
    img = torch.randn(B, 3, 4, 4, generator=g)
    checks: list[tuple[str, nn.Module, nn.Module, torch.Tensor, str | None, str | None]] = [
        ("Linear", nn.Linear(H, 12), _cls("Linear", ctx)(H, 12, context=ctx), x, "act", "act"),
        (
            "Linear[2-dim]",
            nn.Linear(H, 4),
            _cls("Linear", ctx)(H, 4, context=ctx),
            x2,
            "act",
            "act",
        ),
        (
            "Linear(bias=False)",
            nn.Linear(12, H, bias=False),
            _cls("Linear", ctx)(12, H, bias=False, context=ctx),
            torch.randn(B, S, 12, generator=g),
            "act",
            "act",
        ),
        ("LayerNorm", nn.LayerNorm(H), _cls("LayerNorm", ctx)(H, context=ctx), x, "act", "act"),
        (
            "LayerNorm(bias=False)",
            nn.LayerNorm(H, bias=False),
            _cls("LayerNorm", ctx)(H, bias=False, context=ctx),
            x * 3 + 1,
            "act",
            "act",
        ),
        (
            "Embedding(padding_idx)",
            nn.Embedding(16, H, padding_idx=3),
            _cls("Embedding", ctx)(16, H, padding_idx=3, context=ctx),
            ids,
            "batch",
            "act",
        ),
        (
            "VocabParallelEmbedding(padding_idx)",
            nn.Embedding(16, H, padding_idx=3),
            _cls("VocabParallelEmbedding", ctx)(16, H, padding_idx=3, context=ctx),
            ids,
            "batch",
            "act",
        ),
        (
            "PatchEmbedding",
            SerialPatchEmbedding(4, 2, 3, H),
            _cls("PatchEmbedding", ctx)(4, 2, 3, H, context=ctx),
            img,
            "batch",
            "act",
        ),
        (
            "Classifier",
            SerialClassifier(H, 6),
            _cls("Classifier", ctx)(H, 6, context=ctx),
            x,
            "act",
            "batch",
        ),
        (
            "VocabParallelClassifier",
            SerialClassifier(H, 12),
            _cls("VocabParallelClassifier", ctx)(H, 12, context=ctx),
            x,
            "act",
            "act",
        ),
    ]
    return checks


def _deferred_sums(ctx: ParallelContext) -> dict[str, int]:
    """``defer_gradient_sums`` leaves each layer's depth-replicated gradients as this depth
    layer's part, and a LayerNorm's affine gradients as this batch block's: summed over the
    returned groups by the caller, every gradient equals the reference's (a parameter left
    out, or one also summed in autograd, would not). Returns how many parameters each layer
    left to the caller."""
    m = mesh(ctx)
    cases = _layer_cases(ctx)
    returned = _cls("Linear", ctx)(H, 12, skip_bias_add=True, context=ctx)
    cases.append(("Linear(skip_bias_add)", BiasAdded(nn.Linear(H, 12)), BiasAdded(returned),
                  x_of(), "act", "act"))  # fmt: skip
    left: dict[str, int] = {}
    for n, (name, ref, par, inp, in_layout, out_layout) in enumerate(cases):
        sums = defer_gradient_sums([par])
        assert defer_gradient_sums([par]) == sums  # idempotent
        left[name] = sum(len(params) for params in sums.values())
        check_mesh(name, ref, par, inp, ctx, in_layout=in_layout, out_layout=out_layout,
                   seed=n, after_backward=lambda sums=sums: sum_deferred(sums, ctx))  # fmt: skip
    # a head tied to its embedding: one parameter, used by two deferring layers, summed once
    emb = Embedding(16, H, vocab_parallel=True, context=ctx)
    head = Classifier(H, 16, emb.weight, False, vocab_parallel=True, context=ctx)
    tied = defer_gradient_sums([emb, head])
    assert [len(v) for v in tied.values()] == ([1] if m.dep is not None else [])
    return left


def _dispatch_skip_bias_add(ctx: ParallelContext) -> None:
    """The dispatching ``Linear(..., skip_bias_add=True)``: the caller's ``y + bias`` has
    ``nn.Linear``'s values and every gradient; the returned bias is the local block ``[out/q]``
    (block ``j``) that the bias's ShardInfo describes, its gradient summed over the batch group."""
    x = torch.randn(B, S, H, generator=torch.Generator().manual_seed(11))
    linear = Linear(H, 12, skip_bias_add=True, context=ctx)
    assert type(linear) is _cls("Linear", ctx)
    ref, par = BiasAdded(nn.Linear(H, 12)), BiasAdded(linear)
    check_mesh("Linear(skip_bias_add)", ref, par, x, ctx, seed=45)
    bias = check_returned_bias(linear, ref.inner, block(x, ctx, "act"))  # type: ignore[arg-type]
    assert bias.shape == (12 // mesh(ctx).q,)


class ListingOne(nn.Module):
    """Xu et al. 2021, Listing 1, with the sizes made small (1024 -> 16, 8192 -> 64)."""

    def __init__(self, suffix: str) -> None:
        super().__init__()
        linear, norm = getattr(L, "Linear" + suffix), getattr(L, "LayerNorm" + suffix)
        self.linear_1 = linear(16, 64)
        self.norm = norm(64)
        self.linear_2 = linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.linear_1(x)
        x = self.norm(x)
        return self.linear_2(x)


def _listing_one(ctx: ParallelContext) -> None:
    ref = nn.Sequential()
    ref.add_module("linear_1", nn.Linear(16, 64))
    ref.add_module("norm", nn.LayerNorm(64))
    ref.add_module("linear_2", nn.Linear(64, 16))
    previous = set_context(ctx)  # Listing 1 passes no context: it uses the current one
    try:
        par = ListingOne(mesh(ctx).suffix)
    finally:
        set_context(previous)
    x = torch.randn(B, S, 16, generator=torch.Generator().manual_seed(3))
    check_mesh("Listing1", ref, par, x, ctx, seed=50)


def _block(ctx: ParallelContext) -> list[str]:
    ref, par = Block(16, 4), Block(16, 4, context=ctx)
    assert [n for n, _ in ref.named_parameters()] == [n for n, _ in par.named_parameters()]
    x = torch.randn(B, S, 16, generator=torch.Generator().manual_seed(2))
    check_mesh("Block", ref, par, x, ctx, seed=60)
    return [type(c).__name__ for c in par.children()]


def _loss_and_accuracy(ctx: ParallelContext) -> None:
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(B, S, 12, generator=g)
    target = torch.randint(0, 12, (B, S), generator=g)
    target[0, :2] = -100
    target[1, 0] = 7
    logits[1, 0, 3] = logits[1, 0, 7] = logits[1, 0].max() + 1  # a tie: argmax takes index 3
    expected = int((logits.argmax(-1) == target).sum())
    for vocab_parallel, layout in ((False, "batch"), (True, "act")):
        for reduction in ("mean", "sum", "none"):
            loss_fn = CrossEntropyLoss(reduction, vocab_parallel=vocab_parallel, context=ctx)
            prefix = "VocabParallel" if vocab_parallel else ""
            assert type(loss_fn) is _cls(prefix + "CrossEntropyLoss", ctx)
            ref_in = logits.clone().requires_grad_()
            par_in = block(logits, ctx, layout).clone().requires_grad_()
            ref = F.cross_entropy(ref_in.view(-1, 12), target.view(-1), reduction=reduction)
            par = loss_fn(par_in, block(target, ctx, "batch"))
            if reduction == "none":
                ref = ref.view(B, S)
                torch.testing.assert_close(par, block(ref.detach(), ctx, "batch"), **TOL)
                w = torch.rand(B, S, generator=g)
                (ref * w).sum().backward()
                (par * block(w, ctx, "batch")).sum().backward()
            else:
                torch.testing.assert_close(par, ref, **TOL)
                ref.backward()
                par.backward()
            assert ref_in.grad is not None and par_in.grad is not None
            torch.testing.assert_close(par_in.grad, block(ref_in.grad, ctx, layout), **TOL)
        acc = Accuracy(vocab_parallel=vocab_parallel, context=ctx)
        assert type(acc) is _cls(("VocabParallel" if vocab_parallel else "") + "Accuracy", ctx)
        got = acc(block(logits, ctx, layout), block(target, ctx, "batch"))
        assert int(got) == expected


def _language_model_heads(ctx: ParallelContext) -> None:
    """Tied embedding + classifier (both kinds), the matching loss, against torch."""
    ids = torch.randint(0, 16, (B, S), generator=torch.Generator().manual_seed(2))
    target = torch.randint(0, 16, (B, S), generator=torch.Generator().manual_seed(3))
    # 8 classes on a 16-row embedding: the head uses its first rows (Colossal-AI's heads do)
    for vocab_parallel, classes in ((False, 16), (True, 16), (False, 8)):
        emb = Embedding(16, H, vocab_parallel=vocab_parallel, context=ctx)
        head = Classifier(H, classes, emb.weight, False, vocab_parallel=vocab_parallel, context=ctx)
        assert head.weight is emb.weight
        ref_emb = nn.Embedding(16, H)
        randomize(ref_emb, 5)
        load_full_state_dict(emb, ref_emb.state_dict())
        target = target % classes
        ref_loss = F.cross_entropy(
            F.linear(ref_emb(ids), ref_emb.weight[:classes]).view(-1, classes), target.view(-1)
        )
        loss_fn = CrossEntropyLoss(vocab_parallel=vocab_parallel, context=ctx)
        local_ids, local_target = split_batch(ids, ctx), split_batch(target, ctx)
        loss = loss_fn(head(emb(local_ids)), local_target)
        torch.testing.assert_close(loss, ref_loss, **TOL)
        ref_loss.backward()
        loss.backward()
        info = get_shard_info(emb.weight)
        assert info is not None and ref_emb.weight.grad is not None and emb.weight.grad is not None
        torch.testing.assert_close(emb.weight.grad, ref_emb.weight.grad[info.slices], **TOL)
    vocab = Embedding(16, H, vocab_parallel=True, context=ctx)  # rows split: no first rows
    with pytest.raises(ValueError, match=r"has 16 rows but num_classes is 8.*splits the rows"):
        Classifier(H, 8, vocab.weight, vocab_parallel=True, context=ctx)


class Model(nn.Module):
    def __init__(self, context: ParallelContext | None = None) -> None:
        super().__init__()
        self.patch = PatchEmbedding(4, 2, 3, 8, context=context)
        self.emb = Embedding(16, 8, context=context)
        self.vemb = Embedding(16, 8, vocab_parallel=True, context=context)
        self.block = Block(8, 2, context=context)
        self.norm = LayerNorm(8, context=context)
        self.head = Classifier(8, 16, weight=self.emb.weight, context=context)
        self.vhead = Classifier(
            8, 16, weight=self.vemb.weight, vocab_parallel=True, context=context
        )
        self.fc = Linear(8, 12, context=context)


def _state_dict(ctx: ParallelContext) -> int:
    m = mesh(ctx)
    ref = Model()
    randomize(ref, 0)
    full = ref.state_dict()
    par = Model(ctx)
    load_full_state_dict(par, full)
    total_local = total_full = 0
    for name, p in par.named_parameters():
        info = get_shard_info(p)
        assert info is not None, f"{name} carries no ShardInfo"
        assert set(m.depth_modes) <= set(info.replicated_modes), name
        assert tuple(p.shape) == info.local_shape and info.global_shape == full[name].shape
        total_local += p.numel()
        total_full += full[name].numel()
    # no rank holds a full weight: every matrix is split in two dims (or over q*q blocks)
    fc = get_shard_info(par.fc.weight)
    assert fc is not None and fc.split_modes == ((m.row.mode,), (m.col.mode,))
    emb = get_shard_info(par.emb.weight)
    assert emb is not None and emb.split_modes == ((), (m.row.mode, m.col.mode))
    assert emb.local_shape == (16, 8 // (m.q * m.q))
    gathered = gather_full_state_dict(par)
    assert list(gathered) == list(full)
    for name, t in full.items():
        assert torch.equal(gathered[name], t), name
    before = {n: t.detach().clone() for n, t in par.state_dict().items()}
    load_full_state_dict(par, gathered)
    assert all(torch.equal(before[n], t) for n, t in par.state_dict().items())
    return total_local


def _activations(ctx: ParallelContext) -> None:
    m = mesh(ctx)
    x = torch.randn(B, S, H, generator=torch.Generator().manual_seed(9), requires_grad=True)
    local = split_activation(x, ctx)
    assert local.shape == (B // (m.q * m.depth), S, H // m.q)
    torch.testing.assert_close(local, block(x.detach(), ctx, "act"), rtol=0, atol=0)
    full = gather_activation(local, ctx)
    torch.testing.assert_close(full, x.detach(), rtol=0, atol=0)
    (full * 2).sum().backward()  # the whole graph's gradient: 2 everywhere (exact adjoints)
    assert x.grad is not None and torch.equal(x.grad, torch.full_like(x, 2.0))
    ids = torch.arange(B * S).view(B, S)
    torch.testing.assert_close(split_batch(ids, ctx), block(ids, ctx, "batch"), rtol=0, atol=0)
    # every rank holds a different block: dropout masks differ across tensor ranks
    drop = Dropout(0.5, context=ctx)
    assert type(drop) is _cls("Dropout", ctx)
    mask = (drop(torch.ones(64)) != 0).to(torch.float32)
    masks = [torch.empty_like(mask) for _ in range(ctx.tensor_size)]
    torch.distributed.all_gather(masks, mask, group=ctx.get_group(ParallelMode.TENSOR))
    assert len({tuple(t.tolist()) for t in masks}) == ctx.tensor_size


def _errors(ctx: ParallelContext) -> None:
    """Bad sizes raise ValueError on every rank before any collective (no rank hangs)."""
    m = mesh(ctx)
    batch_blocks = m.q * m.depth
    with pytest.raises(
        ValueError, match=rf"dim 0 \(batch\).*size 3 is not divisible by {batch_blocks}"
    ):
        split_activation(torch.zeros(3, 2, 8), ctx)
    with pytest.raises(ValueError, match=r"dim 2 \(hidden\).*size 5 is not divisible by 2"):
        split_activation(torch.zeros(batch_blocks, 2, 5), ctx)
    with pytest.raises(
        ValueError, match=rf"split_batch.*size 1 is not divisible by {batch_blocks}"
    ):
        split_batch(torch.zeros(1, 3, dtype=torch.long), ctx)
    suffix = m.suffix
    with pytest.raises(ValueError, match=rf"Linear{suffix}.weight: dim 1 of \[8, 5\].*size 5"):
        Linear(5, 8, context=ctx)
    with pytest.raises(ValueError, match=rf"Linear{suffix}.weight: dim 0 of \[7, 8\].*size 7"):
        Linear(8, 7, context=ctx)
    with pytest.raises(
        ValueError,
        match=rf"Embedding{suffix} embedding_dim \(q \* q\).*size 6 is not divisible by 4",
    ):
        Embedding(16, 6, context=ctx)
    with pytest.raises(ValueError, match=r"num_embeddings.*size 15 is not divisible by 2"):
        Embedding(15, 8, vocab_parallel=True, context=ctx)
    with pytest.raises(ValueError, match=r"normalized_shape \(hidden\).*size 5"):
        LayerNorm(5, elementwise_affine=False, context=ctx)
    with pytest.raises(ValueError, match=r"gather_output"):
        Linear(8, 8, gather_output=True, context=ctx)
    linear = Linear(8, 8, context=ctx)
    with pytest.raises(
        ValueError,
        match=rf"Linear{suffix}\(8, 8\): expected the input's last dim to be in_features 8 / q 2 "
        rf"= 4 \(the local block of a {m.kind} activation, q=2, depth={m.depth}: split the input "
        r"with split_activation\), got shape \[1, 2, 8\]",
    ):
        linear(torch.zeros(1, 2, 8))  # a full activation where a block was expected
    norm = LayerNorm(8, context=ctx)
    with pytest.raises(ValueError, match=r"\(8\): .* normalized_shape 8 / q 2 = 4"):
        norm(torch.zeros(1, 2, 8))
    head = Classifier(8, 6, context=ctx)
    with pytest.raises(ValueError, match=rf"Classifier{suffix}\(8, 6\): .* in_features 8 / q 2"):
        head(torch.zeros(1, 2, 8))


#: Every check, each run as its own test on a fresh context: one failure hides no other. A
#: check returns what its test asserts about it, or None.
CHECKS: dict[str, Callable[[ParallelContext], Any]] = {
    "coordinates": _mesh_coordinates,
    "summa": _summa,
    "mesh_linear": _mesh_linear,
    "layers": _layers,
    "deferred_sums": _deferred_sums,
    "dispatch_skip_bias_add": _dispatch_skip_bias_add,
    "listing_one": _listing_one,
    "block": _block,
    "loss_and_accuracy": _loss_and_accuracy,
    "language_model_heads": _language_model_heads,
    "state_dict": _state_dict,
    "activations": _activations,
    "errors": _errors,
}


def _run_check(config: str, check: str) -> Any:
    return with_mesh(config, CHECKS[check])


@pytest.mark.parametrize("check", list(CHECKS))
@pytest.mark.parametrize("config", list(CONFIGS))
def test_mesh_layers_match_torch(dist, config: str, check: str) -> None:
    mode, size, _ = CONFIGS[config]
    results = dist.run(_run_check, world_size=size, args=(config, check), timeout=120.0)
    suffix = "2D" if mode == "2d" else "2p5D"
    if check == "layers":
        assert all(r == 10 for r in results)
    elif check == "deferred_sums":
        deep = (CONFIGS[config][2] or 1) > 1  # depth 1 has no DEP to sum over
        left = results[0]
        assert left["LayerNorm"] == 2 and left["LayerNorm(bias=False)"] == 1  # batch group
        assert left["Linear(skip_bias_add)"] == int(deep)
        assert left["Linear"] == 2 * deep and left["PatchEmbedding"] == 4 * deep
    elif check == "block":
        assert results[0] == [
            f"LayerNorm{suffix}",
            f"Linear{suffix}",
            f"Dropout{suffix}",
            f"Linear{suffix}",
            f"Dropout{suffix}",
            f"LayerNorm{suffix}",
            f"Linear{suffix}",
            f"Linear{suffix}",
            f"Dropout{suffix}",
        ]
    elif check == "state_dict":
        # every rank holds the same number of parameter elements: about 1/q^2 of the model
        assert len(set(results)) == 1
