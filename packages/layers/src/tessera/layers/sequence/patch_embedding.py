"""Sequence-parallel patch embedding (ViT): each rank embeds only its own chunk of the patches.

Under ``tensor=dict(size=N, mode="sequence")`` (Li et al. 2021, "Sequence Parallelism: Long
Sequence Training from System Perspective") SEQUENCE rank ``r`` holds tokens
``[r s/N, (r+1) s/N)`` of every activation. For a ViT (Dosovitskiy et al. 2021) the sequence
*is* the patches, preceded by the class token: ``s = N_p + 1`` with ``N_p = (img / P)^2``. A
patch embedding is token-wise, so rank ``r`` computes exactly the tokens of its chunk, and
nothing else: the class token if the chunk starts at 0, then its patches (picked out of the
image, embedded by one matmul with the ``[E, C P P]`` view of the conv weight), plus its slice
of the position embedding. No communication forward; the output is
``split_activation(SerialPatchEmbedding(x))``.

The images ``[b, C, H, W]`` are replicated over SEQUENCE (every rank reads the whole batch),
so their gradient, to which each rank contributes its patches', is summed over SEQUENCE
(``copy_to_group``, Megatron's f; no cost when the images need no gradient). The parameters
are the whole ones on every rank and each rank's gradient covers only its own tokens: they are
marked replicated over SEQUENCE with partial gradients, like every parameter of this mode, and
the engine's ``SequenceParallelGradientHandler`` sums them. Every parameter takes part in
every rank's graph (a rank without the class token uses an empty slice of it, a rank uses only
its rows of the position embedding), so every rank has a gradient for every parameter (zeros
where it saw none) and the handler's all-reduce sees the same tensors everywhere.

``class_token=False`` leaves the class token out of the sequence (a ViT pooled by the mean of
its patch tokens, Beyer et al. 2022): the sequence is the ``N_p`` patches with the position
embedding's rows ``1..N_p``; ``cls_token`` stays a parameter (the state dict is
:class:`SerialPatchEmbedding`'s) with a zero gradient. A square number of patches ``N_p`` is
0 or 1 modulo 3 and 4, so ``N_p + 1`` never splits over a multiple of 3 or 4 ranks (3, 4,
6, 8, ...): those sizes need ``class_token=False``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tessera.context import ParallelContext, ParallelMode

from ..comm.ops import copy_to_group
from ..shared.initializers import Initializer
from ..shared.patches import PatchParameters
from ..shared.serial import patch_grid
from .attention import sequence_group

__all__ = ["SequencePatchEmbedding"]

_SEQUENCE = (ParallelMode.SEQUENCE,)


class SequencePatchEmbedding(PatchParameters):
    """ViT patch embedding returning this SEQUENCE rank's chunk of the token sequence.

    Parameters (whole on every rank, as :class:`SerialPatchEmbedding`'s): ``weight
    [E, C, P, P]``, ``bias [E]``, ``cls_token [1, 1, E]``, ``pos_embed [1, N_p+1, E]``, each
    marked replicated over SEQUENCE with partial gradients. Input ``[b, C, H, W]`` (the whole
    images, replicated); output ``[b, s/N, E]``: chunk ``r`` of the ``s = N_p + 1`` tokens
    (``s = N_p`` with ``class_token=False``).

    Args:
        img_size: Image side H = W.
        patch_size: Patch side P, dividing ``img_size``.
        in_chans: Image channels C.
        embed_size: E.
        dtype: Parameter dtype.
        weight_initializer: Fills the conv weight (torch's default).
        bias_initializer: Fills the conv bias (torch's default).
        position_embed_initializer: Fills the position embedding (default zeros).
        class_token: Whether the sequence starts with the class token (default, as every
            other mode's ``PatchEmbedding``); ``False``: the sequence is the patches only.
        device: Parameter device (default the context's).
        context: The ParallelContext, tensor mode ``'sequence'`` (default the current one).

    Raises:
        ValueError: the context's tensor mode is not ``'sequence'``, ``patch_size`` does not
            divide ``img_size``, or the number of tokens does not split over the SEQUENCE
            ranks.
    """

    def __init__(
        self,
        img_size: int,
        patch_size: int,
        in_chans: int,
        embed_size: int,
        dtype: torch.dtype | None = None,
        weight_initializer: Initializer | None = None,
        bias_initializer: Initializer | None = None,
        position_embed_initializer: Initializer | None = None,
        *,
        class_token: bool = True,
        device: torch.device | str | None = None,
        context: ParallelContext | None = None,
    ) -> None:
        super().__init__(context, device)
        owner = type(self).__name__
        self.sequence = sequence_group(self.context, owner)
        self.side = patch_grid(img_size, patch_size)
        self.img_size, self.patch_size, self.in_chans = img_size, patch_size, in_chans
        self.embed_size, self.class_token = embed_size, class_token
        self.num_patches = self.side * self.side
        tokens = self.num_patches + int(class_token)
        n = self.sequence.world_size
        if tokens % n != 0:
            what = f"{self.num_patches} patches + 1 class token" if class_token else "patches"
            fix = "; build it with class_token=False (mean pooling)" if class_token else ""
            raise ValueError(
                f"{owner}: the sequence of {tokens} tokens ({what}, a {img_size}x{img_size} "
                f"image in {patch_size}x{patch_size} patches) does not split over the {n} "
                f"ranks of SEQUENCE ({tokens} % {n} = {tokens % n}){fix}"
            )
        self.chunk = tokens // n
        # this rank's tokens [start, start + chunk) of the sequence; its patches [p0, p1)
        self.start = self.sequence.rank * self.chunk
        self.has_class_token = class_token and self.start == 0
        self.first_patch = self.start - int(class_token) + int(self.has_class_token)
        self.end_patch = self.start + self.chunk - int(class_token)
        # SerialPatchEmbedding's parameters, whole: [E, C, P, P], [E], [1, 1, E], [1, N_p+1, E]
        self.make_patch_parameters(
            in_chans,
            patch_size,
            embed_size,
            self.num_patches,
            dtype,
            weight_initializer,
            bias_initializer,
            position_embed_initializer,
            replicated=_SEQUENCE,
            partial_grad=_SEQUENCE,
        )

    def _patches(self, x: torch.Tensor) -> torch.Tensor:
        """``[b, C, H, W]`` -> this rank's patches ``[b, p1 - p0, C P P]`` (row-major order)."""
        p, g = self.patch_size, self.side
        first, end = self.first_patch, self.end_patch
        row0, row1 = first // g, -(-end // g)  # the patch rows holding [first, end)
        rows = x[:, :, row0 * p : row1 * p]  # [b, C, (row1-row0) P, W]
        b, c = x.shape[0], x.shape[1]
        patches = rows.reshape(b, c, row1 - row0, p, g, p).permute(0, 2, 4, 1, 3, 5)
        patches = patches.reshape(b, (row1 - row0) * g, c * p * p)  # [b, rows * g, C P P]
        return patches[:, first - row0 * g : end - row0 * g]  # [b, p1 - p0, C P P]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """See the class docstring for shapes."""
        expected = [self.in_chans, self.img_size, self.img_size]
        if x.dim() != 4 or list(x.shape[1:]) != expected:
            raise ValueError(
                f"{type(self).__name__}: expected the whole images [b, {expected[0]}, "
                f"{expected[1]}, {expected[2]}] (in_chans, img_size, img_size), got shape "
                f"{list(x.shape)}"
            )
        x = copy_to_group(x, self.sequence.group)  # f: the image gradient sums every chunk's
        weight = self.weight.reshape(self.embed_size, -1)  # [E, C P P]: the conv as a matmul
        y = F.linear(self._patches(x), weight, self.bias)  # [b, p1 - p0, E]
        # [1, 1 or 0, E]: an empty slice where the chunk has no class token (a zero gradient)
        cls = self.cls_token[:, : int(self.has_class_token)].expand(x.shape[0], -1, -1)
        offset = self.start + 1 - int(self.class_token)  # the position row of token `start`
        pos = self.pos_embed[:, offset : offset + self.chunk]  # [1, s/N, E]
        return torch.cat((cls, y), dim=1) + pos  # [b, s/N, E]

    def extra_repr(self) -> str:
        """The summary shown by ``print(module)``."""
        return (
            f"patch_size={self.patch_size}, embed_size={self.embed_size}, "
            f"class_token={self.class_token}, tokens [{self.start}, {self.start + self.chunk})"
        )
