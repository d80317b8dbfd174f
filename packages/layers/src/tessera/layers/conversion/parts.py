"""A model nobody planned, made of models with plans: each part parallelized, the rest whole.

CLIP's ``CLIPModel`` is a text and a vision tower with a projection each and a learned
temperature; ``CLIPVisionModelWithProjection`` is the vision tower and its projection; a
researcher's classifier is a pretrained encoder under a head of their own. tessera ships plans
for the towers and encoders, whose outputs come back whole (``plan.returns_whole``): their
boundaries split the inputs on entry and gather the hidden states and pooled outputs on exit.
So ``parallelize`` converts each such part alone and leaves the code around them as it is:
it computes on whole tensors, the same numbers on every tensor rank, as one process does, and
its parameters (the projections, the temperature) stay whole, each rank computing their whole
gradient. Only the parts' blocks are split: the towers hold nearly all of the work.

A converted module of a part is only right inside that part's forward, between its boundary's
split and gather; called directly from the code around it (``model.text_model.embeddings``)
it would hand back a block as if it were the whole tensor, so it raises there.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from tessera.context import get_shard_info

from .plan import Plan

__all__ = ["parallelize_parts"]


def parallelize_parts(
    model: nn.Module,
    parts: list[tuple[str, Plan]],
    convert: Callable[[nn.Module, Plan], nn.Module],
    ties_split: bool = True,
) -> nn.Module:
    """Convert each part of ``model`` with its plan (``convert``: ``parallelize``).

    Args:
        model: The model, whole on every tensor rank (its weights checked alike already).
        parts: ``(name, plan)`` of each part (``plan.parts_with_plans``).
        convert: Converts one part in place with its plan.
        ties_split: Whether the mode splits parameters, so that a parameter tied across a
            part's edge would be split on one side only (refused); ``'sequence'`` splits none.

    Returns:
        ``model``, its parts converted in place, the rest whole.
    """
    if ties_split:
        _check_no_ties_across(model, parts)
    for name, plan in parts:
        part = model.get_submodule(name)
        convert(part, plan)
        _refuse_calls_from_outside(name, part)
    return model


def _check_no_ties_across(model: nn.Module, parts: list[tuple[str, Plan]]) -> None:
    """Raise where a module outside the parts holds a parameter of one.

    A head tied to the embedding of the encoder it reads: converting the part would cut its
    copy and leave the outside one whole, the tie silently broken.

    Raises:
        ValueError: naming the tied parameters and what to do.
    """
    owner = {id(p): name for name, _ in parts for p in model.get_submodule(name).parameters()}
    tied = []
    for name, module in model.named_modules():
        if any(name == part or name.startswith(f"{part}.") for part, _ in parts):
            continue
        for pname, param in module.named_parameters(recurse=False):
            if param is not None and id(param) in owner:
                tied.append(f"{name}.{pname} (tied into {owner[id(param)]!r})")
    if tied:
        raise ValueError(
            f"parallelize: tessera ships no plan for {type(model).__name__}, and its parts "
            f"{[name for name, _ in parts]} that have one cannot be converted alone: "
            f"{', '.join(tied)} would keep the whole tensor while its part's copy is split. "
            "Pass a plan naming the model's own modules too (parallelize(model, plan)) "
            "with both sides of each tie"
        )


def _refuse_calls_from_outside(name: str, part: nn.Module) -> None:
    """Make each module of ``part`` holding split parameters raise outside the part's forward.

    There its inputs would not have been split, nor its output gathered.
    """
    depth = [0]

    def enter(module: nn.Module, args: Any) -> None:
        depth[0] += 1

    def leave(module: nn.Module, args: Any, output: Any) -> None:
        depth[0] -= 1

    part.register_forward_pre_hook(enter, prepend=True)
    part.register_forward_hook(leave, always_call=True)  # a forward that raised left it too

    def guard(inner: str) -> Callable[[nn.Module, Any], None]:
        def check(module: nn.Module, args: Any) -> None:
            # activation checkpointing replays a block in the backward, outside the forward
            if depth[0] == 0 and torch._C._current_graph_task_id() == -1:
                raise RuntimeError(
                    f"{name}.{inner} is a split layer of {name!r} "
                    f"({type(part).__name__}), which parallelize converted as a whole: its "
                    f"inputs are split and its outputs gathered at {name!r}'s forward only. "
                    f"Call {name!r} itself rather than its modules, or give the model a plan "
                    "of its own (parallelize(model, plan))"
                )

        return check

    for inner, module in part.named_modules():
        own = module.parameters(recurse=False)
        if inner and any((i := get_shard_info(p)) is not None and i.is_sharded for p in own):
            module.register_forward_pre_hook(guard(inner))
