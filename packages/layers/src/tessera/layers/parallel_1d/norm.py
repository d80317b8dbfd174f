"""1D LayerNorm: the hidden dim is whole on every rank, so the math is torch's.

Between 1D blocks activations are replicated (or split along the sequence), never along the
hidden dim, so the statistics are local. Under sequence parallelism each rank normalizes its
own slice of the sequence and its weight/bias gradients are partial: the forward routes the
parameters through f (``copy_to_group``), whose backward sums them (Korthikanti et al. 2022
all-reduce these gradients in the optimizer; doing it in autograd keeps tessera's contract that
``.grad`` is complete after backward, and the engine defers it to the step:
``Module1D.defer_gradient_sum``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tessera.context import ParallelContext

from ..shared.base import Module1D
from ..shared.input_checks import check_input_dim
from ..shared.norm_over_group import ParallelNorm, check_norm_bias, layer_norm_over_group

__all__ = ["LayerNorm1D", "RMSNorm1D"]


class LayerNorm1D(ParallelNorm, Module1D):
    """LayerNorm over the last dims, parameters replicated over the 1D group.

    Parameters ``weight``/``bias`` ``[*normalized_shape]``, as torch's. The input is
    ``[.., h]`` replicated (``[b, s/p, h]`` with sequence parallelism) or, between a column- and
    a row-parallel layer, the column layer's split output ``[.., h/p]``: the shape says which,
    and the second is normalized over the 1D group.

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

    SEQUENCE_SUMMED = ("weight", "bias")

    def __init__(
        self,
        normalized_shape: int | tuple[int, ...],
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        bias: bool | None = None,
        dtype: torch.dtype | None = None,
        *,
        sequence_parallel: bool = False,
        device: torch.device | str | None = None,
        context: ParallelContext | None = None,
    ) -> None:
        super().__init__(sequence_parallel=sequence_parallel, context=context, device=device)
        bias = check_norm_bias(bias, self.RMS, type(self).__name__)
        shape = (normalized_shape,) if isinstance(normalized_shape, int) else normalized_shape
        self.normalized_shape, self.eps = tuple(shape), eps
        self.make_affine(elementwise_affine, bias, dtype, replicated=(self.split_mode,))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """See the class docstring for shapes."""
        weight: torch.Tensor | None = self.weight
        bias: torch.Tensor | None = self.bias
        if len(self.normalized_shape) == 1 and x.shape[-1:] != self.normalized_shape:
            return self._split_features(x)
        if self.sequence_parallel:
            weight = None if weight is None else self.summed_over_group(weight)
            bias = None if bias is None else self.summed_over_group(bias)
        rows, weight, bias = self.with_offset(x, weight, bias)
        if self.RMS:
            y = F.rms_norm(rows, self.normalized_shape, weight, self.eps)
        else:
            y = F.layer_norm(rows, self.normalized_shape, weight, bias, self.eps)
        return y.to(x.dtype)

    def _split_features(self, x: torch.Tensor) -> torch.Tensor:
        """LayerNorm of a column-parallel layer's output ``[.., h/p]`` (Listing 1's middle).

        The mean and variance are sums over the 1D group (:func:`layer_norm_over_group`); the
        replicated ``[h]`` parameters are routed through ``copy_to_group`` and this rank's
        block taken, so each rank's gradient fills its block and the backward's all-reduce
        leaves the whole gradient on every rank.
        """
        h, world = self.normalized_shape[0], self.tp.world_size
        check_input_dim(
            x,
            h // world if h % world == 0 else h,
            f"LayerNorm1D({h})",
            f"normalized_shape {h}, or {h} / tensor size {world} for the split output of a "
            "column-parallel layer",
        )
        local = h // world
        block = slice(self.tp.rank * local, (self.tp.rank + 1) * local)
        weight = None if self.weight is None else self.summed_over_group(self.weight)[block]
        bias = None if self.bias is None else self.summed_over_group(self.bias)[block]
        rows, weight, bias = self.with_offset(x, weight, bias)
        y = layer_norm_over_group(rows, weight, bias, h, self.eps, self.tp, rms=self.RMS)
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        """The summary shown by ``print(module)``."""
        return self.norm_repr() + super().extra_repr()


class RMSNorm1D(LayerNorm1D):
    """1D RMSNorm (Zhang and Sennrich 2019, as Llama's): :class:`LayerNorm1D` without centering.

    Parameter ``weight`` ``[*normalized_shape]`` only (no bias).
    """

    RMS = True
