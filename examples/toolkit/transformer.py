"""A pre-norm transformer block built from tessera's mode-dispatching layers.

The block is the Megatron-LM one (Shoeybi et al. 2019): attention's ``qkv`` projection and the
MLP's first linear are column-parallel (``parallel="col"``), the output projections are
row-parallel (``parallel="row"``). 2D/2.5D (SUMMA, Tesseract) ignore the word; 3D reads it as
"this layer takes the layout between blocks" (col) or "the layout a col layer returns" (row).
In every mode the ``qkv`` output holds whole heads on each rank, because its features are laid
out ``[heads, 3, head_dim]``: a contiguous block of them is a block of heads with their q, k
and v. Attention itself is then local to the rank.

Under ``tensor=dict(mode="sequence")`` the dispatching layers are plain torch modules working
on the rank's sub-sequence, and attention is tessera's :class:`RingSelfAttention` (Li et al.
2021), whose fused ``qkv`` weight is laid out ``[3, heads, head_dim]`` instead:
:func:`to_ring_layout` permutes a full state dict from one layout to the other.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from tessera.context import ParallelContext, get_context, has_context
from tessera.layers import Dropout, LayerNorm, Linear, RingSelfAttention

__all__ = [
    "Block",
    "SelfAttention",
    "current_context",
    "tensor_mode",
    "to_ring_layout",
]


def current_context() -> ParallelContext | None:
    """The launcher's context, or ``None`` in a plain single process."""
    return get_context() if has_context() else None


def tensor_mode() -> str | None:
    """The current tensor mode: None, '1d', '2d', '2.5d', '3d' or 'sequence'."""
    ctx = current_context()
    return None if ctx is None else ctx.config.tensor_mode


class SelfAttention(nn.Module):
    """Multi-head self-attention from a column-parallel ``qkv`` and a row-parallel ``proj``.

    Input and output ``[b', s, h']``: the local block of ``[b, s, h]`` in the mode's activation
    layout (``b' = b, h' = h`` in 1D; ``b/q, h/q`` in 2D; ...).
    """

    def __init__(self, hidden: int, heads: int, dropout: float, causal: bool) -> None:
        super().__init__()
        if hidden % heads:
            raise ValueError(f"hidden size {hidden} is not divisible by {heads} heads")
        self.head_dim, self.causal = hidden // heads, causal
        self.qkv = Linear(hidden, 3 * hidden, parallel="col")  # full weight [heads*3*d, h]
        self.proj = Linear(hidden, hidden, parallel="row")
        self.attn_drop = Dropout(dropout, parallel_input=True)  # each rank holds other heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        qkv = self.qkv(x)  # [b', s, heads' * 3 * d]: whole heads on this rank
        heads = qkv.shape[-1] // (3 * self.head_dim)
        q, k, v = qkv.view(b, s, heads, 3, self.head_dim).permute(3, 0, 2, 1, 4)  # [b', n', s, d]
        scores = (q * (1.0 / math.sqrt(self.head_dim))) @ k.transpose(-1, -2)  # [b', n', s, s]
        if self.causal:
            mask = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
            scores = scores.masked_fill(mask, float("-inf"))
        probs = self.attn_drop(scores.softmax(dim=-1))
        out = (probs @ v).transpose(1, 2).reshape(b, s, heads * self.head_dim)  # [b', s, h'']
        y: torch.Tensor = self.proj(out)  # [b', s, h']
        return y


def attention(hidden: int, heads: int, dropout: float, causal: bool) -> nn.Module:
    """:class:`SelfAttention`, or tessera's ring self-attention under sequence parallelism."""
    if tensor_mode() == "sequence":
        return RingSelfAttention(hidden, heads, dropout, causal)
    return SelfAttention(hidden, heads, dropout, causal)


class Block(nn.Module):
    """``x + attn(norm1(x))``, then ``x + mlp(norm2(x))`` (pre-norm, GELU MLP)."""

    def __init__(
        self, hidden: int, heads: int, mlp_ratio: int, dropout: float, causal: bool = False
    ) -> None:
        super().__init__()
        self.norm1 = LayerNorm(hidden)
        self.attn = attention(hidden, heads, dropout, causal)
        self.drop1 = Dropout(dropout)
        self.norm2 = LayerNorm(hidden)
        self.fc1 = Linear(hidden, mlp_ratio * hidden, parallel="col")
        self.fc2 = Linear(mlp_ratio * hidden, hidden, parallel="row")
        self.drop2 = Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop1(self.attn(self.norm1(x)))
        out: torch.Tensor = x + self.drop2(self.fc2(F.gelu(self.fc1(self.norm2(x)))))
        return out


def to_ring_layout(state: dict[str, torch.Tensor], heads: int) -> dict[str, torch.Tensor]:
    """Permute each ``*.attn.qkv.*`` from ``[heads, 3, d]`` to ``[3, heads, d]`` (the ring's)."""
    out = dict(state)
    for name, tensor in state.items():
        if ".attn.qkv." in name or name.startswith("attn.qkv."):
            rest = tensor.shape[1:]
            d = tensor.shape[0] // (3 * heads)
            out[name] = tensor.reshape(heads, 3, d, *rest).transpose(0, 1).reshape(tensor.shape)
    return out
