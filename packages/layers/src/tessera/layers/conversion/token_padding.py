"""A sequence 1D sequence parallelism cannot split evenly, padded at the span and stripped.

Under 1D sequence parallelism (Korthikanti et al. 2022) each rank holds ``[b, s/p, h]``
between the column and row layers, and the collectives that move between the two forms (the
all-gather before a column layer or an attention, the reduce-scatter after a row layer) need
equal chunks. A ViT's tokens rarely divide: 196 patches and a class token make 197. So the
span pads the sequence with zero tokens at its end to ``p * ceil(s/p)`` where it splits it,
and strips them where it gathers it. In between:

* token-wise code (norms, the MLP's column and row layers, residual adds, dropout) computes
  on the padding too, which no real token reads: its output is stripped at the end, and its
  gradient is zero;
* attention, the one place tokens meet, strips the padding right after it gathers the
  sequence, so it attends over the ``s`` real tokens exactly as one process does (the keys,
  the softmax, the positions a rotary table counts); its output projection, a row layer,
  pads its input back before the reduce-scatter.

The true length is the one fact the gather cannot read from shapes, so the span records it
in a :class:`TokenCount` shared by its hooks, each forward. Activation checkpointing replays
a block in the backward with the count of the latest forward: with micro-batches of other
lengths in flight, torch's non-reentrant checkpoint (tessera's) finds the replayed tensors of
another shape and raises; a reentrant one would not, where the lengths pad alike.

Between a column and a row layer the sequence is whole but padded, its padding no longer
zero (a bias went through the activation): a reduction over the tokens there would read it.
The span refuses modules mixing tokens there (``check_no_token_mixing``) but for attention.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..parallel_1d.linear import Linear1DRow

__all__ = ["TOKEN_COUNT_ATTR", "TokenCount", "pad_rows_inside", "pad_tokens", "strip_tokens"]

#: Set on an attention module that gathers its own sequence (multihead.py): the span's count.
TOKEN_COUNT_ATTR = "_tessera_token_count"


@dataclass
class TokenCount:
    """The length of the sequence a span split, before its padding (``None``: none yet).

    ``padded``: its length after. ``staged``: the model was cut into pipeline layers
    (``pipeline_layers``), whose later stages, in other processes, never see the length the
    first recorded (a whole-model call there, ``pipeline_layers``' probe, left another): no
    padding is added then, and none stripped.
    """

    tokens: int | None = None
    padded: int | None = None
    staged: bool = False


def pad_tokens(x: torch.Tensor, ranks: int, count: TokenCount) -> torch.Tensor:
    """``x [b, s, ...]`` with zero tokens added at the end to a multiple of ``ranks``.

    Records ``s`` in ``count``. The backward drops the padding's gradient.

    Raises:
        ValueError: padding is needed, but the model runs as pipeline stages.
    """
    extra = -x.shape[1] % ranks
    count.tokens, count.padded = x.shape[1], x.shape[1] + extra
    if not extra:
        return x
    if count.staged:
        raise ValueError(
            f"1D sequence parallelism over pipeline stages: {x.shape[1]} tokens do not divide "
            f"into {ranks} equal chunks, and the stages after the first cannot know a padding "
            "the first would add; give the stages a sequence length the 1D ranks divide"
        )
    widths = [0, 0] * (x.dim() - 2) + [0, extra]  # F.pad reads the last dim first
    return F.pad(x, widths)  # [b, p * ceil(s/p), ...]


def strip_tokens(x: torch.Tensor, count: TokenCount) -> torch.Tensor:
    """``x [b, s + pad, ...]`` without the padding :func:`pad_tokens` added.

    Raises:
        ValueError: ``x`` holds neither the recorded length nor the padded one (a count of
            another forward: never a guess).
    """
    if count.staged or count.tokens is None or x.shape[1] == count.tokens:
        return x
    if x.shape[1] != count.padded:
        raise ValueError(
            f"sequence padding: the span recorded {count.tokens} tokens, padded to "
            f"{count.padded}, but gathered {x.shape[1]}: a call replayed outside the forward "
            "that recorded them (activation checkpointing across batches of other lengths)"
        )
    return x[:, : count.tokens]  # [b, s, ...]


def pad_rows_inside(module: nn.Module, ranks: int) -> None:
    """Pad the input of each sequence-parallel row layer in ``module`` to a multiple of ``ranks``.

    The output projection of an attention that stripped the padding (inside the attention
    module, or after it: BERT's ``attention.output.dense``): its reduce-scatter cuts the
    sequence into equal chunks again, the padded tokens' partial sums zero. The MLP's row
    layers take the padded sequence already, which the hook leaves as it is.
    """

    def pad(layer: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        x = args[0]
        if not isinstance(x, torch.Tensor) or x.dim() < 3 or not x.shape[1] % ranks:
            return None
        return (pad_tokens(x, ranks, TokenCount()), *args[1:])

    for layer in module.modules():
        if isinstance(layer, Linear1DRow) and layer.sequence_parallel:
            layer.register_forward_pre_hook(pad)
