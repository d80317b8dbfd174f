"""Optimizer state keyed by the full model's parameter names, sharded like the parameters.

``torch.optim.Optimizer.state_dict()`` numbers parameters by their position in this rank's
param groups, a numbering that changes with the pipeline partition, the tensor layout and
ZeRO. A checkpoint that must load under another layout keys the state instead by the
parameter's full-model name: ``optim/<name>/<state key>`` (``optim/4.weight/exp_avg``).
A state tensor shaped like its parameter is a block at the parameter's offsets (read from the
parameter's ShardInfo / DTensor), so it reshards exactly like the parameter; a 0-dim state
(Adam's ``step``) is one value, written once; numbers and ``None`` go to JSON, and so do the
param-group settings (``lr``, ``betas``, ...), recorded per parameter name.

ZeRO stage 1 (``ZeroRedundancyOptimizer``, Rajbhandari et al. 2020): each data rank's local
optimizer (``.optim``) holds the state of its partition only, so each rank writes exactly the
state it owns and reads back the state of the partition it owns now, with no consolidation
on one rank. FSDP2 (ZeRO 2/3): parameters and states are ``DTensor``s sharded over DATA; their
chunk offsets compose with ShardInfo in ``block_of``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from tessera.context import get_shard_info

from .blocks import Block, block_of, dtensor_type, local_part
from .errors import CheckpointError

__all__ = [
    "OPTIM_PREFIX",
    "optimizer_parts",
    "prepare_optimizer_load",
    "split_optimizer",
]

OPTIM_PREFIX = "optim/"
_JSON_SCALARS = (bool, int, float, str, type(None))


def optim_key(name: str, state_key: str) -> str:
    """Checkpoint key of one state entry of one parameter."""
    return f"{OPTIM_PREFIX}{name}/{state_key}"


def split_optimizer(
    optimizer: torch.optim.Optimizer,
) -> tuple[torch.optim.Optimizer, list[dict[str, Any]]]:
    """``(holder of the state, param groups that hold every parameter and the settings)``.

    For ZeroRedundancyOptimizer the state lives in its local ``.optim`` (this rank's
    partition) while ``.param_groups`` lists every parameter.
    """
    inner = getattr(optimizer, "optim", None)
    if isinstance(inner, torch.optim.Optimizer) and type(optimizer).__name__ == (
        "ZeroRedundancyOptimizer"
    ):
        return inner, list(optimizer.param_groups)
    return optimizer, list(optimizer.param_groups)


def _encode(value: Any, where: str) -> Any:
    if isinstance(value, _JSON_SCALARS):
        return value
    if isinstance(value, tuple):
        return {"__tuple__": [_encode(v, where) for v in value]}
    if isinstance(value, list):
        return [_encode(v, where) for v in value]
    if isinstance(value, torch.Tensor) and value.numel() <= 16:
        dtype = str(value.dtype).removeprefix("torch.")
        return {"__tensor__": value.detach().cpu().tolist(), "dtype": dtype}
    raise CheckpointError(
        f"{where} is a {type(value).__name__}; checkpoints hold tensors, numbers, strings, "
        "None and tuples/lists of them"
    )


def _decode(value: Any) -> Any:
    if isinstance(value, list):
        return [_decode(v) for v in value]
    if isinstance(value, dict):
        if "__tuple__" in value:
            return tuple(_decode(v) for v in value["__tuple__"])
        if "__tensor__" in value:
            dtype = getattr(torch, str(value["dtype"]), None)
            if not isinstance(dtype, torch.dtype):
                raise CheckpointError(f"unknown dtype {value['dtype']!r} in a param-group setting")
            return torch.tensor(value["__tensor__"], dtype=dtype)
    return value


def _global_shape(name: str, param: torch.Tensor) -> tuple[int, ...]:
    return block_of(name, param).global_shape


def optimizer_parts(
    optimizer: torch.optim.Optimizer, names: Mapping[int, tuple[str, nn.Parameter]]
) -> tuple[dict[str, Block], dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
    """What this rank saves of ``optimizer``.

    Args:
        optimizer: Any ``torch.optim.Optimizer`` (also ZeroRedundancyOptimizer, FSDP2's).
        names: ``id(param) -> (name, param)`` of the model.

    Returns:
        ``(blocks, values, settings)``: state tensors by key; non-tensor state values by
        parameter name; JSON param-group settings by parameter name.

    Raises:
        CheckpointError: a parameter of the optimizer is not in the model, or a state cannot
            be described (a non-scalar state of another shape than a sharded parameter).
    """
    holder, groups = split_optimizer(optimizer)
    settings: dict[str, dict[str, Any]] = {}
    for g, group in enumerate(groups):
        encoded = {
            k: _encode(v, f"param group {g} setting {k!r}")
            for k, v in group.items()
            if k != "params"
        }
        for p in group["params"]:
            if id(p) not in names:
                raise CheckpointError(
                    f"param group {g} holds a parameter of shape {tuple(p.shape)} that is not a "
                    "parameter of the model given to the checkpoint"
                )
            settings[names[id(p)][0]] = encoded
    blocks: dict[str, Block] = {}
    values: dict[str, dict[str, Any]] = {}
    for p, state in holder.state.items():
        if not isinstance(p, torch.Tensor) or id(p) not in names:
            raise CheckpointError("the optimizer holds state of a tensor that is not in the model")
        name = names[id(p)][0]
        for key, value in state.items():
            where = f"optimizer state {key!r} of {name}"
            if not isinstance(value, torch.Tensor):
                values.setdefault(name, {})[key] = _encode(value, where)
                continue
            if tuple(value.shape) == tuple(p.shape):
                blocks[optim_key(name, key)] = block_of(where, value, shard_of=p)
            elif value.dim() == 0:
                blocks[optim_key(name, key)] = Block(local_part(value), (), ())
            elif not _is_split(p):
                local = local_part(value)
                blocks[optim_key(name, key)] = Block(local, tuple(local.shape), (0,) * local.dim())
            else:
                raise CheckpointError(
                    f"{where} has shape {tuple(value.shape)}, neither its sharded parameter's "
                    f"{tuple(p.shape)} nor a scalar: it cannot be resharded"
                )
    return blocks, values, settings


def _is_split(p: torch.Tensor) -> bool:
    info = get_shard_info(p)
    if info is not None and info.is_sharded:
        return True
    dtensor = dtensor_type()
    return dtensor is not None and isinstance(p, dtensor)


def _like_param(local: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """Wrap a loaded local state as a DTensor like ``param`` when ``param`` is one (FSDP2)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return local
    if isinstance(param, DTensor):
        return DTensor.from_local(
            local.to(param.to_local().device),
            param.device_mesh,
            param.placements,
            run_check=False,
            shape=param.shape,
            stride=param.stride(),
        )
    return local


def prepare_optimizer_load(
    optimizer: torch.optim.Optimizer,
    names: Mapping[int, tuple[str, nn.Parameter]],
    tensors: Mapping[str, tuple[torch.dtype, tuple[int, ...]]],
    values: Mapping[str, Mapping[str, Any]],
    settings: Mapping[str, Mapping[str, Any]],
    strict: bool,
) -> tuple[dict[str, Block], Callable[[], None], list[str]]:
    """Allocate the blocks to read this rank's optimizer state into.

    Args:
        optimizer: The optimizer to fill.
        names: ``id(param) -> (name, param)`` of the model.
        tensors: The checkpoint's tensors: key -> (dtype, global shape).
        values: Saved non-tensor state values by parameter name.
        settings: Saved param-group settings by parameter name.
        strict: A parameter without saved settings is an error (else its group keeps its own).

    Returns:
        ``(blocks, finish, errors)``: load the blocks (DCP), then call ``finish()`` to hand
        the state to the optimizer; ``errors`` lists problems found (nothing was changed).
    """
    holder, groups = split_optimizer(optimizer)
    errors: list[str] = []
    by_param: dict[str, list[str]] = {}
    for key in tensors:
        if key.startswith(OPTIM_PREFIX):
            name, _, state_key = key[len(OPTIM_PREFIX) :].rpartition("/")
            by_param.setdefault(name, []).append(state_key)
    blocks: dict[str, Block] = {}
    pending: list[tuple[nn.Parameter, str, str]] = []  # (param, state key, checkpoint key)
    holder_params = [p for g in holder.param_groups for p in g["params"]]
    for p in holder_params:
        if id(p) not in names:
            errors.append(
                f"the optimizer holds a parameter of shape {tuple(p.shape)} not in the model"
            )
            continue
        name = names[id(p)][0]
        for state_key in by_param.get(name, []):
            key = optim_key(name, state_key)
            dtype, shape = tensors[key]
            pblock = block_of(name, p)
            if shape == pblock.global_shape:
                local = torch.empty(pblock.local_shape, dtype=dtype)
                blocks[key] = Block(local, pblock.global_shape, pblock.offsets)
            elif shape == ():
                blocks[key] = Block(torch.empty((), dtype=dtype), (), ())
            elif not _is_split(p):
                blocks[key] = Block(torch.empty(shape, dtype=dtype), shape, (0,) * len(shape))
            else:
                errors.append(
                    f"{key} has shape {list(shape)} but parameter {name} is sharded with global "
                    f"shape {list(pblock.global_shape)}"
                )
                continue
            pending.append((p, state_key, key))
    group_settings: list[dict[str, Any] | None] = []
    for g, group in enumerate(groups):
        chosen: tuple[str, Mapping[str, Any]] | None = None
        for p in group["params"]:
            if id(p) not in names:
                continue
            name = names[id(p)][0]
            saved = settings.get(name)
            if saved is None:
                if strict:
                    errors.append(f"no saved param-group settings for parameter {name}")
                continue
            if chosen is None:
                chosen = (name, saved)
            elif dict(saved) != dict(chosen[1]):
                errors.append(
                    f"param group {g} holds {chosen[0]} and {name}, saved with different "
                    f"settings ({dict(chosen[1])} vs {dict(saved)})"
                )
        group_settings.append(
            {k: _decode(v) for k, v in chosen[1].items()} if chosen is not None else None
        )
    if len(holder.param_groups) != len(groups):
        errors.append(
            f"the local optimizer has {len(holder.param_groups)} param groups, the optimizer "
            f"{len(groups)}"
        )

    def finish() -> None:
        index = {id(p): i for i, p in enumerate(holder_params)}
        state: dict[int, dict[str, Any]] = {}
        for p, state_key, key in pending:
            block = blocks[key]
            sharded_like_param = block.global_shape == block_of(key, p).global_shape
            value = _like_param(block.local, p) if sharded_like_param else block.local
            state.setdefault(index[id(p)], {})[state_key] = value
        for p in holder_params:
            name = names[id(p)][0]
            for state_key, value in values.get(name, {}).items():
                state.setdefault(index[id(p)], {})[state_key] = _decode(value)
        new_groups = []
        for g, (hgroup, saved) in enumerate(zip(holder.param_groups, group_settings, strict=True)):
            current = {k: v for k, v in hgroup.items() if k != "params"}
            if saved is not None:
                current.update(saved)
                for k, v in saved.items():  # the settings of the whole (ZeRO) optimizer too
                    groups[g][k] = v
            current["params"] = [index[id(p)] for p in hgroup["params"]]
            new_groups.append(current)
        holder.load_state_dict({"state": state, "param_groups": new_groups})

    return blocks, finish, errors
