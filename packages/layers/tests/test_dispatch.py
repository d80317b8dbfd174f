"""Mode dispatch: plain torch without tensor parallelism, 1D classes under '1d' (2D/2.5D in
test_layers_2d.py), a clear error for modes without layers, size errors before any collective."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from tp_reference import with_context

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
    SerialAccuracy,
    SerialClassifier,
    SerialPatchEmbedding,
    gather_activation,
    split_activation,
)
from tessera.registry import LAYERS

FACTORIES = {
    "Linear": lambda c: Linear(8, 8, parallel="col", context=c),
    "LayerNorm": lambda c: LayerNorm(8, context=c),
    "Embedding": lambda c: Embedding(16, 8, context=c),
    "PatchEmbedding": lambda c: PatchEmbedding(4, 2, 3, 8, context=c),
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


def _unimplemented(mode: str, size: int, missing: tuple[str, ...]) -> list[str]:
    """The layers in ``missing`` raise under ``mode``; every other one builds."""
    tensor = dict(size=size, mode=mode)
    ctx = create_context(dict(parallel=dict(tensor=tensor)), timeout=60.0)
    try:
        messages = []
        for layer, factory in FACTORIES.items():
            if layer not in missing:
                assert factory(ctx) is not None, layer
                continue
            with pytest.raises(ModeNotImplementedError) as info:
                factory(ctx)
            assert info.value.layer == layer and info.value.mode == mode
            messages.append(str(info.value))
        return messages
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


def _all() -> list[str]:
    # every mode has its layers; a ViT patch embedding under 'sequence' is the one gap
    messages = _unimplemented("sequence", 4, ("PatchEmbedding",))
    with_context(4, _errors_1d)
    with_context(4, _errors_sp, sp=True)
    return messages


def test_modes_without_layers_raise_and_sizes_are_checked(dist) -> None:
    messages = dist.run(_all, world_size=4, timeout=120.0)[0]
    assert len(messages) == 1
    assert "no PatchEmbedding for tensor mode 'sequence'" in messages[0]
    assert "'1d', '2.5d', '2d', '3d'" in messages[0]
