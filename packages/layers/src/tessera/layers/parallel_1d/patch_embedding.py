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
from ..shared.initializers import Initializer, fan_in_uniform, kaiming_uniform, zeros
from ..shared.serial import patch_embed, patch_grid

__all__ = ["PatchEmbedding1D"]


class PatchEmbedding1D(Module1D):
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
        fan_in = in_chans * patch_size * patch_size
        mode = (self.split_mode,)
        self.weight = self.make_parameter(
            "weight",
            (embed_size, in_chans, patch_size, patch_size),
            weight_initializer or kaiming_uniform(),
            fan_in=fan_in,
            fan_out=embed_size,
            splits={0: mode},
            dtype=dtype,
        )  # [E/p, C, P, P]
        self.bias = self.make_parameter(
            "bias",
            (embed_size,),
            bias_initializer or fan_in_uniform(),
            fan_in=fan_in,
            fan_out=embed_size,
            splits={0: mode},
            dtype=dtype,
        )  # [E/p]
        self.cls_token = self.make_parameter(
            "cls_token",
            (1, 1, embed_size),
            zeros(),
            fan_in=1,
            fan_out=embed_size,
            splits={2: mode},
            dtype=dtype,
        )  # [1, 1, E/p]
        self.pos_embed = self.make_parameter(
            "pos_embed",
            (1, self.num_patches + 1, embed_size),
            position_embed_initializer or zeros(),
            fan_in=1,
            fan_out=embed_size,
            splits={2: mode},
            dtype=dtype,
        )  # [1, N+1, E/p]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """See the class docstring for shapes."""
        group = self.tp.group
        x = copy_to_group(x, group)  # f: every rank's slice contributes to the image's gradient
        y = patch_embed(x, self.weight, self.bias, self.cls_token, self.pos_embed)  # [b, N+1, E/p]
        if self.sequence_parallel:
            return all_to_all(y, self.SEQUENCE_DIM, -1, group)  # [b, (N+1)/p, E]
        return gather_along_dim(y, -1, group)  # [b, N+1, E]
