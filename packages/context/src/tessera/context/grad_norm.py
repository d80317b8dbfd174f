"""The true global gradient norm of a model split in any way, and clipping by it.

Here, beside ``ShardInfo``, so that every package clips alike: tessera-engine's step, and a
loop of one's own calling ``torch.nn.utils.clip_grad_norm_`` (:mod:`.torch_clipping`).

What a rank holds of one parameter is described by its ShardInfo (tessera.context): the modes
its dimensions are split over, the modes it is replicated over. The global norm must count
every element of the full model exactly once:

* a tensor-parallel shard: sum the local ``sum |g|^p`` over the modes it is split over
  (the group of those modes holds exactly the blocks of one full tensor);
* a parameter replicated over a mode (a LayerNorm weight kept whole in a 1D group, every
  parameter across DATA): do *not* sum over that mode, every copy already holds it all;
* pipeline stages hold disjoint layers: sum over PIPELINE at the end;
* a gradient that is a DTensor (FSDP2, ZeRO 2/3) is sharded over its device mesh's Shard dims:
  its local piece (``to_local()``, no communication) is summed over those groups like a
  tensor-parallel shard. Under tensor parallelism FSDP2 shards each rank's tensor-parallel
  block over DATA, and the parameter keeps the block's ShardInfo (``shard_with_fsdp2`` moves
  it to the new parameter), so the piece is summed over DATA *and* the ShardInfo's split
  modes (the two groups are orthogonal: the pieces are disjoint and together make the full
  tensor once); a parameter whole on every tensor rank is summed over DATA only;
* a parameter tied across stages (an embedding on the first and last stage) is counted on one
  stage only: pass the other copies in ``exclude``.

The arithmetic is split into a pure part (``norm_contributions`` and ``combine_norms``, tested
without processes) and the reduction (``reduce_contributions``). Megatron-LM computes the same
norm for 1D tensor parallelism (Shoeybi et al. 2019); here any mix of modes follows from the
ShardInfo alone.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from .current import get_context, has_context
from .modes import ModeLike, ParallelMode
from .shard import get_shard_info

if TYPE_CHECKING:
    from .context import ParallelContext

__all__ = [
    "SplitKey",
    "clip_grad_norm",
    "combine_norms",
    "global_grad_norm",
    "group_if_parallel",
    "norm_contributions",
    "reduce_contributions",
    "resolve_context",
    "scale_to_norm",
]

#: The sorted names of the groups a gradient's local block is split over (``()``: not split).
SplitKey = tuple[str, ...]

#: Prefix of a SplitKey entry naming a DTensor mesh group rather than a ParallelMode.
_MESH_PREFIX = "mesh:"


def resolve_context(context: ParallelContext | None) -> ParallelContext | None:
    """``context`` if given, else the current context, else ``None`` (single process)."""
    if context is not None:
        return context
    if has_context():
        return get_context()
    return None


def group_if_parallel(context: ParallelContext | None, mode: ModeLike) -> dist.ProcessGroup | None:
    """The group of ``mode`` if it spans more than one rank, else ``None`` (nothing to reduce).

    A mode the context does not hold counts as size 1: e.g. SEQUENCE in a job without sequence
    parallelism.
    """
    if context is None or not context.is_initialized(mode):
        return None
    if context.get_world_size(mode) <= 1:
        return None
    return context.get_group(mode)


def norm_contributions(
    entries: Iterable[tuple[torch.Tensor, Sequence[str]]], norm_type: float = 2.0
) -> dict[SplitKey, torch.Tensor]:
    """Local partial norms, one per set of split modes (pure, no communication).

    Args:
        entries: ``(local gradient block, modes it is split over)``; a ``None``-free list.
        norm_type: p of the p-norm, or ``math.inf``.

    Returns:
        ``{sorted modes: sum over the entries of sum |g|^p}`` in float32 (for ``inf``: the
        max of |g|). Every key given appears, also for an all-zero or empty block, so all
        ranks of a group issue the same collectives.
    """
    out: dict[SplitKey, torch.Tensor] = {}
    for grad, modes in entries:
        key: SplitKey = tuple(sorted(modes))
        g = grad.detach().float()
        if math.isinf(norm_type):
            value = g.abs().max() if g.numel() else g.new_zeros(())
            prev = out.get(key)
            out[key] = value if prev is None else torch.maximum(prev, value.to(prev.device))
        else:
            value = g.abs().pow(norm_type).sum() if norm_type != 2.0 else (g * g).sum()
            prev = out.get(key)
            out[key] = value if prev is None else prev + value.to(prev.device)
    return out


def combine_norms(reduced: Mapping[SplitKey, torch.Tensor], norm_type: float = 2.0) -> torch.Tensor:
    """Sum (or max, for ``inf``) the reduced partials of every key.

    The result is ``sum |g|^p`` of this rank's stage, before the PIPELINE reduction and the
    ``1/p`` root.
    """
    values = list(reduced.values())
    if not values:
        return torch.zeros((), dtype=torch.float32)
    device = values[0].device
    stacked = torch.stack([v.to(device) for v in values])
    return stacked.max() if math.isinf(norm_type) else stacked.sum()


def reduce_contributions(
    contributions: Mapping[SplitKey, torch.Tensor],
    group_of: Callable[[str], dist.ProcessGroup | None],
    norm_type: float = 2.0,
) -> dict[SplitKey, torch.Tensor]:
    """All-reduce each partial over the groups its key names (keys in sorted order).

    Reducing over several modes one after the other sums over their product group, because the
    groups of distinct modes are orthogonal (a rank's 2D row and 2D column groups meet only in
    that rank).
    """
    op = dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM
    out: dict[SplitKey, torch.Tensor] = {}
    for key in sorted(contributions):
        value = contributions[key].clone()
        for name in key:
            group = group_of(name)
            if group is not None:
                dist.all_reduce(value, op=op, group=group)
        out[key] = value
    return out


def _local_and_mesh_groups(
    grad: torch.Tensor, mesh_groups: dict[str, dist.ProcessGroup]
) -> tuple[torch.Tensor, list[str]]:
    """For a DTensor gradient: its local block and the mesh groups it is sharded over."""
    placements = getattr(grad, "placements", None)
    mesh = getattr(grad, "device_mesh", None)
    if placements is None or mesh is None:
        return grad, []
    names: list[str] = []
    for dim, placement in enumerate(placements):
        if placement.is_shard():
            group = mesh.get_group(dim)
            name = _MESH_PREFIX + str(group.group_name)
            mesh_groups[name] = group
            names.append(name)
    local = getattr(grad, "to_local")()  # noqa: B009  (DTensor only)
    assert isinstance(local, torch.Tensor)
    return local, names


def global_grad_norm(
    parameters: Iterable[torch.Tensor],
    norm_type: float = 2.0,
    context: ParallelContext | None = None,
    exclude: Collection[torch.Tensor] = (),
) -> torch.Tensor:
    """The norm of the gradient of the whole (unsplit) model, the same on every rank.

    Every rank of the job must call it with its own parameters (it runs collectives over the
    tensor modes and PIPELINE). A parameter without a gradient counts as zero.

    Args:
        parameters: This rank's parameters.
        norm_type: p of the p-norm, or ``math.inf``.
        context: The ParallelContext (default: the current one; none: single process).
        exclude: Parameters left out of the norm (the extra copies of tied weights).

    Raises:
        ValueError: a ShardInfo names a mode this context does not hold.
    """
    ctx = resolve_context(context)
    excluded = {id(p) for p in exclude}
    mesh_groups: dict[str, dist.ProcessGroup] = {}
    entries: list[tuple[torch.Tensor, Sequence[str]]] = []
    for p in parameters:
        if id(p) in excluded:
            continue
        info = get_shard_info(p)
        modes = list(info.sharded_modes) if info is not None else []
        grad = p.grad if p.grad is not None else torch.zeros(0, device=p.device)
        grad, mesh_names = _local_and_mesh_groups(grad, mesh_groups)
        for mode in modes:
            if ctx is None or not ctx.is_initialized(mode):
                where = "no ParallelContext" if ctx is None else f"modes {ctx.modes}"
                raise ValueError(
                    f"a parameter of shape {tuple(p.shape)} is split over mode {mode!r} "
                    f"(its ShardInfo) but there is {where}: its norm cannot be summed"
                )
        entries.append((grad, modes + mesh_names))

    def group_of(name: str) -> dist.ProcessGroup | None:
        if name.startswith(_MESH_PREFIX):
            group = mesh_groups[name]
            return group if dist.get_world_size(group) > 1 else None
        return group_if_parallel(ctx, name)

    partial = norm_contributions(entries, norm_type)
    total = combine_norms(reduce_contributions(partial, group_of, norm_type), norm_type)
    pipeline = group_if_parallel(ctx, ParallelMode.PIPELINE)
    if pipeline is not None:
        op = dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM
        dist.all_reduce(total, op=op, group=pipeline)
    if math.isinf(norm_type):
        return total
    return total.pow(1.0 / norm_type)


def clip_grad_norm(
    parameters: Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    context: ParallelContext | None = None,
    exclude: Collection[torch.Tensor] = (),
) -> torch.Tensor:
    """Scale all gradients so that the global norm is at most ``max_norm``; return the norm.

    The same rule as ``torch.nn.utils.clip_grad_norm_`` (coefficient ``max_norm / (norm +
    1e-6)``, clamped to 1), applied with the global norm of ``global_grad_norm`` so every
    rank scales by the same coefficient.
    """
    params = list(parameters)
    total = global_grad_norm(params, norm_type, context, exclude)
    scale_to_norm(params, max_norm, total)
    return total


def scale_to_norm(params: Iterable[torch.Tensor], max_norm: float, total: torch.Tensor) -> None:
    """Scale every gradient by ``max_norm / (total + 1e-6)`` where that is below 1 (torch's)."""
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    with torch.no_grad():
        for p in params:
            if p.grad is not None:
                local, _ = _local_and_mesh_groups(p.grad, {})
                local.mul_(coef.to(device=local.device, dtype=local.dtype))
