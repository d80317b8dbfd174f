"""Gradient sums a layer leaves to the engine (``defer_gradient_sums``): once per step.

The layer here is written in the test (tessera-engine does not depend on tessera-layers): a
linear layer whose weight every 1D rank holds whole while each rank sees its own half of the
batch, so the rank's weight gradient is a part that must be summed over PARALLEL_1D, as
2.5D's depth layers' are over DEP. In autograd it sums at every backward; deferred, the
engine's ``DeferredSumGradientHandler`` sums once per optimizer step.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as tdist
from engine_testlib import _CopyToTensor
from torch import nn

from tessera.context import ConfigError, ParallelMode, create_context, defer_gradient_sums
from tessera.engine import DeferredSumGradientHandler, initialize

M = ParallelMode
ACCUMULATION = 2


class HalfBatchLinear(nn.Module):
    """``nn.Linear`` on this rank's half of the batch; its gradient summed over ``mode``."""

    def __init__(self, full: nn.Linear, ctx: Any, mode: str = M.PARALLEL_1D) -> None:
        super().__init__()
        self.weight = nn.Parameter(full.weight.detach().clone())
        self.bias = nn.Parameter(full.bias.detach().clone())
        self.group = ctx.get_group(M.PARALLEL_1D)
        self.mode = mode
        self.sums = True

    def defer_gradient_sum(self) -> dict[str, list[nn.Parameter]]:
        self.sums = False
        return {self.mode: [self.weight]}  # the bias stays summed in autograd

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = _CopyToTensor.apply(self.weight, self.group) if self.sums else self.weight
        bias = _CopyToTensor.apply(self.bias, self.group)
        return nn.functional.linear(x, weight, bias)


def _full() -> nn.Linear:
    torch.manual_seed(4)
    return nn.Linear(3, 2)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(20 + step)
    return torch.randn(4, 3, generator=g), torch.randn(4, 2, generator=g)


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).sum()  # summed: the halves' losses add up to the whole's


def _train(explicit_handlers: bool) -> dict[str, Any]:
    ctx = create_context(dict(parallel=dict(tensor=dict(size=2, mode="1d"))), timeout=60)
    try:
        rank = ctx.get_local_rank(M.PARALLEL_1D)
        layer = HalfBatchLinear(_full(), ctx)
        config: dict[str, Any] = dict(gradient_accumulation=ACCUMULATION)
        if explicit_handlers:  # a user's list: nothing deferred, autograd keeps its sums
            config["gradient_handlers"] = [dict(type="DataParallelGradientHandler")]
        engine, *_ = initialize(
            layer, torch.optim.SGD(layer.parameters(), lr=0.1), config=config, context=ctx
        )
        handlers = [type(h).__name__ for h in engine.gradient_handlers]
        partial_after_backward = []
        for step in range(2 * ACCUMULATION):
            x, t = _batch(step)
            if step % ACCUMULATION == 0:
                engine.zero_grad()
            engine.backward(_loss(engine(x[2 * rank : 2 * rank + 2]), t[2 * rank : 2 * rank + 2]))
            grads = [torch.zeros(2, 3), torch.zeros(2, 3)]
            assert layer.weight.grad is not None
            tdist.all_gather(grads, layer.weight.grad, group=ctx.get_group(M.PARALLEL_1D))
            partial_after_backward.append(not torch.equal(grads[0], grads[1]))
            engine.step()
        return dict(
            handlers=handlers,
            partial=partial_after_backward,
            weight=layer.weight.detach().clone(),
            bias=layer.bias.detach().clone(),
        )
    finally:
        ctx.destroy()


@pytest.mark.parametrize("explicit_handlers", [False, True], ids=["deferred", "explicit"])
def test_deferred_sums_run_once_per_step_and_train_like_one_process(
    dist: Any, explicit_handlers: bool
) -> None:
    results = dist.run(_train, world_size=2, args=(explicit_handlers,), timeout=120)
    ref = _full()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(2 * ACCUMULATION):
        if step % ACCUMULATION == 0:
            opt.zero_grad()
        x, t = _batch(step)
        (_loss(ref(x), t) / ACCUMULATION).backward()  # the engine's mean over micro-steps
        if step % ACCUMULATION == ACCUMULATION - 1:
            opt.step()
    for got in results:
        torch.testing.assert_close(got["weight"], ref.weight.detach(), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(got["bias"], ref.bias.detach(), rtol=1e-6, atol=1e-6)
        if explicit_handlers:
            assert "DeferredSumGradientHandler" not in got["handlers"]
            assert not any(got["partial"])  # summed in every backward
        else:
            assert "DeferredSumGradientHandler" in got["handlers"]
            assert all(got["partial"])  # each rank's part until the step sums it


def _other_context() -> str:
    ctx = create_context(dict(parallel=dict(tensor=dict(size=2, mode="1d"))), timeout=60)
    try:
        layer = HalfBatchLinear(_full(), ctx, mode="made_up")
        with pytest.raises(ValueError, match=r"over \['made_up'\].*holds no such group"):
            DeferredSumGradientHandler(layer, context=ctx)
        tied = nn.ModuleList([layer, layer])  # the same layer twice: its weight once
        assert [len(v) for v in defer_gradient_sums([tied]).values()] == [1]
        # switched by a first initialize, the model cannot go on without the handler
        again = HalfBatchLinear(_full(), ctx)
        initialize(again, torch.optim.SGD(again.parameters(), lr=0.1), context=ctx)
        explicit = dict(gradient_handlers=[dict(type="DataParallelGradientHandler")])
        with pytest.raises(ConfigError, match=r"leave the sums of \['weight \(over parallel_1d"):
            initialize(again, torch.optim.SGD(again.parameters(), lr=0.1), config=explicit,
                       context=ctx)  # fmt: skip
        return "refused"
    finally:
        ctx.destroy()


def test_a_sum_over_a_mode_the_context_lacks_is_refused(dist: Any) -> None:
    assert dist.run(_other_context, world_size=2, timeout=60) == ["refused", "refused"]
