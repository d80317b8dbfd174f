"""Stochastic depth in a model someone else wrote: one draw per sample, alike on its ranks.

A drop-path module (timm's ``DropPath``, transformers' ``*DropPath``) keeps or drops each
sample's residual branch whole (Huang et al. 2016, "Deep networks with stochastic depth"): one
number per sample, broadcast over its tokens and features. Where the tensor ranks hold parts
of the same samples (the grids' columns, the cube, 'sequence', 1D's sequence span) they must
draw the same numbers, or a sample is dropped in some blocks and kept in others, which no
single process does; where they hold other samples (the grids' rows) their numbers must
differ. The split region's fork (``dropout.py``) gives each rank numbers of its own, right for
an elementwise mask and wrong here.

So a drop-path module runs here: the numbers of the whole batch are drawn from a stream every
tensor rank holds alike (:meth:`RankFork.alike_uniform`, seeded by the draw the fork took
before forking), and each rank keeps its own rows (``split_batch``). Its output is then what
one process computes with those numbers. Outside a forked region it draws from the global
generator, alike on every rank (1D's replicated residual stream).
"""

from __future__ import annotations

import math
import types
from collections.abc import Callable

import torch
from torch import nn

from tessera.context import ParallelContext

from ..dispatch.activations import split_batch
from ..shared.mode_layers import find_mode_layers
from .dropout import RankFork

__all__ = ["install_per_sample_draws", "is_drop_path"]

#: The attribute of a drop-path module holding its draw of the batch's numbers.
_DRAW_ATTR = "_tessera_per_sample_draw"

#: ``(rows here, dims of the input, device) -> [rows here]`` uniform numbers.
PerSampleDraw = Callable[[int, int, torch.device], torch.Tensor]


def is_drop_path(module: nn.Module) -> bool:
    """A stochastic-depth module as timm and transformers write it: ``*DropPath``, ``drop_prob``."""
    return type(module).__name__.endswith("DropPath") and isinstance(
        getattr(module, "drop_prob", None), float
    )


def _forward_per_sample(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The module's drop path with the batch's numbers (module docstring). ``x``: ``[b, ...]``."""
    drop = float(getattr(self, "drop_prob", 0.0))
    if drop == 0.0 or not self.training:
        return x
    keep = 1.0 - drop
    draw: PerSampleDraw = getattr(self, _DRAW_ATTR)
    kept = (draw(x.shape[0], x.dim(), x.device) < keep).to(x.dtype)  # [b]
    if keep > 0.0 and getattr(self, "scale_by_keep", True):
        kept = kept / keep
    return x * kept.view(-1, *(1,) * (x.dim() - 1))


def install_per_sample_draws(model: nn.Module, fork: RankFork, context: ParallelContext) -> None:
    """Run every drop-path module of ``model`` with the batch's numbers (module docstring)."""
    layers = find_mode_layers(context.config.tensor_mode)
    cuts = None if layers is None else layers.activation_cuts

    def draw(rows: int, ndim: int, device: torch.device) -> torch.Tensor:
        groups = () if cuts is None else cuts(context, ndim).get(0, ())
        blocks = math.prod(context.get_world_size(group) for group in groups)
        whole = fork.alike_uniform(rows * blocks, device)  # [b], alike on every tensor rank
        return split_batch(whole, context) if blocks > 1 else whole

    for module in model.modules():
        if is_drop_path(module):
            setattr(module, _DRAW_ATTR, draw)
            # a bound method on the instance: a deep copy binds it to the copy
            module.forward = types.MethodType(_forward_per_sample, module)
