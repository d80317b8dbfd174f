"""``parallelize(..., verify=inputs)``: the converted model against the model it was, once.

tessera converts what a plan names and checks what it can see: parameters left out, modules
that mix what a mode splits, ties across a part. Code it cannot see (a function in the
model's own forward that normalizes over the features, a custom kernel) could still read this
rank's block as the whole tensor, and the model would train differently from one process
without an error. ``verify`` makes that an error for the model at hand: before converting,
``parallelize`` keeps a copy of the whole model; after, it runs both on the same inputs, in
eval mode (dropout's masks are drawn differently by design), and compares

* every floating output: the parallel model's whole ones as they are, its split logits
  gathered (``gather_logits``);
* every parameter's gradient of one scalar, the outputs weighted by fixed random numbers (the
  same on every rank): the whole model's against the parallel one's gathered to the original
  names and forms (``gather_full_state_dict``). Each rank's scalar counts its own block of
  split logits and ``1/N`` of a whole output under modes whose ranks split the sequence, so
  the gradients summed as the sequence gradient handler sums them are the whole scalar's.

The first output or gradient off by more than the tolerance is a ``ValueError`` naming it.
The copy costs one whole model per rank while ``parallelize`` runs: a check for the first
launch on small inputs, not for every job.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_flatten

from tessera.context import ParallelContext, ParallelMode, cut_placements, tensor_mesh_of

from ..shared.mode_layers import find_mode_layers

__all__ = ["Inputs", "check_verify_inputs", "verify_conversion", "whole_copy"]

#: ``model(*inputs)`` for a sequence, ``model(**inputs)`` for a mapping.
Inputs = Sequence[Any] | Mapping[str, Any]
#: Outputs and gradients off by more than ``atol + rtol * |expected|`` fail.
RTOL, ATOL = 1e-4, 1e-5


def whole_copy(model: nn.Module) -> nn.Module:
    """The model before conversion, to verify against.

    Raises:
        ValueError: it holds meta tensors (nothing to run).
    """
    if any(t.is_meta for t in [*model.parameters(), *model.buffers()]):
        raise ValueError(
            "parallelize(verify=...): the model is on the meta device, so there is no whole "
            "model to compare with; verify a model built with its weights"
        )
    return copy.deepcopy(model)


def _call(model: nn.Module, inputs: Inputs) -> Any:
    if isinstance(inputs, Mapping):
        return model(**inputs)
    return model(*inputs)


def check_verify_inputs(inputs: Inputs, context: ParallelContext) -> None:
    """Raise on every tensor rank, before the forward, where the ranks hold other inputs.

    Both models must see the whole batch, the same on every rank (as a transformers model
    takes it): a rank fed its own batch would be compared with another model's outputs.
    """
    leaves, _ = tree_flatten(inputs if isinstance(inputs, Mapping) else list(inputs))
    sums = [float(t.double().sum()) for t in leaves if isinstance(t, torch.Tensor)]
    everyone: list[Any] = [None] * context.get_world_size(ParallelMode.TENSOR)
    dist.all_gather_object(everyone, sums, group=context.get_cpu_group(ParallelMode.TENSOR))
    if any(theirs != everyone[0] for theirs in everyone):
        raise ValueError(
            "parallelize(verify=...): the tensor ranks were given different inputs; pass the "
            "whole batch, the same on every rank"
        )


def verify_conversion(
    whole: nn.Module, parallel: nn.Module, inputs: Inputs, context: ParallelContext
) -> None:
    """Compare ``parallel`` with ``whole`` on ``inputs`` (see the module doc).

    Raises:
        ValueError: an output or a gradient differs, naming it and by how much.
    """
    from ..state.state_dict import gather_full_state_dict
    from .boundary import gather_logits

    modes = (whole.training, parallel.training)
    whole.eval()
    parallel.eval()
    try:
        want, got = _call(whole, inputs), _call(parallel, inputs)
        expected, _ = tree_flatten(want)
        found, _ = tree_flatten(got)
        if len(expected) != len(found):
            raise ValueError(
                f"parallelize(verify=...): the parallel model returns {len(found)} values where "
                f"the whole one returns {len(expected)}"
            )
        kind = context.config.mode
        share = 1.0
        if kind is not None and kind.splits_sequence:
            share = 1.0 / context.get_world_size(ParallelMode.SEQUENCE)
        seed = torch.Generator().manual_seed(0)
        scalar: torch.Tensor | None = None
        reference: torch.Tensor | None = None
        for i, (w, g) in enumerate(zip(expected, found, strict=True)):
            if not (isinstance(w, torch.Tensor) and w.is_floating_point()):
                continue
            weight = torch.randn(w.shape, generator=seed).to(w)  # alike on every rank
            if g.shape == w.shape:
                _compare(f"output {i}", g.detach(), w.detach())
                part = (g * weight).sum() * share
            else:
                _compare(f"output {i} (gathered)", gather_logits(g, context=context), w.detach())
                part = (g * _local_block(weight, context)).sum()
            reference = (w * weight).sum() if reference is None else reference + (w * weight).sum()
            scalar = part if scalar is None else scalar + part
        if scalar is None or reference is None or not scalar.requires_grad:
            return
        torch.autograd.backward(reference)
        torch.autograd.backward(scalar)
        grads = _gathered_grads(parallel, context, gather_full_state_dict)
        for name, param in whole.named_parameters():
            if param.grad is not None and name in grads:
                _compare(f"the gradient of {name}", grads[name], param.grad)
    finally:
        whole.train(modes[0])
        parallel.train(modes[1])
        parallel.zero_grad(set_to_none=True)


def _local_block(whole: torch.Tensor, context: ParallelContext) -> torch.Tensor:
    """This rank's block of ``whole`` laid out as the mode's logits."""
    from torch.distributed.tensor import distribute_tensor

    layers = find_mode_layers(str(context.config.tensor_mode))
    cuts = None if layers is None else layers.logits_cuts
    if cuts is None:
        raise ValueError(
            f"parallelize(verify=...): tensor mode {context.config.tensor_mode!r} states no "
            "layout of its logits (ModeLayers.logits_cuts)"
        )
    placements = cut_placements(cuts(context, whole.dim()), whole.dim(), context)
    mesh = tensor_mesh_of(context)
    return distribute_tensor(whole, mesh, placements, src_data_rank=None).to_local()


def _gathered_grads(parallel: nn.Module, context: ParallelContext, gather: Any) -> Any:
    """Every gradient in the original names and forms (summed over the sequence ranks)."""
    kind = context.config.mode
    params = dict(parallel.named_parameters())
    saved = {n: p.detach().clone() for n, p in params.items()}
    with torch.no_grad():
        for p in params.values():
            grad = torch.zeros_like(p) if p.grad is None else p.grad
            if kind is not None and kind.splits_sequence:
                grad = grad.clone()
                dist.all_reduce(grad, group=context.get_group(ParallelMode.SEQUENCE))
            p.copy_(grad)
    try:
        return gather(parallel, context=context)
    finally:
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(saved[n])


def _compare(what: str, got: torch.Tensor, want: torch.Tensor) -> None:
    if got.shape != want.shape:
        raise ValueError(
            f"parallelize(verify=...): {what} is {list(got.shape)} where one process's is "
            f"{list(want.shape)}"
        )
    gap = (got.float() - want.float()).abs()
    bound = ATOL + RTOL * want.float().abs()
    if bool((gap > bound).any()):
        raise ValueError(
            f"parallelize(verify=...): {what} differs from one process's by up to "
            f"{float(gap.max()):.3g} (tolerance {ATOL:g} + {RTOL:g} x |value|): the parallel "
            "model computes something else. Code the plan does not cover reads a split tensor "
            "as the whole one (a function in the model's forward over the features, the "
            "vocabulary or the sequence): give that code's module a role, move it into a "
            "module of its own (run under DTensor when it holds no parameters), or use tensor "
            "mode '1d'"
        )
