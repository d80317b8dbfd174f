"""Weight gradients of linear layers computed straight into ``.grad``, or kept for W.

Why. A pipeline stage runs one backward per microbatch, and autograd adds each microbatch's
weight gradient to ``.grad`` as a separate step: the matmul writes a fresh ``[out, in]`` tensor,
then AccumulateGrad reads it and ``.grad`` and writes ``.grad`` again. Microbatches are small
(a few rows), so that matmul streams the same ``out * in`` floats the addition does, and the
addition plus the fresh buffer cost about as much as the matmuls themselves: on one CPU core, 8
microbatches of 4 rows through ``Linear(1024, 1024)`` take 27 ms forward and backward with
autograd's accumulation and 13 ms with the weight gradient written into ``.grad`` by one
``addmm_`` (beta = 1). That is Megatron-LM's *gradient accumulation fusion* (Narayanan et al.
2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", which
fuses the weight-gradient GEMM with the accumulation into the main gradient).

Batching across microbatches. The ``addmm_`` still reads and writes all of ``.grad`` once per
microbatch. Unless the schedule asks for the weight gradient at a given time (zero bubble's W),
nobody reads ``.grad`` before the step ends, so :class:`WeightGradBatcher` keeps each layer's
``(x, g)`` rows and adds them with one ``addmm_`` over the concatenated rows when they would
exceed a quarter of the weight's own bytes, and at the end of the step. Few rows per
microbatch (where the pass over ``.grad`` dominates) batch many microbatches; large
microbatches flush at once, as before. The same 8 microbatches: 6.5 ms instead of 8.9 ms for
forward, input gradient and weight gradient together.

The same place holds zero bubble's *weight-gradient store* (Qi et al. 2023, "Zero Bubble
Pipeline Parallelism", section 2 and their implementation): in B a fused layer computes only the
input gradient and keeps ``(x, g)``; W does the ``addmm_`` later.

How. While the executor runs a training forward, :class:`FuseLinearWeightGrad` (a
``TorchFunctionMode``) replaces each eligible ``torch.nn.functional.linear`` call (what
``nn.Linear`` calls) by :class:`_FusedLinear`, an autograd function whose backward returns the
input gradient and hands the weight gradient to the microbatch's :class:`WeightGradStore`. The
store's mode decides what happens to it: added to ``.grad`` now (an unsplit backward), kept for
W (zero bubble's B), or dropped (a B whose W recomputes the whole backward).

Eligible: grad mode on, no autocast, plain tensors (no tensor subclass such as DTensor), a leaf
real floating-point weight that requires grad and has no hooks (nor the bias, which must be
``[out]``: a broadcast bias is reduced by autograd's own backward), matching dtypes, and no
saved-tensor hooks but the executor's own (non-reentrant activation checkpointing recomputes the
forward in backward, outside this mode, and would see different saved tensors). Anything else runs
``F.linear`` unchanged. Stages holding a ``DistributedDataParallel`` or FSDP module (the stage
itself or any submodule) are never fused: both rely on autograd's accumulation hooks
(:func:`stage_allows_fusion`). Hooks put straight on a parameter's accumulation node
(``p.view_as(p).grad_fn.next_functions[0][0].register_hook``) cannot be seen from Python: with
such hooks, turn fusion off (``PipelineRunner(schedule, fuse_weight_grad=False)``).

A backward that runs while the forward is still going (a gradient penalty or an inner step that
calls ``torch.autograd.grad`` inside the stage) is not the executor's: there the store is in
mode AUTOGRAD and the weight gradient is returned to autograd like ``F.linear``'s own, so it is
neither added to ``.grad`` nor lost when that call asks for it. A layer no gradient reaches
(its output gradient is undefined, not zero) leaves ``.grad`` untouched, as autograd does.

Numerics: ``.grad + g^T x`` in one kernel instead of two; the same sum, rounded once less.
"""

from __future__ import annotations

import enum
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

__all__ = [
    "FuseLinearWeightGrad",
    "StoreMode",
    "WeightGradBatcher",
    "WeightGradStore",
    "is_fused_linear_node",
    "stage_allows_fusion",
]


class StoreMode(enum.Enum):
    """What a fused layer's backward does with its weight gradient."""

    ACCUMULATE = "accumulate"  # add it to .grad now
    DEFER = "defer"  # keep (x, g) for W
    SKIP = "skip"  # drop it: a later full backward computes it
    AUTOGRAD = "autograd"  # return it to autograd (a backward inside the forward)


#: Rows of (x, g) a layer may keep in a :class:`WeightGradBatcher`, in bytes, as a fraction of
#: the weight's bytes.
BATCH_BUDGET = 0.25


class WeightGradBatcher:
    """Weight-gradient rows of several microbatches, added to ``.grad`` in one ``addmm_``.

    One per step of the executor; :meth:`flush` must run before the step returns.

    Args:
        budget: a layer's kept rows may use at most this fraction of its weight's bytes.
    """

    def __init__(self, budget: float = BATCH_BUDGET) -> None:
        self.budget = budget
        # id(weight) -> (weight, bias, xs [n, in], gs [n, out]); and the bytes those rows use
        self._rows: dict[
            int, tuple[torch.Tensor, torch.Tensor | None, list[torch.Tensor], list[torch.Tensor]]
        ] = {}
        self._bytes: dict[int, int] = {}

    def add(
        self, weight: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor, g: torch.Tensor
    ) -> None:
        """Keep one layer call's rows (x: [n, in], g: [n, out]); add them when over budget."""
        key = id(weight)
        entry = self._rows.get(key)
        if entry is None or entry[1] is not bias:
            if entry is not None:
                self._flush_one(key)
            entry = self._rows.setdefault(key, (weight, bias, [], []))
        x, g = _compact(x), _compact(g)
        entry[2].append(x)
        entry[3].append(g)
        kept = self._bytes.get(key, 0) + x.nbytes + g.nbytes
        self._bytes[key] = kept
        if kept > self.budget * weight.nbytes:
            self._flush_one(key)

    def flush(self) -> None:
        """Add every kept row to ``.grad`` (the end of a step)."""
        for key in list(self._rows):
            self._flush_one(key)

    def _flush_one(self, key: int) -> None:
        weight, bias, xs, gs = self._rows.pop(key)
        self._bytes.pop(key, None)
        x = xs[0] if len(xs) == 1 else torch.cat(xs)  # [sum n, in]
        g = gs[0] if len(gs) == 1 else torch.cat(gs)  # [sum n, out]
        _accumulate(weight, bias, x, g)


def _compact(rows: torch.Tensor) -> torch.Tensor:
    """``rows`` itself, or a copy when it views a larger storage (kept, that would stay alive)."""
    return rows if rows.untyped_storage().nbytes() <= rows.nbytes else rows.clone()


class WeightGradStore:
    """The fused linear layers of one (microbatch, chunk) and their pending weight gradients.

    Args:
        batcher: where ACCUMULATE sends the weight gradients (None: straight to ``.grad``).

    Attributes:
        mode: what the next backward through these layers does with the weight gradients.
        fused: how many ``F.linear`` calls of the forward were fused.
    """

    def __init__(self, batcher: WeightGradBatcher | None = None) -> None:
        self.mode = StoreMode.ACCUMULATE
        self.batcher = batcher
        self.fused = 0
        # (weight, bias, x [n, in], g [n, out]) per deferred layer call
        self._pending: list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]]
        self._pending = []

    def take(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        inputs: torch.Tensor,
        grad_output: torch.Tensor,
    ) -> None:
        """Handle one layer call's weight gradient according to :attr:`mode`."""
        if self.mode is StoreMode.ACCUMULATE:
            if self.batcher is not None:
                self.batcher.add(weight, bias, inputs, grad_output)
            else:
                _accumulate(weight, bias, inputs, grad_output)
        elif self.mode is StoreMode.DEFER:
            self._pending.append((weight, bias, inputs, grad_output))

    def flush(self) -> None:
        """W: add every deferred weight gradient to ``.grad`` and drop what it kept."""
        pending, self._pending = self._pending, []
        for weight, bias, inputs, grad_output in pending:
            _accumulate(weight, bias, inputs, grad_output)


def _accumulate(
    weight: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor, g: torch.Tensor
) -> None:
    """``weight.grad += g^T x`` and ``bias.grad += sum(g)`` without a temporary weight gradient."""
    # x: [n, in], g: [n, out]
    with torch.no_grad():
        if weight.grad is None:
            weight.grad = g.t().mm(x)  # [out, in], a fresh contiguous tensor
        else:
            weight.grad.addmm_(g.t(), x)
        if bias is not None:
            summed = g.sum(dim=0)  # [out]
            if bias.grad is None:
                bias.grad = summed
            else:
                bias.grad.add_(summed)


class _FusedLinear(torch.autograd.Function):
    """``F.linear`` whose weight gradient goes to a :class:`WeightGradStore`, not autograd."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        store: WeightGradStore,
    ) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.bias = bias
        ctx.store = store
        # An output no gradient reaches comes as None, not zeros: .grad stays as autograd leaves it.
        ctx.set_materialize_grads(False)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(
        ctx: Any, grad_output: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, None]:
        if grad_output is None:
            return None, None, None, None
        x, weight = ctx.saved_tensors  # x: [..., in], weight: [out, in]
        grad_input = grad_output.matmul(weight) if ctx.needs_input_grad[0] else None
        x_rows = x.reshape(-1, x.shape[-1])  # [n, in]
        g_rows = grad_output.reshape(-1, grad_output.shape[-1])  # [n, out]
        if ctx.store.mode is StoreMode.AUTOGRAD:
            grad_bias = g_rows.sum(dim=0) if ctx.bias is not None else None  # [out]
            return grad_input, g_rows.t().mm(x_rows), grad_bias, None
        ctx.store.take(weight, ctx.bias, x_rows, g_rows)
        return grad_input, None, None, None


def is_fused_linear_node(node: Any) -> bool:
    """Whether an autograd node is a fused linear layer (its weight edges carry no gradient)."""
    return isinstance(node, _FusedLinear._backward_cls)


def _plain_leaf(tensor: Any) -> bool:
    return (
        type(tensor) in (nn.Parameter, torch.Tensor)
        and tensor.is_leaf
        and tensor.requires_grad
        and not tensor._backward_hooks
        and getattr(tensor, "_post_accumulate_grad_hooks", None) is None
    )


def _top_saved_tensor_pack() -> Any:
    top = torch._C._autograd._top_saved_tensors_default_hooks(False)
    return None if top is None else top[0]


class FuseLinearWeightGrad(TorchFunctionMode):
    """While active, eligible ``F.linear`` calls hand their weight gradient to ``store``.

    Args:
        store: the (microbatch, chunk)'s store.
        allowed_pack: the pack function of the executor's own saved-tensor hooks (memory
            tracking), which do not change what is saved; any other saved-tensor hooks turn
            fusion off.
    """

    def __init__(self, store: WeightGradStore, allowed_pack: Any = None) -> None:
        super().__init__()
        self.store = store
        self.allowed_pack = allowed_pack
        self._modes: list[StoreMode] = []

    def __enter__(self) -> FuseLinearWeightGrad:
        # While the forward runs, a backward through its layers is the stage's own (an inner
        # torch.autograd.grad): plain autograd semantics. The mode in force before comes back
        # on exit, for the executor's backward.
        self._modes.append(self.store.mode)
        self.store.mode = StoreMode.AUTOGRAD
        super().__enter__()  # type: ignore[no-untyped-call]
        return self

    def __exit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> None:
        super().__exit__(exc_type, exc_val, exc_tb)  # type: ignore[no-untyped-call]
        self.store.mode = self._modes.pop()

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func is F.linear:
            fused = self._fused(*args, **kwargs)
            if fused is not None:
                return fused
        return func(*args, **kwargs)

    def _fused(
        self, input: Any, weight: Any, bias: Any = None, **unexpected: Any
    ) -> torch.Tensor | None:
        if unexpected or not torch.is_grad_enabled():
            return None
        if type(input) not in (torch.Tensor, nn.Parameter) or not _plain_leaf(weight):
            return None
        if bias is not None and not _plain_leaf(bias):
            return None
        if weight.dim() != 2 or input.dtype != weight.dtype or not weight.is_floating_point():
            return None  # complex weights: the gradients are conjugated, leave them to autograd
        if bias is not None and (bias.dtype != weight.dtype or bias.shape != weight.shape[:1]):
            return None  # a broadcast bias: autograd reduces its gradient to its shape
        if torch.is_autocast_enabled(input.device.type):
            return None
        pack = _top_saved_tensor_pack()
        if pack is not None and pack is not self.allowed_pack:
            return None
        self.store.fused += 1
        out: torch.Tensor = _FusedLinear.apply(input, weight, bias, self.store)  # type: ignore[no-untyped-call]
        return out


def stage_allows_fusion(stage: nn.Module) -> bool:
    """Whether a stage may fuse: not compiled, and holding no DDP or FSDP module (at any depth).

    DDP reduces gradients from hooks on autograd's accumulation and FSDP reads ``.grad`` in its
    post-backward; a weight gradient written outside autograd (or deferred to W, or batched to
    the end of the step) bypasses both. A DDP-wrapped submodule counts as much as a wrapped
    stage: its reducer's hooks sit on the parameters' accumulation nodes, where
    :func:`_plain_leaf` cannot see them.
    """
    ddp = nn.parallel.DistributedDataParallel
    if any(isinstance(m, ddp) for m in stage.modules()):
        return False
    # A compiled module would trace the mode; leave compiled code to autograd's own path.
    if any(
        type(m).__name__ == "OptimizedModule" or getattr(m, "_compiled_call_impl", None)
        for m in stage.modules()
    ):
        return False
    import torch.distributed.fsdp as fsdp

    wrappers = tuple(
        cls
        for cls in (
            getattr(fsdp, "FSDPModule", None),
            getattr(fsdp, "FullyShardedDataParallel", None),
        )
        if isinstance(cls, type)
    )
    return not any(isinstance(m, wrappers) for m in stage.modules())
