"""Token embeddings that scale their rows, recognized by what they compute.

Gemma multiplies every embedded row by ``sqrt(hidden)`` (Gemma Team 2024, section 2; its
``ScaledWordEmbedding`` is an ``nn.Embedding`` with a forward of its own). A tessera embedding put
in its place computes the plain lookup, so ``parallelize`` takes such a module only when a probe
shows that it computes exactly ``F.embedding(ids, weight, padding_idx) * c`` for the constant
``c`` it keeps (``embed_scale``), and then scales the tessera embedding's output by ``c`` with a
forward hook (:class:`ScaledRows`). Anything else with a forward of its own stays refused.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from .norms import computes_as, computes_own_forward

__all__ = ["ScaledRows", "embedding_scale"]

#: Attributes under which an embedding keeps the constant it scales its rows by.
SCALE_ATTRIBUTES = ("scalar_embed_scale", "embed_scale", "embedding_scale")


def _constant(value: object) -> float | None:
    """``value`` as a float if it is one number (a float, or a one-element tensor with values)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_meta:
        return float(value.item())
    return None


def embedding_scale(module: nn.Embedding) -> float | None:
    """The constant ``module`` multiplies its rows by (``1.0`` for a plain ``nn.Embedding``).

    ``None`` when it computes anything else than a scaled lookup, or keeps no constant to say
    by how much (see the module docstring).
    """
    if computes_as(module, nn.Embedding):
        return 1.0
    if not computes_own_forward(module) or any(True for _ in module.children()):
        return None
    # The value the forward multiplies by: a buffer's own (rounded to its dtype, as a bf16
    # model holds it), else the exact number kept beside it (a meta buffer has no value).
    kept = [getattr(module, a, None) for a in SCALE_ATTRIBUTES]
    found = [c for c in map(_constant, kept) if c is not None]
    buffers = [c for c in kept if isinstance(c, torch.Tensor) and c.numel() == 1]
    held = [_constant(b) for b in buffers if not b.is_meta]
    scale = held[0] if held and held[0] is not None else (found[0] if found else None)
    if scale is None:
        return None
    # on the module's device (its buffer multiplies there), on the CPU for a meta module
    device = torch.device("cpu") if module.weight.is_meta else module.weight.device
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(module.num_embeddings, module.embedding_dim, generator=g).to(device)
    ids = torch.randint(0, module.num_embeddings, (2, 5), generator=g).to(device)
    values: dict[str, Any] = {"weight": weight}
    values |= {  # meta buffers get the kept number, so the probe can run
        name: torch.tensor(scale)
        for name, buffer in module.named_buffers()
        if buffer.numel() == 1 and buffer.is_meta
    }
    try:
        got = functional_call(module, values, (ids,))
    except Exception:  # any failure means "not a scaled lookup"
        return None
    want = F.embedding(ids, weight, module.padding_idx) * scale
    if not isinstance(got, torch.Tensor) or got.shape != want.shape:
        return None
    return scale if torch.allclose(got, want, rtol=1e-6, atol=0.0) else None


class ScaledRows:
    """A forward hook multiplying a module's output by a constant (a scaled embedding's).

    In the output's dtype, as the scaled embedding multiplies in its weight's.
    """

    def __init__(self, scale: float) -> None:
        self.scale = scale

    def __call__(self, module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        """The module's output times the constant."""
        return output * torch.tensor(self.scale, dtype=output.dtype, device=output.device)

    def __repr__(self) -> str:
        return f"ScaledRows({self.scale})"
