"""Full (single-process) state dicts for tensor-parallel modules, from ``ShardInfo`` alone.

Nothing here knows a layer class or a tensor mode: a parameter's ShardInfo says where its
block sits in the full tensor, so loading slices the full tensor, and gathering collects every
tensor rank's blocks (one all-gather per dtype) and writes each at its offsets. 2D, 2.5D and
3D layers get both for free as long as they attach a ShardInfo to what they split.
A parameter that ``parallelize`` converted from another form (a transposed ``Conv1D``, fused
q/k/v) carries a :class:`~tessera.context.FullForm`: both functions speak the
original model's form, so its state dict goes in and comes out unchanged.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from tessera.context import ParallelContext, ParallelMode, ShardInfo, get_full_form, get_shard_info

from ..comm.collectives import all_gather_along
from ..shared.base import ParallelModule
from ..shared.context_access import resolve_context

__all__ = [
    "ShardReads",
    "StoredRead",
    "full_shape",
    "gather_full_state_dict",
    "gather_full_tensors",
    "load_full_state_dict",
    "shard_of_full",
    "shard_reads",
]


def full_shape(target: torch.Tensor) -> tuple[int, ...]:
    """The shape of ``target``'s full tensor in the original model's form.

    What a checkpoint of the plain model holds under ``target``'s name: the
    :class:`~tessera.context.FullForm`'s original shape for a converted parameter (a GPT-2
    ``Conv1D``'s ``[in, out]``), else the ShardInfo's global shape, else ``target``'s own.
    Known without communication, so a loader checks a whole checkpoint's shapes, and a writer
    lays out its files, before any tensor is read or gathered.
    """
    form = get_full_form(target)
    if form is not None:
        return form.original_shape
    info = get_shard_info(target)
    return info.global_shape if info is not None else tuple(target.shape)


@dataclass(frozen=True)
class StoredRead:
    """One box of a stored tensor (the original model's form) and where it lands in a block.

    Attributes:
        source: The box, one slice per dimension of the stored tensor: what
            ``safe_open(...).get_slice(name)[source]`` reads.
        transposed: The box is transposed before it lands (a ``Conv1D`` stores ``[in, out]``
            where tessera holds ``[out, in]``).
        place: Where it lands in the block seen as :attr:`ShardReads.shape`, per dimension a
            slice or the positions it fills (an index tensor: q, k and v rows interleaved).
    """

    source: tuple[slice, ...]
    transposed: bool
    place: tuple[slice | torch.Tensor, ...]


@dataclass(frozen=True)
class ShardReads:
    """The boxes of the stored tensor that make up this rank's block, and nothing else.

    Attributes:
        shape: The block seen with one dimension per dimension of the stored tensor (in
            tessera's orientation): a view of the block, which has the ShardInfo's local shape.
        reads: The boxes; together they fill the block once.
    """

    shape: tuple[int, ...]
    reads: tuple[StoredRead, ...]

    def place(self, block: torch.Tensor, read: StoredRead, piece: torch.Tensor) -> None:
        """Copy ``piece`` (``read``'s box as stored, any dtype) into ``block`` (:attr:`shape`)."""
        if read.transposed:
            piece = piece.t()
        if all(isinstance(p, slice) for p in read.place):
            block[read.place].copy_(piece)
            return
        mesh = []
        for dim, p in enumerate(read.place):
            where = torch.arange(p.start, p.stop) if isinstance(p, slice) else p
            view = [1] * len(read.place)
            view[dim] = -1
            mesh.append(where.to(block.device).view(view))
        block[tuple(mesh)] = piece.to(block.device, block.dtype)  # index_put_: one device


def shard_reads(target: torch.Tensor, info: ShardInfo | None = None) -> ShardReads | None:
    """The boxes of ``target``'s stored (original-form) full tensor that hold its block.

    The one place the layout arithmetic of loading lives: the ShardInfo's block of tessera's
    full form (every tensor mode writes it the same way) is mapped back through the
    :class:`~tessera.context.FullForm` (a transpose, fused parts reshaped, q/k/v rows
    interleaved by group) to boxes of the tensor as a checkpoint stores it. A loader reads just
    these boxes (``safetensors``' ``get_slice``); :func:`shard_of_full` cuts them from a tensor
    in hand. Each box is contiguous in the stored tensor: one per fused part where q, k and v
    sit side by side in the file, one for everything else.

    Args:
        target: The module's tensor: its ShardInfo and FullForm say what to read.
        info: The block to read in place of ``target``'s ShardInfo: a ZeRO-3 (FSDP2) data
            rank's piece of it, the rows of the tensor-parallel block that rank holds.

    Returns:
        The boxes, or ``None`` where the forms are not related by a transpose and splits of
        dimensions (a shape no tessera layer writes); the caller then converts the whole
        tensor (:meth:`~tessera.context.FullForm.from_original`).
    """
    info = info if info is not None else get_shard_info(target)
    form = get_full_form(target)
    full = info.global_shape if info is not None else tuple(target.shape)
    box = info.slices if info is not None else tuple(slice(0, n) for n in full)
    original = form.original_shape if form is not None else full
    transposed = form is not None and form.transposed
    sections = form.sections if form is not None else ()
    if transposed and len(original) != 2:
        return None
    stored = tuple(reversed(original)) if transposed else original  # in tessera's orientation
    groups = _dim_groups(stored, full)
    if groups is None or 0 in full or (sections and (not stored or sum(sections) != stored[0])):
        return None
    per_dim: list[list[tuple[slice, slice | torch.Tensor]]] = []
    sizes: list[int] = []
    for dim, fulls in enumerate(groups):
        index = _raveled(box, full, fulls)
        if dim == 0 and sections:
            index = _rows_as_stored(index, sections)
        per_dim.append(_runs(index))
        sizes.append(index.numel())
    reads = []
    for combo in itertools.product(*per_dim):
        source = tuple(s for s, _ in combo)
        place = tuple(p for _, p in combo)
        reads.append(StoredRead(source[::-1] if transposed else source, transposed, place))
    return ShardReads(tuple(sizes), tuple(reads))


def _dim_groups(stored: tuple[int, ...], full: tuple[int, ...]) -> list[list[int]] | None:
    """The dimensions of ``full`` each dimension of ``stored`` is split into, else ``None``."""
    groups: list[list[int]] = []
    k = 0
    for n in stored:
        dims: list[int] = []
        product = 1
        while product < n and k < len(full):
            product *= full[k]
            dims.append(k)
            k += 1
        if product != n:
            return None
        groups.append(dims)
    while k < len(full):  # trailing dimensions of one
        if full[k] != 1 or not groups:
            return None
        groups[-1].append(k)
        k += 1
    return groups


def _raveled(box: tuple[slice, ...], full: tuple[int, ...], dims: list[int]) -> torch.Tensor:
    """The indices along one stored dimension of the block's positions, in the block's order."""
    index = torch.zeros(1, dtype=torch.int64)
    for k in dims:
        here = torch.arange(box[k].start, box[k].stop, dtype=torch.int64)
        index = (index[:, None] * full[k] + here[None, :]).reshape(-1)
    return index


def _rows_as_stored(rows: torch.Tensor, sections: tuple[int, ...]) -> torch.Tensor:
    """Rows of tessera's form (parts interleaved by group) -> the stored rows (part by part).

    The inverse of :func:`~tessera.context.grouped` on indices: row ``g * u + c_i + t`` of
    tessera's form (group ``g``, part ``i``, ``u`` a group's width over all parts) is row
    ``o_i + g * w_i + t`` of the stored tensor (``o_i`` where part ``i`` starts).
    """
    groups = math.gcd(*sections)
    widths = torch.tensor([s // groups for s in sections], dtype=torch.int64)
    starts_in_group = torch.cumsum(widths, 0) - widths
    starts = torch.cumsum(torch.tensor(sections, dtype=torch.int64), 0) - torch.tensor(sections)
    group, within = rows // int(widths.sum()), rows % int(widths.sum())
    part = torch.searchsorted(torch.cumsum(widths, 0), within, right=True)
    return starts[part] + group * widths[part] + within - starts_in_group[part]


def _runs(index: torch.Tensor) -> list[tuple[slice, slice | torch.Tensor]]:
    """``index`` cut into runs of consecutive stored indices.

    Each run is one slice of the stored tensor and the block positions it fills (a slice where
    they are consecutive too).
    """
    order = torch.argsort(index, stable=True)
    ordered = index[order]
    breaks = (torch.nonzero(ordered[1:] - ordered[:-1] != 1).reshape(-1) + 1).tolist()
    runs: list[tuple[slice, slice | torch.Tensor]] = []
    for a, b in zip([0, *breaks], [*breaks, index.numel()], strict=True):
        source = slice(int(ordered[a]), int(ordered[b - 1]) + 1)
        positions = order[a:b]
        first = int(positions[0])
        in_order = bool((positions == torch.arange(first, first + b - a)).all())
        runs.append((source, slice(first, first + b - a) if in_order else positions))
    return runs


def shard_of_full(name: str, target: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """This rank's block of ``target`` cut from ``full``, the original model's full tensor.

    The one conversion every loader shares (a whole state dict, or a checkpoint read a tensor
    or a slice at a time): the boxes :func:`shard_reads` names are cut from ``full`` and put
    in tessera's form (transposed, q/k/v interleaved by group). No copy is made where none is
    needed: where the block is one box in the same orientation, the result is a view of
    ``full``.

    Args:
        name: The tensor's key, for the error.
        target: The module's tensor (its ShardInfo and FullForm say what to cut).
        full: The full tensor in the original model's form.

    Raises:
        ValueError: ``full`` does not have the shape the module expects (naming ``name``).
    """
    info = get_shard_info(target)
    expected = info.global_shape if info is not None else tuple(target.shape)
    form = get_full_form(target)
    plan = shard_reads(target)
    if plan is None:  # no box arithmetic for these forms: convert the whole tensor
        if form is not None:
            try:
                full = form.from_original(full, expected)
            except ValueError as err:
                raise ValueError(f"{name!r}: {err}") from None
        if tuple(full.shape) != expected:
            raise ValueError(
                f"{name!r} has shape {list(full.shape)}, the module expects the full shape "
                f"{list(expected)}"
            )
        return full[info.slices] if info is not None else full
    original = full_shape(target)
    if tuple(full.shape) != original:
        raise ValueError(
            f"{name!r}: expected the original shape {list(original)}, got {list(full.shape)}"
            if form is not None
            else f"{name!r} has shape {list(full.shape)}, the module expects the full shape "
            f"{list(expected)}"
        )
    local = info.local_shape if info is not None else expected
    only = plan.reads[0]
    if len(plan.reads) == 1 and all(isinstance(p, slice) for p in only.place):
        piece = full[only.source]
        return (piece.t() if only.transposed else piece).reshape(local)
    block = torch.empty(plan.shape, dtype=full.dtype, device=full.device)
    for read in plan.reads:
        plan.place(block, read, full[read.source])
    return block.view(local)


def load_full_state_dict(
    module: nn.Module, state_dict: Mapping[str, torch.Tensor], *, strict: bool = True
) -> None:
    """Copy each rank's block of a full (single-process) state dict into ``module``.

    No communication: every rank reads the full tensors and keeps what its ShardInfo says.
    Every shape is checked before anything is copied. A checkpoint too large for one rank's
    memory is read one tensor at a time by :func:`~tessera.layers.load_pretrained` instead.

    Args:
        module: A model built from tessera layers (any mix of parallel and plain modules).
        state_dict: The plain torch model's ``state_dict()`` (same names, full shapes).
        strict: Require the same keys on both sides (as ``nn.Module.load_state_dict``).

    Raises:
        KeyError: ``strict`` and keys are missing or unexpected.
        ValueError: a tensor's shape is not the full shape the module expects.
    """
    own = module.state_dict(keep_vars=True)
    if strict:
        missing = sorted(set(own) - set(state_dict))
        unexpected = sorted(set(state_dict) - set(own))
        if missing or unexpected:
            raise KeyError(
                f"load_full_state_dict: missing keys {missing}, unexpected keys {unexpected}"
            )
    plan: list[tuple[torch.Tensor, torch.Tensor]] = []
    for name, target in own.items():
        if name not in state_dict:
            continue
        try:
            plan.append((target, shard_of_full(name, target, state_dict[name])))
        except ValueError as err:
            raise ValueError(f"load_full_state_dict: {err}") from None
    with torch.no_grad():
        for target, block in plan:
            target.copy_(block)


def _find_context(module: nn.Module) -> ParallelContext | None:
    for sub in module.modules():
        if isinstance(sub, ParallelModule):
            return sub.context
    return None


def _meta(info: ShardInfo) -> list[int]:
    return [*info.offsets, *info.local_shape]


def gather_full_state_dict(
    module: nn.Module,
    *,
    context: ParallelContext | None = None,
    names: Collection[str] | None = None,
) -> dict[str, torch.Tensor]:
    """The full (single-process) state dict of ``module``, on every tensor rank.

    Exact: ``load_full_state_dict(m, gather_full_state_dict(m))`` changes nothing, and the
    result loads into the plain torch model. Collective over the TENSOR group: every tensor
    rank must call it, with the same ``names``.

    Args:
        module: A model built from tessera layers.
        context: The context whose TENSOR group holds the blocks; default the context of the
            first tessera layer in ``module``, else the current one. Under ZeRO-2/3 the
            parameters are also gathered over DATA, so every data rank must call it too.
        names: Only these keys (default all): a model larger than one rank's memory is
            gathered a part at a time (what :func:`~tessera.layers.save_pretrained` does).

    Raises:
        KeyError: ``names`` holds keys ``module``'s state dict lacks.
        ValueError: the ranks hold different sets of blocks, or the blocks of a tensor do not
            cover it (a parameter split over a mode outside the TENSOR group).
    """
    own = module.state_dict(keep_vars=True)
    if names is not None:
        unknown = sorted(set(names) - set(own))
        if unknown:
            raise KeyError(f"gather_full_state_dict: the module has no keys {unknown}")
        own = {name: t for name, t in own.items() if name in names}
    return gather_full_tensors(module, own, context)


def gather_full_tensors(
    module: nn.Module, own: Mapping[str, torch.Tensor], context: ParallelContext | None = None
) -> dict[str, torch.Tensor]:
    """The full tensors, in the original model's form, of ``own`` (some of ``module``'s).

    :func:`gather_full_state_dict` on a state dict already in hand (``state_dict(keep_vars=
    True)`` or part of it), so a caller gathering a tensor at a time builds it once.
    Collective as that function is.
    """
    whole = _whole_over_data(dict(own))
    result = _gather_tessera_form(module, whole, context)
    for name, t in whole.items():
        form = get_full_form(t)
        if form is not None:
            result[name] = form.to_original(result[name])
    return result


def _whole_over_data(own: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """ZeRO-3 (FSDP2) keeps each parameter as a DTensor sharded over DATA: gather those.

    Collective over DATA: under ZeRO-2/3 every data rank must call ``gather_full_state_dict``
    (calling it on data rank 0 only would wait forever for the others).
    The tessera marks (ShardInfo, FullForm) stay those of the parameter.
    """
    from torch.distributed.tensor import DTensor

    whole: dict[str, torch.Tensor] = {}
    for name, t in own.items():
        if isinstance(t, DTensor):
            full = t.full_tensor()
            for key, value in vars(t).items():
                if key.startswith("_tessera_"):
                    setattr(full, key, value)
            t = full
        whole[name] = t
    return whole


def _gather_tessera_form(
    module: nn.Module, own: dict[str, torch.Tensor], context: ParallelContext | None
) -> dict[str, torch.Tensor]:
    """Every tensor of ``own`` in tessera's full form (one all-gather per dtype)."""
    result = {name: t.detach().clone() for name, t in own.items()}
    # Tied parameters appear under several names: gather each tensor once.
    sharded: dict[int, tuple[list[str], torch.Tensor, ShardInfo]] = {}
    for name, t in own.items():
        info = get_shard_info(t)
        if info is not None and info.is_sharded:
            sharded.setdefault(id(t), ([], t, info))[0].append(name)
    if not sharded:
        return result

    ctx = context or _find_context(module) or resolve_context(None)
    group = ctx.get_group(ParallelMode.TENSOR)
    world = ctx.get_world_size(ParallelMode.TENSOR)
    by_dtype: dict[torch.dtype, list[tuple[list[str], torch.Tensor, ShardInfo]]] = {}
    for entry in sharded.values():
        by_dtype.setdefault(entry[1].dtype, []).append(entry)

    for dtype in sorted(by_dtype, key=str):
        entries = by_dtype[dtype]
        device = entries[0][1].device
        meta = torch.tensor([v for _, _, i in entries for v in _meta(i)], dtype=torch.int64)
        flat = torch.cat([t.detach().reshape(-1) for _, t, _ in entries])
        header = torch.tensor([flat.numel(), meta.numel()], dtype=torch.int64, device=device)
        headers = all_gather_along(header, 0, group, world).view(world, 2)
        if not bool((headers == header).all()):
            raise ValueError(
                "gather_full_state_dict: tensor ranks hold different shards "
                f"(numel, metadata length) per rank: {headers.tolist()}"
            )
        metas = all_gather_along(meta.to(device), 0, group, world).view(world, -1).cpu()
        flats = all_gather_along(flat, 0, group, world).view(world, -1)
        pos_meta = pos_flat = 0
        for names, t, info in entries:
            ndim = len(info.global_shape)
            numel = t.numel()
            full = torch.empty(info.global_shape, dtype=dtype, device=device)
            seen: set[tuple[int, ...]] = set()
            covered = 0
            for rank in range(world):
                m = metas[rank, pos_meta : pos_meta + 2 * ndim].tolist()
                offsets, shape = tuple(m[:ndim]), tuple(m[ndim:])
                block = flats[rank, pos_flat : pos_flat + numel].view(shape)
                full[tuple(slice(o, o + n) for o, n in zip(offsets, shape, strict=True))] = block
                if offsets not in seen:
                    seen.add(offsets)
                    covered += numel
            if covered != info.global_numel:
                raise ValueError(
                    f"gather_full_state_dict: the blocks of {names[0]!r} on the {world} tensor "
                    f"ranks cover {covered} of its {info.global_numel} elements; it is split "
                    f"over {info.sharded_modes}, which must lie inside the TENSOR group"
                )
            for name in names:
                result[name] = full if name == names[0] else full.clone()
            pos_meta += 2 * ndim
            pos_flat += numel
    return result
