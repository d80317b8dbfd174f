"""A small GPT (Radford et al. 2018) character model from tessera's dispatching layers.

``build_gpt(...)`` returns ``nn.Sequential([stem, block_0, ..., head])`` for a pipeline to cut.
The token embedding and the output head are vocab-parallel (``vocab_parallel=True``): under 1D
each tensor rank holds ``V/p`` rows of the embedding and ``V/p`` classes of the logits, and the
loss is tessera's vocab-parallel cross-entropy (Megatron-LM's), which never gathers the logits.
Under 2D/2.5D/3D the same words select those modes' vocab-parallel layers.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from toolkit.transformer import Block

from tessera.layers import (
    Classifier,
    CrossEntropyLoss,
    Dropout,
    Embedding,
    LayerNorm,
    split_batch,
)

__all__ = ["GPTHead", "GPTLoss", "GPTStem", "build_gpt", "generate"]


class GPTStem(nn.Module):
    """Token ids ``[b, s]`` (the full batch) -> token + position embeddings in the mode's layout."""

    def __init__(self, vocab: int, seq_len: int, hidden: int, dropout: float):
        super().__init__()
        self.tokens = Embedding(vocab, hidden, vocab_parallel=True)
        self.positions = Embedding(seq_len, hidden)
        # every row's positions are 0..s-1: the same on every rank of a batch group, on purpose
        setattr(self.positions, "check_split_batch", False)  # noqa: B010  (2D/2.5D/3D's flag)
        self.drop = Dropout(dropout)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)  # [b, s]
        x = self.tokens(split_batch(ids)) + self.positions(split_batch(positions))  # [b', s, h']
        out: torch.Tensor = self.drop(x)
        return out


class GPTHead(nn.Module):
    """LayerNorm and the vocab-parallel output layer: logits ``[b', s, V']``."""

    def __init__(self, vocab: int, hidden: int):
        super().__init__()
        self.norm = LayerNorm(hidden)
        self.lm_head = Classifier(hidden, vocab, bias=False, vocab_parallel=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.lm_head(self.norm(x))
        return logits


class GPTLoss(nn.Module):
    """Mean next-character cross-entropy from vocab-parallel logits, without gathering them."""

    def __init__(self) -> None:
        super().__init__()
        self.loss = CrossEntropyLoss(vocab_parallel=True)

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        local = split_batch(targets)  # [b', s]
        out: torch.Tensor = self.loss(logits.flatten(0, -2), local.flatten())
        return out


def build_gpt(
    vocab: int,
    seq_len: int = 64,
    hidden: int = 64,
    depth: int = 2,
    heads: int = 4,
    mlp_ratio: int = 4,
    dropout: float = 0.0,
) -> nn.Sequential:
    """The GPT as a sequence of layers, for the current context's tensor mode."""
    layers: list[nn.Module] = [GPTStem(vocab, seq_len, hidden, dropout)]
    layers += [Block(hidden, heads, mlp_ratio, dropout, causal=True) for _ in range(depth)]
    layers.append(GPTHead(vocab, hidden))
    return nn.Sequential(*layers)


@torch.no_grad()
def generate(
    model: nn.Module,
    prompt: torch.Tensor,
    length: int,
    seq_len: int,
    valid: int,
    temperature: float = 0.8,
    seed: int = 0,
) -> torch.Tensor:
    """Sample ``length`` ids after ``prompt`` with a plain (single-process) model."""
    generator = torch.Generator().manual_seed(seed)
    ids = prompt.clone()
    for _ in range(length):
        logits = model(ids[-seq_len:].unsqueeze(0))[0, -1, :valid]  # padding ids never occur
        probs = (logits / temperature).softmax(-1)
        ids = torch.cat((ids, torch.multinomial(probs, 1, generator=generator)))
    return ids
