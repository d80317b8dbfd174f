"""A norm of each attention head's features, the heads split over the tensor ranks.

Qwen3 (``q_norm``, ``k_norm``), Phi with ``qk_layernorm`` and others normalize every query and
key head over its own ``head_dim`` features before rotary positions and the dot product
(Dehghani et al. 2023, "Scaling Vision Transformers to 22 Billion Parameters", section 3.1,
"QK normalization"). One ``[head_dim]`` weight serves every head. The statistics of a head are
its own, so the math needs no communication under any tensor mode; the weight's gradient does:
each tensor rank holds some of the heads (1D) and, on the 2D/2.5D mesh and the 3D cube, a
block of the batch, so its gradient covers only the rows it normalized. The forward routes the
weight and bias through Megatron's f (``copy_to_group`` over the TENSOR group), whose backward
sums the parts, so ``.grad`` is whole on every rank after backward, as for every tessera layer;
a training loop that knows when the optimizer steps can take that sum over
(:class:`~tessera.layers.shared.tensor_sum.SumsOverTensor`), once per step for every layer together.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tessera.context import ParallelContext, ParallelMode

from .context_access import GroupInfo, group_info
from .input_checks import check_input_dim
from .norm_over_group import ParallelNorm, check_norm_bias
from .tensor_sum import SumsOverTensor

__all__ = ["HeadLayerNorm", "HeadRMSNorm"]


class HeadLayerNorm(SumsOverTensor, ParallelNorm):
    """LayerNorm over the last dim of ``[.., head_dim]``, its parameters summed over TENSOR.

    Parameters ``weight``/``bias`` ``[head_dim]``, whole and equal on every tensor rank (their
    ``ShardInfo`` says replicated over TENSOR), as the plain module's.

    Args:
        normalized_shape: ``head_dim`` (an int or a one-element tuple).
        eps: As torch's LayerNorm.
        elementwise_affine: Learn weight (and bias).
        bias: Learn a bias (with ``elementwise_affine``).
        dtype: Parameter dtype.
        device: Parameter device (default the context's).
        context: The ParallelContext (default the current one).
    """

    def __init__(
        self,
        normalized_shape: int | tuple[int, ...],
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        bias: bool | None = None,
        dtype: torch.dtype | None = None,
        *,
        device: torch.device | str | None = None,
        context: ParallelContext | None = None,
    ) -> None:
        super().__init__(context, device)
        bias = check_norm_bias(bias, self.RMS, type(self).__name__)
        shape = (normalized_shape,) if isinstance(normalized_shape, int) else normalized_shape
        if len(shape) != 1:
            raise ValueError(
                f"{type(self).__name__} normalizes one head's features, a single dim; got "
                f"normalized_shape {tuple(shape)}"
            )
        self.normalized_shape, self.eps = tuple(shape), eps
        self.tensor: GroupInfo = group_info(self.context, ParallelMode.TENSOR)
        self.make_affine(elementwise_affine, bias, dtype, replicated=(ParallelMode.TENSOR,))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[.., head_dim]`` -> the same shape, each row normalized on its own."""
        (dim,) = self.normalized_shape
        check_input_dim(x, dim, f"{type(self).__name__}({dim})", "head_dim")
        weight, bias = self.summed_over_tensor(self.weight), self.summed_over_tensor(self.bias)
        rows, weight, bias = self.with_offset(x, weight, bias)
        if self.RMS:
            y = F.rms_norm(rows, self.normalized_shape, weight, self.eps)
        else:
            y = F.layer_norm(rows, self.normalized_shape, weight, bias, self.eps)
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        """The summary shown by ``print(module)``."""
        return f"{self.norm_repr()}summed over {self.tensor.world_size} tensor ranks"


class HeadRMSNorm(HeadLayerNorm):
    """:class:`HeadLayerNorm` without centering (Zhang and Sennrich 2019, as Qwen3's ``q_norm``).

    Parameter ``weight`` ``[head_dim]`` only.
    """

    RMS = True
