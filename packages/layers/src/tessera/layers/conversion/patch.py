"""A transformers ViT's embeddings (patches, class token, positions) in the mode's layout.

transformers' ``ViTEmbeddings`` holds a patch convolution, a class token and a position table
as its own parameters (timm's ``VisionTransformer`` holds the last two itself, beside its
``PatchEmbed``); tessera's patch embeddings (:class:`PatchEmbedding1D`,
:class:`PatchEmbedding2D`, ...) compute the same thing (Dosovitskiy et al. 2021) with the
embedding dim split the mode's way. :class:`PatchEmbeddingAdapter` runs the tessera one and
registers its parameters under transformers' names, so the state dict stays the original's.
"""

from __future__ import annotations

import types
from typing import Any

import torch
from torch import nn

__all__ = [
    "ClipEmbeddingAdapter",
    "PatchEmbeddingAdapter",
    "TimmEmbeddingAdapter",
    "clip_patch_sizes",
    "patch_embedding_fits",
    "patch_embedding_misfit",
    "patch_sizes",
    "timm_patch_sizes",
]


def patch_sizes(name: str, module: nn.Module) -> tuple[int, int, int, int]:
    """``(image side, patch side, channels, embed size)`` of a ``ViTEmbeddings``.

    Raises:
        TypeError: the module is not a ViT-style embedding (class token, position table,
            ``patch_embeddings.projection`` a convolution with stride = kernel).
        ValueError: a non-square image or patch, or a mask token tessera cannot apply.
    """
    projection = getattr(getattr(module, "patch_embeddings", None), "projection", None)
    if (
        not isinstance(projection, nn.Conv2d)
        or not isinstance(getattr(module, "cls_token", None), torch.Tensor)
        or not isinstance(getattr(module, "position_embeddings", None), torch.Tensor)
    ):
        raise TypeError(
            f"parallelize: {name!r} ({type(module).__name__}) has role 'patch_embedding', which "
            "takes a ViT embedding (cls_token, position_embeddings, patch_embeddings.projection)"
        )
    if not _computes_vit_embeddings(module):
        raise TypeError(
            f"parallelize: {name!r} ({type(module).__name__}) holds a ViT embedding's "
            "parameters, and its forward is not ViT's (ViTEmbeddings.forward): it may add "
            "another token (DeiT's distillation token), mask patches (ViT-MAE) or compute "
            "positions of its own, which the mode's patch embedding (ViT's alone) would drop"
        )
    image = tuple(getattr(module, "image_size", ()))
    kernel, stride = tuple(projection.kernel_size), tuple(projection.stride)
    if len(image) != 2 or image[0] != image[1] or kernel[0] != kernel[1] or kernel != stride:
        raise ValueError(
            f"parallelize: {name!r} needs a square image and square, non-overlapping patches; "
            f"got image {image}, kernel {kernel}, stride {stride}"
        )
    if getattr(module, "mask_token", None) is not None:
        raise ValueError(f"parallelize: {name!r} has a mask token, which tessera does not apply")
    return int(image[0]), int(kernel[0]), projection.in_channels, projection.out_channels


def _computes_vit_embeddings(module: nn.Module) -> bool:
    """Whether ``module``'s forward is transformers' ``ViTEmbeddings.forward``.

    Its own class, or one whose forward compiles to the same code (ViT-MSN's copy): what
    the adapter replaces it with computes that and nothing else.
    """
    try:
        from transformers.models.vit.modeling_vit import ViTEmbeddings
    except ImportError:  # pragma: no cover - a ViT embedding comes with transformers
        return False
    if isinstance(module, ViTEmbeddings):
        return True
    mine, vit = type(module).forward.__code__, ViTEmbeddings.forward.__code__
    return (mine.co_code, mine.co_names, mine.co_consts) == (
        vit.co_code,
        vit.co_names,
        vit.co_consts,
    )


class PatchEmbeddingAdapter(nn.Module):
    """A tessera patch embedding under transformers' parameter names.

    ``cls_token``, ``position_embeddings`` and ``patch_embeddings.projection.{weight,bias}``
    are the tessera module's ``cls_token``, ``pos_embed``, ``weight`` and ``bias`` (the same
    parameters, carrying their ``ShardInfo``); the tessera module itself is kept out of the
    module tree so that each parameter has one name.

    Args:
        inner: The mode's patch embedding.
    """

    def __init__(self, inner: nn.Module, dropout: nn.Module | None = None) -> None:
        super().__init__()
        self._inner = [inner]  # not a child: its parameters are registered below, once each
        self.dropout = dropout if dropout is not None else nn.Identity()
        self.cls_token = inner.cls_token
        self.position_embeddings = inner.pos_embed
        self.patch_embeddings = nn.Module()
        self.patch_embeddings.projection = nn.Module()
        self.patch_embeddings.projection.weight = inner.weight
        self.patch_embeddings.projection.bias = inner.bias

    def forward(
        self,
        pixel_values: torch.Tensor,
        bool_masked_pos: torch.Tensor | None = None,
        interpolate_pos_encoding: bool | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        """``[b', C, H, W]`` images -> ``[b', N+1, E']`` in the mode's layout."""
        if bool_masked_pos is not None or interpolate_pos_encoding:
            raise ValueError(
                "a parallelized ViT embedding takes neither bool_masked_pos nor "
                "interpolate_pos_encoding"
            )
        # The adapter's *current* parameters: ZeRO (FSDP2) replaces them on the adapter only.
        projection = self.get_submodule("patch_embeddings.projection")
        params: dict[str, torch.Tensor] = {
            "weight": projection.get_parameter("weight"),
            "bias": projection.get_parameter("bias"),
            "cls_token": self.get_parameter("cls_token"),
            "pos_embed": self.get_parameter("position_embeddings"),
        }
        out: torch.Tensor = torch.func.functional_call(self._inner[0], params, (pixel_values,))
        dropped: torch.Tensor = self.dropout(out)
        return dropped


def clip_patch_sizes(name: str, module: nn.Module) -> tuple[int, int, int, int] | None:
    """``(image side, patch side, channels, embed size)`` of a CLIP-style embedding, or None.

    transformers' ``CLIPVisionEmbeddings`` (and the ones laid out as it: SigLIP's without a
    class token are not) holds a class token ``class_embedding [E]``, a patch convolution
    ``patch_embedding`` (no bias) and a position table ``position_embedding``, an
    ``nn.Embedding`` of ``N + 1`` rows read in order: the ViT embedding of
    :func:`patch_sizes` under other names and shapes.

    Raises:
        ValueError: a non-square image or patch, overlapping patches, or a position table of
            another length than the patches and the class token.
    """
    projection = getattr(module, "patch_embedding", None)
    table = getattr(module, "position_embedding", None)
    token = getattr(module, "class_embedding", None)
    if (
        not isinstance(projection, nn.Conv2d)
        or type(table) is not nn.Embedding
        or not isinstance(token, torch.Tensor)
        or token.dim() != 1
    ):
        return None
    image = getattr(module, "image_size", None)
    kernel, stride = tuple(projection.kernel_size), tuple(projection.stride)
    if not isinstance(image, int) or kernel[0] != kernel[1] or kernel != stride:
        raise ValueError(
            f"parallelize: {name!r} needs a square image and square, non-overlapping patches; "
            f"got image {image}, kernel {kernel}, stride {stride}"
        )
    patches = (image // int(kernel[0])) ** 2
    if table.num_embeddings != patches + 1:
        raise ValueError(
            f"parallelize: {name!r} holds {table.num_embeddings} positions for {patches} "
            "patches and the class token"
        )
    return image, int(kernel[0]), projection.in_channels, projection.out_channels


class ClipEmbeddingAdapter(nn.Module):
    """A tessera patch embedding under CLIP's parameter names and shapes.

    ``class_embedding [E]``, ``patch_embedding.weight`` (and ``.bias`` where the convolution
    has one) and ``position_embedding.weight [N+1, E]`` are the tessera module's
    ``cls_token [1, 1, E]``, ``weight``, ``bias`` and ``pos_embed [1, N+1, E]`` (the same
    parameters; their :class:`~tessera.context.FullForm` gives CLIP's shapes in full state
    dicts). A convolution without a bias leaves the tessera module's bias at zero, frozen and
    out of the module tree.

    Args:
        inner: The mode's patch embedding.
        bias: Whether the convolution had a bias.
    """

    def __init__(self, inner: nn.Module, bias: bool) -> None:
        super().__init__()
        self._inner = [inner]  # not a child: its parameters are registered below, once each
        self._bias = bias
        self.class_embedding = inner.cls_token
        self.patch_embedding = nn.Module()
        self.patch_embedding.weight = inner.weight
        if bias:
            self.patch_embedding.bias = inner.bias
        self.position_embedding = nn.Module()
        self.position_embedding.weight = inner.pos_embed

    def forward(
        self, pixel_values: torch.Tensor, interpolate_pos_encoding: bool | None = False
    ) -> torch.Tensor:
        """``[b', C, H, W]`` images -> ``[b', N+1, E']`` in the mode's layout."""
        if interpolate_pos_encoding:
            raise ValueError("a parallelized CLIP embedding does not take interpolate_pos_encoding")
        # The adapter's *current* parameters: ZeRO (FSDP2) replaces them on the adapter only.
        params: dict[str, torch.Tensor] = {
            "weight": self.get_submodule("patch_embedding").get_parameter("weight"),
            "cls_token": self.get_parameter("class_embedding"),
            "pos_embed": self.get_submodule("position_embedding").get_parameter("weight"),
        }
        if self._bias:
            params["bias"] = self.get_submodule("patch_embedding").get_parameter("bias")
        out: torch.Tensor = torch.func.functional_call(self._inner[0], params, (pixel_values,))
        return out


def timm_patch_sizes(
    name: str, module: nn.Module, owner: nn.Module | None
) -> tuple[int, int, int, int] | None:
    """``(image side, patch side, channels, embed size)`` of timm's ``PatchEmbed``, or None.

    timm's ``VisionTransformer`` (``owner``) holds the class token ``cls_token [1, 1, E]`` and
    the position table ``pos_embed [1, N+1, E]`` itself and adds them in its ``_pos_embed``;
    its ``patch_embed`` holds the convolution ``proj``. Together they compute the tessera patch
    embedding, for the layout timm calls standard (a class token, positions covering it, no
    register tokens, a fixed image size).

    Raises:
        ValueError: naming what of that layout the model does otherwise.
    """
    projection = getattr(module, "proj", None)
    if (
        not isinstance(projection, nn.Conv2d)
        or not hasattr(module, "img_size")
        or owner is None
        or not hasattr(owner, "_pos_embed")
        or not hasattr(owner, "pos_embed")
    ):
        return None
    image, patch = tuple(getattr(module, "img_size", None) or ()), tuple(projection.kernel_size)
    unlike = {
        "a square image": len(image) == 2 and image[0] == image[1],
        "square, non-overlapping patches": patch[0] == patch[1]
        and patch == tuple(projection.stride),
        "patches flattened to [b, N, E]": bool(getattr(module, "flatten", False)),
        "no norm of the patches": isinstance(getattr(module, "norm", None), nn.Identity),
        "a class token": isinstance(getattr(owner, "cls_token", None), torch.Tensor),
        "learned positions": isinstance(getattr(owner, "pos_embed", None), torch.Tensor),
        "no other parameters in the patch embedding": all(
            name.startswith("proj.") for name, _ in module.named_parameters()
        ),
        "no register tokens": getattr(owner, "reg_token", None) is None,
        "positions covering the class token": not getattr(owner, "no_embed_class", False),
        "a fixed image size": not getattr(owner, "dynamic_img_size", False),
    }
    missing = [what for what, holds in unlike.items() if not holds]
    if missing:
        raise ValueError(
            f"parallelize: {name!r} is timm's patch embedding, whose model tessera computes "
            f"with {'; '.join(unlike)}; this one does not have: {'; '.join(missing)}"
        )
    patches = (int(image[0]) // int(patch[0])) ** 2
    positions = owner.get_parameter("pos_embed")
    if tuple(positions.shape) != (1, patches + 1, projection.out_channels):
        raise ValueError(
            f"parallelize: {name!r}'s model holds positions {list(positions.shape)} for "
            f"{patches} patches, the class token and {projection.out_channels} features"
        )
    return int(image[0]), int(patch[0]), projection.in_channels, projection.out_channels


def patch_embedding_misfit(name: str, module: nn.Module, owner: nn.Module | None) -> str | None:
    """Why the mode's patch embedding does not compute ``module`` (``None``: it does).

    As the ``patch_embedding`` role reads it: CLIP's, timm's (with its model, ``owner``) or
    a transformers ViT's. A family inferred for a model of another class holds only where
    this is ``None`` (timm's register tokens or a model without a class token do not), so
    the model is converted part by part, or refused saying why.
    """
    try:
        if clip_patch_sizes(name, module) is not None:
            return None
        if timm_patch_sizes(name, module, owner) is not None:
            return None
        patch_sizes(name, module)
    except (TypeError, ValueError) as error:
        return str(error).removeprefix("parallelize: ")
    return None


def patch_embedding_fits(name: str, module: nn.Module, owner: nn.Module | None) -> bool:
    """Whether the mode's patch embedding computes ``module``: :func:`patch_embedding_misfit`."""
    return patch_embedding_misfit(name, module, owner) is None


def _positions_already_added(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The model's ``_pos_embed`` once ``patch_embed`` is a :class:`TimmEmbeddingAdapter`."""
    dropped: torch.Tensor = self.get_submodule("pos_drop")(x)
    return dropped


class TimmEmbeddingAdapter(nn.Module):
    """A tessera patch embedding as timm's ``PatchEmbed`` (its parameters under timm's names).

    ``proj.weight`` (and ``proj.bias``) are the tessera module's ``weight`` and ``bias``;
    its ``cls_token`` and ``pos_embed`` become the timm model's own (``owner``'s), which keep
    their names and shapes there, and the model's ``_pos_embed`` is left only its dropout: the
    adapter returns the class token and the positions already in, ``[b', N+1, E']`` in the
    mode's layout. A convolution without a bias leaves the tessera one at zero, frozen.

    Args:
        inner: The mode's patch embedding.
        owner: The timm ``VisionTransformer``.
        bias: Whether the convolution had a bias.
        img_size: The images it takes, as timm's ``PatchEmbed`` says (``pipeline_layers``'
            probe reads it; ``forward_intermediates``, which would read it too, runs only where
            its numbers are one process's: :mod:`.entry_points`).
    """

    def __init__(
        self, inner: nn.Module, owner: nn.Module, bias: bool, img_size: tuple[int, int]
    ) -> None:
        super().__init__()
        self.img_size = img_size
        self._inner = [inner]  # not a child: its parameters are registered below, once each
        self._owner = [owner]  # not a child either: it is the parent
        self._bias = bias
        self.proj = nn.Module()
        self.proj.weight = inner.weight
        if bias:
            self.proj.bias = inner.bias
        owner.cls_token = inner.cls_token
        owner.pos_embed = inner.pos_embed
        # a bound method on the instance: a deep copy of the model binds it to the copy
        object.__setattr__(owner, "_pos_embed", types.MethodType(_positions_already_added, owner))

    def dynamic_feat_size(self, img_size: tuple[int, int]) -> tuple[int, int]:
        """The grid of patches of an image (timm's ``PatchEmbed.dynamic_feat_size``).

        Its ``forward_intermediates`` reshapes the blocks' outputs into it (run where the
        activations are whole: :mod:`.entry_points`).
        """
        patch = int(self.get_submodule("proj").get_parameter("weight").shape[-1])
        return img_size[0] // patch, img_size[1] // patch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[b', C, H, W]`` images -> ``[b', N+1, E']`` in the mode's layout."""
        owner = self._owner[0]
        # the *current* parameters: ZeRO (FSDP2) replaces them where they are registered
        params: dict[str, torch.Tensor] = {
            "weight": self.get_submodule("proj").get_parameter("weight"),
            "cls_token": owner.get_parameter("cls_token"),
            "pos_embed": owner.get_parameter("pos_embed"),
        }
        if self._bias:
            params["bias"] = self.get_submodule("proj").get_parameter("bias")
        out: torch.Tensor = torch.func.functional_call(self._inner[0], params, (x,))
        return out
