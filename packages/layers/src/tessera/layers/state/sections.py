"""``SectionOrder``: a layer's output features from tessera's grouped form back to its parts.

A fused projection whose parts differ in size (q, k and v of grouped-query attention) is held
with its output rows interleaved by group (see :mod:`tessera.layers.state.full_form`): each
rank's block of them holds the same fraction of every part, but group by group. The model that
consumes the output slices it part by part (Phi-3: ``qkv[..., :query_pos]``), so the rank's
output features are put back in the order of the parts: this rank's q heads, then its k heads,
then its v heads, which is what the unconverted module returns for those heads.
"""

from __future__ import annotations

import math

import torch
from torch import nn

__all__ = ["SectionOrder", "grouped", "parts_in_turn"]


def parts_in_turn(x: torch.Tensor, sections: tuple[int, ...], dim: int = -1) -> torch.Tensor:
    """Features interleaved by group along ``dim`` -> the same features, part after part.

    ``x.shape[dim]`` may be any whole number of groups (a rank's share of the output).
    """
    groups = math.gcd(*sections)
    widths = [s // groups for s in sections]  # one group's features of each part
    moved = x.movedim(dim, -1)
    by_group = moved.reshape(
        *moved.shape[:-1], moved.shape[-1] // sum(widths), sum(widths)
    )  # [.., G', u]
    pieces = torch.split(by_group, widths, dim=-1)  # each [..., G', s_i/G]
    return torch.cat([p.flatten(-2) for p in pieces], dim=-1).movedim(-1, dim)


def grouped(x: torch.Tensor, sections: tuple[int, ...], dim: int = -1) -> torch.Tensor:
    """The inverse of :func:`parts_in_turn`: whole parts along ``dim`` -> interleaved by group."""
    groups = math.gcd(*sections)
    moved = x.movedim(dim, -1)
    pieces = torch.split(moved, list(sections), dim=-1)  # each [..., s_i]
    by_group = torch.cat(
        [p.reshape(*p.shape[:-1], groups, -1) for p in pieces], dim=-1
    )  # [.., G, u]
    return by_group.flatten(-2).movedim(-1, dim)


class SectionOrder:
    """Forward hook: the layer's output in the order of its parts (see the module docstring).

    Args:
        sections: The sizes of the parts of the whole output (e.g. q, k, v widths).
    """

    def __init__(self, sections: tuple[int, ...]) -> None:
        self.sections = sections

    def __call__(self, module: nn.Module, args: tuple[object, ...], output: object) -> object:
        """The output of ``module``, its features put in the order of the parts."""
        if not isinstance(output, torch.Tensor):
            raise TypeError(
                f"{type(module).__name__} with fused parts {self.sections} returned "
                f"{type(output).__name__}, not a tensor (skip_bias_add is not supported here)"
            )
        return parts_in_turn(output, self.sections)

    def __repr__(self) -> str:
        return f"SectionOrder(sections={self.sections})"
