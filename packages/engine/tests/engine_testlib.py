"""Shared helpers of the engine tests: a tiny model, data, a plain-PyTorch reference, and
hand-made 1D tensor-parallel linears marked with ShardInfo (the engine does not depend on
tessera-layers; Megatron-style column/row split, Shoeybi et al. 2019)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as tdist
import torch.nn.functional as F
from torch import nn

from tessera.context import ParallelMode, ShardInfo, set_shard_info

M = ParallelMode

#: Checkpoint test blocks: key -> (local piece, its slices in the full tensor, full shape).
Locals = dict[str, tuple[torch.Tensor, tuple[slice, ...], tuple[int, ...]]]


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))


def make_data(n: int = 8, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)  # [n, 4]
    y = torch.randint(0, 3, (n,), generator=g)  # [n]
    return x, y


def reference_params(
    steps: list[tuple[torch.Tensor, torch.Tensor]],
    make_opt: Callable[[nn.Module], torch.optim.Optimizer],
    clip: float = 0.0,
    seed: int = 0,
) -> list[torch.Tensor]:
    """Train the model in one process on full batches; return its final parameters."""
    model = make_model(seed)
    opt = make_opt(model)
    loss_fn = nn.CrossEntropyLoss()
    for x, y in steps:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        if clip:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            assert norm > clip, f"reference norm {norm} does not exceed {clip}: nothing clipped"
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1)


def adam(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=0.01)


class _CopyToTensor(torch.autograd.Function):
    """Identity forward; all-reduce of the input gradient over the 1D group."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.clone()
        tdist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTensor(torch.autograd.Function):
    """All-reduce forward; identity backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        x = x.clone()
        tdist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class ColumnLinear(nn.Module):
    def __init__(self, full: nn.Linear, ctx: Any) -> None:
        super().__init__()
        r, n = ctx.get_local_rank(M.PARALLEL_1D), ctx.get_world_size(M.PARALLEL_1D)
        self.group = ctx.get_group(M.PARALLEL_1D)
        w_info = ShardInfo.from_split(full.weight.shape, {0: [(M.PARALLEL_1D, r, n)]})
        b_info = ShardInfo.from_split(full.bias.shape, {0: [(M.PARALLEL_1D, r, n)]})
        self.weight = nn.Parameter(full.weight.detach()[w_info.slices].clone())  # [out/n, in]
        self.bias = nn.Parameter(full.bias.detach()[b_info.slices].clone())  # [out/n]
        set_shard_info(self.weight, w_info)
        set_shard_info(self.bias, b_info)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = _CopyToTensor.apply(x, self.group)
        return F.linear(x, self.weight, self.bias)  # [b, out/n]


class RowLinear(nn.Module):
    def __init__(self, full: nn.Linear, ctx: Any) -> None:
        super().__init__()
        r, n = ctx.get_local_rank(M.PARALLEL_1D), ctx.get_world_size(M.PARALLEL_1D)
        self.group = ctx.get_group(M.PARALLEL_1D)
        w_info = ShardInfo.from_split(full.weight.shape, {1: [(M.PARALLEL_1D, r, n)]})
        b_info = ShardInfo.from_split(full.bias.shape, {}, replicated_modes=[M.PARALLEL_1D])
        self.weight = nn.Parameter(full.weight.detach()[w_info.slices].clone())  # [out, in/n]
        self.bias = nn.Parameter(full.bias.detach().clone())  # [out], whole on every rank
        set_shard_info(self.weight, w_info)
        set_shard_info(self.bias, b_info)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = F.linear(x, self.weight)  # [b, out], a partial sum over the 1D group
        return _ReduceFromTensor.apply(partial, self.group) + self.bias


def assemble(results: list[Locals]) -> dict[str, torch.Tensor]:
    """Full tensors from every rank's blocks; replicas must agree bitwise, no hole is left."""
    full: dict[str, torch.Tensor] = {}
    covered: dict[str, torch.Tensor] = {}
    for r in results:
        for key, (local, where, shape) in r.items():
            if key not in full:
                full[key] = torch.zeros(shape, dtype=local.dtype)
                covered[key] = torch.zeros(shape, dtype=torch.bool)
            seen = covered[key][where]
            assert torch.equal(full[key][where][seen], local[seen]), f"replicas differ: {key}"
            full[key][where] = local
            covered[key][where] = True
    for key, mask in covered.items():
        assert bool(mask.all()), f"{key} is not fully covered by the ranks' blocks"
    return full


class LogCapture(logging.Handler):
    """Keeps every message a logger emits (attach with ``logger.addHandler``)."""

    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())
