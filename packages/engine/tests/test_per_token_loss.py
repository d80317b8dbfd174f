"""per_token_loss: every token of the global step weighs alike, however the batch is cut.

The labels leave out (``-100``) different numbers of samples in each piece of the step (each
data rank's half, each microbatch, each accumulation step), so a mean per piece averaged over
the pieces is NOT the single process's mean over the step: each check first asserts that the
default (mean) engine differs from the reference, then that per_token_loss equals it.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from engine_testlib import make_data, make_model
from torch import nn

from tessera.context import ParallelMode, create_context
from tessera.engine import Engine, initialize
from tessera.pipeline import build_pipeline_model

M = ParallelMode
LR = 0.5


def _labels(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """8 samples, samples 1, 2 and 6 ignored: halves of 2 and 3 tokens, quarters of 1, 1, 2, 1."""
    x, y = make_data(8, seed=seed)
    y = y.clone()
    y[[1, 2, 6]] = -100
    return x, y


def _sum_and_count(output: torch.Tensor, label: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return F.cross_entropy(output, label, reduction="sum"), (label != -100).sum()


def _mean(output: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output, label)  # ignore_index -100 by default


def _reference(model: nn.Module, steps: list[tuple[torch.Tensor, torch.Tensor]]) -> list[Any]:
    """One process, the global batch of each step, the mean over its tokens."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for x, y in steps:
        opt.zero_grad()
        _mean(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _close(got: list[torch.Tensor], want: list[torch.Tensor]) -> bool:
    return all(torch.allclose(g, w, rtol=1e-5, atol=1e-6) for g, w in zip(got, want, strict=True))


def test_gradient_accumulation_weighs_every_token_of_the_step_alike() -> None:
    steps = [_labels(seed) for seed in (1, 2)]
    want = _reference(make_model(), steps)
    results = {}
    for per_token in (False, True):
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        criterion = _sum_and_count if per_token else _mean
        engine = Engine(
            model,
            opt,
            criterion,
            gradient_accumulation=2,
            per_token_loss=per_token,  # type: ignore[arg-type]
        )
        for x, y in steps:
            engine.zero_grad()
            for half in (slice(0, 4), slice(4, 8)):  # 2 tokens, then 3
                engine.execute_schedule(iter([(x[half], y[half])]))
                engine.step()
        results[per_token] = [p.detach().clone() for p in model.parameters()]
    assert not _close(results[False], want)  # a mean per accumulation step is off
    assert _close(results[True], want)


def test_the_manual_loop_counts_tokens_too() -> None:
    x, y = _labels(1)
    want = _reference(make_model(), [(x, y)])
    model = make_model()
    engine = Engine(
        model,
        torch.optim.SGD(model.parameters(), lr=LR),
        _sum_and_count,  # type: ignore[arg-type]
        gradient_accumulation=2,
        per_token_loss=True,
    )
    engine.zero_grad()
    for half in (slice(0, 4), slice(4, 8)):
        engine.backward(engine.criterion(engine(x[half]), y[half]))
        engine.step()
    assert _close([p.detach() for p in model.parameters()], want)


def test_a_mean_from_a_per_token_criterion_is_a_clear_error() -> None:
    model = make_model()
    engine = Engine(model, torch.optim.SGD(model.parameters(), lr=LR), _mean, per_token_loss=True)
    with pytest.raises(TypeError, match=r"must return \(loss_sum, num_tokens\).*tensor of shape"):
        engine.execute_schedule(iter([_labels(1)]))


def _data_and_pipeline(per_token: bool) -> list[Any]:
    """dp2 x pp2, two microbatches per data rank: pieces of 1, 1, 2 and 1 tokens."""
    config: dict[str, Any] = dict(parallel=dict(pipeline=2), num_microbatches=2)
    if per_token:
        config["per_token_loss"] = True
    ctx = create_context(config, timeout=60)
    try:
        d = ctx.get_local_rank(M.DATA)
        torch.manual_seed(0)
        full = nn.Sequential(
            nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3)
        )
        stage = build_pipeline_model(full, method="uniform", context=ctx)
        assert isinstance(stage, nn.Module)
        criterion = _sum_and_count if per_token else _mean
        engine, *_ = initialize(
            stage,
            torch.optim.SGD(stage.parameters(), lr=LR),
            criterion,  # type: ignore[arg-type]
            config=config,
            context=ctx,
        )
        for seed in (1, 2):
            x, y = _labels(seed)
            engine.zero_grad()
            engine.execute_schedule(iter([(x[4 * d : 4 * d + 4], y[4 * d : 4 * d + 4])]))
            assert engine.step()
        return [
            (idx, [p.detach().clone() for p in stage[i].parameters()])
            for i, idx in enumerate(stage.layer_indices)
        ]
    finally:
        ctx.destroy()


@pytest.mark.parametrize("per_token", [False, True], ids=["mean", "per_token"])
def test_data_ranks_and_microbatches_weigh_every_token_alike(dist: Any, per_token: bool) -> None:
    torch.manual_seed(0)
    full = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))
    _reference(full, [_labels(1), _labels(2)])
    agree = []
    for result in dist.run(_data_and_pipeline, world_size=4, args=(per_token,), timeout=120):
        for idx, params in result:
            agree.append(_close(params, [p.detach() for p in full[idx].parameters()]))
    assert all(agree) if per_token else not all(agree)


def test_evaluation_reports_the_token_mean() -> None:
    x, y = _labels(1)
    model = make_model()
    engine = Engine(
        model, torch.optim.SGD(model.parameters(), lr=LR), _sum_and_count, per_token_loss=True
    )  # type: ignore[arg-type]
    _, _, loss = engine.execute_schedule(iter([(x, y)]), forward_only=True)
    with torch.no_grad():
        assert loss is not None and torch.allclose(loss, _mean(model(x), y))


def test_a_step_without_a_token_is_non_finite_as_in_one_process() -> None:
    from tessera.engine import NonFiniteError

    x, y = _labels(1)
    model = make_model()
    engine = Engine(
        model, torch.optim.SGD(model.parameters(), lr=LR), _sum_and_count, per_token_loss=True
    )  # type: ignore[arg-type]
    engine.zero_grad()
    engine.execute_schedule(iter([(x, torch.full_like(y, -100))]))
    with pytest.raises(NonFiniteError):
        engine.step()


def test_a_schedule_that_hides_how_it_cuts_the_batch_is_refused() -> None:
    class Mine:
        def train_step(self, *args: Any, **kwargs: Any) -> Any: ...
        def eval_step(self, *args: Any, **kwargs: Any) -> Any: ...

    model = make_model()
    with pytest.raises(ValueError, match="per_token_loss needs to know how a step cuts"):
        Engine(
            model,
            torch.optim.SGD(model.parameters(), lr=LR),
            _sum_and_count,
            schedule=Mine(),
            per_token_loss=True,
        )  # type: ignore[arg-type]
