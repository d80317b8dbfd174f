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
        # FSDP2 sums over DATA only: switched, the layer's sum over PARALLEL_1D would be lost
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        sharded = HalfBatchLinear(_full(), ctx)
        fully_shard(sharded, mesh=init_device_mesh("cpu", (2,)))
        with pytest.raises(ValueError, match=r"sharded by FSDP2 \(zero.stage 2 or 3\)"):
            DeferredSumGradientHandler(sharded, context=ctx)
        assert sharded.sums, "switched although refused"
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


class OnlyDeferred(nn.Module):
    """A ``[3, 3]`` weight every rank holds whole, its gradient always left to the handler."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(3, 3, generator=torch.Generator().manual_seed(seed)))

    def defer_gradient_sum(self) -> dict[str, list[nn.Parameter]]:
        return {M.PARALLEL_1D: [self.weight]}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight


class Chain(nn.Module):
    """``x a b c``; with ``divergent`` rank 1 skips ``c`` (registered last: sent first)."""

    def __init__(self, rank: int, divergent: bool) -> None:
        super().__init__()
        self.a, self.b, self.c = OnlyDeferred(1), OnlyDeferred(2), OnlyDeferred(3)
        self.skip_c = divergent and rank == 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.b(self.a(x))
        return y if self.skip_c else self.c(y)


def _local_grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


def _summed(local: dict[str, torch.Tensor | None], group: Any) -> dict[str, torch.Tensor | None]:
    """Each gradient summed over the ranks that had one (``None`` where none had)."""
    out: dict[str, torch.Tensor | None] = {}
    for name, grad in local.items():
        parts: list[Any] = [None, None]
        tdist.all_gather_object(parts, grad, group=group)
        present = [g for g in parts if g is not None]
        out[name] = sum(present) if present else None  # type: ignore[assignment]
    return out


def _assert_grads(model: nn.Module, want: dict[str, torch.Tensor | None]) -> None:
    for name, p in model.named_parameters():
        if want[name] is None:
            assert p.grad is None, name
        else:
            torch.testing.assert_close(p.grad, want[name], rtol=1e-6, atol=1e-6, msg=name)


def _edges() -> str:
    ctx = create_context(dict(parallel=dict(tensor=dict(size=2, mode="1d"))), timeout=30)
    try:
        rank, cpu = ctx.get_local_rank(M.PARALLEL_1D), ctx.get_cpu_group(M.PARALLEL_1D)
        handler = dict(type="DeferredSumGradientHandler", bucket_size_mb=1e-6)
        config = dict(gradient_handlers=[handler])
        x = torch.randn(2, 3, generator=torch.Generator().manual_seed(10 + rank))

        def build(divergent: bool) -> tuple[Any, Any, Chain]:
            model = Chain(rank, divergent)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            engine, *_ = initialize(model, opt, config=config, context=ctx)
            return engine, engine.gradient_handlers[0], model

        # c has a gradient on rank 0 only: rank 0 sends its bucket inside the backward, rank 1
        # cannot; a forward with gradients before the step (a metric) makes every rank send
        # the rest and drop them, and the step sums them all again, matched
        engine, deferred, model = build(divergent=True)
        engine.zero_grad()
        engine.backward(engine(x).square().sum())
        local = _local_grads(model)
        engine(x)
        deferred.after_backward()
        _assert_grads(model, _summed(local, cpu))
        assert model.c.weight.grad is not None  # rank 1 had none: it gets rank 0's
        engine.step()

        # frozen when the handler was built, trained later: summed at the step, not left
        # partial; two forwards before their two backwards: nothing starts early
        engine, deferred, model = build(divergent=False)
        model.b.weight.requires_grad_(False)
        engine, deferred, model = build(divergent=False)
        model.b.weight.requires_grad_(True)
        engine.zero_grad()
        first, second = engine(x), engine(2 * x)
        engine.backward(first.square().sum())
        engine.backward(second.square().sum())
        local = _local_grads(model)
        assert deferred.sent_during_backward == 0
        deferred.after_backward()
        _assert_grads(model, _summed(local, cpu))
        engine.step()

        # a second initialize of the same model: only the new handler's hooks fire
        old = deferred
        engine, *_ = initialize(
            model, torch.optim.SGD(model.parameters(), lr=0.1), config=config, context=ctx
        )
        deferred = engine.gradient_handlers[0]
        engine.zero_grad()
        engine.backward(engine(x).square().sum())
        assert (old.sent_during_backward, deferred.sent_during_backward) == (0, 3)
        # a gradient changed after its sum started: refused, not overwritten
        model.a.weight.grad.mul_(2)
        with pytest.raises(RuntimeError, match=r"'a.weight' changed between the backward"):
            engine.step()
        return "ok"
    finally:
        ctx.destroy()


def test_overlapped_sums_stay_matched_and_complete(dist: Any) -> None:
    """Sums started in a backward: a gradient on one rank only, a forward before the step, a
    parameter unfrozen after the handler was built, two forwards before their backwards, a
    second initialize, a gradient changed before the step."""
    assert dist.run(_edges, world_size=2, timeout=120) == ["ok", "ok"]
