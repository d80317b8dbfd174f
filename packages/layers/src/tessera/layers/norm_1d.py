"""1D LayerNorm: the hidden dim is whole on every rank, so the math is torch's.

Between 1D blocks activations are replicated (or split along the sequence), never along the
hidden dim, so the statistics are local. Under sequence parallelism each rank normalizes its
own slice of the sequence and its weight/bias gradients are partial: the forward routes the
parameters through f (``copy_to_group``), whose backward sums them (Korthikanti et al. 2022
all-reduce these gradients in the optimizer; doing it in autograd keeps tessera's contract that
``.grad`` is complete after backward).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tessera.context import ParallelContext

from .base import Module1D
from .comm import copy_to_group
from .initializers import ones, zeros

__all__ = ["LayerNorm1D"]


class LayerNorm1D(Module1D):
    """LayerNorm over the last dims, parameters replicated over the 1D group.

    Parameters ``weight``/``bias`` ``[*normalized_shape]``, as torch's.

    Args:
        normalized_shape: As torch's LayerNorm.
        eps: As torch's LayerNorm.
        elementwise_affine: Learn weight (and bias).
        bias: Learn a bias (with ``elementwise_affine``).
        dtype: Parameter dtype.
        sequence_parallel: The input is split along the sequence (dim 1).
        device: Parameter device (default the context's).
        context: The ParallelContext (default the current one).
    """

    def __init__(
        self,
        normalized_shape: int | tuple[int, ...],
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        bias: bool = True,
        dtype: torch.dtype | None = None,
        *,
        sequence_parallel: bool = False,
        device: torch.device | str | None = None,
        context: ParallelContext | None = None,
    ) -> None:
        super().__init__(sequence_parallel=sequence_parallel, context=context, device=device)
        shape = (normalized_shape,) if isinstance(normalized_shape, int) else normalized_shape
        self.normalized_shape: tuple[int, ...] = tuple(shape)
        self.eps = eps
        n = 1
        for s in self.normalized_shape:
            n *= s
        replicated = (self.split_mode,)
        self.weight = (
            self.make_parameter(
                "weight", shape, ones(), fan_in=n, fan_out=n, replicated=replicated, dtype=dtype
            )
            if elementwise_affine
            else None
        )
        self.bias = (
            self.make_parameter(
                "bias", shape, zeros(), fan_in=n, fan_out=n, replicated=replicated, dtype=dtype
            )
            if elementwise_affine and bias
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """See the class docstring for shapes."""
        weight: torch.Tensor | None = self.weight
        bias: torch.Tensor | None = self.bias
        if self.sequence_parallel:
            group = self.tp.group
            weight = None if weight is None else copy_to_group(weight, group)
            bias = None if bias is None else copy_to_group(bias, group)
        return F.layer_norm(x, self.normalized_shape, weight, bias, self.eps)

    def extra_repr(self) -> str:
        """The summary shown by ``print(module)``."""
        return f"{self.normalized_shape}, eps={self.eps}, " + super().extra_repr()
