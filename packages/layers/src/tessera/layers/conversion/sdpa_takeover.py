"""Sequence parallelism for attention someone wrote themselves, through its SDPA call.

A transformers model routes attention through its ``AttentionInterface`` (sequence.py). A
model a researcher wrote calls ``F.scaled_dot_product_attention`` from its own attention
module, on q, k and v it computed itself: under ``tensor=dict(size=N, mode="sequence")``
those hold this rank's chunk of the tokens, ``[b, heads, s/N, d]``, and SDPA would attend
within the chunk only. So while a converted attention module runs, a ``TorchFunctionMode``
takes that one call over and computes it over the whole sequence (ring self-attention, Li et
al. 2021, or DeepSpeed-Ulysses' all-to-all, :func:`attend_over_sequence`), with the causal
mask on global positions and the batch's padding from the model's :class:`KeyPadding`.
Everything else in the module (its projections, reshapes) runs as written.

An attention module that computes its scores itself (``q @ k.transpose`` and a softmax)
makes no SDPA call, which the mode notices at the end of the forward: an error naming the
module, never attention within a chunk.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from ..sequence.attention import attend_over_sequence

__all__ = ["take_over_sdpa"]


class _SequenceSDPA(TorchFunctionMode):
    """Computes every ``F.scaled_dot_product_attention`` call over the whole sequence."""

    def __init__(self, spec: Any, owner: str) -> None:
        super().__init__()
        self.spec, self.owner, self.calls = spec, owner, 0

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        self.calls += 1
        return self.attend(*args, **kwargs)

    def attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> torch.Tensor:
        """SDPA's signature: ``[b, heads, s/N, d]`` q, k, v -> ``[b, heads, s/N, d]``."""
        if attn_mask is not None:
            raise ValueError(
                f"{self.owner} under tensor mode 'sequence' passes an attn_mask to "
                "F.scaled_dot_product_attention, built from this rank's chunk of the tokens; "
                "pass padding as the model's attention_mask=[b, s] argument (tessera splits it "
                "and masks the keys of every rank) and causality as is_causal=True"
            )
        spec = self.spec
        if key.shape[-3] != query.shape[-3]:  # grouped-query attention
            group = query.shape[-3] // key.shape[-3]
            key, value = key.repeat_interleave(group, -3), value.repeat_interleave(group, -3)
        return attend_over_sequence(
            query,
            key,
            value,
            impl=spec.impl,
            sequence=spec.sequence,
            causal=is_causal,
            scale=scale if scale is not None else query.shape[-1] ** -0.5,
            dropout=dropout_p,
            context=spec.context,
            key_mask=spec.padding.whole(query.shape[0], query.shape[-2], query.dtype),
            dropout_stream=False,  # parallelize forked the generator per rank (dropout.py)
        )


def _forward_over_sequence(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The module's own forward, its SDPA call taken over (see the module docstring)."""
    mode = _SequenceSDPA(getattr(self, _SPEC_ATTR), type(self).__name__)
    with mode:
        out = type(self).forward(self, *args, **kwargs)
    if mode.calls == 0:
        raise ValueError(
            f"{type(self).__name__} under tensor mode 'sequence' made no call to "
            "F.scaled_dot_product_attention, through which tessera attends over every rank's "
            "tokens; an attention that computes its scores itself would see this rank's chunk "
            "only. Call F.scaled_dot_product_attention (or use tessera.layers.RingSelfAttention)"
        )
    return out


#: The attribute of a taken-over attention module holding its ``SequenceAttention``.
_SPEC_ATTR = "_tessera_sdpa_sequence"


def take_over_sdpa(module: nn.Module, spec: Any) -> None:
    """Route ``module``'s SDPA call over the whole sequence (``spec``: its ``SequenceAttention``).

    The forward is a bound method on the instance, so a deep copy binds it to the copy. A
    module that attends over the sequence itself (multihead.py's ``HeadsAttention``: its
    masks are ``nn.MultiheadAttention``'s) is handed ``spec`` through its ``take_sequence``.
    """
    take_sequence = getattr(module, "take_sequence", None)
    if callable(take_sequence):
        take_sequence(spec)
        return
    setattr(module, _SPEC_ATTR, spec)
    setattr(module, "forward", types.MethodType(_forward_over_sequence, module))  # noqa: B010
