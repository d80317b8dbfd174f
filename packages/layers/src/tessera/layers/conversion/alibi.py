"""``AlibiHeads``: an attention module's share of the ALiBi bias the model builds for every head.

ALiBi (Press et al. 2022, "Train Short, Test Long") adds to each head's attention scores a bias
linear in the key position, with a slope of the head's own. BLOOM builds the bias once per
forward for all of its heads, ``[batch * heads, 1, keys]`` (batch-major), and passes it to every
block's attention as ``alibi``. Where the heads are split over tensor ranks, an attention module
scores only this rank's heads, so it must add only their rows: the heads' slopes are not the
same (the slopes of heads ``0..count-1`` would be computed if the model built the bias for the
local count, silently wrong). A forward pre-hook takes those rows out of the whole bias before
the module's forward sees it.

The batch rows are the attention's own already: the bias is built from the model's input
(the attention mask, or the batch size) after the boundary took this rank's rows, in the layout
the attention runs in (3D: layout ``"z"``'s rows, as ``rank_rows`` gives the mask).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

__all__ = ["ALIBI_ARGUMENT", "AlibiHeads", "takes_alibi"]

#: The keyword under which transformers' attention modules take the ALiBi bias.
ALIBI_ARGUMENT = "alibi"


def takes_alibi(module: nn.Module) -> bool:
    """Whether ``module``'s forward takes an ALiBi bias (an ``alibi`` argument)."""
    return ALIBI_ARGUMENT in inspect.signature(type(module).forward).parameters


class AlibiHeads:
    """Forward pre-hook (with kwargs): the ``alibi`` argument cut to this rank's heads.

    Args:
        heads: The heads the model built the bias for (all of them).
        first: The first of this rank's heads.
        count: This rank's heads.
    """

    def __init__(self, heads: int, first: int, count: int) -> None:
        self.heads, self.first, self.count = heads, first, count

    def __call__(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """``[b * heads, 1, keys]`` -> ``[b * count, 1, keys]``, this rank's heads' rows.

        Raises:
            ValueError: the bias is not passed by keyword, or its rows are not a multiple of
                the heads.
        """
        if ALIBI_ARGUMENT in kwargs and kwargs[ALIBI_ARGUMENT] is None:
            return args, kwargs  # no bias this call (Falcon with rotary positions passes None)
        alibi = kwargs.get(ALIBI_ARGUMENT)
        if not isinstance(alibi, torch.Tensor):
            raise ValueError(
                f"{type(module).__name__}: parallelize cuts the ALiBi bias to this rank's "
                f"{self.count} of {self.heads} heads, which takes it as the keyword argument "
                f"{ALIBI_ARGUMENT!r}; it was not given by keyword"
            )
        rows = alibi.shape[0]
        if rows % self.heads != 0:
            raise ValueError(
                f"{type(module).__name__}: the ALiBi bias {list(alibi.shape)} holds {rows} rows, "
                f"not batch x {self.heads} heads ({rows} % {self.heads} = {rows % self.heads})"
            )
        whole = alibi.reshape(rows // self.heads, self.heads, *alibi.shape[1:])  # [b, heads, 1, k]
        mine = whole[:, self.first : self.first + self.count]  # [b, count, 1, k]
        return args, {**kwargs, ALIBI_ARGUMENT: mine.reshape(-1, *alibi.shape[1:])}

    def __repr__(self) -> str:
        """Which heads."""
        last = self.first + self.count - 1
        return f"AlibiHeads(heads {self.first}..{last} of {self.heads})"
