"""Engine.train() / eval() reach every module the Engine runs (one module or model chunks)."""

from __future__ import annotations

import torch
from engine_testlib import make_data, sgd
from torch import nn

from tessera.engine import Engine


def _dropout_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 3))


def test_train_and_eval_switch_the_model_and_its_chunks() -> None:
    model = _dropout_model()
    engine = Engine(model, sgd(model), nn.CrossEntropyLoss())
    x, _ = make_data()
    engine.eval()
    assert not any(m.training for m in model.modules())
    with torch.no_grad():
        first, second = engine(x), engine(x)
    assert torch.equal(first, second)  # dropout off
    engine.train()
    assert all(m.training for m in model.modules())
    with torch.no_grad():
        assert not torch.equal(engine(x), engine(x))  # dropout on
    chunks = [_dropout_model(), _dropout_model()]
    params = [p for c in chunks for p in c.parameters()]
    chunked = Engine(chunks, torch.optim.SGD(params, lr=0.1))
    chunked.eval()
    assert not any(m.training for c in chunks for m in c.modules())
    chunked.train()
    assert all(m.training for c in chunks for m in c.modules())
    assert chunked.model is chunks and chunked.optimizer.param_groups[0]["params"] == params
