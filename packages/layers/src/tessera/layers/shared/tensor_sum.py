"""``SumsOverTensor``: whole parameters on every tensor rank whose gradients are parts.

Some converted modules keep their parameters whole and equal on every TENSOR rank while each
rank's backward covers only its share of the work: a norm of each head (every rank normalizes
its heads' rows), key/value heads repeated over ranks (every rank computes its one head from
the whole weight). The gradient of such a parameter is the sum of the ranks' parts. Megatron's
f (Shoeybi et al. 2019: identity forward, all-reduce backward, ``copy_to_group``) around the
parameter takes that sum in autograd, one all-reduce per module and backward; a training loop
that knows when the optimizer steps can take it over for every module at once
(:meth:`SumsOverTensor.defer_gradient_sum`, read through
:class:`tessera.context.DefersGradientSum`).
"""

from __future__ import annotations

from typing import TypeVar

import torch
from torch import nn

from ..comm.ops import copy_to_group
from .context_access import GroupInfo

__all__ = ["SumsOverTensor"]

_T = TypeVar("_T", torch.Tensor, torch.Tensor | None)


class SumsOverTensor:
    """Mixin: the gradient sum over TENSOR of whole parameters, in autograd or deferred.

    The module sets ``self.tensor`` (its TENSOR :class:`GroupInfo`) and routes each such
    parameter (or a tensor built from them) through :meth:`summed_over_tensor` in its forward.
    """

    tensor: GroupInfo

    #: Set by :meth:`defer_gradient_sum`: the parameters' gradients stay this rank's part.
    tensor_sum_deferred = False

    def tensor_summed_parameters(self) -> list[nn.Parameter]:
        """The parameters whose gradients are summed over TENSOR: ``weight`` and ``bias``."""
        found = (getattr(self, "weight", None), getattr(self, "bias", None))
        return [p for p in found if isinstance(p, nn.Parameter)]

    def defer_gradient_sum(self) -> dict[str, list[nn.Parameter]]:
        """Leave the sum of the parameters' gradients over TENSOR to the training loop.

        Afterwards ``.grad`` holds this rank's part until the caller sums it over the returned
        mode (see :class:`tessera.context.DefersGradientSum`).
        """
        params = self.tensor_summed_parameters()
        if self.tensor.world_size == 1 or not params:
            return {}
        self.tensor_sum_deferred = True
        return {self.tensor.mode: params}

    def summed_over_tensor(self, value: _T) -> _T:
        """``value`` routed so that its gradient is summed over TENSOR (unless deferred)."""
        if value is None or self.tensor_sum_deferred:
            return value
        return copy_to_group(value, self.tensor.group)
