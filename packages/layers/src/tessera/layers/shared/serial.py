"""Single-process layers that torch lacks, used when there is no tensor parallelism.

They define the parameter names and full shapes that every parallel version keeps (the
contract), e.g. ``PatchEmbedding1D`` has the parameters of :class:`SerialPatchEmbedding`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .initializers import Initializer, fan_in_uniform, kaiming_uniform, zeros

__all__ = [
    "SerialAccuracy",
    "SerialClassifier",
    "SerialLinear",
    "SerialPatchEmbedding",
    "init_parameter",
]


def init_parameter(
    shape: tuple[int, ...],
    initializer: Initializer,
    fan_in: int,
    fan_out: int,
    dtype: torch.dtype | None,
    device: torch.device | str | None,
) -> nn.Parameter:
    """A new parameter of ``shape`` filled by ``initializer``."""
    t = torch.empty(shape, dtype=dtype, device=device)
    with torch.no_grad():
        initializer(t, fan_in, fan_out)
    return nn.Parameter(t)


class SerialLinear(nn.Linear):
    """``torch.nn.Linear`` that returns ``(x W^T, bias)`` without adding the bias.

    What the dispatching ``Linear(..., skip_bias_add=True)`` builds without tensor
    parallelism (and, marked, under tensor mode ``'sequence'``), so the caller can fuse the
    bias add into what follows (Megatron-style) in every mode. Same parameters, names and
    initialization as ``nn.Linear``; the bias is the parameter itself (``None`` without), so
    its gradient is whatever the caller's use of it gives.
    """

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:  # type: ignore[override]
        """``x`` ``[.., in]`` -> ``([.., out], bias [out])``."""
        return F.linear(x, self.weight), self.bias


class SerialClassifier(nn.Module):
    """``logits = x W^T + b`` with an optional shared weight (e.g. tied to an embedding).

    Parameters: ``weight [num_classes, in_features]``, ``bias [num_classes]``, as torch's
    ``nn.Linear(in_features, num_classes)``. A shared weight may have more rows than
    ``num_classes`` (an embedding's vocabulary tied to fewer classes, as Colossal-AI's heads
    allow): the first ``num_classes`` rows are the classes.
    """

    def __init__(
        self,
        in_features: int,
        num_classes: int,
        weight: nn.Parameter | None = None,
        bias: bool = True,
        dtype: torch.dtype | None = None,
        weight_initializer: Initializer | None = None,
        bias_initializer: Initializer | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.in_features, self.num_classes = in_features, num_classes
        if weight is not None:
            if weight.dim() != 2 or weight.shape[1] != in_features or weight.shape[0] < num_classes:
                raise ValueError(
                    f"shared classifier weight has shape {list(weight.shape)}, expected "
                    f"[rows >= num_classes, in_features] = [>= {num_classes}, {in_features}]"
                )
            self.weight = weight
        else:
            self.weight = init_parameter(
                (num_classes, in_features),
                weight_initializer or kaiming_uniform(),
                in_features,
                num_classes,
                dtype,
                device,
            )
        self.bias = (
            init_parameter(
                (num_classes,),
                bias_initializer or fan_in_uniform(),
                in_features,
                num_classes,
                dtype,
                device,
            )
            if bias
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """See the class docstring for shapes."""
        weight = self.weight[: self.num_classes]  # the first rows of a larger tied weight
        return F.linear(x, weight, self.bias)  # [.., num_classes]


def patch_grid(img_size: int, patch_size: int) -> int:
    """Patches per side; ``ValueError`` unless ``patch_size`` divides ``img_size``."""
    if img_size % patch_size != 0:
        raise ValueError(
            f"img_size {img_size} is not divisible by patch_size {patch_size} "
            f"({img_size} % {patch_size} = {img_size % patch_size})"
        )
    return img_size // patch_size


class SerialPatchEmbedding(nn.Module):
    """ViT's patch embedding (Dosovitskiy et al. 2021).

    A strided convolution, a class token and a learned position embedding.

    Parameters: ``weight [E, C, P, P]``, ``bias [E]``, ``cls_token [1, 1, E]``,
    ``pos_embed [1, N + 1, E]`` with ``N = (img_size / P)^2``. Input ``[b, C, H, W]``,
    output ``[b, N + 1, E]``.

    With ``flatten=False`` the output keeps the image's layout, ``[b, E, H/P, W/P]``, for a
    model that goes on with convolutions or pools the grid itself: there is no class token
    (a grid has no place for it) and the position embedding is one per cell,
    ``pos_embed [1, E, H/P, W/P]``.
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
        device: torch.device | str | None = None,
        *,
        flatten: bool = True,
    ) -> None:
        super().__init__()
        grid = patch_grid(img_size, patch_size)
        self.patch_size, self.num_patches, self.flatten = patch_size, grid * grid, flatten
        fan_in = in_chans * patch_size * patch_size
        shape = (embed_size, in_chans, patch_size, patch_size)
        self.weight = init_parameter(
            shape, weight_initializer or kaiming_uniform(), fan_in, embed_size, dtype, device
        )
        self.bias = init_parameter(
            (embed_size,), bias_initializer or fan_in_uniform(), fan_in, embed_size, dtype, device
        )
        pos = position_embed_initializer or zeros()
        self.cls_token: nn.Parameter | None = None
        if flatten:
            self.cls_token = init_parameter(
                (1, 1, embed_size), zeros(), 1, embed_size, dtype, device
            )
            pos_shape: tuple[int, ...] = (1, self.num_patches + 1, embed_size)
        else:
            pos_shape = (1, embed_size, grid, grid)
        self.pos_embed = init_parameter(pos_shape, pos, 1, embed_size, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """See the class docstring for shapes."""
        if self.cls_token is None:  # flatten=False: the grid, a position per cell
            y = F.conv2d(x, self.weight, self.bias, stride=self.patch_size)  # [b, E, H/P, W/P]
            return y + self.pos_embed
        return patch_embed(x, self.weight, self.bias, self.cls_token, self.pos_embed)

    def extra_repr(self) -> str:
        """The summary shown by ``print(module)``."""
        return (
            f"patch_size={self.patch_size}, num_patches={self.num_patches}, flatten={self.flatten}"
        )


def patch_embed(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    cls_token: torch.Tensor,
    pos_embed: torch.Tensor,
) -> torch.Tensor:
    """The patch-embedding math on whatever slice of the embedding dim the tensors hold."""
    p = weight.shape[-1]
    y = F.conv2d(x, weight, bias, stride=p)  # [b, E, H/p, W/p]
    y = y.flatten(2).transpose(1, 2)  # [b, N, E]
    cls = cls_token.expand(y.shape[0], -1, -1)  # [b, 1, E]
    return torch.cat((cls, y), dim=1) + pos_embed  # [b, N+1, E]


class SerialAccuracy(nn.Module):
    """The number of correct predictions: ``(logits.argmax(-1) == target).sum()``.

    A count (not a fraction), so results add up over batches and data-parallel ranks.
    """

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """See the class docstring for shapes."""
        with torch.no_grad():
            return (logits.argmax(dim=-1) == target).sum()
