"""Mixture-of-experts layers under 1D: each expert's MLP split like a Megatron MLP.

A sparse MoE block (Shazeer et al. 2017; Mixtral, Jiang et al. 2024) routes every token to its
top-k experts, each a gated MLP, and sums their outputs weighted by the router. transformers
keeps the experts of a block in one module, ``gate_up_proj`` ``[E, 2F, h]`` (each expert's gate
rows, then its up rows) and ``down_proj`` ``[E, h, F]``, called with the tokens, their experts
and their weights. Under 1D each rank holds every expert's ``F/p`` intermediate features, as
Megatron-LM splits one MLP (Shoeybi et al. 2019; "expert tensor parallelism" in Megatron-Core):
the gate and up rows split as columns, the down rows as rows, so a rank's outputs are partial
sums, added by one all-reduce (or, with sequence parallelism, one reduce-scatter after the
tokens were gathered, Korthikanti et al. 2022). Every rank routes the same tokens alike (the
router is replicated, its input too), so no token moves between ranks.

The router's weights multiply the experts' partial outputs: like the tokens, they enter through
Megatron's f (or the gather), whose backward sums the ranks' parts of their gradient, so the
router's gradient is whole. Under sequence parallelism the router runs on this rank's tokens
only, and its parameters' gradients are summed over the 1D group (:class:`TokenRouter`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tessera.context import FullForm, ParallelContext, set_full_form, set_shard_info

from ..comm.collectives import all_gather_along
from ..comm.ops import copy_to_group, gather_along_dim, reduce_from_group, reduce_scatter_along_dim
from ..shared.base import Module1D
from ..shared.initializers import normal
from ..shared.shards import shard_info
from ..state.state_dict import load_full_state_dict
from .lent import lent

__all__ = ["Experts1D", "ExpertSizes", "TokenRouter", "expert_sizes"]

#: The experts' parameters, each ``[experts, rows, cols]``.
EXPERT_PARAMETERS = ("gate_up_proj", "down_proj")


@dataclass(frozen=True)
class ExpertSizes:
    """A transformers experts module's sizes: ``experts`` MLPs of ``hidden -> intermediate``."""

    experts: int
    hidden: int
    intermediate: int


def expert_sizes(name: str, module: nn.Module) -> ExpertSizes:
    """The sizes of ``module`` if it is a transformers experts module 1D can split.

    Raises:
        TypeError: ``module`` holds other parameters than a gated ``gate_up_proj`` ``[E, 2F,
            h]`` (gate rows, then up rows) and a ``down_proj`` ``[E, h, F]``: transposed,
            interleaved or biased experts (gpt-oss) are cut otherwise.
    """
    params = {n: p for n, p in module.named_parameters()}
    flags = {
        "is_transposed": False,
        "has_bias": False,
        "has_gate": True,
        "is_concatenated": True,
        "has_post_expert_norm": False,
    }
    differs = [f for f, want in flags.items() if getattr(module, f, want) != want]
    shapes = [tuple(params[n].shape) for n in EXPERT_PARAMETERS if n in params]
    if sorted(params) != sorted(EXPERT_PARAMETERS) or differs or len(shapes) != 2:
        raise TypeError(
            f"parallelize: {name!r} ({type(module).__name__}) has role 'experts', which takes "
            "transformers' experts holding exactly gate_up_proj [experts, 2 * intermediate, "
            "hidden] (gate rows, then up rows) and down_proj [experts, hidden, intermediate]; "
            f"it holds {sorted(params)}" + (f" and sets {differs}" if differs else "")
        )
    (experts, double, hidden), (experts_down, hidden_down, intermediate) = shapes
    if (experts_down, hidden_down, 2 * intermediate) != (experts, hidden, double):
        raise TypeError(
            f"parallelize: {name!r} has gate_up_proj {list(shapes[0])} and down_proj "
            f"{list(shapes[1])}, which are not [E, 2F, h] and [E, h, F] of one E, F and h"
        )
    return ExpertSizes(experts, hidden, intermediate)


def _as_allocated(tensor: torch.Tensor, fan_in: int, fan_out: int) -> None:
    """Leave the shard as allocated: the plain module's values are loaded next."""


class Experts1D(Module1D):
    """A transformers experts module with every expert's intermediate features split over 1D.

    Called as the module it replaces, ``(tokens [n, h], experts [n, k], weights [n, k])`` ->
    ``[n, h]``: the tokens replicated over the 1D group, or, with ``sequence_parallel``, this
    rank's ``n / p`` of them (gathered here, the output reduce-scattered back). Parameters
    ``gate_up_proj`` ``[E, 2, F/p, h]`` (gate and up, each split on its own; its full form is
    the module's ``[E, 2F, h]``) and ``down_proj`` ``[E, h, F/p]``.

    Args:
        experts: The plain module: this module's shards are cut from its parameters, which
            are then dropped; its forward (and the implementation it picks) runs on this
            rank's blocks, lent at every call.
        sizes: Its sizes (:func:`expert_sizes`).
        dtype: Parameter dtype.
        sequence_parallel: Tokens come and go split along the sequence (dim 0 of ``[n, h]``).
        device: Parameter device (default the context's).
        context: The ParallelContext (default the current one).

    Raises:
        ValueError: the intermediate features are not divisible by the 1D ranks.
    """

    def __init__(
        self,
        experts: nn.Module,
        sizes: ExpertSizes,
        dtype: torch.dtype | None = None,
        *,
        sequence_parallel: bool = False,
        device: torch.device | str | None = None,
        context: ParallelContext | None = None,
    ) -> None:
        super().__init__(sequence_parallel=sequence_parallel, context=context, device=device)
        e, h, f = sizes.experts, sizes.hidden, sizes.intermediate
        split = (self.split_mode,)
        plain = {name: getattr(experts, name) for name in EXPERT_PARAMETERS}
        on_meta = any(p.is_meta for p in plain.values())
        # drawn only on meta (transformers' default initializer_range), else cut from ``plain``
        init = normal(0.0, 0.02) if on_meta else _as_allocated
        self.gate_up_proj = self.make_parameter(
            "gate_up_proj",
            (e, 2, f, h),
            init,
            fan_in=h,
            fan_out=2 * f,
            splits={2: split},
            dtype=dtype,
        )  # [E, 2, F/p, h]
        set_full_form(self.gate_up_proj, FullForm((e, 2 * f, h)))
        self.down_proj = self.make_parameter(
            "down_proj", (e, h, f), init, fan_in=f, fan_out=h, splits={2: split}, dtype=dtype
        )  # [E, h, F/p]
        if not on_meta:
            load_full_state_dict(self, plain)
        for name, param in plain.items():
            getattr(self, name).requires_grad_(param.requires_grad)
            delattr(experts, name)
        self.experts = (experts,)  # not a submodule: its parameters are this module's
        self.train(experts.training)
        self.sizes = sizes

    def train(self, mode: bool = True) -> Experts1D:
        """Set training mode here and on the plain module, whose forward runs here."""
        super().train(mode)
        self.experts[0].train(mode)
        return self

    def forward(
        self, tokens: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, *args: Any
    ) -> torch.Tensor:
        """See the class docstring for shapes."""
        (plain,) = self.experts
        group = self.tp.group
        if self.sequence_parallel:  # every rank's tokens: its own and the others'
            tokens = gather_along_dim(tokens, 0, group, partial_grad=True)  # [n, h]
            experts = all_gather_along(experts, 0, group, self.tp.world_size)  # [n, k]
            weights = gather_along_dim(weights, 0, group, partial_grad=True)  # [n, k]
        else:
            tokens, weights = copy_to_group(tokens, group), copy_to_group(weights, group)
        blocks: Mapping[str, torch.Tensor] = {
            "gate_up_proj": self.gate_up_proj.flatten(1, 2),  # [E, 2F/p, h]: gate, then up
            "down_proj": self.down_proj,
        }
        with lent(plain, blocks):
            partial = plain(tokens, experts, weights, *args)  # [n, h], this rank's F/p
        if self.sequence_parallel:
            return reduce_scatter_along_dim(partial, 0, group)  # [n/p, h]
        return reduce_from_group(partial, group)

    def extra_repr(self) -> str:
        """The summary shown by ``print(module)``."""
        (plain,) = self.experts
        s = self.sizes
        return (
            f"{s.experts} experts of {s.hidden} -> {s.intermediate}, "
            f"computed by {type(plain).__name__}, " + super().extra_repr()
        )


class TokenRouter(Module1D):
    """A router (or any plain module) run on this rank's tokens, its gradient summed over 1D.

    Under sequence parallelism each rank routes its own tokens with the whole, replicated
    parameters, so each holds a part of their gradient: summed over the 1D group in autograd,
    or once per step by the training loop (:meth:`defer_gradient_sum`), as Megatron-LM sums a
    sequence-parallel LayerNorm's. Parameters under the plain module's names.

    Args:
        router: The plain module; its forward runs with the parameters lent at every call.
        context: The ParallelContext (default the current one).
    """

    def __init__(self, router: nn.Module, *, context: ParallelContext | None = None) -> None:
        params = dict(router.named_parameters(recurse=False))
        device = next(iter(params.values())).device
        super().__init__(sequence_parallel=True, context=context, device=device)
        for name, param in params.items():
            delattr(router, name)
            self.register_parameter(name, param)
            info = shard_info(self.context, param.shape, replicated=(self.split_mode,))
            set_shard_info(param, info)  # whole on every 1D rank
        self.router = (router,)
        self.train(router.training)

    def defer_gradient_sum(self) -> dict[str, list[nn.Parameter]]:
        """Leave the sum of every parameter's gradient over the 1D group to the loop.

        See :meth:`~tessera.layers.shared.base.Module1D.defer_gradient_sum`.
        """
        params = list(self.parameters(recurse=False))
        if self.tp.world_size == 1 or not params:
            return {}
        self.sequence_sum_deferred = True
        return {self.tp.mode: params}

    def train(self, mode: bool = True) -> TokenRouter:
        """Set training mode here and on the plain module, whose forward runs here."""
        super().train(mode)
        self.router[0].train(mode)
        return self

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The plain module's forward, on the parameters routed through the 1D sum."""
        (plain,) = self.router
        routed = {n: self.summed_over_group(p) for n, p in self.named_parameters(recurse=False)}
        with lent(plain, routed):
            return plain(*args, **kwargs)
