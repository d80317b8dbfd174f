"""Helpers for the 2D / 2.5D tests: contexts, mesh blocks of full tensors, the reference check.

Imported by the test modules and, through them, by the harness's worker processes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as tdist
from torch import nn
from tp_reference import TOL, first, randomize

from tessera.context import ParallelContext, create_context, get_shard_info
from tessera.layers import Mesh, load_full_state_dict, mesh_of

#: (mode, tensor size, depth) of every configuration the tests run.
CONFIGS = {
    "2d-4": ("2d", 4, None),
    "2.5d-4-depth1": ("2.5d", 4, 1),
    "2.5d-8-depth2": ("2.5d", 8, 2),
}

#: What a tensor is split like: "act" = [b, ..., h] batch and hidden, "batch" = dim 0 only,
#: None = whole.
Layout = str | None


def mesh_context(mode: str, size: int, depth: int | None) -> ParallelContext:
    tensor: dict[str, Any] = dict(size=size, mode=mode)
    if depth is not None:
        tensor["depth"] = depth
    return create_context(dict(parallel=dict(tensor=tensor)), timeout=60.0)


def with_mesh(config: str, body: Callable[[ParallelContext], Any]) -> Any:
    ctx = mesh_context(*CONFIGS[config])
    try:
        return body(ctx)
    finally:
        ctx.destroy()


def mesh(ctx: ParallelContext) -> Mesh:
    return mesh_of(ctx, str(ctx.config.tensor_mode))


def block(x: torch.Tensor, ctx: ParallelContext, layout: Layout) -> torch.Tensor:
    """This rank's block of full ``x``: batch block ``k*q + i``, hidden block ``j``."""
    if layout is None:
        return x
    m = mesh(ctx)
    x = x.chunk(m.batch.world_size, 0)[m.batch.rank]
    if layout == "act":
        x = x.chunk(m.q, -1)[m.row.rank]
    return x


def sum_deferred(sums: Mapping[str, Sequence[torch.Tensor]], ctx: ParallelContext) -> None:
    """What the engine's ``DeferredSumGradientHandler`` does: each gradient summed over its mode."""
    for mode, params in sums.items():
        for p in params:
            assert p.grad is not None
            tdist.all_reduce(p.grad, group=ctx.get_group(mode))


def check_mesh(
    name: str,
    ref: nn.Module,
    par: nn.Module,
    x_full: torch.Tensor,
    ctx: ParallelContext,
    *,
    in_layout: Layout = "act",
    out_layout: Layout = "act",
    seed: int = 0,
    after_backward: Callable[[], None] | None = None,
) -> None:
    """Same full weights and input: outputs, every parameter gradient and the input gradient.

    Each rank's loss is a fixed random projection of its output block, so the global loss of
    tessera's convention (summed over the distinct blocks) is the reference's loss.
    ``after_backward`` runs between the backward and the comparison (a deferred gradient sum).
    """
    randomize(ref, seed)
    load_full_state_dict(par, ref.state_dict())
    floating = x_full.is_floating_point()
    x_ref = x_full.clone().requires_grad_(floating)
    x_par = block(x_full, ctx, in_layout).clone().requires_grad_(floating)
    y_ref = first(ref(x_ref))
    y_par = first(par(x_par))
    w = torch.randn(y_ref.shape, generator=torch.Generator().manual_seed(seed + 1))
    (y_ref * w).sum().backward()
    (y_par * block(w, ctx, out_layout)).sum().backward()
    if after_backward is not None:
        after_backward()
    torch.testing.assert_close(
        y_par, block(y_ref.detach(), ctx, out_layout), **TOL, msg=lambda m: f"{name} output: {m}"
    )
    ref_params = dict(ref.named_parameters(remove_duplicate=False))
    par_params = dict(par.named_parameters(remove_duplicate=False))
    assert sorted(ref_params) == sorted(par_params), name
    for pname, p in par_params.items():
        info = get_shard_info(p)
        assert info is not None, f"{name}.{pname} carries no ShardInfo"
        expected = ref_params[pname].grad
        assert expected is not None and p.grad is not None, f"{name}.{pname} has no gradient"
        torch.testing.assert_close(
            p.grad, expected[info.slices], **TOL, msg=lambda m, n=pname: f"{name}.{n} grad: {m}"
        )
    if floating:
        assert x_ref.grad is not None and x_par.grad is not None
        torch.testing.assert_close(
            x_par.grad,
            block(x_ref.grad, ctx, in_layout),
            **TOL,
            msg=lambda m: f"{name} input grad: {m}",
        )
