"""``parallelize``: models nobody wrote for tessera, against the single-process model.

For each mode: the full state dict after converting equals the original one (names, forms,
tied weights); the loss and every parameter gradient equal the single-process model's from
the same weights and batch. One worker pool per world size runs every check of that size.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hf_models import GPT2_CONFIG, gpt2_lm, token_ids
from torch import nn

from tessera.context import ParallelContext, create_context
from tessera.layers import (
    ModeNotImplementedError,
    causal_lm_loss,
    gather_full_state_dict,
    load_full_state_dict,
    parallelize,
    split_batch,
)

pytest.importorskip("transformers")

TOL = dict(rtol=1e-5, atol=1e-5)

#: name -> the ``tensor`` block of the parallel config.
LAYOUTS: dict[str, dict[str, Any]] = {
    "1d": dict(size=2, mode="1d"),
    "1d-sp": dict(size=2, mode="1d", sequence_parallel=True),
    "1d-4": dict(size=4, mode="1d"),
    "2d": dict(size=4, mode="2d"),
    "2.5d": dict(size=8, mode="2.5d", depth=2),
    "3d": dict(size=8, mode="3d"),
}


def _context(tensor: dict[str, Any]) -> ParallelContext:
    return create_context(dict(parallel=dict(tensor=tensor)), timeout=60.0)


def _full_grads(model: nn.Module, ctx: ParallelContext) -> dict[str, torch.Tensor]:
    """Every parameter's gradient in the original model's names and forms."""
    saved = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        for n, p in model.named_parameters():
            assert p.grad is not None, f"{n} has no gradient"
            p.copy_(p.grad)
    grads = gather_full_state_dict(model, context=ctx)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(saved[n])
    return grads


def _assert_same_state(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].shape == tensor.shape, (name, got[name].shape, tensor.shape)
        assert torch.equal(got[name], tensor), f"{name} differs after parallelize"


def _gpt2_matches_reference(tensor: dict[str, Any]) -> dict[str, Any]:
    ctx = _context(tensor)
    try:
        ref = gpt2_lm()
        model = parallelize(copy.deepcopy(ref), context=ctx)
        original = ref.state_dict()
        _assert_same_state(gather_full_state_dict(model, context=ctx), original)
        assert model.lm_head.weight is model.transformer.wte.weight, "the head is no longer tied"

        ids = token_ids()
        ref_logits = ref(ids).logits
        ref_loss = F.cross_entropy(
            ref_logits[:, :-1].reshape(-1, GPT2_CONFIG["vocab_size"]), ids[:, 1:].reshape(-1)
        )
        ref_loss.backward()
        logits = model(ids).logits
        loss = causal_lm_loss(logits, ids, context=ctx)
        loss.backward()
        torch.testing.assert_close(loss, ref_loss, **TOL)
        if tensor["mode"] == "1d":  # [b, s, V/p]: this rank's classes
            rank, world = ctx.get_local_rank("parallel_1d"), tensor["size"]
            expected = ref_logits.detach().chunk(world, -1)[rank]
        else:  # [b/(depth q), s, V]: this rank's rows
            expected = split_batch(ref_logits.detach(), ctx)
        torch.testing.assert_close(logits, expected, **TOL)

        grads = _full_grads(model, ctx)
        for name, p in ref.named_parameters(remove_duplicate=False):
            assert p.grad is not None
            torch.testing.assert_close(
                grads[name], p.grad, **TOL, msg=lambda m, n=name: f"{n} grad: {m}"
            )
        # The original state dict loads back as it is (Conv1D orientation, fused q/k/v).
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        load_full_state_dict(model, original)
        _assert_same_state(gather_full_state_dict(model, context=ctx), original)
        return {"loss": round(float(loss.detach()), 5), "mlp": _mlp_matches_reference(ctx)}
    finally:
        ctx.destroy()


def _plain_block(*layers: nn.Module) -> nn.Sequential:
    torch.manual_seed(3)
    ref = nn.Sequential(*layers)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn(p.shape) * 0.1)
    return ref


def _mlp_matches_reference(ctx: ParallelContext) -> int:
    """Plain torch blocks with a user's dict plan: full input in, full output out.

    The first is a pre-norm MLP; the second the paper's Listing 1 (Linear -> LayerNorm ->
    Linear), whose LayerNorm takes the column layer's output.
    """
    mlp = _plain_block(nn.LayerNorm(16), nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
    checked = _block_matches_reference(ctx, mlp, {"0": "norm", "1": "col", "3": "row"})
    listing_1 = _plain_block(nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 16))
    checked += _block_matches_reference(ctx, listing_1, {"0": "col", "1": "norm", "2": "row"})
    return checked + _dispatching_listing_1(ctx)


def _dispatching_listing_1(ctx: ParallelContext) -> int:
    """Listing 1 written with the dispatching layers, no layout argument but the 3D one."""
    from tessera.layers import LayerNorm, Linear, gather_activation, split_activation

    ref = _plain_block(nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 16))
    model = nn.Sequential(
        Linear(16, 32, parallel="col", context=ctx),
        LayerNorm(32, parallel_input=True, context=ctx),
        Linear(32, 16, parallel="row", context=ctx),
    )
    load_full_state_dict(model, ref.state_dict())
    x = torch.randn(4, 8, 16, generator=torch.Generator().manual_seed(4))
    w = torch.randn(4, 8, 16, generator=torch.Generator().manual_seed(5))
    y_ref = ref(x)
    y = gather_activation(model(split_activation(x, ctx)), ctx)
    torch.testing.assert_close(y, y_ref, **TOL)
    (y_ref * w).sum().backward()
    (y * w).sum().backward()
    grads = _full_grads(model, ctx)
    for name, p in ref.named_parameters():
        assert p.grad is not None
        torch.testing.assert_close(grads[name], p.grad, **TOL, msg=lambda m, n=name: f"{n}: {m}")
    if ctx.config.tensor_mode == "3d":  # the same shapes in both layouts: the mark tells
        unmarked = nn.Sequential(model[0], LayerNorm(32, context=ctx))
        with pytest.raises(ValueError, match=r"input is in layout 'z'.*parallel_input=True"):
            unmarked(split_activation(x, ctx))
    return len(grads)


def _block_matches_reference(ctx: ParallelContext, ref: nn.Module, plan: dict[str, str]) -> int:
    model = parallelize(copy.deepcopy(ref), plan, context=ctx)
    x = torch.randn(4, 8, 16, generator=torch.Generator().manual_seed(4))
    x_ref, x_par = x.clone().requires_grad_(), x.clone().requires_grad_()
    w = torch.randn(4, 8, 16, generator=torch.Generator().manual_seed(5))
    y_ref, y_par = ref(x_ref), model(x_par)
    (y_ref * w).sum().backward()
    (y_par * w).sum().backward()
    torch.testing.assert_close(y_par, y_ref, **TOL)
    assert x_par.grad is not None and x_ref.grad is not None
    torch.testing.assert_close(x_par.grad, x_ref.grad, **TOL)
    grads = _full_grads(model, ctx)
    for name, p in ref.named_parameters():
        assert p.grad is not None
        torch.testing.assert_close(grads[name], p.grad, **TOL, msg=lambda m, n=name: f"{n}: {m}")
    return len(grads)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_gpt2_and_a_plain_block_equal_single_process(dist, layout: str) -> None:
    tensor = LAYOUTS[layout]
    results = dist.run(
        _gpt2_matches_reference, world_size=tensor["size"], args=(tensor,), timeout=180.0
    )
    assert results[0]["mlp"] == 18
    assert all(r == results[0] for r in results)


def _errors() -> list[str]:
    """Each misuse raises before any collective, naming what to do."""
    from transformers import GPT2LMHeadModel

    caught: list[str] = []

    def expect(error: type[Exception], text: str, fn: Any) -> None:
        with pytest.raises(error, match=text):
            fn()
        caught.append(text)

    ctx = _context(dict(size=2, mode="1d"))
    try:
        block = nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
        expect(
            ValueError,
            r"patterns \['fc9'\] match no module",
            lambda: parallelize(copy.deepcopy(block), {"1": "col", "fc9": "row"}, context=ctx),
        )
        expect(
            ValueError,
            r"'1' is a 'row' layer with no 'col'",
            lambda: parallelize(copy.deepcopy(block), {"1": "row", "3": "col"}, context=ctx),
        )
        expect(
            ValueError,
            "splits no parameter",
            lambda: parallelize(copy.deepcopy(block), {"0": "norm"}, context=ctx),
        )
        expect(
            TypeError,
            "takes an nn.Linear",
            lambda: parallelize(copy.deepcopy(block), {"0": "col"}, context=ctx),
        )
        expect(
            ValueError,
            "ships no plan for Sequential",
            lambda: parallelize(copy.deepcopy(block), context=ctx),
        )
        twice = parallelize(copy.deepcopy(block), {"1": "col", "3": "row"}, context=ctx)
        expect(ValueError, "already parallelized", lambda: parallelize(twice, context=ctx))
        odd_heads = gpt2_lm(n_embd=18, n_head=3)
        expect(
            ValueError,
            r"num_heads = 3 is not divisible by the 2 ranks",
            lambda: parallelize(odd_heads, context=ctx),
        )
        lm = parallelize(gpt2_lm(), context=ctx)
        assert isinstance(lm, GPT2LMHeadModel)
        ids = token_ids()
        expect(ValueError, "causal_lm_loss", lambda: lm(ids, labels=ids))
    finally:
        ctx.destroy()
    seq = _context(dict(size=2, mode="sequence"))
    try:
        expect(
            ModeNotImplementedError,
            "no parallelize for tensor mode 'sequence'",
            lambda: parallelize(gpt2_lm(), context=seq),
        )
    finally:
        seq.destroy()
    return caught


def test_misuse_is_a_clear_error(dist) -> None:
    results = dist.run(_errors, world_size=2, timeout=120.0)
    assert len(results[0]) == 9


def test_a_plan_with_an_unknown_role_is_refused() -> None:
    from tessera.layers import Plan

    with pytest.raises(ValueError, match=r"unknown role 'column'.*did you mean 'col'"):
        Plan({"fc1": "column"})
