"""3D linear layer (Bian et al. 2021): ``y = x W^T + b`` on the q x q x q cube.

The layer takes its input in one activation layout and returns the other (see
:mod:`tessera.layers.cube.layout`): ``Linear3D(h, 4h)`` takes layout ``"y"`` (between blocks) and
returns ``"z"``, ``Linear3D(4h, h, input_layout="z")`` takes it back to ``"y"``. A Megatron MLP
or an attention block's qkv / proj pair is one layer of each.

The weight keeps torch's layout ``[out, in]``: the input features are split over the input
layout's hidden axis, the output features over the other axis and, inside that block, over the
WEIGHT axis (``[out/q^2, in/q]``: every rank holds a distinct ``1/P`` of the weight). The bias
``[out/q]`` is split like the output's hidden dim and replicated over the output's batch group,
through which its gradient is summed (``copy_to_group``, inside autograd).
"""

from __future__ import annotations

import torch
from torch import nn

from tessera.context import ParallelContext

from ..comm.ops import copy_to_group
from ..shared.dense import DenseModule, LinearOutput, flat_bias
from ..shared.initializers import Initializer
from .layout import (
    CubeModule,
    Layout3D,
    check_layout,
    check_marked_layout,
    mark_layout,
    other_layout,
    switch_cube_layout,
)
from .matmul import cube_linear

__all__ = ["Linear3D", "keep_gathered_operands"]


class Linear3D(DenseModule, CubeModule):
    """3D linear layer; input in ``input_layout``, output in the other layout.

    Input ``[b/q^2, ..., in/q]``; output ``[b/q^2, ..., out/q]``. Weight ``[out/q^2, in/q]``,
    bias ``[out/q]``.

    Args:
        in_features: Input features, divisible by q.
        out_features: Output features, divisible by q^2.
        bias: Whether to learn a bias.
        skip_bias_add: Return ``(y, bias)`` without adding the bias; the returned bias block
            is routed so that its gradient is summed over the output's batch group.
        dtype: Parameter dtype.
        weight_initializer: Fills the full ``[out, in]`` weight (torch's default).
        bias_initializer: Fills the full ``[out]`` bias (torch's default).
        input_layout: ``"y"`` (default: the layout between blocks, e.g. a first MLP layer or
            qkv) or ``"z"`` (the output of a ``"y"`` layer, e.g. a second MLP layer or proj).
        output_layout: Default: the other layout. The input's layout makes a layer that keeps
            the layout (a head's transform, BERT's ``cls.predictions.transform.dense``): its
            output is swapped with the mirror rank's (:func:`switch_cube_layout`), one
            exchange of the output block.
        fused: The output is this many equal parts (q, k, v), each split over the cube on its
            own (see :class:`~tessera.layers.Linear1DCol`); weight ``[fused, out/(fused q^2),
            in/q]``.
        keep_gathered: Save the operands the forward gathered (rows, weight) for the backward
            instead of gathering them again: less communication for more saved activations
            (:mod:`~tessera.layers.cube.matmul`); also set by :func:`keep_gathered_operands`.
        device: Parameter device (default the context's).
        context: The ParallelContext (default the current one).
    """

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
        input_layout: Layout3D = "y",
        output_layout: Layout3D | None = None,
        fused: int = 1,
        keep_gathered: bool = False,
        device: torch.device | str | None = None,
        context: ParallelContext | None = None,
    ) -> None:
        super().__init__(context, device)
        self.keep_gathered = keep_gathered
        self.input_layout: Layout3D = check_layout(input_layout, self.owner)
        self._output_layout = (
            other_layout(self.input_layout)
            if output_layout is None
            else check_layout(output_layout, self.owner)
        )
        if self._output_layout == self.input_layout and skip_bias_add:
            raise ValueError(
                f"{self.owner}: skip_bias_add returns the bias block of the product's layout, "
                f"which output_layout={output_layout!r} switches away from; add the bias here"
            )
        cube = self.cube
        self.in_features, self.out_features = in_features, out_features
        self.skip_bias_add, self.fused = skip_bias_add, fused
        hidden, across = cube.hidden(self.input_layout), cube.across(self.input_layout)
        self.make_dense(
            in_features,
            out_features,
            bias,
            dtype,
            weight_initializer,
            bias_initializer,
            weight_splits={0: (across.mode, cube.weight.mode), 1: (hidden.mode,)},
            bias_splits={0: (across.mode,)},
            bias_replicated=(hidden.mode, cube.weight.mode),
            fused=fused,
        )  # weight [out/q^2, in/q], bias [out/q]

    @property
    def output_layout(self) -> Layout3D:
        """The layout of the output: the other one, unless ``output_layout`` kept the input's."""
        return self._output_layout

    def forward(self, x: torch.Tensor) -> LinearOutput:
        """See the class docstring for shapes."""
        cube = self.cube
        local_in = self.in_features // cube.q
        cube.check_local(x, -1, local_in, self.signature, name="in_features")
        check_marked_layout(
            x,
            self.input_layout,
            self.signature,
            "a layer after a parallel='col' Linear takes layout 'z' (parallel='row', "
            "input_layout='z')",
        )
        local_bias = flat_bias(self.bias)
        if not self.skip_bias_add:  # the bias's gradient rides in the product's collectives
            y = cube_linear(
                x, self.weight, cube, self.input_layout, bias=local_bias, keep=self.keep_gathered
            )
            if self.output_layout == self.input_layout:  # back to the input's layout
                return switch_cube_layout(y, cube, other_layout(self.input_layout))
            return mark_layout(y, self.output_layout)  # [b/q^2, ..., out/q]
        y = cube_linear(x, self.weight, cube, self.input_layout, keep=self.keep_gathered)
        bias = (
            None
            if local_bias is None
            else copy_to_group(local_bias, cube.batch(self.output_layout).group)
        )
        return mark_layout(y, self.output_layout), bias

    def extra_repr(self) -> str:
        """The summary shown by ``print(module)``."""
        return f"{self.dense_repr()}input_layout={self.input_layout!r}, " + super().extra_repr()


def keep_gathered_operands(model: nn.Module, keep: bool = True) -> int:
    """Let every :class:`Linear3D` in ``model`` keep (or not) its gathered operands.

    Kept, each layer's backward reuses the rows and weight blocks its forward gathered instead
    of gathering them again, as Colossal-AI's 3D layers do: one gather fewer per operand and
    layer in the backward (``benchmarks/bench_colossal.py --keep-gathered`` measures it), for
    ``q (n k + o k)`` more saved elements per layer (``n`` rows, ``k = in/q``,
    ``o = out/q^2``; ``q^2 n k`` where the weights stay), so 3D no longer saves exactly the
    single process's activations over ``P``. Off by default. Works on a model built with
    tessera's layers or converted by ``parallelize``.

    Returns:
        How many layers were set.
    """
    layers = [m for m in model.modules() if isinstance(m, Linear3D)]
    for layer in layers:
        layer.keep_gathered = keep
    return len(layers)
