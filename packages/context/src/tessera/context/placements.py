"""A split tensor's layout as DTensor placements on its tensor mode's mesh.

Every parameter tessera splits carries a :class:`~tessera.context.ShardInfo`: which modes
(process groups) cut which of its dims, which hold it whole. A tensor mode names the axes of
its mesh (``TensorMode.mesh_axes``: 2D's row and column, 2.5D's layer, row and column, 3D's
output, input and weight axes), so the same facts read as ``torch.distributed.tensor``
placements on a ``DeviceMesh`` over one block of tensor ranks: ``Shard(d)`` on an axis that
cuts dim ``d``, ``Replicate()`` on one that holds it whole. :func:`placements_of` translates
and checks, :func:`shard_info_of_placements` translates back (the two agree on every
parameter tessera builds: the tests hold them to it), and :func:`as_dtensor` gives a
parameter's local block as the ``DTensor`` torch's own tools read (``full_tensor()``,
redistribution, DCP).

A dim cut over two axes in the other order than the mesh's (2D's and 2.5D's embedding
tables: block ``col * q + row``, where DTensor's nested ``Shard`` takes ``row * q + col``) is
torch's ``_StridedShard`` on the earlier axis, the placement FSDP2 gives tensor-parallel
shards. Layouts with no placements are refused by name (:class:`PlacementError`), never
guessed: a dim cut over three or more axes out of the mesh's order, a tensor split over a
group that is no axis of the mode's mesh.

A partial gradient (``ShardInfo.partial_grad_modes``: sequence parallelism's weights) is a
property of the gradient, not of the tensor: the tensor is ``Replicate()`` there and its
gradient ``Partial()``, which :func:`grad_placements_of` gives.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from .modes import ParallelMode
from .shard import ShardInfo

if TYPE_CHECKING:
    from .context import ParallelContext

__all__ = [
    "PlacementError",
    "as_dtensor",
    "cut_placements",
    "grad_placements_of",
    "mesh_axes_of",
    "placements_of",
    "rng_tracker_without_world_sync",
    "shard_info_of_placements",
    "tensor_mesh_of",
]


class PlacementError(ValueError):
    """A ShardInfo that DTensor placements on the mode's mesh cannot express."""


def mesh_axes_of(context: ParallelContext) -> tuple[tuple[str, int], ...]:
    """The axes of the context's tensor mode's mesh: ``(group, size)``, outermost first.

    Raises:
        PlacementError: the context has no tensor mode, or its mode names no axes.
    """
    config = context.config
    mode = config.mode
    axes = () if mode is None else mode.mesh_axes(config.tensor_size, config.tensor_args)
    if not axes:
        raise PlacementError(
            f"tensor mode {config.tensor_mode!r} names no mesh axes (TensorMode.mesh_axes): "
            "its tensors have no placements"
        )
    return axes


def _axes_of_group(context: ParallelContext, group: str) -> tuple[str, ...]:
    """The mesh axes a group varies, outermost first.

    One axis, two for a combined group, every axis for the TENSOR group.
    """
    axes = [name for name, _ in mesh_axes_of(context)]
    if group in axes:
        return (group,)
    if group == ParallelMode.TENSOR.value:
        return tuple(axes)
    mode = context.config.mode
    combined = {} if mode is None else dict(mode.combined_axes)
    if group in combined:
        return tuple(combined[group])
    raise PlacementError(
        f"group {group!r} is no axis of tensor mode {context.config.tensor_mode!r}'s mesh "
        f"(axes {axes}, combined groups {sorted(combined)})"
    )


def cut_placements(
    cuts: Mapping[int, Sequence[str]], ndim: int, context: ParallelContext
) -> tuple[Any, ...]:
    """The placements of an ``ndim``-dim tensor whose dim ``d`` is cut over ``cuts[d]``.

    The groups of a dim outermost first, as ``ShardInfo.split_modes``; every axis that cuts
    nothing holds the tensor whole (``Replicate()``). For activations, whose layout a mode's
    layers state this way (``ModeLayers.activation_cuts``).
    """
    from torch.distributed.tensor import Replicate

    split = tuple(tuple(cuts.get(d, ())) for d in range(ndim))
    shape = (1,) * ndim  # the cuts read no sizes; this only names the tensor in a message
    info = ShardInfo(shape, (0,) * ndim, shape, split_modes=(), replicated_modes=())
    axes = [name for name, _ in mesh_axes_of(context)]
    found = _cut_axes(split, info, context)
    return tuple(found.get(axis, Replicate()) for axis in axes)


def placements_of(info: ShardInfo, context: ParallelContext) -> tuple[Any, ...]:
    """The placements, one per mesh axis, of a tensor laid out as ``info``.

    Raises:
        PlacementError: ``info`` cuts a dim over axes in another order than the mesh's, over a
            group that is no axis, or leaves an axis neither cutting nor holding it whole.
    """
    from torch.distributed.tensor import Replicate

    axes = [name for name, _ in mesh_axes_of(context)]
    found = _cut_axes(info.split_modes, info, context)
    for group in info.replicated_modes:
        for axis in _axes_of_group(context, group) if _is_axis(context, group) else ():
            found.setdefault(axis, Replicate())
    missing = [axis for axis in axes if axis not in found]
    if missing:
        raise PlacementError(
            f"a {list(info.global_shape)} tensor (split {info.split_modes}, replicated "
            f"{info.replicated_modes}) says nothing of mesh axes {missing}"
        )
    return tuple(found[axis] for axis in axes)


def _cut_axes(
    split_modes: Sequence[Sequence[str]], info: ShardInfo, context: ParallelContext
) -> dict[str, Any]:
    """The placement of each mesh axis that cuts a dim (``split_modes`` as a ShardInfo's)."""
    from torch.distributed.tensor import Shard

    axes = [name for name, _ in mesh_axes_of(context)]
    sizes = dict(mesh_axes_of(context))
    found: dict[str, Any] = {}
    for dim, groups in enumerate(split_modes):
        order = [axis for group in groups for axis in _axes_of_group(context, group)]
        if order == sorted(order, key=axes.index):
            for axis in order:  # nested in the mesh's order: DTensor's own nesting
                found[axis] = Shard(dim)
        elif len(order) == 2:
            # cut first along the later mesh axis, then along the earlier one (2D's tables:
            # block col * q + row): the earlier axis shards each of the later's blocks
            later, earlier = order
            found[later] = Shard(dim)
            found[earlier] = _strided_shard(dim, sizes[later], info)
        else:
            raise PlacementError(
                f"dim {dim} of a {list(info.global_shape)} tensor is cut over {list(groups)}, "
                f"whose axes {order} run against the mesh's {axes}: no placements express "
                "that block order"
            )
    return found


def _strided_shard(dim: int, split_factor: int, info: ShardInfo) -> Any:
    """Torch's ``_StridedShard``: a shard of each of another axis's ``split_factor`` blocks.

    torch made it for FSDP2 over tensor-parallel shards, the same order of cuts; it is not
    public, so where a release lacks it the layout has no placements.
    """
    try:
        from torch.distributed.tensor.placement_types import _StridedShard
    except ImportError as exc:  # pragma: no cover - every torch tessera supports has it
        raise PlacementError(
            f"a {list(info.global_shape)} tensor is cut over {info.split_modes} against the "
            "mesh's order, which needs torch's _StridedShard placement, missing here"
        ) from exc
    return _StridedShard(dim, split_factor=split_factor)


def _is_axis(context: ParallelContext, group: str) -> bool:
    """Whether ``group`` is an axis, combined axes or TENSOR (every axis) of the mesh."""
    try:
        _axes_of_group(context, group)
    except PlacementError:
        return False
    return True


def grad_placements_of(info: ShardInfo, context: ParallelContext) -> tuple[Any, ...]:
    """The placements of the gradient: the tensor's, ``Partial()`` where it is partial."""
    from torch.distributed.tensor import Partial

    partial = {
        axis
        for group in info.partial_grad_modes
        if _is_axis(context, group)
        for axis in _axes_of_group(context, group)
    }
    axes = [name for name, _ in mesh_axes_of(context)]
    return tuple(
        Partial() if axis in partial else placement
        for axis, placement in zip(axes, placements_of(info, context), strict=True)
    )


def shard_info_of_placements(
    global_shape: Sequence[int], placements: Sequence[Any], context: ParallelContext
) -> ShardInfo:
    """The ShardInfo of this rank's block of a ``global_shape`` tensor placed so.

    The inverse of :func:`placements_of` (up to combined groups, written as their axes):
    each ``Shard(d)`` cuts dim ``d`` over its axis, nested in the mesh's order; each
    ``Replicate()`` holds it whole there.

    Raises:
        PlacementError: a placement is neither ``Shard`` nor ``Replicate``, or a dim does
            not divide by the axes that cut it.
    """
    from torch.distributed.tensor import Replicate, Shard

    axes = mesh_axes_of(context)
    if len(placements) != len(axes):
        raise PlacementError(
            f"{len(placements)} placements for a mesh of {len(axes)} axes {[n for n, _ in axes]}"
        )
    splits: dict[int, list[tuple[str, int, int]]] = {}
    strided: dict[int, list[tuple[str, int, int]]] = {}
    replicated: list[str] = []
    for (axis, size), placement in zip(axes, placements, strict=True):
        cut = (axis, context.get_local_rank(axis), size)
        if type(placement).__name__ == "_StridedShard":
            strided.setdefault(placement.dim, []).append(cut)  # cuts after the others
        elif isinstance(placement, Shard):
            splits.setdefault(placement.dim, []).append(cut)
        elif isinstance(placement, Replicate):
            replicated.append(axis)
        else:
            raise PlacementError(f"placement {placement} on axis {axis!r}: Shard or Replicate")
    for dim, cuts in strided.items():
        splits[dim] = [*splits.get(dim, []), *cuts]
    return ShardInfo.from_split(global_shape, splits, replicated_modes=replicated)


def tensor_mesh_of(context: ParallelContext) -> Any:
    """A ``DeviceMesh`` over this rank's block of tensor ranks, one dim per mesh axis.

    Built from the context's own groups (``DeviceMesh.from_group``), so it creates no
    communicator; dim ``i`` is named ``"{mode's axis}_{process group's name}"``. Cached on
    the context.
    """
    cached = getattr(context, "_tessera_tensor_mesh", None)
    if cached is not None:
        return cached
    from torch.distributed.device_mesh import DeviceMesh

    axes = mesh_axes_of(context)
    first = context.global_rank - context.get_local_rank("tensor")
    sizes = [size for _, size in axes]
    ranks = torch.arange(first, first + context.config.tensor_size, dtype=torch.int)
    groups = [context.get_group(axis) for axis, _ in axes]
    mesh = DeviceMesh.from_group(
        groups,
        context.device.type,
        mesh=ranks.reshape(sizes),
        # the groups' own names in each dim's: meshes over the same ranks compare equal by
        # their names, and DTensor's caches would hand a later context's tensors this one's
        mesh_dim_names=tuple(
            f"{axis}_{g.group_name}" for (axis, _), g in zip(axes, groups, strict=True)
        ),
    )
    context._tessera_tensor_mesh = mesh  # type: ignore[attr-defined]
    rng_tracker_without_world_sync(mesh)
    return mesh


def rng_tracker_without_world_sync(mesh: Any) -> None:
    """Make DTensor's RNG tracker for ``mesh`` now, without its broadcast over the world group.

    On CUDA the first random op on a DTensor (a dropout in a module a plan leaves out) makes
    torch's tracker lazily, and that broadcasts rank 0's generator state over the default
    (world) group: a collective joined only by the ranks running such an op, so with pipeline
    stages, where only some stages run one, the others never would and the step hangs. tessera
    seeds every rank alike (the context's seed), so the broadcast is not needed; made here,
    on every rank that builds the mesh, it never runs. A tracker already made is kept. On CPU
    DTensor draws with torch's generator directly and no tracker is made.
    """
    if mesh.device_type == "cpu":
        return
    from torch.distributed.tensor import _random as dtensor_random

    if dtensor_random._rng_tracker is None and dtensor_random.is_rng_supported_mesh(mesh):
        dtensor_random._rng_tracker = dtensor_random.OffsetBasedRNGTracker(
            mesh, run_state_sync=False
        )


def as_dtensor(tensor: torch.Tensor, context: ParallelContext) -> Any:
    """``tensor`` (this rank's block) as the ``DTensor`` its ShardInfo describes.

    A view of the same storage: ``full_tensor()`` gathers the whole parameter, torch's DTensor
    operators redistribute it. A tensor without a ShardInfo is whole on every tensor rank.

    Raises:
        PlacementError: its layout has no placements (see the module docstring).
    """
    from torch.distributed.tensor import DTensor, Replicate

    from .shard import get_shard_info

    info = get_shard_info(tensor)
    mesh = tensor_mesh_of(context)
    if info is None:
        placements: tuple[Any, ...] = (Replicate(),) * mesh.ndim
        shape, stride = tensor.shape, tensor.stride()
    else:
        placements = placements_of(info, context)
        shape = torch.Size(info.global_shape)
        stride = torch.empty(info.global_shape, device="meta").stride()
    return DTensor.from_local(
        tensor.detach(), mesh, placements, run_check=False, shape=shape, stride=stride
    )
