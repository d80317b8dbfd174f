"""Mode dispatch: plain torch without tensor parallelism, 1D classes under '1d' (2D/2.5D in
test_layers_2d.py), every layer in every mode, a clear error for a mode without a layer, size
errors before any collective."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from tp_reference import TOL, BiasAdded, randomize, with_context

from tessera.context import ParallelContext, create_context
from tessera.layers import (
    IMPLEMENTATIONS,
    Accuracy,
    Classifier,
    CrossEntropyLoss,
    Dropout,
    Embedding,
    LayerNorm,
    Linear,
    Linear1DCol,
    Linear2D,
    Linear2p5D,
    ModeNotImplementedError,
    PatchEmbedding,
    SequencePatchEmbedding,
    SerialAccuracy,
    SerialClassifier,
    SerialLinear,
    SerialPatchEmbedding,
    gather_activation,
    register_implementation,
    split_activation,
    unregister_implementation,
)
from tessera.registry import LAYERS

FACTORIES = {
    "Linear": lambda c: Linear(8, 8, parallel="col", context=c),
    "LayerNorm": lambda c: LayerNorm(8, context=c),
    "Embedding": lambda c: Embedding(16, 8, context=c),
    "PatchEmbedding": lambda c: PatchEmbedding(6, 2, 3, 8, context=c),  # 9 + 1 tokens
    "Classifier": lambda c: Classifier(8, 16, context=c),
    "Dropout": lambda c: Dropout(0.1, context=c),
    "CrossEntropyLoss": lambda c: CrossEntropyLoss(context=c),
    "Accuracy": lambda c: Accuracy(context=c),
}


def test_without_context_everything_is_plain_torch() -> None:
    assert type(Linear(4, 6)) is nn.Linear
    assert type(LayerNorm(4)) is nn.LayerNorm
    assert type(Embedding(10, 4, padding_idx=0)) is nn.Embedding
    assert type(Dropout(0.1)) is nn.Dropout
    assert type(CrossEntropyLoss()) is nn.CrossEntropyLoss
    assert type(Classifier(4, 3)) is SerialClassifier
    assert type(PatchEmbedding(4, 2, 3, 8)) is SerialPatchEmbedding
    assert type(Accuracy()) is SerialAccuracy
    x = torch.randn(2, 3)
    assert split_activation(x) is x and gather_activation(x) is x
    linear = Linear(4, 6, weight_initializer=lambda t, i, o: nn.init.ones_(t))
    assert torch.equal(linear.weight, torch.ones(6, 4))


def test_skip_bias_add_without_context_is_torch_linear_split_in_two() -> None:
    """``Linear(..., skip_bias_add=True)`` without a context: ``(x W^T, bias)``; the caller's
    ``y + bias`` has ``nn.Linear``'s values and gradients, the bias's included."""
    linear = Linear(8, 6, skip_bias_add=True)
    assert type(linear) is SerialLinear and isinstance(linear, nn.Linear)
    ref, par = BiasAdded(nn.Linear(8, 6)), BiasAdded(linear)
    randomize(ref, 1)
    par.load_state_dict(ref.state_dict())
    x = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(2))
    x_ref, x_par = x.clone().requires_grad_(), x.clone().requires_grad_()
    w = torch.randn(2, 3, 6, generator=torch.Generator().manual_seed(3))
    y_ref, y_par = ref(x_ref), par(x_par)
    (y_ref * w).sum().backward()
    (y_par * w).sum().backward()
    torch.testing.assert_close(y_par, y_ref, **TOL)
    assert x_ref.grad is not None and x_par.grad is not None
    torch.testing.assert_close(x_par.grad, x_ref.grad, **TOL)
    for (name, p), q in zip(par.named_parameters(), ref.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None, name
        torch.testing.assert_close(p.grad, q.grad, **TOL, msg=name)
    y, bias = linear(x)
    assert bias is linear.bias
    torch.testing.assert_close(y, x @ linear.weight.detach().t(), **TOL)  # no bias added
    assert Linear(8, 6, bias=False, skip_bias_add=True)(x)[1] is None


def test_serial_patch_embedding_without_flatten_keeps_the_grid() -> None:
    import torch.nn.functional as F

    from tessera.layers import SerialPatchEmbedding

    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    grid = SerialPatchEmbedding(8, 4, 3, 6, flatten=False)
    tokens = SerialPatchEmbedding(8, 4, 3, 6)
    randomize(grid, 1)
    randomize(tokens, 1)
    assert sorted(grid.state_dict()) == ["bias", "pos_embed", "weight"]  # no class token
    assert tuple(grid.pos_embed.shape) == (1, 6, 2, 2)
    conv = F.conv2d(x, grid.weight, grid.bias, stride=4)  # [2, 6, 2, 2]
    out = grid(x)
    assert out.shape == (2, 6, 2, 2)
    torch.testing.assert_close(out, conv + grid.pos_embed, **TOL)
    out.sum().backward()
    assert grid.pos_embed.grad is not None and torch.equal(
        grid.pos_embed.grad, torch.full((1, 6, 2, 2), 2.0)
    )
    # flatten=True (the default): class token first, then the patches row by row
    seq = tokens(x)
    assert seq.shape == (2, 5, 6)
    conv = F.conv2d(x, tokens.weight, tokens.bias, stride=4).flatten(2).transpose(1, 2)
    torch.testing.assert_close(seq[:, 1:], conv + tokens.pos_embed[:, 1:], **TOL)


def test_every_layer_is_registered() -> None:
    for name in [
        *IMPLEMENTATIONS,
        "Linear1DCol",
        "Linear1DRow",
        "Embedding1D",
        "VocabParallelEmbedding1D",
        "Classifier1D",
        "VocabParallelClassifier1D",
        "LayerNorm1D",
        "Dropout1D",
        "PatchEmbedding1D",
        "SequencePatchEmbedding",
        "SerialLinear",
        *(
            prefix + name + suffix
            for suffix in ("2D", "2p5D")
            for prefix in ("", "VocabParallel")
            for name in ("Embedding", "Classifier", "CrossEntropyLoss", "Accuracy")
        ),
        *(
            name + suffix
            for suffix in ("2D", "2p5D")
            for name in ("Linear", "LayerNorm", "PatchEmbedding", "Dropout")
        ),
    ]:
        assert name in LAYERS, name
    assert LAYERS.get("Linear1DCol") is Linear1DCol
    assert LAYERS.get("Linear2D") is Linear2D and LAYERS.get("Linear2p5D") is Linear2p5D


def _sequence_mode() -> str:
    """Under 'sequence' (2 ranks x 2 data ranks) every layer builds; a mode without an entry
    in the table raises ModeNotImplementedError (shown by taking 'sequence''s entry out)."""
    tensor = dict(size=2, mode="sequence")
    ctx = create_context(dict(parallel=dict(tensor=tensor)), timeout=60.0)
    try:
        for layer, factory in FACTORIES.items():
            assert factory(ctx) is not None, layer
        assert type(FACTORIES["PatchEmbedding"](ctx)) is SequencePatchEmbedding
        builder = unregister_implementation("PatchEmbedding", "sequence")
        try:
            with pytest.raises(ModeNotImplementedError) as info:
                FACTORIES["PatchEmbedding"](ctx)
        finally:
            register_implementation("PatchEmbedding", "sequence", builder)
        assert info.value.layer == "PatchEmbedding" and info.value.mode == "sequence"
        assert type(FACTORIES["PatchEmbedding"](ctx)) is SequencePatchEmbedding
        return str(info.value)
    finally:
        ctx.destroy()


def _errors_1d(ctx: ParallelContext) -> None:
    with pytest.raises(ValueError, match=r"parallel='col' or parallel='row'"):
        Linear(8, 8, context=ctx)
    with pytest.raises(
        ValueError, match=r"Linear1DCol out_features.*size 10 is not divisible by 4"
    ):
        Linear(8, 10, parallel="col", context=ctx)
    with pytest.raises(ValueError, match=r"Linear1DRow in_features.*size 6 is not divisible by 4"):
        Linear(6, 8, parallel="row", context=ctx)
    with pytest.raises(ValueError, match=r"VocabParallelEmbedding1D num_embeddings.*size 10"):
        Embedding(10, 8, vocab_parallel=True, context=ctx)
    for name, factory in FACTORIES.items():
        assert factory(ctx) is not None, name


def _errors_sp(ctx: ParallelContext) -> None:
    # a sequence of 6 does not split over 4 ranks: ValueError on every rank, no collective
    with pytest.raises(ValueError, match=r"dim 1 \(sequence\).*size 6 is not divisible by 4"):
        split_activation(torch.zeros(2, 6, 8), ctx)
    assert split_activation(torch.zeros(2, 8, 8), ctx).shape == (2, 2, 8)


def _all() -> str:
    message = _sequence_mode()
    with_context(4, _errors_1d)
    with_context(4, _errors_sp, sp=True)
    return message


def test_every_mode_has_every_layer() -> None:
    for layer, row in IMPLEMENTATIONS.items():
        assert sorted(row) == ["1d", "2.5d", "2d", "3d", "sequence"], layer


def test_the_table_changes_only_through_registration() -> None:
    """IMPLEMENTATIONS is a read-only view; register_implementation checks what it is given."""
    with pytest.raises(TypeError):
        IMPLEMENTATIONS["Linear"]["mine"] = lambda ctx, **kw: nn.Identity()  # type: ignore[index]

    def mine(context: object, **kwargs: object) -> nn.Module:
        return nn.Identity()

    register_implementation("Linear", "mine", mine)
    try:
        assert IMPLEMENTATIONS["Linear"]["mine"] is mine  # the view is live
        with pytest.raises(ValueError, match=r"'Linear' already has a builder for .*'mine'"):
            register_implementation("Linear", "mine", mine)
        register_implementation("Linear", "mine", mine, replace=True)
    finally:
        assert unregister_implementation("Linear", "mine") is mine
    assert "mine" not in IMPLEMENTATIONS["Linear"]
    with pytest.raises(KeyError, match=r"'Linaer' is not a dispatching layer; they are Linear"):
        register_implementation("Linaer", "mine", mine)
    with pytest.raises(TypeError, match="must be callable"):
        register_implementation("Linear", "mine", 3)  # type: ignore[arg-type]
    with pytest.raises(KeyError, match=r"no builder for tensor mode 'mine'"):
        unregister_implementation("Linear", "mine")


def test_modes_without_layers_raise_and_sizes_are_checked(dist) -> None:
    message = dist.run(_all, world_size=4, timeout=120.0)[0]
    assert "no PatchEmbedding for tensor mode 'sequence'" in message
    assert "'1d', '2.5d', '2d', '3d'" in message


def _register_line_mode() -> None:
    """A user's tensor mode 'line': 1D's groups, layers and loss under a name of its own.

    Registered the way a package outside tessera would (nothing edited in tessera): its
    ``TensorMode`` and initializer, its ``ModeLayers`` and its dispatching layers' builders.
    """
    from dataclasses import replace

    from tessera.context import TENSOR_MODE_PLUGINS, Mode1D, Tensor1DInitializer
    from tessera.layers import MODE_LAYERS, register_mode_layers

    if "line" in TENSOR_MODE_PLUGINS:
        return

    class LineInitializer(Tensor1DInitializer):
        tensor_mode = "line"

    class Line(Mode1D):
        name = "line"
        initializer = LineInitializer

    TENSOR_MODE_PLUGINS.register(Line, name="line")
    register_mode_layers(replace(MODE_LAYERS["1d"], name="line"))
    for layer, row in IMPLEMENTATIONS.items():
        register_implementation(layer, "line", row["1d"])


def _user_mode_parallelizes_like_1d() -> list[float]:
    """``parallelize``, the boundary, ``token_loss`` and dropout's forks under 'line' and '1d'.

    Same plain model, same batch: the loss and every gradient equal bitwise (the same kernels
    on the same groups), and the loss equals one process's.
    """
    from plain_models import plain_lm

    from tessera.layers import parallelize, token_loss

    _register_line_mode()
    ids = torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(3))
    plain = plain_lm()
    logits = plain(ids)
    whole = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 32), ids[:, 1:].reshape(-1))
    results = []
    for mode in ("line", "1d"):
        ctx = create_context(dict(parallel=dict(tensor=dict(size=2, mode=mode))), timeout=60.0)
        try:
            model = parallelize(plain_lm(), context=ctx)
            loss = token_loss(model(ids)[:, :-1], ids[:, 1:], context=ctx)
            loss.backward()
            results.append((loss.detach(), [p.grad for p in model.parameters()]))
        finally:
            ctx.destroy()
    (line_loss, line_grads), (one_d_loss, one_d_grads) = results
    assert torch.equal(line_loss, one_d_loss)
    for got, want in zip(line_grads, one_d_grads, strict=True):
        assert got is not None and want is not None and torch.equal(got, want)
    torch.testing.assert_close(line_loss, whole.detach(), rtol=1e-5, atol=1e-6)
    return [float(line_loss)]


def test_a_users_mode_takes_every_path_a_builtin_one_does(dist) -> None:
    losses = dist.run(_user_mode_parallelizes_like_1d, world_size=2, timeout=120.0)
    assert losses[0] == losses[1]
