"""Autocast inside tessera's autograd functions: compute as ``F.linear`` would.

Under ``torch.autocast`` a built-in matmul casts its operands to the autocast dtype, but a
custom autograd function sees its inputs as given, and an in-place accumulation into a
result of another dtype fails. So a kernel asks :func:`autocast_dtype`, casts its operands to
it and computes with autocast off (:func:`computing_in`); autograd casts each gradient back to
its input's dtype, as it does for ``torch.amp.custom_fwd(cast_inputs=...)``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["autocast_dtype", "cast_operands", "computing_in"]


def autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    """The dtype autocast computes a matmul of ``x`` in, or ``None`` outside autocast."""
    device = x.device.type
    if device not in ("cpu", "cuda") or not x.is_floating_point():
        return None
    if not torch.is_autocast_enabled(device):
        return None
    return torch.get_autocast_dtype(device)


def cast_operands(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.dtype | None, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A linear layer's operands in the dtype ``F.linear`` computes in (and that dtype)."""
    dtype = autocast_dtype(x)
    if dtype is None:
        return None, x, weight, bias
    return dtype, x.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype)


@contextlib.contextmanager
def computing_in(dtype: torch.dtype | None, device: torch.device) -> Iterator[None]:
    """Autocast off while a kernel computes on operands already cast to ``dtype``."""
    if dtype is None:
        yield
        return
    with torch.autocast(device.type, enabled=False):
        yield
