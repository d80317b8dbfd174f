"""``SectionOrder``: a layer's output features from tessera's grouped form back to its parts.

A fused projection whose parts differ in size (q, k and v of grouped-query attention) is held
with its output rows interleaved by group (see :mod:`tessera.context.full_form`): each
rank's block of them holds the same fraction of every part, but group by group. The model that
consumes the output slices it part by part (Phi-3: ``qkv[..., :query_pos]``), so the rank's
output features are put back in the order of the parts: this rank's q heads, then its k heads,
then its v heads, which is what the unconverted module returns for those heads.
"""

from __future__ import annotations

import torch
from torch import nn

from tessera.context import parts_in_turn

__all__ = ["SectionOrder"]


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
