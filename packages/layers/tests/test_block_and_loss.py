"""A transformer block from the dispatching layers, vocab-parallel loss and accuracy."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from blocks import Block
from tp_reference import TOL, check_against_reference, chunk, with_context

from tessera.context import ParallelContext, ParallelMode
from tessera.layers import (
    Accuracy,
    Classifier,
    CrossEntropyLoss,
    Embedding,
    Linear1DCol,
    Linear1DRow,
    VocabParallelAccuracy1D,
    VocabParallelClassifier1D,
    gather_activation,
    split_activation,
    vocab_parallel_cross_entropy,
)


def _block(ctx: ParallelContext) -> list[str]:
    sp = ctx.config.tensor_args.get("sequence_parallel", False)
    ref, par = Block(16, 4), Block(16, 4, context=ctx)
    assert isinstance(par.qkv, Linear1DCol) and isinstance(par.proj, Linear1DRow)
    assert [n for n, _ in ref.named_parameters()] == [n for n, _ in par.named_parameters()]
    x = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(2))
    split = 1 if sp else None
    check_against_reference("Block", ref, par, x, ctx, in_split=split, out_split=split, seed=3)
    # split_activation / gather_activation are inverse and match the layers' layout
    local = split_activation(x, ctx)
    assert local.shape == chunk(x, split, ctx).shape
    torch.testing.assert_close(gather_activation(local, ctx), x, rtol=0, atol=0)
    return [type(m).__name__ for m in par.children()]


def _loss_and_accuracy(ctx: ParallelContext) -> float:
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(3, 5, 16, generator=g)
    target = torch.randint(0, 16, (3, 5), generator=g)
    target[0, :2] = -100
    target[1, 0] = 7
    logits[1, 0, 3] = logits[1, 0, 7] = logits[1, 0].max() + 1  # a tie: argmax takes index 3
    group = ctx.get_group(ParallelMode.PARALLEL_1D)
    for reduction in ("mean", "sum", "none"):
        ref_in = logits.clone().requires_grad_()
        par_in = chunk(logits, -1, ctx).clone().requires_grad_()
        ref = F.cross_entropy(ref_in.view(-1, 16), target.view(-1), reduction=reduction)
        par = vocab_parallel_cross_entropy(par_in, target, group, reduction=reduction)
        torch.testing.assert_close(par.reshape(ref.shape), ref, **TOL)
        w = torch.rand(ref.shape, generator=g)
        (ref * w).sum().backward()
        (par.reshape(ref.shape) * w).sum().backward()
        assert ref_in.grad is not None and par_in.grad is not None
        torch.testing.assert_close(par_in.grad, chunk(ref_in.grad, -1, ctx), **TOL)
    # Whole logits (a plain model's, alike on every rank) are never read as a slice: an error
    # without the vocabulary's size, the plain cross-entropy with it, value and gradient.
    with pytest.raises(ValueError, match=r"logits \[.., 16\] are the same on all"):
        vocab_parallel_cross_entropy(logits, target, group)
    whole = logits.clone().requires_grad_()
    got = vocab_parallel_cross_entropy(whole, target, group, vocab_size=16)
    want_in = logits.clone().requires_grad_()
    want = F.cross_entropy(want_in.view(-1, 16), target.view(-1))
    torch.testing.assert_close(got, want, **TOL)
    got.backward()
    want.backward()
    torch.testing.assert_close(whole.grad, want_in.grad, **TOL)
    with pytest.raises(ValueError, match=r"neither the whole vocabulary of 12 nor a slice"):
        vocab_parallel_cross_entropy(chunk(logits, -1, ctx), target, group, vocab_size=12)
    # bf16 logits: max, exponentials and their sum in fp32, as torch's under autocast
    low = (logits * 8).bfloat16()
    par_low = chunk(low, -1, ctx).clone().requires_grad_()
    loss_low = vocab_parallel_cross_entropy(par_low, target, group)
    ref_low = F.cross_entropy(low.float().view(-1, 16), target.view(-1))
    torch.testing.assert_close(loss_low, ref_low, rtol=1e-6, atol=1e-6)
    loss_low.backward()
    assert par_low.grad is not None and par_low.grad.dtype == torch.bfloat16
    # the dispatching loss/metric pick the vocab-parallel versions
    loss = CrossEntropyLoss(vocab_parallel=True, context=ctx)
    torch.testing.assert_close(
        loss(chunk(logits, -1, ctx), target), F.cross_entropy(logits.view(-1, 16), target.view(-1))
    )
    acc = Accuracy(vocab_parallel=True, context=ctx)
    assert isinstance(acc, VocabParallelAccuracy1D)
    expected = (logits.argmax(-1) == target).sum()
    assert int(acc(chunk(logits, -1, ctx), target)) == int(expected)
    assert int(Accuracy(context=ctx)(logits, target)) == int(expected)
    assert isinstance(CrossEntropyLoss(context=ctx), torch.nn.CrossEntropyLoss)
    return float(expected)


def _language_model_head(ctx: ParallelContext) -> None:
    """Tied vocab-parallel embedding and classifier, vocab-parallel loss, against torch."""
    torch.manual_seed(0)
    emb = Embedding(16, 8, vocab_parallel=True, context=ctx)
    head = Classifier(8, 16, weight=emb.weight, bias=False, vocab_parallel=True, context=ctx)
    assert isinstance(head, VocabParallelClassifier1D) and head.weight is emb.weight
    ref_emb = torch.nn.Embedding(16, 8)
    with torch.no_grad():
        ref_emb.weight.copy_(torch.randn(16, 8, generator=torch.Generator().manual_seed(1)))
        emb.weight.copy_(chunk(ref_emb.weight, 0, ctx))
    ids = torch.randint(0, 16, (2, 4), generator=torch.Generator().manual_seed(2))
    target = torch.randint(0, 16, (2, 4), generator=torch.Generator().manual_seed(3))
    ref_loss = F.cross_entropy(F.linear(ref_emb(ids), ref_emb.weight).view(-1, 16), target.view(-1))
    loss = CrossEntropyLoss(vocab_parallel=True, context=ctx)(head(emb(ids)), target)
    torch.testing.assert_close(loss, ref_loss, **TOL)
    ref_loss.backward()
    loss.backward()
    assert ref_emb.weight.grad is not None and emb.weight.grad is not None
    torch.testing.assert_close(emb.weight.grad, chunk(ref_emb.weight.grad, 0, ctx), **TOL)


def _all(tp: int) -> list[str]:
    names = with_context(tp, _block)
    with_context(tp, _block, sp=True)
    with_context(tp, _loss_and_accuracy)
    with_context(tp, _language_model_head)
    return names


@pytest.mark.parametrize("tp", [2, 4])
def test_block_loss_and_accuracy_match_torch(dist, tp: int) -> None:
    names = dist.run(_all, world_size=tp, args=(tp,), timeout=120.0)
    assert names[0] == [
        "LayerNorm1D",
        "Linear1DCol",
        "Dropout1D",
        "Linear1DRow",
        "Dropout1D",
        "LayerNorm1D",
        "Linear1DCol",
        "Linear1DRow",
        "Dropout1D",
    ]


def test_reference_block_is_plain_torch() -> None:
    block = Block(16, 4)
    assert isinstance(block.qkv, torch.nn.Linear) and isinstance(block.ln1, torch.nn.LayerNorm)
    assert isinstance(block.attn_drop, torch.nn.Dropout)
