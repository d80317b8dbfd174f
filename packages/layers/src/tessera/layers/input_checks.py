"""The input check every tensor-parallel layer runs first: dtype and device, named.

A tensor-parallel layer that receives an input on the wrong device or in the wrong dtype
fails deep inside a matmul or a collective with torch's message ("mat1 and mat2 must have the
same dtype", "Tensor on device cpu is not on the expected device meta"), which names neither the
layer nor the shapes; under NCCL a wrong device can also reach a collective. ``check_input``
runs as a forward pre-hook of every ``ParallelModule`` and raises a ``ValueError`` that names
the layer, the input's shape, and what was expected, before any computation or communication.
The per-dim size checks stay with each family (``Mesh.check_local``, ``Cube.check_local``),
which know the local block a dim must have.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["check_input", "describe"]


def describe(x: torch.Tensor) -> str:
    """``[2, 3, 8] float32 on cpu``."""
    return f"{list(x.shape)} {str(x.dtype).removeprefix('torch.')} on {x.device}"


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
