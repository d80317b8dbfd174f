"""``torch.compile`` of a parallelized model: one graph, no break, and eager's numbers.

A training step's forward and loss (transformers' GPT-2, parallelized) is compiled with
``fullgraph=True``, so any graph break, tessera's or transformers', fails the test; the
backward runs through the compiled graph's own backward (AOTAutograd). Its loss and every
gradient must equal the eager parallel step's (the layout tests hold that equal to one
process), dropout included: the eager model draws from the counter streams a traced split
region draws from (``shared/rank_draws.py``). The ``aot_eager`` backend traces forward and
backward as Inductor would, without generating code (seconds, not minutes, on CPU);
``benchmarks/bench_compile.py`` runs Inductor.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

#: name -> the ``tensor`` block of the parallel config (the modes the issue names).
LAYOUTS: dict[str, dict[str, Any]] = {
    "1d": dict(size=2, mode="1d"),
    "2d": dict(size=4, mode="2d"),
    "3d": dict(size=8, mode="3d"),
    "sequence-ring": dict(size=2, mode="sequence"),
}


def _compiled_step_equals_eager(tensor: dict[str, Any]) -> tuple[float, float]:
    """GPT-2 with dropout 0.1 everywhere: one compiled graph, eager's numbers.

    Traced, the split regions answer their draws from each rank's counter stream (a
    generator fork cannot be traced); the eager model is told to draw from the same streams,
    so both draw the same masks. Returns the loss and the sum of the embeddings' output after
    its dropout, which 1D holds whole: alike on every rank only if that dropout was not
    taken for a split region's.
    """
    from transformers import GPT2Config, GPT2LMHeadModel

    from tessera.context import create_context
    from tessera.layers import causal_lm_loss, parallelize

    # Each rank compiles alone: on 2 cores one of 8 can reach the first collective minutes
    # after another (a CI run lost 3D's step to a 60 s timeout), so the collectives wait long.
    ctx = create_context(dict(parallel=dict(tensor=tensor)), timeout=240.0)
    try:
        torch.manual_seed(0)
        config = GPT2Config(
            vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=4, resid_pdrop=0.1,
            embd_pdrop=0.1, attn_pdrop=0.1, bos_token_id=0, eos_token_id=0,
        )  # fmt: skip
        plain = GPT2LMHeadModel(config)
        eager = parallelize(copy.deepcopy(plain), context=ctx)
        eager._tessera_rank_fork.streams_in_eager = True
        compiled_model = parallelize(plain, context=ctx)
        ids = torch.randint(0, 64, (8, 8), generator=torch.Generator().manual_seed(1))

        def step(model: torch.nn.Module, batch: torch.Tensor) -> tuple[torch.Tensor, ...]:
            out = model(batch, output_hidden_states=True)
            return causal_lm_loss(out.logits, batch, context=ctx), out.hidden_states[0]

        compiled_model(ids, output_hidden_states=True)  # the first call's checks, eagerly
        torch.manual_seed(7)  # alike on every rank, as the context seeds it
        expected, _ = step(eager, ids)
        expected.backward()
        torch._dynamo.reset()
        torch.manual_seed(7)
        loss, embedded = torch.compile(step, backend="aot_eager", fullgraph=True)(
            compiled_model, ids
        )
        loss.backward()
        torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-6)
        grads = dict(eager.named_parameters())
        for name, p in compiled_model.named_parameters():
            reference = grads[name].grad
            assert p.grad is not None and reference is not None, name
            torch.testing.assert_close(p.grad, reference, rtol=1e-5, atol=1e-6, msg=name)
        # every mode a region entered was left (the first call's check and the streams nest)
        assert torch._C._len_torch_function_stack() == 0
        return float(loss.detach()), float(embedded.detach().sum())
    finally:
        torch._dynamo.reset()
        ctx.destroy()


def _compiled_mesh_dropout_differs_per_rank(ctx: Any) -> None:
    """``Dropout2D`` compiled whole: each rank's block gets a mask of its own."""
    from tessera.layers import Dropout2D

    dropout = torch.compile(Dropout2D(0.5, context=ctx), backend="aot_eager", fullgraph=True)
    torch.manual_seed(3)  # alike on every rank
    mask = (dropout(torch.ones(16, 16)) != 0).float()
    masks = [torch.empty_like(mask) for _ in range(4)]
    torch.distributed.all_gather(masks, mask)
    assert all(not torch.equal(masks[0], other) for other in masks[1:])


def _compiled_drop_paths_equal_eager() -> int:
    """Stochastic depth compiled whole: each rank's numbers from its stream, then the first
    rank's of the group holding parts of the same samples (a traced broadcast; 1D with
    sequence parallelism cuts the tokens, as 2D's columns cut the features, on 2 ranks), as
    the eager model drawing from the streams."""
    from tessera.context import create_context

    tensor = dict(size=2, mode="1d", sequence_parallel=True)
    # Each rank compiles alone: on 2 cores one of 8 can reach the first collective minutes
    # after another (a CI run lost 3D's step to a 60 s timeout), so the collectives wait long.
    ctx = create_context(dict(parallel=dict(tensor=tensor)), timeout=240.0)
    try:
        return _drop_paths_equal(ctx)
    finally:
        torch._dynamo.reset()
        ctx.destroy()


def _drop_paths_equal(ctx: Any) -> int:
    from plain_models import DropPathLM

    from tessera.layers import parallelize

    torch.manual_seed(0)
    plain = DropPathLM(drop=0.5, layers=1)
    eager = parallelize(copy.deepcopy(plain), context=ctx)
    eager._tessera_rank_fork.streams_in_eager = True
    compiled_model = parallelize(plain, context=ctx)
    ids = torch.randint(0, 32, (8, 16), generator=torch.Generator().manual_seed(2))
    compiled_model(ids)  # the first call's checks, eagerly
    torch.manual_seed(5)
    expected = eager(ids)
    torch._dynamo.reset()
    torch.manual_seed(5)
    got = torch.compile(compiled_model, backend="aot_eager", fullgraph=True)(ids)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    return 1


@pytest.mark.newest_torch_only  # the pinned torch traces the same streams (GPT-2 above)
def test_compiled_drop_paths_equal_eager(dist: Any) -> None:
    assert dist.run(_compiled_drop_paths_equal_eager, world_size=2, timeout=300.0) == [1] * 2


def _mesh_products_equal_eager() -> int:
    """Each 2D product variant (SUMMA, streamed SUMMA, stationary weights), compiled whole.

    Then a compiled ``Dropout2D``: the layers' own dropout is traced too.

    On a 2 x 2 mesh the layers pick SUMMA or stationary weights by shape, and stream SUMMA
    only on larger meshes: here each is asked for by name, so its traced collectives (one
    all-gather for the broadcast panels, one reduce-scatter for the reduced partials, one
    all-to-all for the point-to-point blocks) are checked against its eager schedule.
    """
    from tessera.context import create_context
    from tessera.layers.mesh.layout import mesh_of
    from tessera.layers.mesh.matmul import mesh_linear

    ctx = create_context(dict(parallel=dict(tensor=LAYOUTS["2d"])), timeout=60.0)
    try:
        mesh = mesh_of(ctx, "2d")
        seed = torch.Generator().manual_seed(10 + torch.distributed.get_rank())  # each its block
        x = torch.randn(6, 4, generator=seed)  # [m, in/q]
        weight, bias = torch.randn(5, 4, generator=seed), torch.randn(5, generator=seed)
        grad_out = torch.randn(6, 5, generator=seed)
        for algorithm in ("summa", "streamed", "stationary"):
            results = []
            for run in (
                mesh_linear,
                torch.compile(mesh_linear, backend="aot_eager", fullgraph=True),
            ):
                leaves = [t.clone().requires_grad_() for t in (x, weight, bias)]
                y = run(*leaves, mesh, algorithm)
                (y * grad_out).sum().backward()
                results.append([y.detach(), *(t.grad for t in leaves)])
            for got, want in zip(results[1], results[0], strict=True):
                torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, msg=algorithm)
            torch._dynamo.reset()
        _compiled_mesh_dropout_differs_per_rank(ctx)
        return 3
    finally:
        torch._dynamo.reset()
        ctx.destroy()


def test_each_2d_product_compiles_whole_and_equals_eager(dist: Any) -> None:
    assert dist.run(_mesh_products_equal_eager, world_size=4, timeout=300.0) == [3] * 4


@pytest.mark.parametrize(
    "layout",
    # 3D's collectives are 2D's (all-gather, reduce-scatter, all-to-all) on other groups; the
    # compiled steps but 1D's run on the newest torch (the layout checks under 2D run there
    # too), the pinned one compiling 1D's and 2D's products
    [pytest.param(n, marks=[pytest.mark.newest_torch_only] * (n != "1d")) for n in LAYOUTS],
)
def test_a_compiled_step_is_one_graph_and_equals_eager(dist: Any, layout: str) -> None:
    tensor = LAYOUTS[layout]
    results = dist.run(
        _compiled_step_equals_eager, world_size=tensor["size"], args=(tensor,), timeout=300.0
    )
    assert all(loss == results[0][0] for loss, _ in results)  # the whole batch's, everywhere
    if layout == "1d":  # the embeddings' output is whole: its dropout mask alike on each rank
        assert all(embedded == results[0][1] for _, embedded in results)


def _left_out_modules_equal_eager() -> float:
    """A model whose own modules run under DTensor (conversion/left_out.py), compiled.

    Not one graph: torch's DTensor breaks it where the hooks wrap a module's inputs (its
    dispatch takes a lock Dynamo cannot enter), so ``fullgraph`` is off; the loss and every
    gradient still equal eager's.
    """
    from plain_models import OWN_MODULES_PLAN, own_modules_lm

    from tessera.context import create_context
    from tessera.layers import causal_lm_loss, parallelize

    # 1D with sequence parallelism splits the norms' tokens, so they run under DTensor as on
    # the grids, on 2 ranks (2D's 4 took a minute on CI's 2 cores)
    tensor = dict(size=2, mode="1d", sequence_parallel=True)
    # Each rank compiles alone: on 2 cores one of 8 can reach the first collective minutes
    # after another (a CI run lost 3D's step to a 60 s timeout), so the collectives wait long.
    ctx = create_context(dict(parallel=dict(tensor=tensor)), timeout=240.0)
    try:
        plain = own_modules_lm(layers=1)  # each block compiles alike: one is enough
        eager = parallelize(copy.deepcopy(plain), OWN_MODULES_PLAN, context=ctx)
        compiled_model = parallelize(plain, OWN_MODULES_PLAN, context=ctx)
        ids = torch.randint(0, 32, (8, 8), generator=torch.Generator().manual_seed(1))
        expected = causal_lm_loss(eager(ids), ids, context=ctx)
        expected.backward()
        torch._dynamo.reset()
        compiled = torch.compile(compiled_model, backend="aot_eager")
        loss = causal_lm_loss(compiled(ids), ids, context=ctx)
        loss.backward()
        torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-6)
        grads = dict(eager.named_parameters())
        for name, p in compiled_model.named_parameters():
            reference = grads[name].grad
            assert p.grad is not None and reference is not None, name
            torch.testing.assert_close(p.grad, reference, rtol=1e-5, atol=1e-6, msg=name)
        return float(loss)
    finally:
        torch._dynamo.reset()
        ctx.destroy()


@pytest.mark.newest_torch_only  # the compiled steps above cover Dynamo on the pinned torch
def test_modules_left_out_of_the_plan_compile_and_equal_eager(dist: Any) -> None:
    losses = dist.run(_left_out_modules_equal_eager, world_size=2, timeout=300.0)
    assert all(loss == losses[0] for loss in losses)
