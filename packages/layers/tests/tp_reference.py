"""Helpers shared by the tests: contexts, identical full weights, and the reference check.

Imported by the test modules and, through them, by the harness's worker processes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from tessera.context import ParallelContext, ParallelMode, create_context, get_shard_info
from tessera.layers import load_full_state_dict

TOL = dict(rtol=1e-5, atol=1e-5)


def context_1d(tp: int, sequence_parallel: bool = False) -> ParallelContext:
    tensor: dict[str, Any] = dict(size=tp, mode="1d")
    if sequence_parallel:
        tensor["sequence_parallel"] = True
    return create_context(dict(parallel=dict(tensor=tensor)), timeout=60.0)


def with_context(tp: int, body: Callable[[ParallelContext], Any], sp: bool = False) -> Any:
    ctx = context_1d(tp, sp)
    try:
        return body(ctx)
    finally:
        ctx.destroy()


def randomize(module: nn.Module, seed: int) -> None:
    """Fill every parameter/buffer with values drawn from ``seed`` (same on every rank)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, t in sorted(module.state_dict(keep_vars=True).items()):
            if t.is_floating_point():
                t.copy_(torch.randn(t.shape, generator=g) * 0.5)


def chunk(x: torch.Tensor, dim: int | None, ctx: ParallelContext) -> torch.Tensor:
    """This rank's block of a full tensor split along ``dim`` over the 1D group."""
    if dim is None:
        return x
    world = ctx.get_world_size(ParallelMode.PARALLEL_1D)
    rank = ctx.get_local_rank(ParallelMode.PARALLEL_1D)
    return x.chunk(world, dim)[rank]


def first(y: Any) -> torch.Tensor:
    return y[0] if isinstance(y, tuple) else y


class BiasAdded(nn.Module):
    """The caller of a ``skip_bias_add=True`` layer: ``y, bias = inner(x)``, returns ``y + bias``.

    Wrapping the torch reference too (whose ``inner`` returns ``y`` with the bias added) keeps
    the parameter names equal (``inner.weight``, ``inner.bias``), so the reference checks
    compare ``y + bias`` and every gradient, the bias's included, with ``nn.Linear``'s.
    """

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.inner(x)
        if not isinstance(out, tuple):
            return out
        y, bias = out
        assert bias is not None and bias.shape == y.shape[-1:], "bias must match y's last dim"
        return y + bias


def check_returned_bias(
    linear: nn.Module, ref: nn.Linear, x: torch.Tensor, *, whole: bool = False
) -> torch.Tensor:
    """``linear(x)``'s bias is the block of ``ref.bias`` that ``linear.bias``'s ShardInfo
    describes (``whole``: all of it, e.g. gathered with ``gather_output``); returns it."""
    _, bias = linear(x)
    info = get_shard_info(linear.bias)
    full = ref.bias.detach()
    expected = full if whole or info is None else full[info.slices]
    if not whole and info is not None:
        assert tuple(bias.shape) == info.local_shape, (list(bias.shape), info)
    torch.testing.assert_close(bias, expected, rtol=0, atol=0)
    return bias


def check_against_reference(
    name: str,
    ref: nn.Module,
    par: nn.Module,
    x_full: torch.Tensor,
    ctx: ParallelContext,
    *,
    in_split: int | None = None,
    out_split: int | None = None,
    seed: int = 0,
    after_backward: Callable[[], None] | None = None,
) -> None:
    """Same full weights and input: outputs, parameter gradients and input gradients agree.

    ``after_backward`` runs between the backward and the comparison (a deferred gradient sum).

    ``in_split``/``out_split``: the dim along which the parallel layer's input/output is this
    rank's block of the full tensor (None: replicated). The loss of each rank is a fixed
    random projection of its output block, so the sum over ranks is the reference loss.
    """
    randomize(ref, seed)
    load_full_state_dict(par, ref.state_dict())
    floating = x_full.is_floating_point()
    x_ref = x_full.clone().requires_grad_(floating)
    x_par = chunk(x_full, in_split, ctx).clone().requires_grad_(floating)
    y_ref = first(ref(x_ref))
    y_par = first(par(x_par))
    w = torch.randn(y_ref.shape, generator=torch.Generator().manual_seed(seed + 1))
    (y_ref * w).sum().backward()
    (y_par * chunk(w, out_split, ctx)).sum().backward()
    if after_backward is not None:
        after_backward()
    torch.testing.assert_close(
        y_par, chunk(y_ref.detach(), out_split, ctx), **TOL, msg=lambda m: f"{name} output: {m}"
    )
    ref_params = dict(ref.named_parameters(remove_duplicate=False))
    for pname, p in par.named_parameters(remove_duplicate=False):
        info = get_shard_info(p)
        expected = ref_params[pname].grad
        assert expected is not None and p.grad is not None, f"{name}.{pname} has no gradient"
        if info is not None:
            expected = expected[info.slices]
        torch.testing.assert_close(
            p.grad, expected, **TOL, msg=lambda m, n=pname: f"{name}.{n} grad: {m}"
        )
    if floating:
        assert x_ref.grad is not None and x_par.grad is not None
        torch.testing.assert_close(
            x_par.grad,
            chunk(x_ref.grad, in_split, ctx),
            **TOL,
            msg=lambda m: f"{name} input grad: {m}",
        )
