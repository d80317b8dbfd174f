"""Sequence parallelism on 2 and 4 ranks against torch attention on the full sequence.

One ``dist.run`` per size runs every check: the ring products, ``RingSelfAttention`` (ring
and all-to-all, causal or not, several heads), a transformer block from the dispatching
layers, the ``ShardInfo`` marks, losses and metrics, activation maps, dropout streams and
errors. Parameter gradients are compared after summing the ranks' partial gradients over
SEQUENCE, as the engine's sequence-parallel gradient handler does.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from tp_reference import TOL, randomize

from tessera.context import ParallelContext, ParallelMode, create_context, get_shard_info
from tessera.layers import (
    Accuracy,
    CrossEntropyLoss,
    Dropout,
    Embedding,
    LayerNorm,
    Linear,
    ModeNotImplementedError,
    PatchEmbedding,
    RingSelfAttention,
    SequenceAccuracy,
    SequenceDropout,
    gather_activation,
    gather_full_state_dict,
    group_info,
    load_full_state_dict,
    ring_av,
    ring_of,
    ring_qk,
    split_activation,
    split_batch,
)

B, S = 2, 8  # S splits over 2 and 4 ranks


class TorchAttention(nn.Module):
    """Plain multi-head self-attention with RingSelfAttention's parameter names and layout."""

    def __init__(self, hidden: int, heads: int, causal: bool) -> None:
        super().__init__()
        self.heads, self.head_dim, self.causal = heads, hidden // heads, causal
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.head_dim)  # [b, n, s, s]
        if self.causal:
            future = torch.ones(s, s, dtype=torch.bool).triu(1)
            scores = scores.masked_fill(future, float("-inf"))
        out = scores.softmax(-1) @ v  # [b, n, s, d]
        return self.proj(out.transpose(1, 2).reshape(b, s, h))


class SequenceBlock(nn.Module):
    """A pre-norm transformer block; with a 'sequence' context its attention is the ring's."""

    def __init__(
        self,
        hidden: int,
        heads: int,
        *,
        causal: bool = False,
        impl: str = "ring",
        context: ParallelContext | None = None,
    ) -> None:
        super().__init__()
        self.ln1 = LayerNorm(hidden, context=context)
        self.attn: nn.Module = (
            TorchAttention(hidden, heads, causal)
            if context is None
            else RingSelfAttention(hidden, heads, causal=causal, impl=impl, context=context)  # type: ignore[arg-type]
        )
        self.drop = Dropout(0.0, context=context)
        self.ln2 = LayerNorm(hidden, context=context)
        self.fc1 = Linear(hidden, 4 * hidden, parallel="col", context=context)
        self.fc2 = Linear(4 * hidden, hidden, parallel="row", context=context)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


def chunk(x: torch.Tensor, ctx: ParallelContext, dim: int = 1) -> torch.Tensor:
    n = ctx.get_world_size(ParallelMode.SEQUENCE)
    return x.chunk(n, dim)[ctx.get_local_rank(ParallelMode.SEQUENCE)]


def summed(t: torch.Tensor, ctx: ParallelContext) -> torch.Tensor:
    """What the sequence-parallel gradient handler computes: the sum over SEQUENCE."""
    out = t.clone()
    dist.all_reduce(out, group=ctx.get_group(ParallelMode.SEQUENCE))
    return out


def check_sequence(
    name: str, ref: nn.Module, par: nn.Module, x: torch.Tensor, ctx: ParallelContext, seed: int
) -> None:
    """Output, input gradient (local chunks) and summed parameter gradients against torch."""
    randomize(ref, seed)
    load_full_state_dict(par, ref.state_dict())
    x_ref = x.clone().requires_grad_()
    x_par = split_activation(x, ctx).detach().requires_grad_()
    y_ref, y_par = ref(x_ref), par(x_par)
    w = torch.randn(y_ref.shape, generator=torch.Generator().manual_seed(seed + 1))
    (y_ref * w).sum().backward()
    (y_par * chunk(w, ctx)).sum().backward()
    torch.testing.assert_close(y_par, chunk(y_ref.detach(), ctx), **TOL, msg=f"{name} out")
    assert x_ref.grad is not None and x_par.grad is not None
    torch.testing.assert_close(x_par.grad, chunk(x_ref.grad, ctx), **TOL, msg=f"{name} dx")
    ref_params = dict(ref.named_parameters())
    names = []
    for pname, p in par.named_parameters():
        info = get_shard_info(p)
        assert info is not None, f"{name}.{pname} carries no ShardInfo"
        assert info.replicated_modes == ("sequence",) == info.partial_grad_modes, pname
        assert not info.is_sharded and info.global_shape == tuple(p.shape)
        expected = ref_params[pname].grad
        assert p.grad is not None and expected is not None
        torch.testing.assert_close(
            summed(p.grad, ctx), expected, **TOL, msg=f"{name}.{pname} grad (summed)"
        )
        names.append(pname)
    assert names == list(ref_params), name


def _ring_products(ctx: ParallelContext) -> None:
    """ring_qk and ring_av, forward and both input gradients, against torch."""
    ring = ring_of(group_info(ctx, ParallelMode.SEQUENCE))
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(B, 3, S, 4, generator=g) for _ in range(3))
    p = torch.randn(B, 3, S, S, generator=g)
    for name, fn, ref_fn, a, b, out_dim in (
        ("ring_qk", ring_qk, lambda a, b: a @ b.transpose(-1, -2), q, k, S),
        ("ring_av", ring_av, lambda a, b: a @ b, p, v, 4),
    ):
        a_ref, b_ref = a.clone().requires_grad_(), b.clone().requires_grad_()
        out_ref = ref_fn(a_ref, b_ref)
        a_par = chunk(a, ctx, 2).clone().requires_grad_()
        b_par = chunk(b, ctx, 2).clone().requires_grad_()
        out = fn(a_par, b_par, ring)
        assert out.shape[-1] == out_dim
        w = torch.randn(out_ref.shape, generator=g)
        (out_ref * w).sum().backward()
        (out * chunk(w, ctx, 2)).sum().backward()
        torch.testing.assert_close(out, chunk(out_ref.detach(), ctx, 2), **TOL, msg=name)
        assert a_ref.grad is not None and b_ref.grad is not None
        torch.testing.assert_close(a_par.grad, chunk(a_ref.grad, ctx, 2), **TOL, msg=name)
        torch.testing.assert_close(b_par.grad, chunk(b_ref.grad, ctx, 2), **TOL, msg=name)


def _attention(ctx: ParallelContext) -> int:
    n = ctx.get_world_size(ParallelMode.SEQUENCE)
    x16 = torch.randn(B, S, 16, generator=torch.Generator().manual_seed(1))
    x12 = torch.randn(B, S, 12, generator=torch.Generator().manual_seed(2))
    cases: list[tuple[str, int, int, bool, str, torch.Tensor]] = []
    for causal in (False, True):
        cases.append((f"ring h16 n4 causal={causal}", 16, 4, causal, "ring", x16))
        cases.append((f"a2a h16 n4 causal={causal}", 16, 4, causal, "all_to_all", x16))
        # 3 heads: not divisible by the sequence size, only the ring can run it
        cases.append((f"ring h12 n3 causal={causal}", 12, 3, causal, "ring", x12))
    for i, (name, hidden, heads, causal, impl, x) in enumerate(cases):
        ref = TorchAttention(hidden, heads, causal)
        par = RingSelfAttention(hidden, heads, causal=causal, impl=impl, context=ctx)  # type: ignore[arg-type]
        assert sorted(par.state_dict()) == ["proj.bias", "proj.weight", "qkv.bias", "qkv.weight"]
        check_sequence(f"{name} (N={n})", ref, par, x, ctx, seed=10 + i)
    return len(cases)


def _block(ctx: ParallelContext) -> list[str]:
    x = torch.randn(B, S, 16, generator=torch.Generator().manual_seed(4))
    for i, (impl, causal) in enumerate((("ring", True), ("all_to_all", False))):
        ref = SequenceBlock(16, 4, causal=causal)
        par = SequenceBlock(16, 4, causal=causal, impl=impl, context=ctx)
        check_sequence(f"block {impl}", ref, par, x, ctx, seed=30 + i)
    # the whole model's state dict is the torch block's, unchanged by gathering
    full = gather_full_state_dict(par)
    assert all(torch.equal(full[k], t) for k, t in par.state_dict().items())
    assert sorted(full) == sorted(ref.state_dict())
    return [type(c).__name__ for c in par.children()]


def _losses_and_activations(ctx: ParallelContext) -> None:
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(B, S, 6, generator=g)
    target = torch.randint(0, 6, (B, S), generator=g)
    # the loss is torch's on the local tokens: the mean over the rank's own sub-sequence
    loss_fn = CrossEntropyLoss(context=ctx)
    assert type(loss_fn) is nn.CrossEntropyLoss
    local_logits, local_target = split_activation(logits, ctx), split_batch(target, ctx)
    assert local_target.shape == (B, S // ctx.tensor_size)
    local = loss_fn(local_logits.reshape(-1, 6), local_target.reshape(-1))
    torch.testing.assert_close(
        local, F.cross_entropy(chunk(logits, ctx).transpose(1, 2), chunk(target, ctx)), **TOL
    )
    # ... whose average over the sequence ranks is the full loss
    mean = summed(local.detach(), ctx) / ctx.tensor_size
    torch.testing.assert_close(mean, F.cross_entropy(logits.transpose(1, 2), target), **TOL)
    acc = Accuracy(context=ctx)
    assert type(acc) is SequenceAccuracy
    assert int(acc(local_logits, local_target)) == int((logits.argmax(-1) == target).sum())
    # activations: split / gather dim 1 with exact adjoints
    x = torch.randn(B, S, 4, generator=g, requires_grad=True)
    local_x = split_activation(x, ctx)
    torch.testing.assert_close(local_x, chunk(x.detach(), ctx), rtol=0, atol=0)
    full = gather_activation(local_x, ctx)
    torch.testing.assert_close(full, x.detach(), rtol=0, atol=0)
    (full * 3).sum().backward()
    assert x.grad is not None and torch.equal(x.grad, torch.full_like(x, 3.0))
    # dropout: every rank holds other tokens, so masks differ
    drop = Dropout(0.5, context=ctx)
    assert type(drop) is SequenceDropout
    mask = (drop(torch.ones(64)) != 0).to(torch.float32)
    masks = [torch.empty_like(mask) for _ in range(ctx.tensor_size)]
    dist.all_gather(masks, mask, group=ctx.get_group(ParallelMode.SEQUENCE))
    assert len({tuple(m.tolist()) for m in masks}) == ctx.tensor_size
    # the token-wise layers are plain torch modules, marked partial over SEQUENCE
    emb = Embedding(16, 4, context=ctx)
    assert type(emb) is nn.Embedding
    info = get_shard_info(emb.weight)
    assert info is not None and info.partial_grad_modes == ("sequence",)


def _errors(ctx: ParallelContext) -> None:
    n = ctx.tensor_size
    with pytest.raises(ValueError, match=rf"dim 1 \(sequence\).*size 3 is not divisible by {n}"):
        split_activation(torch.zeros(2, 3, 4), ctx)
    with pytest.raises(ValueError, match=r"splits dim 1 of \[batch, seq"):
        split_batch(torch.zeros(4, dtype=torch.long), ctx)
    with pytest.raises(ValueError, match=rf"num_heads 3 is not divisible by the sequence size {n}"):
        RingSelfAttention(12, 3, impl="all_to_all", context=ctx)
    with pytest.raises(ValueError, match=r"hidden_size 10 is not divisible by num_heads 4"):
        RingSelfAttention(10, 4, context=ctx)
    with pytest.raises(ValueError, match=r"impl must be one of"):
        RingSelfAttention(8, 2, impl="flash", context=ctx)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"vocab_parallel=True.*whole vocabulary"):
        Embedding(16, 4, vocab_parallel=True, context=ctx)
    with pytest.raises(ModeNotImplementedError, match=r"PatchEmbedding for tensor mode 'sequence'"):
        PatchEmbedding(4, 2, 3, 8, context=ctx)
    with pytest.raises(ValueError, match=r"expected the local chunk \[b, s/N, 8\]"):
        RingSelfAttention(8, 2, context=ctx)(torch.zeros(2, 4, 6))


def _all(size: int) -> dict[str, Any]:
    ctx = create_context(dict(parallel=dict(tensor=dict(size=size, mode="sequence"))), timeout=60.0)
    try:
        _ring_products(ctx)
        cases = _attention(ctx)
        names = _block(ctx)
        _losses_and_activations(ctx)
        _errors(ctx)
        return {"cases": cases, "block": names}
    finally:
        ctx.destroy()


@pytest.mark.parametrize("size", [2, 4])
def test_sequence_parallel_matches_torch(dist, size: int) -> None:
    results = dist.run(_all, world_size=size, args=(size,), timeout=300.0)
    assert all(r["cases"] == 6 for r in results)
    assert results[0]["block"] == [
        "LayerNorm",
        "RingSelfAttention",
        "SequenceDropout",
        "LayerNorm",
        "Linear",
        "Linear",
    ]


def test_ring_attention_needs_a_sequence_context(dist) -> None:
    results = dist.run(_wrong_mode, world_size=2, timeout=60.0)
    assert results == ["ok", "ok"]


def _wrong_mode() -> str:
    ctx = create_context(dict(parallel=dict(tensor=dict(size=2, mode="1d"))), timeout=60.0)
    try:
        with pytest.raises(ValueError, match=r"needs a context with tensor mode 'sequence'"):
            RingSelfAttention(8, 2, context=ctx)
        return "ok"
    finally:
        ctx.destroy()
