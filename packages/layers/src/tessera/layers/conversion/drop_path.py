"""Stochastic depth in a model someone else wrote: one draw per sample, alike on its ranks.

A drop-path module (timm's ``DropPath``, transformers' ``*DropPath``, torchvision's
``StochasticDepth``) keeps or drops each sample's residual branch whole (Huang et al. 2016,
"Deep networks with stochastic depth"): one number per sample, broadcast over its tokens and
features (torchvision's ``mode="batch"``: one number for the whole batch, which every tensor
rank must then share). Where the tensor ranks hold parts
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

import torch
from torch import nn

from tessera.context import ParallelContext

from ..comm.ops import broadcast
from ..shared.mode_layers import Cuts, find_mode_layers
from .operator_dims import SPLIT_DIMS_MARK

__all__ = ["install_per_sample_draws", "is_drop_path"]

#: The attribute of a drop-path module holding how its numbers are made alike.
_AGREE_ATTR = "_tessera_per_sample_agree"


class _Agreement:
    """How a drop path's numbers are made alike: over the groups of the activations' layout.

    Args:
        name: The drop path's module name, for messages.
        cuts: The mode's ``activation_cuts``, or ``None`` (nothing is cut between blocks).
        context: The ParallelContext.
    """

    def __init__(self, name: str, cuts: Cuts | None, context: ParallelContext) -> None:
        self.name, self.cuts, self.context = name, cuts, context

    def check_layout(self, x: torch.Tensor) -> None:
        """Raise where ``x`` is cut otherwise than an activation between blocks.

        The first call's check of the model's own code marks every split tensor with its cut
        dims (``own_code.py``). A drop path on another layout (a 1D column layer's output,
        split by features in a region forked per rank) would draw its numbers on groups
        that do not hold its samples' parts: refused. Layouts with the same cut dims and
        other groups (3D's ``"z"`` against ``"y"``) are not told apart here.
        """
        marked = getattr(x, SPLIT_DIMS_MARK, None)
        if marked is None:  # not the checked call, or nothing cut
            return
        between = frozenset(
            d % x.dim()
            for d, groups in (self.cuts(self.context, x.dim()) if self.cuts else {}).items()
            if any(self.context.get_world_size(g) > 1 for g in groups)
        )
        if marked != between:
            raise ValueError(
                f"parallelize: the drop path {self.name!r} is given a {list(x.shape)} tensor "
                f"whose dims {sorted(marked)} the tensor ranks cut, where the activations "
                f"between blocks have dims {sorted(between)} cut; tessera makes a drop path's "
                "numbers alike on the ranks holding parts of one sample in the activations' "
                "layout, so here a sample would be dropped in some blocks and kept in others. "
                "Apply it to a residual branch's output (after its row layer), as transformer "
                "blocks do"
            )

    def __call__(self, numbers: torch.Tensor, ndim: int, whole_batch: bool) -> torch.Tensor:
        """``numbers`` as the first rank of each group holding the same samples drew them.

        One broadcast per group, in turn; for the batch's one number (``whole_batch``) the
        batch's groups too, so every tensor rank ends with the same number.
        """
        if self.cuts is None:
            return numbers
        cut = self.cuts(self.context, ndim).items()
        groups = {g for dim, by in cut if whole_batch or dim != 0 for g in by}
        for group in sorted(groups):  # the same order on every rank
            if self.context.get_world_size(group) > 1:
                numbers = broadcast(numbers, 0, self.context.get_group(group))
        return numbers


def _drop_probability(module: nn.Module) -> float | None:
    """The probability a drop-path module drops a branch with, or ``None``: not one.

    timm's and transformers' ``*DropPath`` hold it as ``drop_prob``; torchvision's
    ``StochasticDepth`` as ``p``, beside its ``mode`` (``"row"`` or ``"batch"``).
    """
    name = type(module).__name__
    if name.endswith("DropPath"):
        drop = getattr(module, "drop_prob", None)
    elif name == "StochasticDepth" and getattr(module, "mode", None) in ("row", "batch"):
        drop = getattr(module, "p", None)
    else:
        return None
    return drop if isinstance(drop, float) else None


def is_drop_path(module: nn.Module) -> bool:
    """A stochastic-depth module as timm, transformers and torchvision write it."""
    return _drop_probability(module) is not None


def _forward_per_sample(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The module's drop path, its samples' numbers alike on their ranks. ``x``: ``[b, ...]``."""
    drop = _drop_probability(self) or 0.0
    agree: _Agreement = getattr(self, _AGREE_ATTR)
    agree.check_layout(x)  # on the first call, whatever its rate (a schedule may start at 0)
    if not 0.0 <= drop <= 1.0:  # as torchvision's check, before any collective
        raise ValueError(f"drop probability has to be between 0 and 1, but got {drop}")
    if drop == 0.0 or not self.training:
        return x
    keep = 1.0 - drop
    whole_batch = getattr(self, "mode", "row") == "batch"
    rows = 1 if whole_batch else x.shape[0]
    numbers = agree(torch.rand(rows, device=x.device), x.dim(), whole_batch)  # [b] or [1]
    kept = (numbers < keep).to(x.dtype)
    if keep > 0.0 and getattr(self, "scale_by_keep", True):
        kept = kept / keep
    return x * kept.view(-1, *(1,) * (x.dim() - 1))


def install_per_sample_draws(model: nn.Module, context: ParallelContext) -> None:
    """Run every drop-path module of ``model`` on numbers alike on a sample's ranks."""
    layers = find_mode_layers(context.config.tensor_mode)
    cuts = None if layers is None else layers.activation_cuts
    for name, module in model.named_modules():
        if is_drop_path(module) and "forward" not in vars(module):
            setattr(module, _AGREE_ATTR, _Agreement(name, cuts, context))
            # a bound method on the instance: a deep copy binds it to the copy
            module.forward = types.MethodType(_forward_per_sample, module)
