"""3D patch embedding: ViT's patchify, every parameter split along E like ``Embedding3D``.

Images arrive split like the batch of layout ``"y"`` (``[b/q^2, C, H, W]``, use
``split_batch``); every parameter's embedding dim ``E`` is split into ``q^2`` blocks over
INPUT x WEIGHT and all-gathered over WEIGHT into block ``y`` (backward: reduce-scatter over
WEIGHT, and a sum over OUTPUT, whose ranks saw other images), so the output is
``[b/q^2, N+1, E/q]`` in layout ``"y"``. The images are replicated over INPUT, so their
gradient (each rank's covers its embedding block) is summed over INPUT.
"""

from __future__ import annotations

import torch

from tessera.context import ParallelContext

from .collectives import check_divisible
from .comm import copy_to_group
from .cube import CubeModule
from .initializers import Initializer, fan_in_uniform, kaiming_uniform, zeros
from .serial import patch_embed, patch_grid

__all__ = ["PatchEmbedding3D"]


class PatchEmbedding3D(CubeModule):
    """Patch embedding with E split over INPUT x WEIGHT (``E/q^2`` per rank).

    Parameters (full shapes as :class:`SerialPatchEmbedding`): ``weight [E, C, P, P]``,
    ``bias [E]``, ``cls_token [1, 1, E]``, ``pos_embed [1, N+1, E]``. Input
    ``[b/q^2, C, H, W]``; output ``[b/q^2, N+1, E/q]``.

    Args:
        img_size: Image side.
        patch_size: Patch side, dividing ``img_size``.
        in_chans: Image channels C.
        embed_size: E, divisible by ``q * q``.
        dtype: Parameter dtype.
        weight_initializer: Fills the full conv weight (torch's default).
        bias_initializer: Fills the full conv bias (torch's default).
        position_embed_initializer: Fills the full position embedding (default zeros).
        device: Parameter device (default the context's).
        context: The ParallelContext (default the current one).
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
        device: torch.device | str | None = None,
        context: ParallelContext | None = None,
    ) -> None:
        super().__init__(context, device)
        cube = self.cube
        grid = patch_grid(img_size, patch_size)
        check_divisible(embed_size, cube.q * cube.q, f"{self.owner} embed_size (q * q)")
        self.patch_size, self.num_patches, self.embed_size = patch_size, grid * grid, embed_size
        fan_in = in_chans * patch_size * patch_size
        e = embed_size
        face = (cube.input.mode, cube.weight.mode)
        rep = (cube.output.mode,)
        self.weight = self.make_parameter(
            "weight",
            (e, in_chans, patch_size, patch_size),
            weight_initializer or kaiming_uniform(),
            fan_in=fan_in,
            fan_out=e,
            splits={0: face},
            replicated=rep,
            dtype=dtype,
        )  # [E/q^2, C, P, P]
        self.bias = self.make_parameter(
            "bias",
            (e,),
            bias_initializer or fan_in_uniform(),
            fan_in=fan_in,
            fan_out=e,
            splits={0: face},
            replicated=rep,
            dtype=dtype,
        )  # [E/q^2]
        self.cls_token = self.make_parameter(
            "cls_token",
            (1, 1, e),
            zeros(),
            fan_in=1,
            fan_out=e,
            splits={2: face},
            replicated=rep,
            dtype=dtype,
        )  # [1, 1, E/q^2]
        self.pos_embed = self.make_parameter(
            "pos_embed",
            (1, self.num_patches + 1, e),
            position_embed_initializer or zeros(),
            fan_in=1,
            fan_out=e,
            splits={2: face},
            replicated=rep,
            dtype=dtype,
        )  # [1, N+1, E/q^2]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """See the class docstring for shapes."""
        # the images are replicated over INPUT, each rank embeds them into its block y:
        # their gradient is summed over INPUT (Megatron's f)
        x = copy_to_group(x, self.cube.input.group)
        return patch_embed(
            x,
            self.gather_table(self.weight, 0),  # [E/q, C, P, P]: block y
            self.gather_table(self.bias, 0),
            self.gather_table(self.cls_token, 2),
            self.gather_table(self.pos_embed, 2),
        )  # [b/q^2, N+1, E/q]

    def extra_repr(self) -> str:
        """The summary shown by ``print(module)``."""
        return f"patch_size={self.patch_size}, embed_size={self.embed_size}, " + (
            super().extra_repr()
        )
