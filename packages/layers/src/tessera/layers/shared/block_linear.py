"""The frame every grid linear product shares as an autograd function; the product differs.

2D/2.5D (``mesh/matmul.py``: SUMMA, streamed SUMMA, stationary weights) and 3D
(``cube/matmul.py``: gathered operands, stationary weights) each implement one ``product`` and
one backward. Around the product, the forward is the same for all five: the operands are cast
as ``F.linear`` would under autocast, ``(x, weight)`` saved for the backward, the rows
flattened to ``[n, k]`` and the bias added in the product's dtype. Each backward opens with the
same question, which gradients are wanted (:func:`gradients_needed`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch

from .autocast import cast_operands, computing_in

__all__ = ["BlockLinearFunction", "block_linear_forward", "gradients_needed"]


class BlockLinearFunction(torch.autograd.Function):
    """``x W^T + b`` from blocks; a subclass gives ``product(x [n, k], weight, *grid)``.

    ``grid`` (the mesh, or the cube and the input layout) is kept as ``ctx.grid`` for the
    subclass's backward, which returns one gradient per input of ``apply`` (``None`` for
    each grid argument).
    """

    #: ``product(x [n, k], weight, *grid) -> [n, out_local]``, the variant's communication;
    #: or ``([n, out_local], kept)``: tensors saved for the backward after ``x`` and ``weight``.
    product: ClassVar[Callable[..., torch.Tensor | tuple[torch.Tensor, tuple[torch.Tensor, ...]]]]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Give each variant a static ``forward`` around its ``product``.

        A classmethod ``forward`` (``cls.product`` looked up at the call) is what autograd
        accepts, but ``torch.compile`` binds ``forward`` as a staticmethod and passes ``ctx``
        where ``cls`` goes: each variant gets its own static one instead.
        """
        super().__init_subclass__(**kwargs)
        product = cls.__dict__.get("product")
        if product is None:
            return
        compute = product.__func__ if isinstance(product, staticmethod) else product

        def forward(
            ctx: Any,
            x: torch.Tensor,
            weight: torch.Tensor,
            bias: torch.Tensor | None,
            *grid: Any,
        ) -> torch.Tensor:
            return block_linear_forward(compute, ctx, x, weight, bias, grid)

        forward.__doc__ = block_linear_forward.__doc__
        cls.forward = staticmethod(forward)  # type: ignore[method-assign]


def block_linear_forward(
    product: Callable[..., Any],
    ctx: Any,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    grid: tuple[Any, ...],
) -> torch.Tensor:
    """``x [.., k]`` -> ``[n, out_local]`` through ``product``, plus the bias.

    ``n`` is the rows of ``x`` (every dim but the last); the caller views the result back
    to ``x``'s leading dims.
    """
    dtype, x, weight, bias = cast_operands(x, weight, bias)
    ctx.grid, ctx.has_bias = grid, bias is not None
    with computing_in(dtype, x.device):
        out = product(x.detach().reshape(-1, x.shape[-1]), weight.detach(), *grid)
        kept: tuple[torch.Tensor, ...] = ()
        if isinstance(out, tuple):  # the variant keeps what it gathered for its backward
            out, kept = out
        out = out if bias is None else out.add_(bias)
    ctx.save_for_backward(x, weight, *kept)
    assert isinstance(out, torch.Tensor)
    # A view made here would be one autograd forbids changing in place (Falcon adds its
    # attention output into its MLP output with +=): callers restore ``lead`` outside.
    return out if out._base is None else out.clone()  # [n, out_local]


def gradients_needed(ctx: Any) -> tuple[bool, bool, bool]:
    """Which of the input, weight and bias gradients the backward must compute."""
    needs = ctx.needs_input_grad
    return bool(needs[0]), bool(needs[1]), bool(ctx.has_bias and needs[2])
