"""Position modules kept whole, their ``[b, s, h]`` output split into the mode's layout.

Two kinds of position module outside the blocks compute their rows in a forward of their own,
which a tessera embedding would not:

* XGLM adds sinusoidal positions (Vaswani et al. 2017, section 3.5): a module holding a
  ``[positions, h]`` table as a buffer and no parameters;
* OPT learns a table whose rows are read two places past each position (``nn.Embedding``
  subclass ``OPTLearnedPositionalEmbedding``, Zhang et al. 2022), from the position ids or
  from the attention mask's running count.

Either returns the rows of the model's positions, ``[b, s, h]`` (or ``[1, s, h]``, shared by
the batch). The token embedding under 2D, 2.5D and 3D returns this rank's block of the same
activation (whole ids in, the mode's layout out), so the sum would fail on its shapes; under
1D and the sequence mode the positions already have the embedding's shape (replicated, or this
rank's sequence chunk of global position ids) and nothing changes. :class:`SplitToLayout` puts
the module's output into the mode's layout with :func:`~tessera.layers.split_activation`, as a
forward hook, so the module, its parameters, buffers and names stay as they are (one row shared
by the batch stays one row of this rank's hidden block). A learned table stays whole on every
rank: the split's backward gathers the output's gradient, so every rank computes the table's
whole gradient, the same on every tensor rank (under ``sequence``, each rank's positions'
part, summed over the ranks as every parameter's is).

A module is taken for one (:func:`is_position_table`) when it is an ``nn.Embedding`` of the
hidden size with a forward of its own, or when it holds no parameters and a floating-point
buffer of two or more dims whose rows have the hidden size: integer position ids (BERT's
``position_ids``) and rotary tables (rows of a head's size) are not.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tessera.context import ParallelContext, ParallelMode

from ..dispatch.activations import split_activation

__all__ = ["SPLIT_MODES", "SplitToLayout", "is_position_table"]

#: The tensor modes whose activations between blocks are blocks of the whole one.
SPLIT_MODES = ("2d", "2.5d", "3d")


def is_position_table(module: nn.Module, hidden: int) -> bool:
    """Whether ``module`` computes positions of ``hidden`` features in a forward of its own."""
    if isinstance(module, nn.Embedding):
        return module.embedding_dim == hidden and type(module).forward is not nn.Embedding.forward
    if any(True for _ in module.parameters()):
        return False
    return any(
        b.is_floating_point() and b.dim() >= 2 and b.shape[-1] == hidden for b in module.buffers()
    )


class SplitToLayout:
    """A forward hook: the module's full ``[b, ..., h]`` output, as this rank's block.

    Args:
        context: The ParallelContext whose tensor mode sets the layout.
    """

    def __init__(self, context: ParallelContext) -> None:
        self.context = context

    def __call__(self, module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        """``output`` ``[b, s, h]`` -> this rank's block in the mode's layout.

        Positions shared by every sample (``[1, s, h]``, to be broadcast over the batch) keep
        their one row: it is repeated once per tensor rank (a multiple of the mode's batch
        blocks), split, and one row of this rank's block kept (``[1, s, h/q]``).
        """
        if output.shape[0] != 1:
            return split_activation(output, context=self.context)
        ranks = self.context.get_world_size(ParallelMode.TENSOR)
        rows = output.expand(ranks, *output.shape[1:])  # [ranks, s, h], every row the same
        return split_activation(rows, context=self.context)[:1]
