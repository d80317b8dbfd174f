"""Every 1D layer against its torch reference: outputs, parameter and input gradients."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as tdist
import torch.nn.functional as F
from torch import nn
from tp_reference import (
    TOL,
    BiasAdded,
    check_against_reference,
    check_returned_bias,
    chunk,
    randomize,
    with_context,
)

from tessera.context import ParallelContext, defer_gradient_sums, get_shard_info
from tessera.layers import (
    Classifier1D,
    Embedding1D,
    LayerNorm1D,
    Linear,
    Linear1DCol,
    Linear1DRow,
    PatchEmbedding1D,
    SerialClassifier,
    SerialPatchEmbedding,
    VocabParallelClassifier1D,
    VocabParallelEmbedding1D,
    load_full_state_dict,
)

B, S, H = 2, 4, 8


def _inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, S, H, generator=g)
    ids = torch.randint(0, 16, (B, S), generator=g)
    img = torch.randn(B, 3, 6, 6, generator=g)
    return x, ids, img


def _layers_plain(ctx: ParallelContext) -> int:
    x, ids, img = _inputs(1)
    ids[0, 0] = 3  # the padding row
    checks = [
        ("Linear1DCol", nn.Linear(H, 16), Linear1DCol(H, 16, context=ctx), x, None, -1),
        (
            "Linear1DCol(gather_output)",
            nn.Linear(H, 16),
            Linear1DCol(H, 16, gather_output=True, context=ctx),
            x,
            None,
            None,
        ),
        (
            "Linear1DCol(bias=False)",
            nn.Linear(H, 16, bias=False),
            Linear1DCol(H, 16, bias=False, context=ctx),
            x,
            None,
            -1,
        ),
        ("Linear1DRow", nn.Linear(16, H), Linear1DRow(16, H, context=ctx), None, -1, None),
        (
            "Linear1DRow(parallel_input=False)",
            nn.Linear(H, 12),
            Linear1DRow(H, 12, parallel_input=False, context=ctx),
            x,
            None,
            None,
        ),
        ("Embedding1D", nn.Embedding(16, H), Embedding1D(16, H, context=ctx), ids, None, None),
        (
            "Embedding1D(padding_idx)",
            nn.Embedding(16, H, padding_idx=3),
            Embedding1D(16, H, padding_idx=3, context=ctx),
            ids,
            None,
            None,
        ),
        (
            "VocabParallelEmbedding1D(padding_idx)",
            nn.Embedding(16, H, padding_idx=3),
            VocabParallelEmbedding1D(16, H, padding_idx=3, context=ctx),
            ids,
            None,
            None,
        ),
        ("Classifier1D", SerialClassifier(H, 12), Classifier1D(H, 12, context=ctx), x, None, None),
        (
            "VocabParallelClassifier1D",
            SerialClassifier(H, 16),
            VocabParallelClassifier1D(H, 16, context=ctx),
            x,
            None,
            -1,
        ),
        (
            "VocabParallelClassifier1D(gather_output)",
            SerialClassifier(H, 16),
            VocabParallelClassifier1D(H, 16, gather_output=True, context=ctx),
            x,
            None,
            None,
        ),
        ("LayerNorm1D", nn.LayerNorm(H), LayerNorm1D(H, context=ctx), x, None, None),
        (
            "PatchEmbedding1D",
            SerialPatchEmbedding(6, 2, 3, H),
            PatchEmbedding1D(6, 2, 3, H, context=ctx),
            img,
            None,
            None,
        ),
    ]
    for i, (name, ref, par, inp, in_split, out_split) in enumerate(checks):
        if inp is None:  # row-parallel input: [b, s, 16] split along the features
            inp = torch.randn(B, S, 16, generator=torch.Generator().manual_seed(5))
        check_against_reference(
            name, ref, par, inp, ctx, in_split=in_split, out_split=out_split, seed=10 + i
        )
    return len(checks)


def _skip_bias_add(ctx: ParallelContext) -> None:
    x, _, _ = _inputs(2)
    for gather in (False, True):
        ref = nn.Linear(H, 16)
        randomize(ref, 3)
        par = Linear1DCol(H, 16, gather_output=gather, skip_bias_add=True, context=ctx)
        load_full_state_dict(par, ref.state_dict())
        y, bias = par(x)
        split = None if gather else -1
        torch.testing.assert_close(y + bias, chunk(ref(x), split, ctx), **TOL)
    row = Linear1DRow(16, H, skip_bias_add=True, context=ctx)
    ref = nn.Linear(16, H)
    randomize(ref, 4)
    load_full_state_dict(row, ref.state_dict())
    x16 = torch.randn(B, S, 16, generator=torch.Generator().manual_seed(8))
    y, bias = row(chunk(x16, -1, ctx))
    torch.testing.assert_close(y + bias, ref(x16), **TOL)


def _dispatch_skip_bias_add(ctx: ParallelContext) -> int:
    """The dispatching ``Linear(..., skip_bias_add=True)``: the caller's ``y + bias`` has the
    values and every gradient (the bias's included) of ``nn.Linear``, with and without
    sequence parallelism; the returned bias is the block the bias's ShardInfo describes."""
    sp = bool(ctx.config.tensor_args.get("sequence_parallel", False))
    x, _, _ = _inputs(4)
    x16 = torch.randn(B, S, 16, generator=torch.Generator().manual_seed(9))
    seq = 1 if sp else None  # the sequence split of the activations between blocks
    cases: list[tuple[str, int, int, dict[str, object], torch.Tensor, int | None, int | None]] = [
        ("col", H, 16, {"parallel": "col"}, x, seq, -1),
        ("col gather", H, 16, {"parallel": "col", "gather_output": True}, x, seq, None),
        ("row", 16, H, {"parallel": "row"}, x16, -1, seq),
    ]
    for i, (name, n_in, n_out, kwargs, inp, in_split, out_split) in enumerate(cases):
        ref, par = (
            BiasAdded(nn.Linear(n_in, n_out)),
            BiasAdded(Linear(n_in, n_out, skip_bias_add=True, context=ctx, **kwargs)),  # type: ignore[arg-type]
        )
        name = f"Linear({name}, skip_bias_add, sp={sp})"
        check_against_reference(
            name, ref, par, inp, ctx, in_split=in_split, out_split=out_split, seed=50 + i
        )
        # col: the local block [out/p] (whole if gathered); row: the replicated bias [out]
        whole = kwargs != {"parallel": "col"}
        bias = check_returned_bias(par.inner, ref.inner, chunk(inp, in_split, ctx), whole=whole)  # type: ignore[arg-type]
        assert bias.shape == ((n_out,) if whole else (n_out // ctx.tensor_size,)), name
    return len(cases)


def _layers_sequence_parallel(ctx: ParallelContext) -> int:
    x, ids, img = _inputs(3)
    tp = ctx.tensor_size
    checks = [
        (
            "Linear1DCol[sp]",
            nn.Linear(H, 16),
            Linear1DCol(H, 16, sequence_parallel=True, context=ctx),
            x,
            1,
            -1,
        ),
        (
            "Linear1DRow[sp]",
            nn.Linear(16, H),
            Linear1DRow(16, H, sequence_parallel=True, context=ctx),
            None,
            "row",
            1,
        ),
        (
            "LayerNorm1D[sp]",
            nn.LayerNorm(H),
            LayerNorm1D(H, sequence_parallel=True, context=ctx),
            x,
            1,
            1,
        ),
        (
            "Embedding1D[sp]",
            nn.Embedding(16, H),
            Embedding1D(16, H, sequence_parallel=True, context=ctx),
            ids,
            None,
            1,
        ),
        (
            "VocabParallelEmbedding1D[sp]",
            nn.Embedding(16, H),
            VocabParallelEmbedding1D(16, H, sequence_parallel=True, context=ctx),
            ids,
            None,
            1,
        ),
        (
            "Classifier1D[sp]",
            SerialClassifier(H, 12),
            Classifier1D(H, 12, sequence_parallel=True, context=ctx),
            x,
            1,
            None,
        ),
        (
            "VocabParallelClassifier1D[sp]",
            SerialClassifier(H, 16),
            VocabParallelClassifier1D(H, 16, sequence_parallel=True, context=ctx),
            x,
            1,
            -1,
        ),
    ]
    if tp == 2:  # (img/patch)^2 + 1 = 10 tokens split over 2 ranks
        checks.append(
            (
                "PatchEmbedding1D[sp]",
                SerialPatchEmbedding(6, 2, 3, H),
                PatchEmbedding1D(6, 2, 3, H, sequence_parallel=True, context=ctx),
                img,
                None,
                1,
            )
        )
    for i, (name, ref, par, inp, in_split, out_split) in enumerate(checks):
        if in_split == "row":
            # [b, s, 16] split along the features (the column layer's output)
            inp, in_split = torch.randn(B, S, 16, generator=torch.Generator().manual_seed(6)), -1
        check_against_reference(
            name, ref, par, inp, ctx, in_split=in_split, out_split=out_split, seed=30 + i
        )
    return len(checks)


#: What each layer of ``_deferred_sums`` leaves to the caller.
DEFERRED = {"LayerNorm1D[sp]": 2, "Linear1DRow[sp]": 1, "Linear1DCol[sp]": 0, "LayerNorm1D": 0}


def _deferred_sums(ctx: ParallelContext) -> dict[str, int]:
    """Under sequence parallelism a LayerNorm's parameters and a row layer's bias leave their
    sum over the 1D group (each rank saw its own tokens) to the caller of
    ``defer_gradient_sums``, as Megatron-LM sums them at the step; summed over the returned
    group, every gradient equals the reference's. Without sequence parallelism, and for
    parameters split over the group, nothing is deferred. Returns how many parameters each
    layer left."""
    x, _, _ = _inputs(3)
    features = torch.randn(B, S, 16, generator=torch.Generator().manual_seed(6))
    cases = [
        ("LayerNorm1D[sp]", nn.LayerNorm(H), LayerNorm1D(H, sequence_parallel=True, context=ctx),
         x, 1, 1),
        ("Linear1DRow[sp]", nn.Linear(16, H), Linear1DRow(16, H, sequence_parallel=True,
         context=ctx), features, -1, 1),
        ("Linear1DCol[sp]", nn.Linear(H, 16), Linear1DCol(H, 16, sequence_parallel=True,
         context=ctx), x, 1, -1),
        ("LayerNorm1D", nn.LayerNorm(H), LayerNorm1D(H, context=ctx), x, None, None),
    ]  # fmt: skip
    left: dict[str, int] = {}
    for i, (name, ref, par, inp, in_split, out_split) in enumerate(cases):
        sums = defer_gradient_sums([par])
        left[name] = sum(len(params) for params in sums.values())

        def sum_parts(sums: dict[str, list[nn.Parameter]] = sums) -> None:
            for mode, params in sums.items():
                for p in params:
                    assert p.grad is not None
                    tdist.all_reduce(p.grad, group=ctx.get_group(mode))

        check_against_reference(
            name,
            ref,
            par,
            inp,
            ctx,
            in_split=in_split,
            out_split=out_split,
            seed=50 + i,
            after_backward=sum_parts,
        )
    return left


def _streamed_row(ctx: ParallelContext) -> int:
    """Linear1DRow(stream_chunk_num=3) at inference equals the whole layer (and nn.Linear)."""
    x16 = torch.randn(B, S, 16, generator=torch.Generator().manual_seed(9))
    streamed = 0
    for parallel_input, skip in ((True, False), (False, False), (True, True)):
        ref = nn.Linear(16, 12)
        randomize(ref, 5)
        par = Linear1DRow(
            16,
            12,
            parallel_input=parallel_input,
            skip_bias_add=skip,
            stream_chunk_num=3,
            context=ctx,
        )
        load_full_state_dict(par, ref.state_dict())
        assert [tuple(w.shape) for w in par.chunk_weight()] == [(4, 16 // ctx.tensor_size)] * 3
        whole = par._streamed

        def counted(x: torch.Tensor, whole=whole) -> torch.Tensor:
            nonlocal streamed
            streamed += 1
            return whole(x)

        par._streamed = counted  # type: ignore[method-assign]
        inp = chunk(x16, -1, ctx) if parallel_input else x16
        with torch.no_grad():
            out = par(inp)
        y = out[0] + out[1] if skip else out
        torch.testing.assert_close(y, ref(x16).detach(), **TOL)
        if not skip:  # recording gradients, the layer computes whole: nn.Linear's gradients
            name = f"Linear1DRow(stream_chunk_num=3, parallel_input={parallel_input}) training"
            split = -1 if parallel_input else None
            check_against_reference(name, ref, par, x16, ctx, in_split=split, seed=20)
    with pytest.raises(ValueError, match=r"stream_chunk_num 5 must be >= 1 and divide"):
        Linear1DRow(16, 12, stream_chunk_num=5, context=ctx)
    return streamed


def _tied_head_with_fewer_classes(ctx: ParallelContext) -> None:
    """A head tied to a 16-row embedding classifies into 8: it uses the first 8 rows."""
    ids = torch.randint(0, 16, (B, S), generator=torch.Generator().manual_seed(4))
    target = torch.randint(0, 8, (B, S), generator=torch.Generator().manual_seed(5))
    ref_emb, ref_bias = nn.Embedding(16, H), torch.randn(8, generator=torch.Generator())
    randomize(ref_emb, 6)
    ref_logits = F.linear(ref_emb(ids), ref_emb.weight[:8], ref_bias)
    ref_loss = F.cross_entropy(ref_logits.reshape(-1, 8), target.reshape(-1))
    ref_loss.backward()
    assert ref_emb.weight.grad is not None
    serial_emb = nn.Embedding(16, H)
    serial_emb.load_state_dict(ref_emb.state_dict())
    for emb, head in (
        (serial_emb, SerialClassifier(H, 8, weight=serial_emb.weight)),
        (emb1d := Embedding1D(16, H, context=ctx), Classifier1D(H, 8, emb1d.weight, context=ctx)),
    ):
        assert head.weight is emb.weight
        load_full_state_dict(emb, ref_emb.state_dict())
        with torch.no_grad():
            assert head.bias is not None
            head.bias.copy_(ref_bias)
        logits = head(emb(ids))
        torch.testing.assert_close(logits, ref_logits.detach(), **TOL)
        F.cross_entropy(logits.reshape(-1, 8), target.reshape(-1)).backward()
        info = get_shard_info(emb.weight)
        want = ref_emb.weight.grad[info.slices] if info is not None else ref_emb.weight.grad
        torch.testing.assert_close(emb.weight.grad, want, **TOL)
    vocab = VocabParallelEmbedding1D(16, H, context=ctx)
    with pytest.raises(ValueError, match=r"has 16 rows but num_classes is 8.*splits the rows"):
        VocabParallelClassifier1D(H, 8, vocab.weight, context=ctx)


#: Every check, each run as its own test: ``(body, sequence_parallel, what it returns per tp)``
#: (``None``: the body asserts everything itself).
CHECKS: dict[str, tuple[Callable[[ParallelContext], Any], bool, dict[int, int] | None]] = {
    "plain": (_layers_plain, False, {2: 13, 4: 13}),
    "streamed_row": (_streamed_row, False, {2: 3, 4: 3}),  # every call took the streamed path
    "tied_head_with_fewer_classes": (_tied_head_with_fewer_classes, False, None),
    "skip_bias_add": (_skip_bias_add, False, None),
    "dispatch_skip_bias_add": (_dispatch_skip_bias_add, False, {2: 3, 4: 3}),
    "dispatch_skip_bias_add_sp": (_dispatch_skip_bias_add, True, {2: 3, 4: 3}),
    "sequence_parallel": (_layers_sequence_parallel, True, {2: 8, 4: 7}),
    "deferred_sums": (_deferred_sums, False, {tp: DEFERRED for tp in (2, 4)}),
}


def _run_check(tp: int, check: str) -> Any:
    body, sp, _ = CHECKS[check]
    return with_context(tp, body, sp=sp)


@pytest.mark.parametrize("check", list(CHECKS))
@pytest.mark.parametrize("tp", [2, 4])
def test_every_1d_layer_matches_torch(dist, tp: int, check: str) -> None:
    results = dist.run(_run_check, world_size=tp, args=(tp, check), timeout=120.0)
    expected = CHECKS[check][2]
    if expected is not None:
        assert results[0] == expected[tp]
    assert all(r == results[0] for r in results)
