"""1D patch embedding (ViT): the embedding dim is split, ``[E/p, C, P, P]``.

Each rank computes its slice of every patch's embedding (and of the class token and position
embedding) and the slices are all-gathered along the hidden dim, or, with sequence parallelism,
one all-to-all trades the hidden split for a sequence split.
"""

from __future__ import annotations

import torch

from tessera.context import ParallelContext

from ..comm.collectives import check_divisible
from ..comm.ops import all_to_all, copy_to_group, gather_along_dim
from ..shared.base import Module1D
from ..shared.initializers import Initializer
from ..shared.patches import PatchParameters
from ..shared.serial import patch_embed, patch_grid

__all__ = ["PatchEmbedding1D"]


class PatchEmbedding1D(PatchParameters, Module1D):
    """Patch embedding with the embedding dim split over the 1D group.

    Parameters (full shapes as :class:`SerialPatchEmbedding`): ``weight [E, C, P, P]``,
    ``bias [E]``, ``cls_token [1, 1, E]``, ``pos_embed [1, N+1, E]``, each split along E.
    Input ``[b, C, H, W]`` replicated; output ``[b, N+1, E]`` replicated (``[b, (N+1)/p, E]``
    with sequence parallelism).
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
        sequence_parallel: bool = False,
        device: torch.device | str | None = None,
        context: ParallelContext | None = None,
    ) -> None:
        super().__init__(sequence_parallel=sequence_parallel, context=context, device=device)
        check_divisible(embed_size, self.tp.world_size, "PatchEmbedding1D embed_size")
        grid = patch_grid(img_size, patch_size)
        self.num_patches = grid * grid
        if sequence_parallel:
            check_divisible(
                self.num_patches + 1,
                self.tp.world_size,
                "PatchEmbedding1D sequence length (num_patches + 1)",
            )
        self.make_patch_parameters(
            in_chans,
            patch_size,
            embed_size,
            self.num_patches,
            dtype,
            weight_initializer,
            bias_initializer,
            position_embed_initializer,
            split=(self.split_mode,),
        )  # E/p of each: weight [E/p, C, P, P], bias [E/p], tokens [1, 1 or N+1, E/p]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """See the class docstring for shapes."""
        group = self.tp.group
        x = copy_to_group(x, group)  # f: every rank's slice contributes to the image's gradient
        y = patch_embed(x, self.weight, self.bias, self.cls_token, self.pos_embed)  # [b, N+1, E/p]
        if self.sequence_parallel:
            return all_to_all(y, self.SEQUENCE_DIM, -1, group)  # [b, (N+1)/p, E]
        return gather_along_dim(y, -1, group)  # [b, N+1, E]
