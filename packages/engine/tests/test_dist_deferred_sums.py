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
        deferred = [
            h for h in engine.gradient_handlers if isinstance(h, DeferredSumGradientHandler)
        ]
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
            sent_during_backward=[h.sent_during_backward for h in deferred],
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
            # the last micro-step's backward starts the sum; the first ones do not
            assert got["sent_during_backward"] == [2]


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


class TwoLayers(nn.Module):
    """Two deferring layers and one the forward never uses (registered first)."""

    def __init__(self, ctx: Any) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.unused = HalfBatchLinear(nn.Linear(3, 3), ctx)
        self.first = HalfBatchLinear(nn.Linear(3, 3), ctx)
        self.second = HalfBatchLinear(_full(), ctx)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.tanh(self.first(x)))


def _overlapped(overlap: bool, data: int) -> dict[str, Any]:
    parallel = dict(data=data, tensor=dict(size=2, mode="1d"))
    ctx = create_context(dict(parallel=parallel), timeout=60)
    try:
        # this rank's quarter (data 2) or half of the batch
        rows = 4 // (2 * data)
        start = rows * (ctx.get_local_rank(M.DATA) * 2 + ctx.get_local_rank(M.PARALLEL_1D))
        mine = slice(start, start + rows)
        model = TwoLayers(ctx)
        config: dict[str, Any] = {}
        if data == 1:  # tiny buckets: one parameter each
            handler = dict(type="DeferredSumGradientHandler", bucket_size_mb=1e-6, overlap=overlap)
            config["gradient_handlers"] = [handler]
        else:  # DDP, told about the unused layer
            config["ddp"] = dict(find_unused_parameters=True)
        engine, *_ = initialize(
            model, torch.optim.SGD(model.parameters(), lr=0.1), config=config, context=ctx
        )
        (deferred,) = engine.gradient_handlers
        assert isinstance(deferred, DeferredSumGradientHandler)
        sent = []
        for step in range(2):
            x, t = _batch(step)
            engine.zero_grad()
            engine.backward(_loss(engine(x[mine]), t[mine]))
            sent.append(deferred.sent_during_backward)
            engine.step()
        late = ""
        if overlap and data == 1:  # a second backward of the same forward reaches a sum sent
            loss = _loss(engine(x[mine]), t[mine])
            loss.backward(retain_graph=True)
            with pytest.raises(RuntimeError, match=r"'second.weight' got a second gradient") as e:
                loss.backward()
            late = str(e.value)
        return dict(
            sent=sent,
            late=late,
            unused_grad=model.unused.weight.grad,
            state={k: v.detach().clone() for k, v in model.state_dict().items()},
        )
    finally:
        ctx.destroy()


@pytest.mark.parametrize(
    ("overlap", "data"), [(True, 1), (False, 1), (True, 2)], ids=["overlap", "at_step", "ddp"]
)
def test_sums_sent_during_the_backward_equal_one_process(
    dist: Any, overlap: bool, data: int
) -> None:
    """Buckets of one parameter each: the two used ones are sent inside the backward, in
    order; the unused one (last in bucket order) waits for the step and stays ``None``.

    Under DDP (data 2) nothing is sent inside the backward: DDP rewrites ``.grad`` with the
    replicas' mean at its end, which would overwrite a sum started before.
    """
    results = dist.run(_overlapped, world_size=2 * data, args=(overlap, data), timeout=120)
    ref = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 2))
    torch.manual_seed(5)
    unused = nn.Linear(3, 3)
    ref[0].load_state_dict(nn.Linear(3, 3).state_dict())
    ref[2].load_state_dict(_full().state_dict())
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(2):
        x, t = _batch(step)
        opt.zero_grad()
        (_loss(ref(x), t) / data).backward()  # DDP: the mean of the replicas' sums
        opt.step()
    want = {"unused.weight": unused.weight, "unused.bias": unused.bias}
    want |= {f"first.{k}": v for k, v in ref[0].state_dict().items()}
    want |= {f"second.{k}": v for k, v in ref[2].state_dict().items()}
    for got in results:
        assert got["state"].keys() == want.keys()
        for name, value in want.items():
            torch.testing.assert_close(got["state"][name], value.detach(), rtol=1e-6, atol=1e-6)
        assert got["unused_grad"] is None  # no rank used it: the optimizer skipped it
        assert got["sent"] == ([2, 4] if overlap and data == 1 else [0, 0])
        assert ("overlap=False" in got["late"]) == (overlap and data == 1)
