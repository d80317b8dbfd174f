"""A transformer block written once with the dispatching layers (test helper).

Built with ``context=None`` (no current context) it is plain torch: the reference. Built with a
1D context it is Megatron-style tensor parallel; the parameter names are the same.
"""

from __future__ import annotations

import torch
from torch import nn

from tessera.context import ParallelContext
from tessera.layers import Dropout, LayerNorm, Linear


class Block(nn.Module):
    def __init__(
        self, hidden: int, heads: int, p: float = 0.0, context: ParallelContext | None = None
    ) -> None:
        super().__init__()
        self.head_dim = hidden // heads
        self.ln1 = LayerNorm(hidden, context=context)
        self.qkv = Linear(hidden, 3 * hidden, parallel="col", context=context)
        self.attn_drop = Dropout(p, parallel_input=True, context=context)
        self.proj = Linear(hidden, hidden, parallel="row", context=context)
        self.drop1 = Dropout(p, context=context)
        self.ln2 = LayerNorm(hidden, context=context)
        self.fc1 = Linear(hidden, 4 * hidden, parallel="col", context=context)
        self.fc2 = Linear(4 * hidden, hidden, parallel="row", context=context)
        self.drop2 = Dropout(p, context=context)

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(self.ln1(x))  # [b, s, 3h/p], head-major: [heads/p, 3, d]
        b, s, _ = qkv.shape
        q, k, v = qkv.view(b, s, -1, 3, self.head_dim).permute(3, 0, 2, 1, 4)  # [b, n, s, d]
        scores = (q @ k.transpose(-1, -2)) / self.head_dim**0.5
        probs = self.attn_drop(scores.softmax(dim=-1))
        out = (probs @ v).transpose(1, 2).reshape(b, s, -1)  # [b, s, h/p]
        return self.drop1(self.proj(out))

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop2(self.fc2(torch.nn.functional.gelu(self.fc1(self.ln2(x)))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(x)
        return x + self.mlp(x)
