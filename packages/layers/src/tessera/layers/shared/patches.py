"""What every parallel patch embedding shares: its four parameters, made in one place.

:class:`~tessera.layers.shared.serial.SerialPatchEmbedding` is the contract: ``weight
[E, C, P, P]`` and ``bias [E]`` (a strided convolution, torch's initialization over the fan-in
``C P P``), ``cls_token [1, 1, E]`` (zeros) and ``pos_embed [1, N+1, E]``, drawn in that order,
so the same RNG state gives the same values in every mode. The 1D, 2D, 2.5D, 3D and sequence
versions keep exactly these and differ only in how the embedding dim ``E`` is split (over
which modes, or not at all) and replicated; :class:`PatchParameters` makes them from that.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from tessera.context import ModeLike

from .base import ParallelModule
from .initializers import Initializer, fan_in_uniform, kaiming_uniform, zeros

__all__ = ["PatchParameters"]


class PatchParameters(ParallelModule):
    """Mixin of the parallel patch embeddings (listed before their mode's base class).

    Attributes (set by :meth:`make_patch_parameters`): ``weight``, ``bias``, ``cls_token``
    and ``pos_embed``.
    """

    weight: nn.Parameter
    bias: nn.Parameter
    cls_token: nn.Parameter
    pos_embed: nn.Parameter

    def make_patch_parameters(
        self,
        in_chans: int,
        patch_size: int,
        embed_size: int,
        num_patches: int,
        dtype: torch.dtype | None,
        weight_initializer: Initializer | None,
        bias_initializer: Initializer | None,
        position_embed_initializer: Initializer | None,
        *,
        split: Sequence[ModeLike] = (),
        replicated: Sequence[ModeLike] = (),
        partial_grad: Sequence[ModeLike] = (),
    ) -> None:
        """Make the four parameters, their embedding dim ``E`` split over ``split``.

        ``E`` is dim 0 of ``weight`` and ``bias`` and dim 2 of ``cls_token`` and
        ``pos_embed``; the four are split, replicated and summed alike.

        Args:
            in_chans: Image channels C.
            patch_size: Patch side P.
            embed_size: E.
            num_patches: N, the patches of an image.
            dtype: Parameter dtype.
            weight_initializer: Fills the full conv weight (default torch's).
            bias_initializer: Fills the full conv bias (default torch's).
            position_embed_initializer: Fills the full position embedding (default zeros).
            split: The modes ``E`` is split over, outermost first (``()``: whole).
            replicated: The modes every parameter is replicated over.
            partial_grad: Those of ``replicated`` whose ranks hold partial gradients.
        """
        fan_in = in_chans * patch_size * patch_size

        def param(
            name: str, shape: tuple[int, ...], init: Initializer, fan: int, dim: int
        ) -> nn.Parameter:
            return self.make_parameter(
                name,
                shape,
                init,
                fan_in=fan,
                fan_out=embed_size,
                splits={dim: split} if split else None,
                replicated=replicated,
                partial_grad=partial_grad,
                dtype=dtype,
            )

        self.weight = param(
            "weight",
            (embed_size, in_chans, patch_size, patch_size),
            weight_initializer or kaiming_uniform(),
            fan_in,
            0,
        )  # [E, C, P, P], E split
        self.bias = param("bias", (embed_size,), bias_initializer or fan_in_uniform(), fan_in, 0)
        self.cls_token = param("cls_token", (1, 1, embed_size), zeros(), 1, 2)  # [1, 1, E]
        self.pos_embed = param(
            "pos_embed",
            (1, num_patches + 1, embed_size),
            position_embed_initializer or zeros(),
            1,
            2,
        )  # [1, N+1, E]
