"""A small Vision Transformer (Dosovitskiy et al. 2021) from tessera's dispatching layers.

``build_vit(...)`` returns an ``nn.Sequential`` ``[stem, block_0, ..., block_{n-1}, head]`` so a
pipeline can cut it anywhere; parameter names (``0.patch_embed.weight``, ``1.attn.qkv.weight``,
...) are the same under every parallel mode and are those of the model built without tessera.

Pooling: the head reads the mean of the patch tokens (global average pooling, as in Beyer et
al. 2022, "Better plain ViT baselines for ImageNet-1k"); the patch embedding's class token is
dropped. With 8x8 digits and patch size 2 there are 16 patch tokens, which split evenly over
2 or 4 sequence-parallel ranks (16 + 1 tokens would not).

Where each mode's data lives:

* no tensor parallelism / 1D: every rank of a tensor group holds the whole batch;
* 2D, 2.5D, 3D: ``split_batch`` gives each rank its rows of the images, ``PatchEmbedding``
  returns the mode's activation layout, the ``Classifier`` batch-split logits, and
  ``CrossEntropyLoss`` / ``Accuracy`` the value of the whole batch on every rank;
* sequence: ``SequencePatchEmbedding(..., class_token=False)`` embeds only this rank's chunk
  of the 16 patch tokens from the whole images; blocks use ring self-attention; the head
  all-gathers the normalized tokens, so the logits and the loss are the whole batch's on every
  rank (see ``ViTHead``).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from toolkit.transformer import Block, current_context, tensor_mode

from tessera.context import ParallelMode
from tessera.layers import (
    Accuracy,
    Classifier,
    CrossEntropyLoss,
    Dropout,
    LayerNorm,
    PatchEmbedding,
    SequencePatchEmbedding,
    SerialAccuracy,
    gather_along_dim,
    normal,
    split_batch,
)

__all__ = ["ViTAccuracy", "ViTHead", "ViTLoss", "ViTStem", "build_vit"]


class ViTStem(nn.Module):
    """Images ``[b, C, H, W]`` (the full batch) -> patch tokens in the mode's layout."""

    def __init__(
        self,
        img_size: int,
        patch_size: int,
        in_chans: int,
        hidden: int,
        dropout: float,
        pos_std: float = 0.02,
    ):
        super().__init__()
        # a random position embedding: with mean pooling, a zero one would leave the model
        # blind to where a patch is until the embedding grows
        pos = normal(std=pos_std)
        self.sequence = tensor_mode() == "sequence"
        if self.sequence:
            # this rank's chunk of the patch tokens only (no class token: mean pooling); its
            # parameters' gradients are partial, summed over SEQUENCE by the engine's handler
            self.patch_embed: nn.Module = SequencePatchEmbedding(
                img_size,
                patch_size,
                in_chans,
                hidden,
                position_embed_initializer=pos,
                class_token=False,
            )
        else:
            self.patch_embed = PatchEmbedding(
                img_size, patch_size, in_chans, hidden, position_embed_initializer=pos
            )
        self.drop = Dropout(dropout)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        if self.sequence:
            tokens = self.patch_embed(images)  # [b, N/n, h]: this rank's patch tokens
        else:
            tokens = self.patch_embed(split_batch(images))[:, 1:]  # [b', N, h']
        out: torch.Tensor = self.drop(tokens)
        return out


class ViTHead(nn.Module):
    """LayerNorm, mean over the patch tokens, classifier: logits ``[b', num_classes]``."""

    def __init__(self, hidden: int, num_classes: int):
        super().__init__()
        self.norm = LayerNorm(hidden)
        self.classifier = Classifier(hidden, num_classes)
        ctx = current_context()
        self.sequence_group = None
        if ctx is not None and ctx.config.tensor_mode == "sequence":
            self.sequence_group = ctx.get_group(ParallelMode.SEQUENCE)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x)  # [b', s', h']
        if self.sequence_group is not None:
            # [b, N/n, h] -> [b, N, h] on every rank. Every rank then computes the same loss,
            # so the gradient that comes back is the sum of n identical ones: partial_grad
            # reduce-scatters it (the adjoint of the all-gather). After the handler divides by
            # the SEQUENCE_DP size, every gradient is the single-process one.
            x = gather_along_dim(x, 1, self.sequence_group, partial_grad=True)
        logits: torch.Tensor = self.classifier(x.mean(dim=1))  # [b', classes]
        return logits


def build_vit(
    img_size: int = 8,
    patch_size: int = 2,
    in_chans: int = 1,
    num_classes: int = 10,
    hidden: int = 32,
    depth: int = 2,
    heads: int = 4,
    mlp_ratio: int = 2,
    dropout: float = 0.0,
    pos_std: float = 0.02,
) -> nn.Sequential:
    """The ViT as a sequence of layers, for the current context's tensor mode."""
    layers: list[nn.Module] = [ViTStem(img_size, patch_size, in_chans, hidden, dropout, pos_std)]
    layers += [Block(hidden, heads, mlp_ratio, dropout) for _ in range(depth)]
    layers.append(ViTHead(hidden, num_classes))
    return nn.Sequential(*layers)


def _labels_local(labels: torch.Tensor, num_microbatches: int) -> torch.Tensor:
    """This rank's labels for logits concatenated over microbatches (batch-split per part)."""
    if tensor_mode() == "sequence":
        return labels  # the logits are the whole batch's on every rank
    parts = labels.chunk(num_microbatches) if num_microbatches > 1 else (labels,)
    return torch.cat([split_batch(p) for p in parts])


class ViTLoss(nn.Module):
    """Cross-entropy of the head's logits against the full batch of labels."""

    def __init__(self) -> None:
        super().__init__()
        self.loss = CrossEntropyLoss()

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.loss(logits, _labels_local(labels, 1))
        return out


class ViTAccuracy:
    """``accuracy_fn`` of the engine's ``AccuracyHook``: (correct in the batch, batch size).

    The logits a step returns are the microbatches' concatenated, each batch-split in 2D, 2.5D
    and 3D, so the labels are split the same way before tessera's ``Accuracy`` counts.
    """

    def __init__(self, num_microbatches: int = 1) -> None:
        self.num_microbatches = num_microbatches
        # sequence: the logits are replicated, a plain count is the batch's
        self.count = SerialAccuracy() if tensor_mode() == "sequence" else Accuracy()

    def __call__(self, logits: Any, labels: Any) -> tuple[torch.Tensor, int]:
        local = _labels_local(labels, self.num_microbatches)
        return self.count(logits, local), int(labels.numel())
