"""The input checks every tensor-parallel layer runs first: dtype, device and feature size.

A tensor-parallel layer that receives an input on the wrong device or in the wrong dtype
fails deep inside a matmul or a collective with torch's message ("mat1 and mat2 must have the
same dtype", "Tensor on device cpu is not on the expected device meta"), which names neither the
layer nor the shapes; under NCCL a wrong device can also reach a collective. ``check_input``
runs as a forward pre-hook of every ``ParallelModule`` and raises a ``ValueError`` that names
the layer, the input's shape, and what was expected, before any computation or communication.

The size of the feature dim depends on the mode (whole, ``in/p`` for a 1D row-parallel input,
``in/q`` for a 2D/3D activation block), so each layer calls :func:`check_input_dim` first thing
in ``forward`` with the expected size *and how it follows from the layer's arguments*; the 1D
layers call it directly, the 2D/2.5D/3D ones through ``Mesh.check_local`` /
``Cube.check_local``, which add the grid's hint. One message format for every family.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["check_input", "check_input_dim", "describe"]


def describe(x: torch.Tensor) -> str:
    """``[2, 3, 8] float32 on cpu``."""
    return f"{list(x.shape)} {str(x.dtype).removeprefix('torch.')} on {x.device}"


def check_input_dim(
    x: torch.Tensor,
    expected: int,
    owner: str,
    derivation: str,
    *,
    dim: int = -1,
    hint: str = "",
) -> None:
    """``ValueError`` unless ``x.shape[dim] == expected``; call it before any collective.

    A wrong feature size would otherwise fail in torch's matmul ("mat1 and mat2 shapes cannot
    be multiplied"), naming neither the layer nor where the expected size comes from, or, in a
    layer that communicates first, leave the other ranks hanging in a collective.

    Args:
        x: The input.
        expected: The size ``dim`` must have.
        owner: Names the layer, e.g. ``"Linear1DRow(64, 8)"``.
        derivation: How ``expected`` follows from the layer's arguments, e.g.
            ``"in_features 64 / tensor size 4"``; the message adds ``" = 16"``.
        dim: The checked dim (default the last, the features).
        hint: Appended to the message, e.g. ``" (a row-parallel input is split ...)"``.

    Raises:
        ValueError: e.g. ``Linear1DRow(64, 8): expected the input's last dim to be
            in_features 64 / tensor size 4 = 16 (...), got shape [2, 4, 64]``.
    """
    if x.dim() > 0 and -x.dim() <= dim < x.dim() and x.shape[dim] == expected:
        return
    where = "last dim" if dim == -1 else f"dim {dim}"
    raise ValueError(
        f"{owner}: expected the input's {where} to be {derivation} = {expected}{hint}, "
        f"got shape {list(x.shape)}"
    )


def check_block_dim(
    x: torch.Tensor, dim: int, expected: int, owner: str, name: str, q: int, block: str
) -> None:
    """:func:`check_input_dim` for a dim split into ``q`` blocks over a 2D/2.5D mesh or a cube.

    Args:
        x: The input.
        dim: The checked dim.
        expected: The local block ``full / q``.
        owner: Names the layer.
        name: What ``full`` is, e.g. ``in_features``.
        q: The number of blocks.
        block: Says which activation the block belongs to and how to make it, e.g.
            ``"a 2d activation, q=2, depth=1: split the input with split_activation"``.
    """
    derivation = f"{name} {expected * q} / q {q}"
    check_input_dim(x, expected, owner, derivation, dim=dim, hint=f" (the local block of {block})")


def _first_parameter(module: nn.Module) -> torch.Tensor | None:
    for param in module.parameters():
        return param
    return None


def check_input(module: nn.Module, args: tuple[Any, ...]) -> None:
    """Forward pre-hook: the first positional tensor matches the layer's parameters.

    Checked against the first parameter (a layer without parameters is not checked):

    - device: the input must be on the parameters' device;
    - dtype: a floating-point input must have the parameters' dtype, unless autocast is on
      (then torch casts), or the parameter is a DTensor (FSDP2 casts under its own policy).
      Integer inputs are left to the layer (embeddings take ids; a Linear given ids gets
      this check's dtype message below).

    Raises:
        ValueError: naming the layer, the input's shape, dtype and device, and the expected
            dtype or device.
    """
    x = next((a for a in args if isinstance(a, torch.Tensor)), None)
    param = _first_parameter(module)
    if x is None or param is None:
        return
    owner = type(module).__name__
    if param.device.type != "meta" and x.device != param.device:
        raise ValueError(
            f"{owner}: input {describe(x)} is on device {x.device}, but the layer's parameters "
            f"are on {param.device}; move the input with .to({str(param.device)!r})"
        )
    if hasattr(param, "device_mesh") or not param.is_floating_point():
        return
    wants_ids = getattr(module, "takes_indices", False)
    if wants_ids:
        if x.is_floating_point() or x.is_complex():
            raise ValueError(
                f"{owner}: input {describe(x)} must hold integer indices (int64 or int32)"
            )
        return
    if torch.is_autocast_enabled(x.device.type):
        return
    if x.dtype != param.dtype:
        raise ValueError(
            f"{owner}: input {describe(x)} has dtype {str(x.dtype).removeprefix('torch.')}, "
            f"expected {str(param.dtype).removeprefix('torch.')} (the layer's parameters); "
            "cast the input, or run under torch.autocast"
        )
