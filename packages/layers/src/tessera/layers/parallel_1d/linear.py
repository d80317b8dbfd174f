"""1D (Megatron-LM) column- and row-parallel linear layers.

Shoeybi et al. 2019, section 3: an MLP ``Y = GeLU(X A) B`` splits ``A`` by columns and ``B`` by
rows, so the only communication is one all-reduce forward (after ``B``) and one backward
(before ``A``). With sequence parallelism (Korthikanti et al. 2022) the input of ``A`` is
all-gathered along the sequence and the output of ``B`` reduce-scattered along it instead.

Weights keep torch's layout ``[out, in]``: a column-parallel weight holds rows
``[out/p, in]``, a row-parallel weight columns ``[out, in/p]``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tessera.context import ParallelContext

from ..comm.collectives import check_divisible
from ..comm.inflight import start_all_reduce
from ..comm.ops import (
    apply_function,
    gather_along_dim,
    reduce_from_group,
    reduce_scatter_along_dim,
    split_along_dim,
)
from ..shared.autocast import cast_operands, computing_in
from ..shared.base import Module1D
from ..shared.dense import DenseModule, LinearOutput, flat_bias, flat_weight
from ..shared.initializers import Initializer
from ..shared.input_checks import check_input_dim

__all__ = ["Linear1DCol", "Linear1DRow"]


def _check_row_input(
    x: torch.Tensor, in_features: int, world_size: int, parallel_input: bool, owner: str
) -> None:
    """The last dim of a row-parallel input: ``in/p`` if already split, else ``in``."""
    if parallel_input:
        check_input_dim(
            x,
            in_features // world_size,
            owner,
            f"in_features {in_features} / tensor size {world_size}",
            hint=" (a row-parallel input is split along its features, e.g. the output of a "
            "column-parallel layer; pass parallel_input=False to give the whole input)",
        )
    else:
        check_input_dim(
            x, in_features, owner, "in_features", hint=" (parallel_input=False: the whole input)"
        )


class _ColumnLinear(torch.autograd.Function):
    """Megatron's ``f`` and a column-parallel ``F.linear`` in one, the backward overlapped.

    The input gradient ``dy W`` is computed first and its all-reduce posted; the weight and
    bias gradients are computed while it travels (as Megatron-LM overlaps its input-gradient
    all-reduce, Narayanan et al. 2021, section 4.1). ``copy_to_group`` followed by
    ``F.linear`` would all-reduce only after both gradients are done.
    """

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        group: dist.ProcessGroup,
    ) -> torch.Tensor:
        dtype, x, weight, bias = cast_operands(x, weight, bias)
        ctx.group, ctx.has_bias = group, bias is not None
        ctx.save_for_backward(x, weight)
        with computing_in(dtype, x.device):
            return F.linear(x, weight, bias)  # grad mode is off in forward: nothing to detach

    @staticmethod
    def backward(
        ctx: Any, grad: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, None]:
        x, weight = ctx.saved_tensors
        grad_x = None
        if ctx.needs_input_grad[0]:  # [.., in], partial: this rank's output features only
            size = dist.get_world_size(ctx.group)
            grad_x = start_all_reduce(grad.matmul(weight), ctx.group, size)
        flat = grad.reshape(-1, grad.shape[-1])  # [tokens, out/p]
        grad_w = flat.t() @ x.reshape(-1, x.shape[-1]) if ctx.needs_input_grad[1] else None
        grad_b = flat.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return None if grad_x is None else grad_x.wait(), grad_w, grad_b, None


class _RowLinear(torch.autograd.Function):
    """A row-parallel ``F.linear``, Megatron's ``g`` and the bias add in one.

    The partial product is all-reduced in place (it is this function's own buffer: no copy
    for the collective) and the replicated bias added to the sum in place, so the forward
    makes one ``[.., out]`` tensor where ``F.linear`` + ``reduce_from_group`` + ``+ bias``
    make three, and autograd records one node instead of three.
    """

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        group: dist.ProcessGroup,
    ) -> torch.Tensor:
        dtype, x, weight, bias = cast_operands(x, weight, bias)
        ctx.has_bias = bias is not None
        ctx.save_for_backward(x, weight)
        with computing_in(dtype, x.device):
            y = F.linear(x, weight)  # [.., out], partial sums
            dist.all_reduce(y, group=group)
            return y if bias is None else y.add_(bias)

    @staticmethod
    def backward(
        ctx: Any, grad: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, None]:
        x, weight = ctx.saved_tensors
        flat = grad.reshape(-1, grad.shape[-1])  # [tokens, out], replicated
        grad_x = grad.matmul(weight) if ctx.needs_input_grad[0] else None  # [.., in/p]
        grad_w = flat.t() @ x.reshape(-1, x.shape[-1]) if ctx.needs_input_grad[1] else None
        grad_b = flat.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b, None


class Linear1DCol(DenseModule, Module1D):
    """``y = x W^T + b`` with ``W`` split by output features (rows of ``[out, in]``).

    Input ``[.., in]`` replicated over the 1D group (``[b, s/p, in]`` with sequence
    parallelism, or its tokens flattened, ``[b s/p, in]``: see ``Module1D.token_dim``); output
    ``[.., out/p]`` (or ``[.., out]`` replicated with ``gather_output``).

    Args:
        in_features: Input features.
        out_features: Output features of the full layer; divisible by the 1D size.
        bias: Whether to learn a bias (split like the output).
        gather_output: All-gather the output so every rank holds ``[.., out]``.
        skip_bias_add: Return ``(y, bias)`` without adding the bias.
        dtype: Parameter dtype.
        weight_initializer: Fills the full ``[out, in]`` weight (torch's default).
        bias_initializer: Fills the full ``[out]`` bias (torch's default).
        sequence_parallel: The input is split along dim 1 (sequence); gathered here.
        fused: The output is this many equal parts (an attention's q, k, v: 3), each split
            over the ranks on its own, so rank ``r`` computes block ``r`` of every part: its
            output is ``[.., out/p]`` = ``[part_0 block r, part_1 block r, ...]``. The weight is
            then kept as ``[fused, out/(fused p), in]`` (see :mod:`tessera.layers.shared.dense`).
        device: Parameter device (default the context's).
        context: The ParallelContext (default the current one).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        gather_output: bool = False,
        skip_bias_add: bool = False,
        dtype: torch.dtype | None = None,
        weight_initializer: Initializer | None = None,
        bias_initializer: Initializer | None = None,
        *,
        sequence_parallel: bool = False,
        fused: int = 1,
        device: torch.device | str | None = None,
        context: ParallelContext | None = None,
    ) -> None:
        super().__init__(sequence_parallel=sequence_parallel, context=context, device=device)
        check_divisible(out_features, self.tp.world_size * fused, "Linear1DCol out_features")
        if fused > 1 and gather_output:
            raise ValueError(
                f"Linear1DCol({in_features}, {out_features}, fused={fused}): gather_output would "
                "interleave the fused parts rank by rank; gather each part after splitting them"
            )
        self.in_features, self.out_features = in_features, out_features
        self.gather_output, self.skip_bias_add = gather_output, skip_bias_add
        self.fused = fused
        split = {0: (self.split_mode,)}
        self.make_dense(
            in_features,
            out_features,
            bias,
            dtype,
            weight_initializer,
            bias_initializer,
            weight_splits=split,
            bias_splits=split,
            fused=fused,
        )  # weight [out/p, in], bias [out/p] ([fused, out/(fused p), ...] when fused)

    def forward(self, x: torch.Tensor) -> LinearOutput:
        """See the class docstring for shapes."""
        check_input_dim(
            x,
            self.in_features,
            self.signature,
            "in_features",
            hint=" (a column-parallel input holds every feature)",
        )
        group = self.tp.group
        local_bias = flat_bias(self.bias)
        bias = None if self.skip_bias_add else local_bias
        if self.sequence_parallel:
            x = gather_along_dim(x, self.token_dim(x), group, partial_grad=True)  # [b, s, in]
            y = F.linear(x, flat_weight(self.weight), bias)  # [.., out/p]
        elif self.tp.world_size > 1:  # f, its all-reduce overlapped with the weight gradient
            y = apply_function(_ColumnLinear, x, flat_weight(self.weight), bias, group)
        else:
            y = F.linear(x, flat_weight(self.weight), bias)
        if self.gather_output:
            y = gather_along_dim(y, -1, group)  # [.., out]
            if self.skip_bias_add and self.bias is not None:
                return y, gather_along_dim(self.bias, 0, group)
        if self.skip_bias_add:
            return y, local_bias
        return y

    def extra_repr(self) -> str:
        """The summary shown by ``print(module)``."""
        return (
            f"{self.dense_repr()}gather_output={self.gather_output}, "
            + (f"fused={self.fused}, " if self.fused > 1 else "")
            + super().extra_repr()
        )


class Linear1DRow(DenseModule, Module1D):
    """``y = x W^T + b`` with ``W`` split by input features (columns of ``[out, in]``).

    Input ``[.., in/p]`` (the output of a Linear1DCol), or ``[.., in]`` replicated with
    ``parallel_input=False`` (split here); output ``[.., out]`` replicated (``[b, s/p, out]``,
    or ``[b s/p, out]`` for flattened tokens,
    with sequence parallelism). The bias is replicated and added after the reduction.

    Args:
        in_features: Input features of the full layer; divisible by the 1D size.
        out_features: Output features.
        bias: Whether to learn a bias (replicated).
        parallel_input: Whether the input is already split along its last dim.
        skip_bias_add: Return ``(y, bias)`` without adding the bias.
        dtype: Parameter dtype.
        weight_initializer: Fills the full ``[out, in]`` weight (torch's default).
        bias_initializer: Fills the full ``[out]`` bias (torch's default).
        sequence_parallel: Reduce-scatter the output along dim 1 instead of all-reducing it.
        stream_chunk_num: Inference in this many chunks of output features (Colossal-AI's
            streamed row layer): when no gradient is recorded (``torch.no_grad()``,
            ``torch.inference_mode()``), chunk ``i``'s partial sums are all-reduced while chunk
            ``i + 1`` is multiplied, and the all-reduce buffers are ``out / k`` wide. Training
            computes the layer whole. ``out_features`` must divide by it.
        device: Parameter device (default the context's).
        context: The ParallelContext (default the current one).
    """

    SEQUENCE_SUMMED = ("bias",)  # added to this rank's tokens only under sequence parallelism

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        parallel_input: bool = True,
        skip_bias_add: bool = False,
        dtype: torch.dtype | None = None,
        weight_initializer: Initializer | None = None,
        bias_initializer: Initializer | None = None,
        *,
        sequence_parallel: bool = False,
        stream_chunk_num: int = 1,
        device: torch.device | str | None = None,
        context: ParallelContext | None = None,
    ) -> None:
        super().__init__(sequence_parallel=sequence_parallel, context=context, device=device)
        check_divisible(in_features, self.tp.world_size, "Linear1DRow in_features")
        if isinstance(stream_chunk_num, bool) or not isinstance(stream_chunk_num, int):
            raise TypeError(
                f"Linear1DRow stream_chunk_num must be an int, got {stream_chunk_num!r}"
            )
        if stream_chunk_num < 1 or out_features % stream_chunk_num != 0:
            raise ValueError(
                f"Linear1DRow({in_features}, {out_features}): stream_chunk_num "
                f"{stream_chunk_num} must be >= 1 and divide out_features ({out_features} % "
                f"{stream_chunk_num} = {out_features % max(stream_chunk_num, 1)})"
            )
        if stream_chunk_num > 1 and sequence_parallel:
            raise ValueError(
                "Linear1DRow: stream_chunk_num > 1 streams all-reduces of output chunks; under "
                "sequence_parallel the output is reduce-scattered instead: use one or the other"
            )
        self.stream_chunk_num = stream_chunk_num
        self.in_features, self.out_features = in_features, out_features
        self.parallel_input, self.skip_bias_add = parallel_input, skip_bias_add
        # Under sequence parallelism each rank adds the bias to its own slice of the sequence,
        # so the bias gradient is partial: the forward routes it through f (copy_to_group),
        # whose backward sums it, and .grad is the full gradient as the contract promises.
        self.make_dense(
            in_features,
            out_features,
            bias,
            dtype,
            weight_initializer,
            bias_initializer,
            weight_splits={1: (self.split_mode,)},
            bias_replicated=(self.split_mode,),
        )  # weight [out, in/p], bias [out]

    def chunk_weight(self) -> list[torch.Tensor]:
        """The ``stream_chunk_num`` row blocks of the weight the streamed forward multiplies.

        Views ``[out/k, in/p]`` of the weight (no copy), made afresh from the current weight,
        so a loaded or updated weight is always the one used.
        """
        return list(self.weight.chunk(self.stream_chunk_num, dim=0))

    def _streamed(self, x: torch.Tensor) -> torch.Tensor:
        """``x W^T`` summed over the group, one output chunk at a time (no autograd).

        Each chunk's all-reduce is posted before the next chunk is multiplied, so the two
        overlap; a chunk's buffer is ``[.., out/k]``.
        """
        size = self.tp.world_size
        posted = [  # [.., out/k] each, this rank's partial sums, summed in place
            start_all_reduce(F.linear(x, w), self.tp.group, size) for w in self.chunk_weight()
        ]
        return torch.cat([sums.wait() for sums in posted], dim=-1)  # [.., out]

    def forward(self, x: torch.Tensor) -> LinearOutput:
        """See the class docstring for shapes."""
        _check_row_input(
            x, self.in_features, self.tp.world_size, self.parallel_input, self.signature
        )
        group = self.tp.group
        if not self.parallel_input:
            x = split_along_dim(x, -1, group)  # [.., in/p]
        if self.stream_chunk_num > 1 and not torch.is_grad_enabled():
            streamed = self._streamed(x)
            if self.skip_bias_add:
                return streamed, self.bias
            return streamed if self.bias is None else streamed + self.bias
        if not self.sequence_parallel and self.tp.world_size > 1:  # g and the bias, fused
            added = None if self.skip_bias_add else self.bias
            fused = apply_function(_RowLinear, x, self.weight, added, group)
            return (fused, self.bias) if self.skip_bias_add else fused
        y = F.linear(x, self.weight)  # [.., out], partial sums
        if self.sequence_parallel:
            y = reduce_scatter_along_dim(y, self.token_dim(y), group)  # [b, s/p, out]
        else:
            y = reduce_from_group(y, group)  # g
        bias: torch.Tensor | None = self.bias
        if bias is not None and self.sequence_parallel:
            bias = self.summed_over_group(bias)
        if self.skip_bias_add:
            return y, bias
        return y if bias is None else y + bias

    def extra_repr(self) -> str:
        """The summary shown by ``print(module)``."""
        return (
            f"{self.dense_repr()}parallel_input={self.parallel_input}, "
            + (f"stream_chunk_num={self.stream_chunk_num}, " if self.stream_chunk_num > 1 else "")
            + super().extra_repr()
        )
