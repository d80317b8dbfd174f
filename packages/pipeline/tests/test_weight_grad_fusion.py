"""Linear layers whose weight gradient goes straight into .grad (or to zero bubble's W).

Every case is compared with plain autograd on a copy of the same module and inputs.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as tdist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from tessera.pipeline import (
    GPipeSchedule,
    InterleavedPipelineSchedule,
    PipelineRunner,
    PipelineSchedule,
    ZeroBubbleSchedule,
    backward_input,
    backward_weight,
    select_stage_layers,
)
from tessera.pipeline.weight_grad_fusion import (
    FuseLinearWeightGrad,
    StoreMode,
    WeightGradBatcher,
    WeightGradStore,
    is_fused_linear_node,
    stage_allows_fusion,
)

TOL = dict(atol=1e-6, rtol=1e-5)


def _mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 5, bias=False), nn.Linear(5, 3))


def _assert_same_grads(a: nn.Module, b: nn.Module) -> None:
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert pb.grad is not None, name
        torch.testing.assert_close(pb.grad, pa.grad, **TOL, msg=name)


@pytest.mark.parametrize("shape", [(5, 4), (2, 3, 4), (4,)], ids=["2d", "3d", "1d"])
def test_fused_accumulation_equals_autograd_over_several_backwards(shape):
    ref, fused = _mlp(), _mlp()
    torch.manual_seed(1)
    xs = [torch.randn(*shape) for _ in range(3)]
    gs = [torch.randn(*shape[:-1], 3) for _ in range(3)]
    for x, g in zip(xs, gs, strict=True):  # three microbatches accumulate
        xr, xf = x.clone().requires_grad_(), x.clone().requires_grad_()
        ref(xr).backward(g)
        store = WeightGradStore()
        with FuseLinearWeightGrad(store):
            out = fused(xf)
        assert store.fused == 3 and is_fused_linear_node(out.grad_fn)
        out.backward(g)
        torch.testing.assert_close(xf.grad, xr.grad, **TOL)
    _assert_same_grads(ref, fused)


def test_input_without_grad_only_weight_gradients():
    ref, fused = _mlp(), _mlp()
    x, g = torch.randn(5, 4), torch.randn(5, 3)
    ref(x).backward(g)
    with FuseLinearWeightGrad(WeightGradStore()):
        out = fused(x)
    out.backward(g)
    _assert_same_grads(ref, fused)


def test_defer_keeps_the_weight_gradient_for_flush_and_skip_drops_it():
    ref, fused = _mlp(), _mlp()
    x, g = torch.randn(5, 4), torch.randn(5, 3)
    ref(x).backward(g)
    store = WeightGradStore()
    with FuseLinearWeightGrad(store):
        out = fused(x)
    store.mode = StoreMode.DEFER
    out.backward(g)
    assert all(p.grad is None for p in fused.parameters())
    store.flush()
    _assert_same_grads(ref, fused)
    store = WeightGradStore()
    with FuseLinearWeightGrad(store):
        out = fused(x)
    store.mode = StoreMode.SKIP
    out.backward(g)
    _assert_same_grads(ref, fused)  # unchanged: the skipped gradient was not added


def _hooked(model: nn.Module) -> list[int]:
    calls: list[int] = []
    model[0].weight.register_hook(lambda grad: calls.append(1))
    return calls


@pytest.mark.parametrize(
    "case", ["no_grad", "frozen", "hook", "post_accumulate_hook", "autocast", "checkpoint"]
)
def test_ineligible_calls_run_plain_linear(case):
    ref, fused = _mlp(), _mlp()
    x, g = torch.randn(5, 4), torch.randn(5, 3)
    store = WeightGradStore()
    if case == "no_grad":
        with torch.no_grad(), FuseLinearWeightGrad(store):
            fused(x)
        assert store.fused == 0
        return
    calls: list[int] = []
    if case == "frozen":
        for model in (ref, fused):
            for p in model.parameters():
                p.requires_grad_(False)
            model[3].requires_grad_(True)
    if case == "hook":
        calls = _hooked(fused)
        _hooked(ref)
    if case == "post_accumulate_hook":
        fused[0].weight.register_post_accumulate_grad_hook(lambda p: calls.append(1))
    with FuseLinearWeightGrad(store):
        if case == "autocast":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = fused(x)
        elif case == "checkpoint":  # non-reentrant: recomputes outside the mode
            out = checkpoint(fused, x, use_reentrant=False)
        else:
            out = fused(x)
    if case == "autocast":
        assert store.fused == 0
        return
    if case == "frozen":
        assert store.fused == 1  # only the trainable last layer
    elif case in ("hook", "post_accumulate_hook"):
        assert store.fused == 2  # the hooked first layer stays on autograd
    else:
        assert store.fused == 0
    out.backward(g)
    ref_out = ref(x)
    ref_out.backward(g)
    for (name, pa), pb in zip(ref.named_parameters(), fused.parameters(), strict=True):
        if pa.grad is None:
            assert pb.grad is None, name
        else:
            torch.testing.assert_close(pb.grad, pa.grad, **TOL, msg=name)
    if case in ("hook", "post_accumulate_hook"):
        assert calls == [1]


def test_reentrant_checkpoint_recomputes_in_backward_and_stays_exact():
    ref, fused = _mlp(), _mlp()
    x, g = torch.randn(5, 4, requires_grad=True), torch.randn(5, 3)
    ref(x).backward(g)
    ref_x_grad = x.grad.clone()
    x.grad = None
    store = WeightGradStore()
    with FuseLinearWeightGrad(store):
        out = checkpoint(fused, x, use_reentrant=True)
    out.backward(g)
    assert store.fused == 0  # the forward ran under no_grad
    _assert_same_grads(ref, fused)
    torch.testing.assert_close(x.grad, ref_x_grad, **TOL)


def test_batcher_keeps_rows_within_budget_and_flushes_them_in_one_addition():
    torch.manual_seed(0)
    ref, fused = nn.Linear(64, 32), nn.Linear(64, 32)
    fused.load_state_dict(ref.state_dict())
    batcher = WeightGradBatcher(budget=0.25)  # 0.25 * 8 KiB weight = 2 KiB = 5 rows of (64+32)*4 B
    flushed_after = []
    for step in range(7):
        x, g = torch.randn(1, 64), torch.randn(1, 32)
        ref(x).backward(g)
        store = WeightGradStore(batcher)
        with FuseLinearWeightGrad(store):
            out = fused(x)
        out.backward(g)
        if fused.weight.grad is not None and not flushed_after:
            flushed_after.append(step)
    assert flushed_after == [5]  # the sixth row went over the budget
    batcher.flush()
    _assert_same_grads(ref, fused)


def test_executor_batches_weight_gradients_of_wide_layers_with_few_rows():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(48, 64), nn.ReLU(), nn.Linear(64, 64), nn.Linear(64, 8))
    x, y = torch.randn(8, 48), torch.randn(8, 8)  # 8 microbatches of one row
    ref = copy.deepcopy(model)
    ((ref(x) - y) ** 2).mean().backward()
    schedule = PipelineSchedule(8)
    stage = select_stage_layers(model, 0, 1, method="uniform")[0]
    PipelineRunner(schedule).train_step(
        stage, iter([(x, y)]), lambda o, t: ((o - t) ** 2).mean(), keep_outputs=False
    )
    _assert_same_grads(ref, model)


# --------------------------------------------------------------------------- split backward


class _OffInputPath(nn.Module):
    """A linear layer applied to a learned constant: not reachable from the stage's input."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(4, 3)
        self.bias_proj = nn.Linear(2, 3)
        self.const = nn.Parameter(torch.randn(1, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) + self.bias_proj(self.const)


def _mixed() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.LayerNorm(6), nn.Tanh(), nn.Linear(6, 3))


@pytest.mark.parametrize(
    ("factory", "with_input", "split"),
    [
        (_mlp, True, True),  # fused layers only: W is the store's flush
        (_mixed, True, True),  # fused layers and a LayerNorm's split node
        (_OffInputPath, True, False),  # falls back: W runs one full backward
        (_mlp, False, False),  # first stage: everything in W
    ],
    ids=["fused_only", "mixed", "off_input_path", "first_stage"],
)
def test_split_backward_with_fused_layers(factory, with_input, split):
    ref, fused = factory(), factory()
    torch.manual_seed(3)
    x, g = torch.randn(5, 4), torch.randn(5, 3)
    xr = x.clone().requires_grad_(with_input)
    ref(xr).backward(g)
    xf = x.clone().requires_grad_(with_input)
    store = WeightGradStore()
    with FuseLinearWeightGrad(store):
        out = fused(xf)
    assert store.fused >= 2
    input_grads, work = backward_input([out], [g], [xf] if with_input else [], store)
    assert work.split is split
    assert all(p.grad is None for p in fused.parameters())  # B touched no weight
    if with_input:
        torch.testing.assert_close(input_grads[0], xr.grad, **TOL)
    backward_weight(work)
    _assert_same_grads(ref, fused)


# --------------------------------------------------------------------------- executor


@pytest.mark.parametrize(
    "make",
    [
        lambda: GPipeSchedule(4),
        lambda: PipelineSchedule(4),
        lambda: ZeroBubbleSchedule(4),
        lambda: InterleavedPipelineSchedule(4, 2),
    ],
    ids=["gpipe", "1f1b", "zero_bubble", "interleaved"],
)
def test_schedules_with_and_without_fusion_match_the_reference(make):
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 6), nn.LayerNorm(6), nn.Linear(6, 6),
        nn.Linear(6, 2),
    )  # fmt: skip
    x, y = torch.randn(8, 4), torch.randn(8, 2)
    ref = copy.deepcopy(model)
    ((ref(x) - y) ** 2).mean().backward()
    for fuse in (True, False):
        trained = copy.deepcopy(model)
        schedule = make()
        stages = select_stage_layers(trained, 0, 1, schedule.num_chunks, method="uniform")
        stage = stages[0] if schedule.num_chunks == 1 else stages
        PipelineRunner(schedule, fuse_weight_grad=fuse).train_step(
            stage, iter([(x, y)]), lambda o, t: ((o - t) ** 2).mean(), keep_outputs=False
        )
        _assert_same_grads(ref, trained)


def _ddp_is_never_fused() -> tuple[bool, bool, bool]:
    model = _mlp()
    wrapped = nn.parallel.DistributedDataParallel(copy.deepcopy(model))
    # a DDP submodule: its reducer hooks the accumulation nodes, which the leaf check cannot see
    nested = nn.Sequential(nn.parallel.DistributedDataParallel(nn.Linear(4, 4)), nn.Tanh())
    return stage_allows_fusion(model), stage_allows_fusion(wrapped), stage_allows_fusion(nested)


def test_ddp_wrapped_stage_is_not_fused(dist: Any) -> None:
    for plain, wrapped, nested in dist.run(_ddp_is_never_fused, world_size=2, timeout=60):
        assert plain and not wrapped and not nested
    assert tdist.is_available()


def test_compiled_stages_are_not_fused_and_kept_rows_do_not_pin_larger_storages():
    model = _mlp()
    assert stage_allows_fusion(model)
    assert not stage_allows_fusion(torch.compile(model))  # wrapped
    inner = _mlp()
    inner[2].compile()  # compiled in place
    assert not stage_allows_fusion(inner)
    batcher = WeightGradBatcher(budget=1.0)
    layer = nn.Linear(64, 32)
    big, g = torch.randn(100, 64), torch.randn(2, 32)
    batcher.add(layer.weight, layer.bias, big[:2], g)
    (kept,) = batcher._rows[id(layer.weight)][2]
    assert kept.untyped_storage().nbytes() == kept.nbytes  # a copy, not a view of `big`
    assert layer.weight.grad is None
    batcher.flush()
    torch.testing.assert_close(layer.weight.grad, g.t() @ big[:2])
    torch.testing.assert_close(layer.bias.grad, g.sum(0))


# --------------------------------------------------------------------------- review regressions


class _TiedBelow(nn.Module):
    """The layer's weight is used again by a matmul above the layer (on the input path)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) @ self.lin.weight


class _TiedBias(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.lin.bias


class _TiedBeside(nn.Module):
    """The weight's other use is on a branch that does not go through the fused layer."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + torch.tanh(x) @ self.lin.weight


@pytest.mark.parametrize(
    ("factory", "split"),
    [(_TiedBelow, False), (_TiedBias, False), (_TiedBeside, True)],
    ids=["weight_above", "bias_above", "weight_beside"],
)
def test_split_backward_with_a_fused_weight_tied_to_another_op(factory, split):
    # W started at the matmul would run the fused layer again (it has an edge to the weight)
    # and keep its rows twice: such a stage falls back to the full backward in W.
    ref, fused = factory(), factory()
    for mb in range(2):
        torch.manual_seed(10 + mb)
        x, g = torch.randn(3, 4), torch.randn(3, 4)
        xr = x.clone().requires_grad_()
        ref(xr).backward(g)
        xf = x.clone().requires_grad_()
        store = WeightGradStore()
        with FuseLinearWeightGrad(store):
            out = fused(xf)
        assert store.fused == 1
        input_grads, work = backward_input([out], [g], [xf], store)
        assert work.split is split
        torch.testing.assert_close(input_grads[0], xr.grad, **TOL)
        backward_weight(work)
    _assert_same_grads(ref, fused)


class _GradientPenalty(nn.Module):
    """Calls torch.autograd.grad inside its forward (w.r.t. its input, building a graph)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)
        self.out = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x if x.requires_grad else x.clone().requires_grad_()
        h = self.lin(x)
        (gx,) = torch.autograd.grad(h.pow(2).sum(), x, create_graph=True)
        return self.out(h + gx)


class _InnerStep(nn.Module):
    """One inner gradient step on its own weight inside the forward (MAML-like)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inner = self.lin(x).pow(2).sum()
        (gw,) = torch.autograd.grad(inner, self.lin.weight, create_graph=True)
        return F.linear(x, self.lin.weight - 0.1 * gw, self.lin.bias)


@pytest.mark.parametrize("factory", [_GradientPenalty, _InnerStep], ids=["penalty", "inner"])
def test_a_backward_inside_the_forward_gets_plain_autograd_semantics(factory):
    # Neither the inner call's weight gradient is added to .grad, nor is it missing from what
    # the inner call asks for.
    model = factory()
    x, y = torch.randn(4, 4), torch.randn(4, 2)
    ref = copy.deepcopy(model)
    ((ref(x) - y) ** 2).mean().backward()
    schedule = GPipeSchedule(1)
    PipelineRunner(schedule).train_step(
        model, iter([(x, y)]), lambda o, t: ((o - t) ** 2).mean(), keep_outputs=False
    )
    _assert_same_grads(ref, model)
    store = WeightGradStore()
    with FuseLinearWeightGrad(store):
        model(x)
    assert store.fused >= 1 and store.mode is StoreMode.ACCUMULATE  # restored after the forward


class _ScalarBias(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.weight = nn.Parameter(torch.randn(3, 4))
        self.bias = nn.Parameter(torch.randn(1))  # broadcast over the 3 outputs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


def _complex_linear() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(4, 3).to(torch.cfloat)


@pytest.mark.parametrize("factory", [_ScalarBias, _complex_linear], ids=["bias", "complex"])
def test_broadcast_bias_and_complex_weights_are_left_to_autograd(factory):
    ref, fused = factory(), factory()
    dtype = next(ref.parameters()).dtype
    x = torch.randn(5, 4, dtype=dtype)
    ref(x).abs().pow(2).sum().backward()
    store = WeightGradStore()
    with FuseLinearWeightGrad(store):
        out = fused(x)
    assert store.fused == 0
    out.abs().pow(2).sum().backward()
    _assert_same_grads(ref, fused)


class _DropsGradient(torch.autograd.Function):
    """Passes two tensors on and sends no gradient (None, not zeros) to the second."""

    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return a * 1, b * 1

    @staticmethod
    def backward(ctx: Any, ga: torch.Tensor, gb: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ga, None


def test_a_layer_no_gradient_reaches_keeps_grad_none():
    torch.manual_seed(0)
    used, unused = nn.Linear(4, 3), nn.Linear(4, 3)
    x = torch.randn(2, 4)
    store = WeightGradStore()
    with FuseLinearWeightGrad(store):
        a, b = _DropsGradient.apply(used(x), unused(x))
        out = a + b
    assert store.fused == 2
    out.sum().backward()
    assert used.weight.grad is not None
    assert unused.weight.grad is None and unused.bias.grad is None  # as autograd leaves them


def test_split_backward_gives_a_parameter_output_and_a_sparse_gradient_their_grads():
    class Passes(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.randn(4))
            self.token = nn.Parameter(torch.randn(3, 4))  # handed on to the next stage as is
            self.emb = nn.Embedding(5, 4, sparse=True)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return x * self.scale * self.emb(torch.tensor([0, 1, 1])), self.token

    torch.manual_seed(0)
    ref = Passes()
    split = copy.deepcopy(ref)
    for _ in range(2):
        x, g1, g2 = torch.randn(3, 4), torch.randn(3, 4), torch.randn(3, 4)
        a, b = ref(x.clone().requires_grad_())
        torch.autograd.backward([a, b], [g1, g2])
        xs = x.clone().requires_grad_()
        outs = list(split(xs))
        _, work = backward_input(outs, [g1, g2], [xs])
        backward_weight(work)
    for (name, pa), pb in zip(ref.named_parameters(), split.parameters(), strict=True):
        assert pb.grad is not None, name
        torch.testing.assert_close(pb.grad.to_dense(), pa.grad.to_dense(), **TOL, msg=name)
