"""2D (SUMMA) and 2.5D (Tesseract) linear layers: one implementation on a :class:`Mesh`.

Xu et al. 2021, section 3.1: ``Y = X W`` with ``X`` ``[b, in]`` split into q x q blocks
(batch by mesh row, features by mesh column) and ``W`` (``[in, out]`` in the paper's notation)
into q x q blocks, computed by SUMMA or by its variant that keeps the weights in place,
whichever sends less for the shapes at hand (:mod:`tessera.layers.mesh.matmul`); the backward
is ``dX = dY W^T`` and ``dW = X^T dY``. Tesseract (Wang et al. 2021, section 3) runs the same
product in each of ``depth`` layers on its share of the batch, with the weight blocks
replicated across depth and their gradients summed over DEP.

The weight keeps torch's layout ``[out, in]``: rank ``(i, j, k)`` holds ``W[out_j, in_i]``,
the transpose of the paper's block ``(i, j)`` of ``W^T``, so ``ShardInfo`` says dim 0 is split
over ROW (local rank ``j``) and dim 1 over COL (local rank ``i``).
"""

from __future__ import annotations

import torch

from tessera.context import ParallelContext

from ..shared.dense import DenseModule, LinearOutput, flat_bias, flat_weight
from ..shared.initializers import Initializer
from .layout import MeshModule
from .matmul import mesh_linear

__all__ = ["Linear2D", "Linear2p5D", "MeshLinear"]


class MeshLinear(DenseModule, MeshModule):
    """``y = x W^T + b`` on a 2D/2.5D mesh (the implementation behind ``Linear2D``/``2p5D``).

    Input ``[b/(depth q), ..., in/q]``; output ``[b/(depth q), ..., out/q]`` (activation
    layout, see :mod:`tessera.layers.mesh.layout`). Weight ``[out/q, in/q]`` (block ``W[out_j,
    in_i]``), bias ``[out/q]`` (block ``j``, replicated over the batch group).

    Args:
        in_features: Input features, divisible by q.
        out_features: Output features, divisible by q.
        bias: Whether to learn a bias.
        skip_bias_add: Return ``(y, bias)`` without adding the bias; the returned bias block
            is routed so that its gradient is summed over the batch group.
        dtype: Parameter dtype.
        weight_initializer: Fills the full ``[out, in]`` weight (torch's default).
        bias_initializer: Fills the full ``[out]`` bias (torch's default).
        fused: The output is this many equal parts (q, k, v), each split over the mesh row on
            its own (see :class:`~tessera.layers.Linear1DCol`); weight ``[fused,
            out/(fused q), in/q]``.
        device: Parameter device (default the context's).
        context: The ParallelContext (default the current one).
    """

    DEPTH_SUMMED = ("weight", "bias")  # the product's one depth all-reduce

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        skip_bias_add: bool = False,
        dtype: torch.dtype | None = None,
        weight_initializer: Initializer | None = None,
        bias_initializer: Initializer | None = None,
        *,
        fused: int = 1,
        device: torch.device | str | None = None,
        context: ParallelContext | None = None,
    ) -> None:
        super().__init__(context, device)
        mesh = self.mesh
        self.in_features, self.out_features = in_features, out_features
        self.skip_bias_add, self.fused = skip_bias_add, fused
        self.make_dense(
            in_features,
            out_features,
            bias,
            dtype,
            weight_initializer,
            bias_initializer,
            weight_splits={0: (mesh.row.mode,), 1: (mesh.col.mode,)},
            weight_replicated=mesh.depth_modes,
            bias_splits={0: (mesh.row.mode,)},
            bias_replicated=(mesh.col.mode, *mesh.depth_modes),
            fused=fused,
        )  # weight [out/q, in/q]: W[out_j, in_i]; bias [out/q]: b[out_j]

    def depth_summed(self) -> tuple[str, ...]:
        """The weight, and the bias unless it is returned (then the batch group sums it)."""
        return ("weight",) if self.skip_bias_add else self.DEPTH_SUMMED

    def forward(self, x: torch.Tensor) -> LinearOutput:
        """See the class docstring for shapes."""
        mesh = self.mesh
        local_in = self.in_features // mesh.q
        mesh.check_local(x, -1, local_in, self.signature, name="in_features")
        lead = x.shape[:-1]
        weight = flat_weight(self.weight)  # [out/q, in/q]: W[out_j, in_i]
        local_bias = flat_bias(self.bias)
        fused_bias = None if self.skip_bias_add else local_bias
        y = mesh_linear(x.reshape(-1, local_in), weight, fused_bias, mesh)  # [m, out/q]
        y = y.view(*lead, y.shape[-1])  # [b/(dq), ..., out/q]
        if not self.skip_bias_add:
            return y
        bias = None if local_bias is None else mesh.over_batch(local_bias)
        return y, bias

    def extra_repr(self) -> str:
        """The summary shown by ``print(module)``."""
        return self.dense_repr() + super().extra_repr()


class Linear2D(MeshLinear):
    """2D (SUMMA, Xu et al. 2021) linear layer on q x q ranks; see :class:`MeshLinear`."""

    MESH = "2d"


class Linear2p5D(MeshLinear):
    """2.5D (Tesseract, Wang et al. 2021) linear layer on q x q x depth ranks.

    See :class:`MeshLinear`; the weight blocks are replicated over depth.
    """

    MESH = "2.5d"
