"""Sequence parallelism on 2 and 4 ranks against torch attention on the full sequence.

Each check is its own test (one ``dist.run`` on a fresh context, the workers reused): the
ring products, ``RingSelfAttention`` (ring
and all-to-all, causal or not, several heads), a transformer block from the dispatching
layers, the ``ShardInfo`` marks, losses and metrics, activation maps, dropout streams and
errors. Parameter gradients are compared after summing the ranks' partial gradients over
SEQUENCE, as the engine's sequence-parallel gradient handler does.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from tp_reference import TOL, BiasAdded, check_returned_bias, randomize

from tessera.context import ParallelContext, ParallelMode, create_context, get_shard_info
from tessera.layers import (
    Accuracy,
    CrossEntropyLoss,
    Dropout,
    Embedding,
    LayerNorm,
    Linear,
    PatchEmbedding,
    RingSelfAttention,
    SequenceAccuracy,
    SequenceDropout,
    SequencePatchEmbedding,
    SerialLinear,
    SerialPatchEmbedding,
    gather_activation,
    gather_full_state_dict,
    group_info,
    load_full_state_dict,
    normal,
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

    def forward(self, x: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.head_dim)  # [b, n, s, s]
        if keep is not None:  # [b, s]: which keys exist
            # added, the lowest finite value, as transformers' masks: a query that sees only
            # padding (left padding under a causal mask) attends to it, not to NaN
            low = torch.finfo(scores.dtype).min
            scores = scores + torch.zeros_like(scores).masked_fill(~keep[:, None, None, :], low)
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
    name: str,
    ref: nn.Module,
    par: nn.Module,
    x: torch.Tensor,
    ctx: ParallelContext,
    seed: int,
    *,
    split_input: bool = True,
    mask: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Output, input gradient and summed parameter gradients against torch.

    The input is this rank's chunk of ``x`` (``split_input``) or the whole of it (images:
    replicated, so its gradient must be the whole one); the output is this rank's chunk.
    ``mask``: the reference's ``[b, s]`` keep-mask and the parallel module's form of it
    (split with the sequence on dim -1).
    """
    randomize(ref, seed)
    load_full_state_dict(par, ref.state_dict())
    x_ref = x.clone().requires_grad_()
    x_par = (split_activation(x, ctx) if split_input else x.clone()).detach().requires_grad_()
    if mask is None:
        y_ref, y_par = ref(x_ref), par(x_par)
    else:
        y_ref, y_par = ref(x_ref, mask[0]), par(x_par, chunk(mask[1], ctx, -1))
    w = torch.randn(y_ref.shape, generator=torch.Generator().manual_seed(seed + 1))
    if mask is not None:
        # A query that sees no real key (the first tokens of a left-padded sample, causal) is
        # ignored by any loss; its gradient is left out: SDPA's fused CPU kernel recomputes its
        # softmax from a log-sum-exp that rounds away everything next to the lowest finite
        # value, which one process's SDPA shares and the plain reference does not.
        seen = mask[0].cumsum(-1) if getattr(ref, "causal", False) else mask[0].sum(-1, True)
        w = w * (seen > 0).unsqueeze(-1).to(w)  # [b, s, 1]
    (y_ref * w).sum().backward()
    (y_par * chunk(w, ctx)).sum().backward()
    torch.testing.assert_close(y_par, chunk(y_ref.detach(), ctx), **TOL, msg=f"{name} out")
    assert x_ref.grad is not None and x_par.grad is not None
    dx_ref = chunk(x_ref.grad, ctx) if split_input else x_ref.grad
    torch.testing.assert_close(x_par.grad, dx_ref, **TOL, msg=f"{name} dx")
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
    # Padding masks, different per sample and reaching into several ranks' chunks: sample 0 is
    # padded at the end, sample 1 at the start (its first causal rows see only padding, and
    # must still not see the future) and with a hole.
    keep = torch.ones(B, S, dtype=torch.bool)
    keep[0, -3:], keep[1, :2], keep[1, 4:6] = False, False, False
    low = torch.finfo(torch.float32).min
    additive = torch.zeros(B, 1, 1, S).masked_fill(~keep[:, None, None, :], low)
    masks = {"bool": keep, "int": keep.long(), "additive": additive}
    masked = [
        ("ring", False, "int"),
        ("ring", True, "bool"),
        ("all_to_all", False, "bool"),
        ("all_to_all", True, "int"),
        ("all_to_all", True, "additive"),
    ]
    for i, (impl, causal, form) in enumerate(masked):
        # float64: masked rows sum fewer terms, in another order than the reference's
        ref = TorchAttention(16, 4, causal).double()
        par = RingSelfAttention(16, 4, causal=causal, impl=impl, dtype=torch.float64, context=ctx)  # type: ignore[arg-type]
        name = f"{impl} causal={causal} {form} padding mask (N={n})"
        x = x16.double()
        check_sequence(name, ref, par, x, ctx, seed=30 + i, mask=(keep, masks[form]))
    with pytest.raises(ValueError, match=r"does not broadcast to this rank's \[b, 1, 1, c\]"):
        RingSelfAttention(16, 4, context=ctx)(chunk(x16, ctx), keep)  # the whole mask
    return len(cases) + len(masked)


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


class PatchTokens(SerialPatchEmbedding):
    """The reference of ``class_token=False``: torch's patch embedding without the class token."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)[:, 1:]  # [b, N_p, E]


def _patch_embedding(ctx: ParallelContext) -> int:
    """Each rank embeds its chunk of the tokens: outputs, the whole images' gradient and the
    parameter gradients summed over SEQUENCE (the class token's, on ranks without it, zero)."""
    n = ctx.tensor_size
    g = torch.Generator().manual_seed(7)
    cases: list[tuple[str, nn.Module, nn.Module, torch.Tensor]] = [
        # 36 patches: 18 per rank (whole patch rows) on 2, 9 (rows cut in half) on 4
        (
            "patches 12/2",
            PatchTokens(12, 2, 3, 8),
            SequencePatchEmbedding(12, 2, 3, 8, class_token=False, context=ctx),
            torch.randn(B, 3, 12, 12, generator=g),
        ),
        # 4 patches of 3x3: 2 per rank on 2, 1 on 4
        (
            "patches 6/3",
            PatchTokens(6, 3, 2, 4),
            SequencePatchEmbedding(6, 3, 2, 4, class_token=False, context=ctx),
            torch.randn(B, 2, 6, 6, generator=g),
        ),
    ]
    if n == 2:  # 9 patches + the class token = 10 tokens: [cls, p0..p3] and [p4..p8]
        par = PatchEmbedding(6, 2, 3, 8, context=ctx)
        assert type(par) is SequencePatchEmbedding
        img = torch.randn(B, 3, 6, 6, generator=g)
        cases.append(("class token 6/2", SerialPatchEmbedding(6, 2, 3, 8), par, img))
    for i, (name, ref, par, img) in enumerate(cases):
        check_sequence(f"{name} (N={n})", ref, par, img, ctx, seed=60 + i, split_input=False)
        # every rank has every gradient, so the handler's all-reduce matches across ranks
        cls_grad = par.get_parameter("cls_token").grad
        assert cls_grad is not None
        has_cls = (
            not isinstance(ref, PatchTokens) and ctx.get_local_rank(ParallelMode.SEQUENCE) == 0
        )
        assert bool(cls_grad.abs().sum() > 0) == has_cls, name
    # initialized as torch's model from the same RNG state
    torch.manual_seed(3)
    ref_init = SerialPatchEmbedding(12, 2, 3, 8, position_embed_initializer=normal(std=0.02))
    torch.manual_seed(3)
    par_init = SequencePatchEmbedding(
        12, 2, 3, 8, position_embed_initializer=normal(std=0.02), class_token=False, context=ctx
    )
    for key, value in ref_init.state_dict().items():
        assert torch.equal(par_init.state_dict()[key], value), key
    return len(cases)


def _skip_bias_add(ctx: ParallelContext) -> None:
    """``Linear(..., skip_bias_add=True)``: the caller's ``y + bias`` is ``nn.Linear``'s, with
    every gradient (summed over SEQUENCE); the bias is the parameter itself, whole."""
    x = torch.randn(B, S, 16, generator=torch.Generator().manual_seed(8))
    linear = Linear(16, 12, skip_bias_add=True, context=ctx)
    assert type(linear) is SerialLinear
    ref, par = BiasAdded(nn.Linear(16, 12)), BiasAdded(linear)
    check_sequence("Linear(skip_bias_add)", ref, par, x, ctx, seed=70)
    bias = check_returned_bias(linear, ref.inner, split_activation(x, ctx))  # type: ignore[arg-type]
    assert bias is linear.bias
    no_bias = Linear(16, 12, bias=False, skip_bias_add=True, context=ctx)
    assert no_bias(x)[1] is None


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
    # 4 patches + the class token: 5 tokens split over neither 2 nor 4 ranks
    with pytest.raises(
        ValueError,
        match=rf"SequencePatchEmbedding: the sequence of 5 tokens \(4 patches \+ 1 class token, "
        rf"a 4x4 image in 2x2 patches\) does not split over the {n} ranks of SEQUENCE "
        rf"\(5 % {n} = {5 % n}\); build it with class_token=False",
    ):
        PatchEmbedding(4, 2, 3, 8, context=ctx)
    with pytest.raises(ValueError, match=r"the sequence of 9 tokens \(patches"):
        SequencePatchEmbedding(6, 2, 3, 8, class_token=False, context=ctx)
    patches = SequencePatchEmbedding(4, 2, 3, 8, class_token=False, context=ctx)
    with pytest.raises(
        ValueError, match=r"expected the whole images \[b, 3, 4, 4\].*\[2, 3, 4, 2\]"
    ):
        patches(torch.zeros(2, 3, 4, 2))  # e.g. an image split like an activation
    with pytest.raises(ValueError, match=r"expected the local chunk \[b, s/N, 8\]"):
        RingSelfAttention(8, 2, context=ctx)(torch.zeros(2, 4, 6))


#: Every check, each run as its own test on a fresh context: one failure hides no other. A
#: check returns what its test asserts about it, or None.
CHECKS: dict[str, Callable[[ParallelContext], Any]] = {
    "ring_products": _ring_products,
    "attention": _attention,
    "block": _block,
    "patch_embedding": _patch_embedding,
    "skip_bias_add": _skip_bias_add,
    "losses_and_activations": _losses_and_activations,
    "errors": _errors,
}


def _run_check(size: int, check: str) -> Any:
    ctx = create_context(dict(parallel=dict(tensor=dict(size=size, mode="sequence"))), timeout=60.0)
    try:
        return CHECKS[check](ctx)
    finally:
        ctx.destroy()


@pytest.mark.parametrize("check", list(CHECKS))
@pytest.mark.parametrize("size", [2, 4])
def test_sequence_parallel_matches_torch(dist, size: int, check: str) -> None:
    results = dist.run(_run_check, world_size=size, args=(size, check), timeout=120.0)
    if check == "attention":
        assert all(r == 11 for r in results)
    elif check == "patch_embedding":
        assert all(r == (3 if size == 2 else 2) for r in results)
    elif check == "block":
        assert results[0] == [
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
        with pytest.raises(ValueError, match=r"SequencePatchEmbedding needs a context with tensor"):
            SequencePatchEmbedding(4, 2, 3, 8, class_token=False, context=ctx)
        return "ok"
    finally:
        ctx.destroy()
