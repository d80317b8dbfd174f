"""3D tensor parallelism on 8 ranks (q = 2) against the torch reference.

Each check is its own test (one ``dist.run`` on a fresh context, the 8 workers reused): each
layer's output,
parameter and input gradients, a Megatron MLP and a transformer block from the dispatching
layers (alternating layouts), two models built in one process, the losses and metrics, tied
language-model heads, the state-dict round trip, the activation maps, dropout streams and the
errors.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from blocks import Block
from mesh_reference import sum_deferred
from torch import nn
from tp_reference import TOL, BiasAdded, check_returned_bias, first, randomize

from tessera.context import (
    ParallelContext,
    ParallelMode,
    create_context,
    defer_gradient_sums,
    get_shard_info,
)
from tessera.layers import (
    Accuracy,
    Accuracy3D,
    Classifier,
    Classifier3D,
    CrossEntropyLoss,
    CrossEntropyLoss3D,
    Dropout,
    Dropout3D,
    Embedding,
    Embedding3D,
    LayerNorm,
    LayerNorm3D,
    Linear,
    Linear3D,
    PatchEmbedding,
    PatchEmbedding3D,
    SerialClassifier,
    SerialPatchEmbedding,
    VocabParallelAccuracy3D,
    VocabParallelClassifier3D,
    VocabParallelCrossEntropyLoss3D,
    VocabParallelEmbedding3D,
    choose_cube_algorithm,
    cube_linear,
    cube_of,
    gather_activation,
    gather_full_state_dict,
    keep_gathered_operands,
    load_full_state_dict,
    split_activation,
    split_batch,
)

B, S, H = 4, 3, 8  # the batch splits into q^2 = 4 blocks

#: How a full tensor is split: "y"/"z" = activation layouts, "batch" = the batch of layout
#: "y" only, None = whole.
Layout = str | None


def block(x: torch.Tensor, ctx: ParallelContext, layout: Layout) -> torch.Tensor:
    """This rank's block of a full tensor: written from the coordinates, not the library."""
    if layout is None:
        return x
    q = 2
    t = ctx.get_local_rank(ParallelMode.TENSOR)
    xx, yy, zz = t % q, (t // q) % q, t // (q * q)
    if layout in ("y", "batch"):
        rows, hidden = zz * q + xx, yy
    else:
        rows, hidden = yy * q + xx, zz
    x = x.chunk(q * q, 0)[rows]
    return x if layout == "batch" else x.chunk(q, -1)[hidden]


def check(
    name: str,
    ref: nn.Module,
    par: nn.Module,
    x_full: torch.Tensor,
    ctx: ParallelContext,
    *,
    in_layout: Layout = "y",
    out_layout: Layout = "y",
    seed: int = 0,
    after_backward: Callable[[], None] | None = None,
) -> None:
    """Same full weights and input: output, every parameter gradient, the input gradient.

    ``after_backward`` runs between the backward and the comparison (a deferred gradient sum).
    """
    randomize(ref, seed)
    load_full_state_dict(par, ref.state_dict())
    floating = x_full.is_floating_point()
    x_ref = x_full.clone().requires_grad_(floating)
    x_par = block(x_full, ctx, in_layout).clone().requires_grad_(floating)
    y_ref, y_par = first(ref(x_ref)), first(par(x_par))
    w = torch.randn(y_ref.shape, generator=torch.Generator().manual_seed(seed + 1))
    (y_ref * w).sum().backward()
    (y_par * block(w, ctx, out_layout)).sum().backward()
    if after_backward is not None:
        after_backward()
    torch.testing.assert_close(
        y_par, block(y_ref.detach(), ctx, out_layout), **TOL, msg=lambda m: f"{name} out: {m}"
    )
    ref_params = dict(ref.named_parameters(remove_duplicate=False))
    for pname, p in par.named_parameters(remove_duplicate=False):
        info = get_shard_info(p)
        expected = ref_params[pname].grad
        assert info is not None, f"{name}.{pname} carries no ShardInfo"
        assert expected is not None and p.grad is not None, f"{name}.{pname} has no gradient"
        torch.testing.assert_close(
            p.grad, expected[info.slices], **TOL, msg=lambda m, n=pname: f"{name}.{n}: {m}"
        )
    if floating:
        assert x_ref.grad is not None and x_par.grad is not None
        torch.testing.assert_close(
            x_par.grad, block(x_ref.grad, ctx, in_layout), **TOL, msg=lambda m: f"{name} dx: {m}"
        )


def _layers(ctx: ParallelContext) -> int:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(B, S, H, generator=g)
    ids = torch.randint(0, 16, (B, S), generator=g)
    ids[0, 0] = 3  # the padding row
    img = torch.randn(B, 3, 4, 4, generator=g)
    checks: list[tuple[str, nn.Module, nn.Module, torch.Tensor, Layout, Layout]] = [
        ("Linear y->z", nn.Linear(H, 12), Linear3D(H, 12, context=ctx), x, "y", "z"),
        (
            "Linear z->y",
            nn.Linear(H, 12),
            Linear3D(H, 12, input_layout="z", context=ctx),
            x,
            "z",
            "y",
        ),
        (
            "Linear[2-dim]",
            nn.Linear(H, 4),
            Linear3D(H, 4, context=ctx),
            torch.randn(B, H, generator=g),
            "y",
            "z",
        ),
        (
            "Linear(bias=False)",
            nn.Linear(12, H, bias=False),
            Linear3D(12, H, bias=False, input_layout="z", context=ctx),
            torch.randn(B, S, 12, generator=g),
            "z",
            "y",
        ),
        ("LayerNorm y", nn.LayerNorm(H), LayerNorm3D(H, context=ctx), x * 2 + 1, "y", "y"),
        (
            "LayerNorm z (bias=False)",
            nn.LayerNorm(H, bias=False),
            LayerNorm3D(H, bias=False, layout="z", context=ctx),
            x,
            "z",
            "z",
        ),
        (
            "Embedding(padding_idx)",
            nn.Embedding(16, H, padding_idx=3),
            Embedding3D(16, H, padding_idx=3, context=ctx),
            ids,
            "batch",
            "y",
        ),
        (
            "VocabParallelEmbedding(padding_idx)",
            nn.Embedding(16, H, padding_idx=3),
            VocabParallelEmbedding3D(16, H, padding_idx=3, context=ctx),
            ids,
            "batch",
            "y",
        ),
        (
            "PatchEmbedding",
            SerialPatchEmbedding(4, 2, 3, H),
            PatchEmbedding3D(4, 2, 3, H, context=ctx),
            img,
            "batch",
            "y",
        ),
        ("Classifier", SerialClassifier(H, 6), Classifier3D(H, 6, context=ctx), x, "y", "batch"),
        (
            "VocabParallelClassifier",
            SerialClassifier(H, 12),
            VocabParallelClassifier3D(H, 12, context=ctx),
            x,
            "y",
            "y",
        ),
    ]
    for n, (name, ref, par, inp, in_layout, out_layout) in enumerate(checks):
        check(name, ref, par, inp, ctx, in_layout=in_layout, out_layout=out_layout, seed=n)
    # skip_bias_add returns the bias block; adding it gives the output
    ref_linear = nn.Linear(H, 12)
    randomize(ref_linear, 40)
    par_linear = Linear3D(H, 12, skip_bias_add=True, context=ctx)
    load_full_state_dict(par_linear, ref_linear.state_dict())
    y, bias = par_linear(block(x, ctx, "y"))
    torch.testing.assert_close(y + bias, block(ref_linear(x), ctx, "z"), **TOL)
    return len(checks)


def _dispatch_skip_bias_add(ctx: ParallelContext) -> int:
    """The dispatching ``Linear(..., skip_bias_add=True)`` in both layouts: the caller's
    ``y + bias`` has ``nn.Linear``'s values and every gradient; the returned bias is the local
    block ``[out/q]`` of the output's hidden axis that the bias's ShardInfo describes."""
    x = torch.randn(B, S, H, generator=torch.Generator().manual_seed(12))
    for n, (parallel, layout, out) in enumerate((("col", "y", "z"), ("row", "z", "y"))):
        linear = Linear(H, 12, parallel=parallel, skip_bias_add=True, context=ctx)  # type: ignore[arg-type]
        assert type(linear) is Linear3D and linear.input_layout == layout
        ref, par = BiasAdded(nn.Linear(H, 12)), BiasAdded(linear)
        name = f"Linear({parallel}, skip_bias_add)"
        check(name, ref, par, x, ctx, in_layout=layout, out_layout=out, seed=45 + n)
        bias = check_returned_bias(linear, ref.inner, block(x, ctx, layout))  # type: ignore[arg-type]
        assert bias.shape == (12 // 2,), name
    return 2


class MLP(nn.Module):
    """A Megatron MLP from the dispatching layers: the 3D layouts alternate y -> z -> y."""

    def __init__(self, hidden: int, context: ParallelContext | None = None) -> None:
        super().__init__()
        self.norm = LayerNorm(hidden, context=context)
        self.fc1 = Linear(hidden, 4 * hidden, parallel="col", context=context)
        self.fc2 = Linear(4 * hidden, hidden, parallel="row", context=context)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


def _blocks(ctx: ParallelContext) -> list[str]:
    x = torch.randn(B, S, H, generator=torch.Generator().manual_seed(2))
    ref_mlp, par_mlp = MLP(H), MLP(H, context=ctx)
    assert [type(m).__name__ for m in par_mlp.children()] == ["LayerNorm3D", "Linear3D", "Linear3D"]
    assert (par_mlp.fc1.input_layout, par_mlp.fc2.input_layout) == ("y", "z")
    check("MLP", ref_mlp, par_mlp, x, ctx, seed=50)
    # two stacked MLPs: the layouts alternate inside each, and every MLP starts from "y"
    ref2 = nn.Sequential(MLP(H), MLP(H))
    par2 = nn.Sequential(MLP(H, context=ctx), MLP(H, context=ctx))
    check("MLP x2", ref2, par2, x, ctx, seed=51)
    ref_block, par_block = Block(H, 2), Block(H, 2, context=ctx)
    assert [n for n, _ in ref_block.named_parameters()] == [
        n for n, _ in par_block.named_parameters()
    ]
    check("Block", ref_block, par_block, x, ctx, seed=60)
    return [type(c).__name__ for c in par_block.children()]


def _two_models(ctx: ParallelContext) -> None:
    """Building a second model (and a second context) changes nothing in the first."""
    x = torch.randn(B, S, H, generator=torch.Generator().manual_seed(5))
    first_ref, first_par = MLP(H), MLP(H, context=ctx)
    randomize(first_ref, 70)
    load_full_state_dict(first_par, first_ref.state_dict())
    second_ctx = create_context(dict(parallel=dict(tensor=dict(size=8, mode="3d"))), timeout=60.0)
    try:
        second_ref, second_par = MLP(H), MLP(H, context=second_ctx)
        third = Linear3D(H, H, context=ctx)  # a lone layer built between them: still "y"
        assert third.input_layout == "y" and third.output_layout == "z"
        randomize(second_ref, 71)
        load_full_state_dict(second_par, second_ref.state_dict())
        local = block(x, ctx, "y")
        # interleave the two models' forwards
        out_second = second_par(local)
        out_first = first_par(local)
        torch.testing.assert_close(out_first, block(first_ref(x).detach(), ctx, "y"), **TOL)
        torch.testing.assert_close(out_second, block(second_ref(x).detach(), ctx, "y"), **TOL)
    finally:
        second_ctx.destroy()


def _loss_and_accuracy(ctx: ParallelContext) -> None:
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(B, S, 12, generator=g)
    target = torch.randint(0, 12, (B, S), generator=g)
    target[0, :2] = -100
    target[1, 0] = 7
    logits[1, 0, 3] = logits[1, 0, 7] = logits[1, 0].max() + 1  # a tie: argmax takes index 3
    expected = int((logits.argmax(-1) == target).sum())
    for vocab_parallel, layout in ((False, "batch"), (True, "y")):
        for reduction in ("mean", "sum", "none"):
            loss_fn = CrossEntropyLoss(reduction, vocab_parallel=vocab_parallel, context=ctx)
            cls = VocabParallelCrossEntropyLoss3D if vocab_parallel else CrossEntropyLoss3D
            assert type(loss_fn) is cls
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
        assert type(acc) is (VocabParallelAccuracy3D if vocab_parallel else Accuracy3D)
        got = acc(block(logits, ctx, layout), block(target, ctx, "batch"))
        assert int(got) == expected


def _language_model_heads(ctx: ParallelContext) -> None:
    """Tied embedding + classifier (both kinds) and the matching loss, against torch."""
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
        loss = loss_fn(head(emb(split_batch(ids, ctx))), split_batch(target, ctx))
        torch.testing.assert_close(loss, ref_loss, **TOL)
        ref_loss.backward()
        loss.backward()
        info = get_shard_info(emb.weight)
        assert info is not None and ref_emb.weight.grad is not None and emb.weight.grad is not None
        torch.testing.assert_close(emb.weight.grad, ref_emb.weight.grad[info.slices], **TOL)
    vocab = Embedding(16, H, vocab_parallel=True, context=ctx)  # rows split: no first rows
    with pytest.raises(ValueError, match=r"has 16 rows but num_classes is 8.*splits the rows"):
        Classifier(H, 8, vocab.weight, vocab_parallel=True, context=ctx)
    # a weight split another way cannot be shared
    with pytest.raises(ValueError, match=r"shared weight is the block"):
        Classifier(H, 16, Embedding(16, H, context=ctx).weight, vocab_parallel=True, context=ctx)


class Model(nn.Module):
    def __init__(self, context: ParallelContext | None = None) -> None:
        super().__init__()
        self.patch = PatchEmbedding(4, 2, 3, H, context=context)
        self.emb = Embedding(16, H, context=context)
        self.vemb = Embedding(16, H, vocab_parallel=True, context=context)
        self.block = Block(H, 2, context=context)
        self.norm = LayerNorm(H, context=context)
        self.head = Classifier(H, 16, weight=self.emb.weight, context=context)
        self.vhead = Classifier(
            H, 16, weight=self.vemb.weight, vocab_parallel=True, context=context
        )


def _state_dict(ctx: ParallelContext) -> int:
    ref = Model()
    randomize(ref, 0)
    full = ref.state_dict()
    par = Model(ctx)
    load_full_state_dict(par, full)
    total = 0
    for name, p in par.named_parameters():
        info = get_shard_info(p)
        assert info is not None, f"{name} carries no ShardInfo"
        assert tuple(p.shape) == info.local_shape and info.global_shape == full[name].shape
        total += p.numel()
    # a linear weight is split over all three axes: 1/q^3 of it per rank
    qkv = get_shard_info(par.block.qkv.weight)
    assert qkv is not None
    assert qkv.split_modes == (
        (ParallelMode.PARALLEL_3D_OUTPUT.value, ParallelMode.PARALLEL_3D_WEIGHT.value),
        (ParallelMode.PARALLEL_3D_INPUT.value,),
    )
    assert qkv.local_shape == (3 * H // 4, H // 2)
    proj = get_shard_info(par.block.proj.weight)
    assert proj is not None and proj.split_modes[1] == (ParallelMode.PARALLEL_3D_OUTPUT.value,)
    gathered = gather_full_state_dict(par)
    assert list(gathered) == list(full)
    for name, t in full.items():
        assert torch.equal(gathered[name], t), name
    before = {n: t.detach().clone() for n, t in par.state_dict().items()}
    load_full_state_dict(par, gathered)
    assert all(torch.equal(before[n], t) for n, t in par.state_dict().items())
    return total


def _activations(ctx: ParallelContext) -> None:
    cube = cube_of(ctx)
    t = ctx.get_local_rank(ParallelMode.TENSOR)
    assert (cube.weight.rank, cube.input.rank, cube.output.rank) == (t % 2, (t // 2) % 2, t // 4)
    x = torch.randn(B, S, H, generator=torch.Generator().manual_seed(9), requires_grad=True)
    local = split_activation(x, ctx)
    assert local.shape == (B // 4, S, H // 2)
    torch.testing.assert_close(local, block(x.detach(), ctx, "y"), rtol=0, atol=0)
    full = gather_activation(local, ctx)
    torch.testing.assert_close(full, x.detach(), rtol=0, atol=0)
    (full * 2).sum().backward()  # exact adjoints: the gradient is 2 everywhere
    assert x.grad is not None and torch.equal(x.grad, torch.full_like(x, 2.0))
    ids = torch.arange(B * S).view(B, S)
    torch.testing.assert_close(split_batch(ids, ctx), block(ids, ctx, "batch"), rtol=0, atol=0)
    drop = Dropout(0.5, context=ctx)
    assert type(drop) is Dropout3D
    mask = (drop(torch.ones(64)) != 0).to(torch.float32)
    masks = [torch.empty_like(mask) for _ in range(ctx.tensor_size)]
    torch.distributed.all_gather(masks, mask, group=ctx.get_group(ParallelMode.TENSOR))
    assert len({tuple(m.tolist()) for m in masks}) == ctx.tensor_size


def _errors(ctx: ParallelContext) -> None:
    """Bad sizes and missing layouts raise on every rank before any collective."""
    with pytest.raises(ValueError, match=r"dim 0 \(batch\).*size 3 is not divisible by 4"):
        split_activation(torch.zeros(3, 2, 8), ctx)
    with pytest.raises(ValueError, match=r"dim 2 \(hidden\).*size 5 is not divisible by 2"):
        split_activation(torch.zeros(4, 2, 5), ctx)
    with pytest.raises(ValueError, match=r"split_batch.*size 2 is not divisible by 4"):
        split_batch(torch.zeros(2, 3, dtype=torch.long), ctx)
    with pytest.raises(ValueError, match=r"needs parallel='col'.*or parallel='row'"):
        Linear(8, 8, context=ctx)
    with pytest.raises(ValueError, match=r"Linear3D.weight: dim 0 of \[6, 8\].*size 6"):
        Linear(8, 6, parallel="col", context=ctx)
    with pytest.raises(ValueError, match=r"a 3d layout is 'y' or 'z'"):
        Linear3D(8, 8, input_layout="x", context=ctx)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"embedding_dim \(q \* q\).*size 6 is not divisible by 4"):
        Embedding(16, 6, context=ctx)
    with pytest.raises(ValueError, match=r"gather_output"):
        Linear(8, 8, parallel="col", gather_output=True, context=ctx)
    linear = Linear(8, 8, parallel="col", context=ctx)
    with pytest.raises(
        ValueError,
        match=r"Linear3D\(8, 8\): expected the input's last dim to be in_features 8 / q 2 = 4 "
        r"\(the local block of a 3d activation, q=2: split the input with split_activation / "
        r"split_batch\), got shape \[1, 2, 8\]",
    ):
        linear(torch.zeros(1, 2, 8))  # a full activation where a block was expected
    head = Classifier(8, 12, vocab_parallel=True, context=ctx)
    with pytest.raises(
        ValueError, match=r"VocabParallelClassifier3D\(8, 12\): .* in_features 8 / q"
    ):
        head(torch.zeros(1, 2, 8))


class _Forced(Linear3D):
    """A Linear3D whose product runs the given variant."""

    def __init__(self, *args: Any, algorithm: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.algorithm = algorithm

    def forward(self, x: torch.Tensor) -> Any:
        bias = None if self.bias is None else self.bias.reshape(-1)
        return cube_linear(
            x,
            self.weight,
            self.cube,
            self.input_layout,
            self.algorithm,
            bias=bias,
            keep=self.keep_gathered,
        )


def _cube_linear(ctx: ParallelContext) -> None:
    """Both variants of the product against torch, in both layouts, keeping the gathered
    operands or not; fused parts alike."""
    x = torch.randn(B, S, H, generator=torch.Generator().manual_seed(5))
    for algorithm, keep in itertools.product(("gathered", "stationary"), (False, True)):
        for layout, other in (("y", "z"), ("z", "y")):
            name = f"cube_linear {algorithm} {layout} keep={keep}"
            bias = layout == "y"
            par = _Forced(
                H, 12, bias, input_layout=layout, algorithm=algorithm, keep_gathered=keep,
                context=ctx,
            )  # fmt: skip
            ref = nn.Linear(H, 12, bias=bias)
            check(name, ref, par, x, ctx, in_layout=layout, out_layout=other)
    # A layer that keeps the layout: the product's output swapped with the mirror rank.
    for layout in ("y", "z"):
        keep = Linear3D(H, 12, input_layout=layout, output_layout=layout, context=ctx)
        check(f"keep {layout}", nn.Linear(H, 12), keep, x, ctx, in_layout=layout, out_layout=layout)
    with pytest.raises(ValueError, match="skip_bias_add returns the bias block"):
        Linear3D(H, 12, skip_bias_add=True, output_layout="y", context=ctx)
    # Fused q, k, v parts: the stationary variant equals the gathered one, with blocks moved
    # pairwise (gloo's path) and by collectives (NCCL's path).
    import tessera.layers.comm.inflight as inflight
    import tessera.layers.cube.matmul as matmul

    gathers = {"backward": 0}
    counted = {name: getattr(matmul, name) for name in ("start_all_gather", "start_gather_blocks")}

    def counting(real: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            gathers["backward"] += 1
            return real(*args, **kwargs)

        return call

    def run(algorithm: str, keep: bool = False) -> tuple[torch.Tensor | None, ...]:
        torch.manual_seed(3)
        layer = _Forced(H, 24, fused=3, algorithm=algorithm, keep_gathered=keep, context=ctx)
        xb = block(x, ctx, "y").clone().requires_grad_()
        out = layer(xb)
        gathers["backward"] = 0
        for name, real in counted.items():  # the gathers of the backward
            setattr(matmul, name, counting(real))
        try:
            (out * torch.arange(out.numel()).view(out.shape).sin()).sum().backward()
        finally:
            for name, real in counted.items():
                setattr(matmul, name, real)
        return out.detach(), layer.weight.grad, layer.bias.grad, xb.grad, gathers["backward"]

    gathered, stationary = run("gathered"), run("stationary")
    kept_gathered, kept_stationary = run("gathered", keep=True), run("stationary", keep=True)
    pairwise = inflight._pairwise
    inflight._pairwise = lambda group: False  # type: ignore[assignment]
    try:
        over_collectives = run("stationary")
    finally:
        inflight._pairwise = pairwise  # type: ignore[assignment]
    # kept operands: the gathered variant's backward gathers dy only (not W, not the rows),
    # the stationary one its bias runs only (not the input plane's rows)
    assert (gathered[-1], kept_gathered[-1]) == (3, 1)
    assert (stationary[-1], kept_stationary[-1]) == (2, 1)
    results = (stationary, over_collectives, kept_gathered, kept_stationary)
    for want, *got in zip(gathered[:-1], *(r[:-1] for r in results), strict=True):
        assert want is not None and all(g is not None for g in got)
        for g in got:
            torch.testing.assert_close(g, want, **TOL)
    assert choose_cube_algorithm(2, 4, 4, 2, backward=True) == "gathered"
    assert choose_cube_algorithm(1, 4, 4, 2, backward=True) == "stationary"
    # keeping the operands, the backward gathers nothing again: the forward's rule decides
    assert choose_cube_algorithm(3, 4, 16, 2, backward=True) == "stationary"
    assert choose_cube_algorithm(3, 4, 16, 2, backward=True, keep=True) == "gathered"
    model = nn.Sequential(Linear3D(H, 12, context=ctx), nn.Sequential(Linear3D(12, H, context=ctx)))
    assert keep_gathered_operands(model) == 2
    assert all(m.keep_gathered for m in model.modules() if isinstance(m, Linear3D))


def _deferred_sums(ctx: ParallelContext) -> dict[str, int]:
    """A LayerNorm3D leaves its affine gradients (this batch plane's part) to the caller of
    ``defer_gradient_sums``; summed over the returned group they equal the reference's. A
    Linear3D has no sum to leave. Returns how many parameters each layer left."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(B, S, H, generator=g)
    cases: list[tuple[str, nn.Module, nn.Module, torch.Tensor, Layout, Layout]] = [
        ("LayerNorm y", nn.LayerNorm(H), LayerNorm3D(H, context=ctx), x * 2 + 1, "y", "y"),
        ("LayerNorm z (bias=False)", nn.LayerNorm(H, bias=False),
         LayerNorm3D(H, bias=False, layout="z", context=ctx), x, "z", "z"),
        ("Linear y->z", nn.Linear(H, 12), Linear3D(H, 12, context=ctx), x, "y", "z"),
    ]  # fmt: skip
    left: dict[str, int] = {}
    for n, (name, ref, par, inp, in_layout, out_layout) in enumerate(cases):
        sums = defer_gradient_sums([par])
        left[name] = sum(len(params) for params in sums.values())
        check(name, ref, par, inp, ctx, in_layout=in_layout, out_layout=out_layout, seed=n,
              after_backward=lambda sums=sums: sum_deferred(sums, ctx))  # fmt: skip
    return left


def _layers_and_dispatch(ctx: ParallelContext) -> int:
    return _layers(ctx) + _dispatch_skip_bias_add(ctx)


#: Every check, each run as its own test on a fresh context: one failure hides no other. A
#: check returns what its test asserts about it, or None.
CHECKS: dict[str, Callable[[ParallelContext], Any]] = {
    "cube_linear": _cube_linear,
    "layers": _layers_and_dispatch,
    "deferred_sums": _deferred_sums,
    "blocks": _blocks,
    "two_models": _two_models,
    "loss_and_accuracy": _loss_and_accuracy,
    "language_model_heads": _language_model_heads,
    "state_dict": _state_dict,
    "activations": _activations,
    "errors": _errors,
}


def _run_check(check: str) -> Any:
    ctx = create_context(dict(parallel=dict(tensor=dict(size=8, mode="3d"))), timeout=120.0)
    try:
        return CHECKS[check](ctx)
    finally:
        ctx.destroy()


@pytest.mark.parametrize("check", list(CHECKS))
def test_3d_layers_match_torch(dist, check: str) -> None:
    results = dist.run(_run_check, world_size=8, args=(check,), timeout=300.0)
    if check == "layers":
        assert all(r == 13 for r in results)
    elif check == "deferred_sums":
        assert results[0] == {"LayerNorm y": 2, "LayerNorm z (bias=False)": 1, "Linear y->z": 0}
    elif check == "blocks":
        assert results[0] == [
            "LayerNorm3D",
            "Linear3D",
            "Dropout3D",
            "Linear3D",
            "Dropout3D",
            "LayerNorm3D",
            "Linear3D",
            "Linear3D",
            "Dropout3D",
        ]
    elif check == "state_dict":
        # every rank holds the same number of parameter elements
        assert len(set(results)) == 1


def test_3d_dispatch_table_has_every_layer() -> None:
    from tessera.layers import IMPLEMENTATIONS

    assert all("3d" in row for row in IMPLEMENTATIONS.values())
