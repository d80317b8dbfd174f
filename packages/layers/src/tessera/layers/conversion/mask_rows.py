"""A model of one's own is given its mask in the rows of its hidden states; attention swaps it.

Under 3D the two layouts hold different samples off the cube's diagonal (cube/layout.py):
between blocks rank ``(x, y, z)`` holds batch block ``z q + x`` (layout ``"y"``), while
attention runs on a column layer's output, batch block ``y q + x`` (layout ``"z"``). A
transformers model reads its ``attention_mask`` in attention only, so the boundary gives it
the rows attention runs on (``boundary.rank_rows``). A model someone wrote may also read the
mask beside its hidden states (a mean over the tokens it keeps, padding zeroed): with
attention's rows there, each sample's hidden states would meet another sample's mask, and
the model would train differently from one process without an error.

So a model of one's own is given its mask in the rows of its hidden states, and the mode's
``rows_to_attention`` (3D's mirror swap) moves a mask to attention's rows where attention
consumes it:

* the ``F.scaled_dot_product_attention`` call of each attention module the plan names: its
  ``attn_mask`` of this rank's rows is swapped (a mask of one row, shared by the batch,
  swaps to the same values);
* ``nn.MultiheadAttention`` (multihead.py's ``HeadsAttention``): its masks of this rank's rows.

An attention module that made no SDPA call while the model was given a mask is an error
naming it: it would mask its scores with other samples' rows.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from tessera.context import ParallelContext

from ..shared.mode_layers import find_mode_layers
from .multihead import HeadsAttention

__all__ = ["MaskGiven", "install_mask_rows"]

#: Set on a ``HeadsAttention``: the map of its masks' rows to attention's.
ROWS_TO_ATTENTION_ATTR = "_tessera_rows_to_attention"
#: Set on another attention module: its :class:`_MaskRows`.
_MASK_ROWS_ATTR = "_tessera_mask_rows"

RowsMap = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class MaskGiven:
    """Whether the model's current forward was given an ``attention_mask`` (the boundary's)."""

    value: bool = False

    def __deepcopy__(self, memo: dict[int, Any]) -> MaskGiven:
        return self  # a copied model's modules read the flag its (shared) boundary hook sets


@dataclass(frozen=True)
class _MaskRows:
    to_attention: RowsMap
    given: MaskGiven


class _SwapMaskRows(TorchFunctionMode):
    """Moves the ``attn_mask`` of every SDPA call to the rows attention runs on."""

    def __init__(self, to_attention: RowsMap) -> None:
        super().__init__()
        self.to_attention, self.calls = to_attention, 0

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = dict(kwargs or {})
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        self.calls += 1
        query = args[0] if args else kwargs["query"]
        if len(args) > 3:
            args = (*args[:3], self._rows(args[3], query), *args[4:])
        elif kwargs.get("attn_mask") is not None:
            kwargs["attn_mask"] = self._rows(kwargs["attn_mask"], query)
        return func(*args, **kwargs)

    def _rows(self, mask: Any, query: torch.Tensor) -> Any:
        """``mask`` ``[b', ..., L, S]`` of this rank's rows -> attention's; others unchanged."""
        per_row = (
            isinstance(mask, torch.Tensor)
            and mask.dim() == query.dim() == 4
            and mask.shape[0] == query.shape[0]
        )
        return self.to_attention(mask) if per_row else mask


def _forward_with_mask_rows(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The module's own forward, its SDPA masks moved to attention's rows (module docstring)."""
    spec: _MaskRows = getattr(self, _MASK_ROWS_ATTR)
    mode = _SwapMaskRows(spec.to_attention)
    with mode:
        out = type(self).forward(self, *args, **kwargs)
    if mode.calls == 0 and spec.given.value:
        raise ValueError(
            f"{type(self).__name__} made no call to F.scaled_dot_product_attention while the "
            "model was given an attention_mask: under this tensor mode attention runs on other "
            "rows of the batch than the model's hidden states, and tessera moves a mask to them "
            "at that call; a module computing its scores itself would mask them with other "
            "samples' rows. Call F.scaled_dot_product_attention (attn_mask=...) in its forward, "
            "or use tensor mode '2d' or '2.5d'"
        )
    return out


def install_mask_rows(
    model: nn.Module, attention: Sequence[str], context: ParallelContext
) -> MaskGiven | None:
    """Have ``attention`` move masks to attention's rows, for a model of one's own.

    Returns:
        What the boundary sets each forward, or ``None`` where the model keeps attention's
        rows: the mode has one set of rows (no ``rows_to_attention``), or it is a
        transformers model (its mask is read in attention only).
    """
    layers = find_mode_layers(context.config.tensor_mode)
    if layers is None or layers.rows_to_attention is None:
        return None
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "_attn_implementation"):
        return None
    rows = layers.rows_to_attention

    def to_attention(x: torch.Tensor) -> torch.Tensor:
        return rows(x, context)

    given = MaskGiven()
    for name in attention:
        module = model.get_submodule(name)
        if isinstance(module, HeadsAttention):
            setattr(module, ROWS_TO_ATTENTION_ATTR, to_attention)
            continue
        setattr(module, _MASK_ROWS_ATTR, _MaskRows(to_attention, given))
        # a bound method on the instance: a deep copy binds it to the copy
        module.forward = types.MethodType(_forward_with_mask_rows, module)
    return given
