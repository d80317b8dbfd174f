"""Stochastic depth in a model someone else wrote: one draw per sample, alike on its ranks.

A drop-path module (timm's ``DropPath``, transformers' ``*DropPath``) keeps or drops each
sample's residual branch whole (Huang et al. 2016, "Deep networks with stochastic depth"): one
number per sample, broadcast over its tokens and features. Where the tensor ranks hold parts
of the same samples (the grids' columns, the cube's feature axis, 'sequence', 1D's sequence
span) they must use the same numbers, or a sample is dropped in some blocks and kept in
others, which no single process does; where they hold other samples (the grids' rows) the
numbers must differ. The split region's fork (``dropout.py``) gives each rank numbers of its
own, right for an elementwise mask and wrong here.

So a drop-path module runs here: each rank draws the numbers of its own rows as the module
would (from torch's generator, forked per rank), and the first rank of each group that cuts
another dim of the activation (``ModeLayers.activation_cuts``) sends its numbers to the rest,
one broadcast of ``b`` numbers per call. The draw comes from torch's global generator, so
activation checkpointing, which replays that generator, recomputes the same masks.
"""

from __future__ import annotations

import types
from collections.abc import Callable

import torch
from torch import nn

from tessera.context import ParallelContext

from ..comm.ops import broadcast
from ..shared.mode_layers import find_mode_layers

__all__ = ["install_per_sample_draws", "is_drop_path"]

#: The attribute of a drop-path module holding how its numbers are made alike.
_AGREE_ATTR = "_tessera_per_sample_agree"

#: ``(numbers [rows here], dims of the input) -> the numbers of the group's first rank``.
Agree = Callable[[torch.Tensor, int], torch.Tensor]


def is_drop_path(module: nn.Module) -> bool:
    """A stochastic-depth module as timm and transformers write it: ``*DropPath``, ``drop_prob``."""
    return type(module).__name__.endswith("DropPath") and isinstance(
        getattr(module, "drop_prob", None), float
    )


def _forward_per_sample(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The module's drop path, its samples' numbers alike on their ranks. ``x``: ``[b, ...]``."""
    drop = float(getattr(self, "drop_prob", 0.0))
    if drop == 0.0 or not self.training:
        return x
    keep = 1.0 - drop
    agree: Agree = getattr(self, _AGREE_ATTR)
    numbers = agree(torch.rand(x.shape[0], device=x.device), x.dim())  # [b]
    kept = (numbers < keep).to(x.dtype)
    if keep > 0.0 and getattr(self, "scale_by_keep", True):
        kept = kept / keep
    return x * kept.view(-1, *(1,) * (x.dim() - 1))


def install_per_sample_draws(model: nn.Module, context: ParallelContext) -> None:
    """Run every drop-path module of ``model`` on numbers alike on a sample's ranks."""
    layers = find_mode_layers(context.config.tensor_mode)
    cuts = None if layers is None else layers.activation_cuts

    def agree(numbers: torch.Tensor, ndim: int) -> torch.Tensor:
        if cuts is None:
            return numbers
        groups = {g for dim, cut in cuts(context, ndim).items() if dim != 0 for g in cut}
        for group in sorted(groups):  # the same order on every rank
            if context.get_world_size(group) > 1:
                numbers = broadcast(numbers, 0, context.get_group(group))
        return numbers

    for module in model.modules():
        if is_drop_path(module) and "forward" not in vars(module):
            setattr(module, _AGREE_ATTR, agree)
            # a bound method on the instance: a deep copy binds it to the copy
            module.forward = types.MethodType(_forward_per_sample, module)
