"""2D and 2.5D patch embedding (ViT): the embedding dim split into ``q * q`` blocks.

Images arrive split along the batch (``[b/(depth q), C, H, W]``, use ``split_batch``). Every
parameter is split along E into ``q * q`` blocks (block ``j * q + i`` on rank ``(i, j, k)``),
all-gathered over COL into block ``j`` of E (``[E/q, ...]``) in the forward and
reduce-scattered in the backward, as :class:`MeshEmbedding` does with its table; the output
``[b/(depth q), N+1, E/q]`` is in activation layout. The image feeds every rank of a mesh row
(each computes another slice of E), so its gradient is summed over ROW (``copy_to_group``).
"""

from __future__ import annotations

import torch

from tessera.context import ParallelContext

from .collectives import check_divisible
from .comm import copy_to_group, gather_along_dim
from .initializers import Initializer, fan_in_uniform, kaiming_uniform, zeros
from .mesh import MeshModule
from .serial import patch_embed, patch_grid

__all__ = ["MeshPatchEmbedding", "PatchEmbedding2D", "PatchEmbedding2p5D"]


class MeshPatchEmbedding(MeshModule):
    """Patch embedding with E split over the whole q x q mesh.

    Parameters (full shapes as :class:`SerialPatchEmbedding`): ``weight [E, C, P, P]``,
    ``bias [E]``, ``cls_token [1, 1, E]``, ``pos_embed [1, N+1, E]``, each ``E/q^2`` locally.
    Input ``[b/(depth q), C, H, W]``; output ``[b/(depth q), N+1, E/q]``.

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
        mesh = self.mesh
        check_divisible(embed_size, mesh.q * mesh.q, f"{self.owner} embed_size (q * q)")
        grid = patch_grid(img_size, patch_size)
        self.num_patches, self.embed_size = grid * grid, embed_size
        fan_in = in_chans * patch_size * patch_size
        modes = (mesh.row.mode, mesh.col.mode)
        replicated = mesh.depth_modes

        def param(name: str, shape: tuple[int, ...], init: Initializer, fan: int, dim: int) -> None:
            self.make_parameter(
                name,
                shape,
                init,
                fan_in=fan,
                fan_out=embed_size,
                splits={dim: modes},
                replicated=replicated,
                dtype=dtype,
            )

        param(
            "weight",
            (embed_size, in_chans, patch_size, patch_size),
            weight_initializer or kaiming_uniform(),
            fan_in,
            0,
        )  # [E/q^2, C, P, P]
        param("bias", (embed_size,), bias_initializer or fan_in_uniform(), fan_in, 0)
        param("cls_token", (1, 1, embed_size), zeros(), 1, 2)  # [1, 1, E/q^2]
        param(
            "pos_embed",
            (1, self.num_patches + 1, embed_size),
            position_embed_initializer or zeros(),
            1,
            2,
        )  # [1, N+1, E/q^2]

    def _gathered(self, name: str, dim: int) -> torch.Tensor:
        """Parameter ``name``'s block ``j`` of E: ``E/q`` along ``dim``."""
        param = self.get_parameter(name)
        mesh = self.mesh
        return gather_along_dim(mesh.over_depth(param), dim, mesh.col.group, partial_grad=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """See the class docstring for shapes."""
        x = copy_to_group(x, self.mesh.row.group)  # every rank of the row uses the image
        return patch_embed(
            x,
            self._gathered("weight", 0),  # [E/q, C, P, P]
            self._gathered("bias", 0),  # [E/q]
            self._gathered("cls_token", 2),  # [1, 1, E/q]
            self._gathered("pos_embed", 2),  # [1, N+1, E/q]
        )  # [b/(dq), N+1, E/q]


class PatchEmbedding2D(MeshPatchEmbedding):
    """2D ViT patch embedding; see :class:`MeshPatchEmbedding`."""

    MESH = "2d"


class PatchEmbedding2p5D(MeshPatchEmbedding):
    """2.5D ViT patch embedding; see :class:`MeshPatchEmbedding`."""

    MESH = "2.5d"
