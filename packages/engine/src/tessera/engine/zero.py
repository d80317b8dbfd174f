"""ZeRO over the DATA group, built on PyTorch's own implementations.

ZeRO (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models") removes the redundancy of data parallelism stage by stage:

* stage 1 shards the optimizer state: torch's ``ZeroRedundancyOptimizer`` (each data rank
  keeps and updates the state of its share of the parameters, then broadcasts them);
* stage 2 also shards the gradients: FSDP2 ``fully_shard(reshard_after_forward=False)``
  (gradients reduce-scattered, parameters kept gathered from forward to backward; torch's
  documentation maps this setting to ZeRO-2, ``SHARD_GRAD_OP``);
* stage 3 also shards the parameters: FSDP2 ``fully_shard`` (gathered per module for its
  forward and backward, freed after), with ``CPUOffloadPolicy`` when ``offload=True``.

FSDP2 replaces each parameter with a sharded ``DTensor``; an optimizer built on the old
parameters would update tensors no longer used, so ``rebuild_optimizer`` makes a new one of the
same class and the same param-group settings on the new parameters (matched by name).

Under tensor parallelism the tensor FSDP2 shards is a rank's tensor-parallel block: the new
DTensor's shape is the block's shape, its data shards are pieces of that block, and only the
old parameter's ``ShardInfo`` says where the block sits in the full parameter. FSDP2 does not
carry attributes over to the parameters it creates, so ``shard_with_fsdp2`` moves each
ShardInfo to the new parameter of the same name (clipping and checkpoints read it there).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from tessera.context import (
    FullForm,
    ParallelContext,
    ParallelMode,
    ShardInfo,
    get_full_form,
    get_shard_info,
    set_full_form,
    set_shard_info,
)

__all__ = ["fsdp_units", "rebuild_optimizer", "shard_with_fsdp2", "zero_redundancy_optimizer"]


def _group_settings(group: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params"}


def _constructor_kwargs(
    optimizer_class: type[torch.optim.Optimizer], settings: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split param-group settings into constructor keywords and the rest.

    A param group carries keys its optimizer's constructor does not accept: keys an lr
    scheduler adds (``initial_lr``) and keys an optimizer records itself (AdamW's
    ``decoupled_weight_decay``). Passing those back to the constructor would raise, so they
    are returned separately for the caller to set on the new param group.
    """
    accepted = inspect.signature(optimizer_class.__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values()):
        return dict(settings), {}
    keywords = {k: v for k, v in settings.items() if k in accepted}
    extra = {k: v for k, v in settings.items() if k not in accepted}
    return keywords, extra


def zero_redundancy_optimizer(
    optimizer: torch.optim.Optimizer, context: ParallelContext
) -> torch.optim.Optimizer:
    """ZeRO stage 1.

    A ``ZeroRedundancyOptimizer`` over DATA with ``optimizer``'s class and
    param groups (its state, if any, is not carried over).
    """
    from torch.distributed.optim import ZeroRedundancyOptimizer

    groups = [{"params": list(g["params"]), **_group_settings(g)} for g in optimizer.param_groups]
    first, rest = groups[0], groups[1:]
    params = first.pop("params")
    keywords, extra = _constructor_kwargs(type(optimizer), first)
    zero = ZeroRedundancyOptimizer(
        params,
        optimizer_class=type(optimizer),
        process_group=context.get_group(ParallelMode.DATA),
        **keywords,
    )
    # ZeroRedundancyOptimizer copies every param-group key to its local optimizer on step.
    zero.param_groups[0].update(extra)
    for group in rest:
        zero.add_param_group(group)
    return zero


def shard_with_fsdp2(
    model: nn.Module, context: ParallelContext, stage: int, offload: bool = False
) -> nn.Module:
    """Shard ``model`` in place over DATA with FSDP2.

    The units of :func:`fsdp_units` (each repeated block), then the root, so a block's
    parameters are gathered only around its own compute. The ShardInfo of a tensor-parallel
    parameter is moved to the DTensor parameter that replaces it.

    Args:
        model: The module (moved to ``context.device`` already).
        context: The ParallelContext.
        stage: 2 (keep parameters gathered between forward and backward) or 3.
        offload: Keep the sharded parameters, gradients and optimizer state on the CPU (a
            no-op when ``context.device`` is the CPU already).

    Raises:
        RuntimeError: a parameter that carried a ShardInfo has no successor of its name.
    """
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    group = context.get_group(ParallelMode.DATA)
    # The dim name carries the group's name: torch caches sharding metadata by the mesh's hash
    # (ranks, device type, dim names, not the group), so a second job in the same process with
    # a new DATA group over the same ranks would otherwise reuse a mesh whose group is gone.
    mesh = DeviceMesh.from_group(
        group, context.device.type, mesh_dim_names=(f"data_{group.group_name}",)
    )
    # On a CPU-only job everything already lives in host memory: offloading is a no-op there
    # (and torch's CPUOffloadPolicy requires an accelerator).
    policy: OffloadPolicy = (
        CPUOffloadPolicy() if offload and context.device.type != "cpu" else OffloadPolicy()
    )
    reshard = stage == 3
    infos = _shard_infos(model)
    extras = _tessera_attributes(model)
    for unit in fsdp_units(model):
        fully_shard(unit, mesh=mesh, reshard_after_forward=reshard, offload_policy=policy)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard, offload_policy=policy)
    _reattach_shard_infos(model, infos)
    current = dict(model.named_parameters())
    for name, attributes in extras.items():
        for key, value in attributes.items():
            setattr(current[name], key, value)
    return model


def fsdp_units(model: nn.Module) -> list[nn.Module]:
    """The modules FSDP2 shards on their own before the root, deepest first.

    The wrap policy of a transformer: every repeated block (each child of an ``nn.ModuleList``
    that no other list holds, GPT-2's ``h.0``, Llama's ``layers.0``), or each direct child of a
    model without one. A list inside a block (StableLM's norm per head) stays in the block's
    unit: the module holding it may compute with its parameters without calling its entries,
    whose FSDP2 hooks would then never gather them. A unit
    whose parameters are also used outside it (a head tied to the token embedding) is left to
    the root: FSDP2 needs each parameter managed by one unit, and the root covers every user.
    """
    named = list(model.named_modules())
    lists = {name for name, module in named if isinstance(module, nn.ModuleList)}
    blocks = [
        (f"{name}.{i}" if name else str(i), block)
        for name, module in named
        if name in lists and not _inside_a_list(name, lists)
        for i, block in enumerate(module)
    ]
    candidates = blocks or [(name, child) for name, child in model.named_children()]
    users: dict[int, list[str]] = {}  # parameter -> the modules that hold it directly
    for name, module in model.named_modules(remove_duplicate=False):
        for param in module.parameters(recurse=False):
            users.setdefault(id(param), []).append(name)
    units: list[tuple[int, nn.Module]] = []
    depth = {name: name.count(".") for name, _ in named}
    for prefix, unit in candidates:
        params = list(unit.parameters())
        inside = all(
            user == prefix or user.startswith(f"{prefix}.")
            for param in params
            for user in users[id(param)]
        )
        if params and inside:
            units.append((depth.get(prefix, 0), unit))
    return [unit for _, unit in sorted(units, key=lambda item: -item[0])]


def _inside_a_list(name: str, lists: set[str]) -> bool:
    """Whether module ``name`` sits inside an entry of one of the ``nn.ModuleList``s ``lists``."""
    parts = name.split(".")
    return any(".".join(parts[:i]) in lists for i in range(len(parts) - 1))


def _tessera_attributes(model: nn.Module) -> dict[str, dict[str, object]]:
    """``name -> {attribute: value}`` of the other ``_tessera_*`` marks parameters carry.

    Packages above the context mark parameters for themselves (tessera-layers records the
    original form of a converted parameter for its state dicts); FSDP2's new parameters get
    them back by name, as they get their ShardInfo, without the engine knowing what they mean.
    """
    marks: dict[str, dict[str, object]] = {}
    for name, p in model.named_parameters():
        found = {
            key: value
            for key, value in vars(p).items()
            if key.startswith("_tessera_") and not isinstance(value, ShardInfo)
        }
        if found:
            marks[name] = found
    return marks


def _shard_infos(model: nn.Module) -> dict[str, tuple[ShardInfo | None, FullForm | None]]:
    """``name -> (ShardInfo, FullForm)`` of every parameter that carries either."""
    infos: dict[str, tuple[ShardInfo | None, FullForm | None]] = {}
    for name, p in model.named_parameters():
        info, form = get_shard_info(p), get_full_form(p)
        if info is not None or form is not None:
            infos[name] = (info, form)
    return infos


def _reattach_shard_infos(
    model: nn.Module, infos: dict[str, tuple[ShardInfo | None, FullForm | None]]
) -> None:
    """Put each recorded ShardInfo (and FullForm) on the parameter of the same name.

    FSDP2 made new parameters. A new parameter is a DTensor over DATA whose (global) shape is
    the tensor-parallel block's, so ``info.local_shape`` still describes it.

    Raises:
        RuntimeError: a parameter that carried a ShardInfo has no successor of that name.
    """
    current = dict(model.named_parameters())
    missing = sorted(set(infos) - set(current))
    if missing:
        raise RuntimeError(
            f"after fully_shard the model has no parameters named {missing}; their ShardInfo "
            "(tensor-parallel placement) cannot be carried over"
        )
    for name, (info, form) in infos.items():
        if info is not None:
            set_shard_info(current[name], info)
        if form is not None:
            set_full_form(current[name], form)


def rebuild_optimizer(
    optimizer: torch.optim.Optimizer,
    old_names: dict[int, str],
    model: nn.Module,
) -> torch.optim.Optimizer:
    """A new optimizer like ``optimizer`` on ``model``'s current parameters.

    Same class and param-group settings; parameters matched by name (``old_names``: id of an
    old parameter -> its name).

    Raises:
        ValueError: an optimized parameter is not in the model.
    """
    current = dict(model.named_parameters())
    groups: list[dict[str, Any]] = []
    for g in optimizer.param_groups:
        params = []
        for p in g["params"]:
            name = old_names.get(id(p))
            if name is None or name not in current:
                raise ValueError(
                    f"the optimizer holds a parameter of shape {tuple(p.shape)} that is not a "
                    "parameter of the model; ZeRO needs an optimizer over model.parameters()"
                )
            params.append(current[name])
        groups.append({"params": params, **_group_settings(g)})
    keywords, _ = _constructor_kwargs(type(optimizer), dict(optimizer.defaults))
    rebuilt = type(optimizer)(groups, **keywords)
    _release_parameters(optimizer)
    return rebuilt


def _release_parameters(optimizer: torch.optim.Optimizer) -> None:
    """Empty ``optimizer``'s param groups and state, so that it holds no tensor any more.

    The optimizer a user passed to ``initialize`` stays alive in their script; after FSDP2 it
    would keep the whole unsharded parameters it was built on (the model no longer uses them)
    in every rank's memory: the very copy ZeRO-3 exists to remove. Emptied, a stray
    ``optimizer.step()`` is a no-op, as it was on the parameters no longer used.
    """
    for group in optimizer.param_groups:
        group["params"] = []
    optimizer.state.clear()
