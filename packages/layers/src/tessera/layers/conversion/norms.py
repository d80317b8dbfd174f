"""Which norms ``parallelize`` can compute in a split layout, and with which sizes.

A norm over a split hidden dim has to be recomputed from partial sums (its statistics
gathered over the ranks that split the dim), so ``parallelize`` replaces it with a tessera
norm of the same kind, shape and epsilon. That is only right if the replaced module computes
exactly one of the two kinds tessera has: a LayerNorm (Ba et al. 2016) or an RMSNorm (Zhang and
Sennrich 2019), each with an optional elementwise weight (and, for LayerNorm, bias).

``nn.LayerNorm`` and ``nn.RMSNorm`` say so by their class, unless a subclass computes a forward
of its own (Nemotron's ``LayerNorm1P`` scales by ``1 + weight``). transformers defines one RMSNorm
class per model family (``LlamaRMSNorm``, ``MistralRMSNorm``, ``GraniteRMSNorm``, ...), most of
them copies of Llama's, but not all: Gemma's scales by ``1 + weight`` (its weight starts at zero;
tessera's norms take that as ``weight_offset=1``), and OLMo's LayerNorm has no parameters at
all. A class name cannot tell them apart, so any other module is
*probed*: it is called with random weights in place of its own (``torch.func.functional_call``,
so a model on the meta device can be probed) on random rows ``[2, 3, h]`` at two scales (``1``
and ``1e-3``, where the epsilon dominates the mean square), and its output and its gradients
for the rows and the weights are compared with both formulas (fp32, relative 1e-5 on the
output), each scaling by ``weight`` or by ``1 + weight``. It is accepted only if it matches
one; a norm that computes anything else is refused
with an error naming it, never approximated. The probe runs in fp32 and in the module's
current train / eval mode; a module holding submodules (a dropout), buffers, hooks or
parametrizations is not probed but refused.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call
from torch.nn.utils import parametrize

__all__ = [
    "NormSpec",
    "computes_as",
    "computes_formula",
    "computes_own_forward",
    "epsilons_of",
    "norm_spec",
    "normalized",
]

#: Attribute names under which norm classes keep their epsilon.
EPSILON_ATTRIBUTES = ("variance_epsilon", "eps", "epsilon", "layer_norm_eps")

#: The epsilons tried on a norm that keeps none in an attribute (OLMo's writes 1e-5 into its
#: forward); the probe's small rows tell them apart.
USUAL_EPSILONS = (1e-5, 1e-6, 1e-12)


@dataclass(frozen=True)
class NormSpec:
    """A norm's sizes, whatever class holds it."""

    kind: str  # "layer" or "rms"
    shape: tuple[int, ...]
    eps: float
    affine: bool
    bias: bool
    offset: float = 0.0  # added to the weight where it scales: 1 for ``1 + weight``


def _torch_norm(module: nn.Module) -> NormSpec | None:
    """The spec of a torch norm that computes as one (a subclass may not: it is probed)."""
    if isinstance(module, nn.LayerNorm) and computes_as(module, nn.LayerNorm):
        return NormSpec(
            "layer",
            tuple(module.normalized_shape),
            module.eps,
            module.elementwise_affine,
            module.bias is not None,
        )
    if isinstance(module, nn.RMSNorm) and computes_as(module, nn.RMSNorm):
        weight = module.weight
        dtype = weight.dtype if weight is not None else torch.get_default_dtype()
        eps = module.eps if module.eps is not None else torch.finfo(dtype).eps
        return NormSpec(
            "rms", tuple(module.normalized_shape), eps, module.elementwise_affine, False
        )
    return None


def epsilons_of(modules: Iterable[nn.Module]) -> list[float]:
    """The epsilon the first of ``modules`` keeping one holds, else :data:`USUAL_EPSILONS`."""
    named = [getattr(m, a, None) for m in modules for a in EPSILON_ATTRIBUTES]
    return [float(e) for e in named if isinstance(e, float)][:1] or list(USUAL_EPSILONS)


def _candidates(module: nn.Module) -> tuple[list[NormSpec], str]:
    """The specs ``module`` could have, read from its attributes; or why there are none."""
    params = dict(module.named_parameters())
    if set(params) - {"weight", "bias"} or any(True for _ in module.buffers()):
        return [], "it holds parameters or buffers other than a weight and a bias"
    weight, bias = params.get("weight"), params.get("bias")
    if weight is not None:
        shape = tuple(weight.shape)
    else:
        normalized = getattr(module, "normalized_shape", None)
        if not isinstance(normalized, tuple | list | int):
            return [], "it has neither a weight nor a normalized_shape to size it"
        shape = (normalized,) if isinstance(normalized, int) else tuple(normalized)
    if len(shape) != 1 or (bias is not None and tuple(bias.shape) != shape):
        return [], f"its weight and bias are not one vector over the hidden size ({shape})"
    epsilons = epsilons_of([module])
    affine = weight is not None
    kinds = ("layer",) if bias is not None else ("layer", "rms")
    offsets = (0.0, 1.0) if affine else (0.0,)
    return [
        NormSpec(k, shape, e, affine, bias is not None, offset)
        for offset in offsets
        for k in kinds
        for e in epsilons
    ], ""


def normalized(spec: NormSpec, x: torch.Tensor) -> torch.Tensor:
    """``x`` normalized over its last dim as ``spec``'s kind does, before weight and bias."""
    if spec.kind == "layer":
        return F.layer_norm(x, x.shape[-1:], None, None, spec.eps)
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + spec.eps)


def _formula(
    spec: NormSpec, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None
) -> torch.Tensor:
    y = normalized(spec, x)
    if weight is not None:
        y = y * (weight + spec.offset)
    return y if bias is None else y + bias


def _matches(
    module: nn.Module, spec: NormSpec, params: dict[str, torch.Tensor], rows: torch.Tensor
) -> bool:
    """Whether ``module`` with ``params`` gives ``spec``'s output and gradients on ``rows``."""

    def formula(x: torch.Tensor, values: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return _formula(spec, x, values.get("weight"), values.get("bias"))

    return computes_formula(module, formula, params, rows)


def computes_formula(
    module: nn.Module,
    formula: Callable[[torch.Tensor, Mapping[str, torch.Tensor]], torch.Tensor],
    params: dict[str, torch.Tensor],
    rows: torch.Tensor,
) -> bool:
    """Whether ``module`` with ``params`` gives ``formula``'s output and gradients on ``rows``.

    ``formula(rows, params)`` computes what the module should; both run in fp32 (relative
    1e-5 on the output, 1e-4 on the gradients of the rows and of every parameter).
    """
    inputs = (
        rows.clone().requires_grad_(),
        {k: v.clone().requires_grad_() for k, v in params.items()},
    )
    want_inputs = (
        rows.clone().requires_grad_(),
        {k: v.clone().requires_grad_() for k, v in params.items()},
    )
    got = functional_call(module, inputs[1], (inputs[0],))
    want = formula(want_inputs[0], want_inputs[1])
    if not isinstance(got, torch.Tensor) or got.shape != want.shape:
        return False
    grad_out = torch.randn(want.shape, generator=torch.Generator().manual_seed(1))
    leaves = [inputs[0], *inputs[1].values()]
    want_leaves = [want_inputs[0], *want_inputs[1].values()]
    grads = torch.autograd.grad(got, leaves, grad_out, allow_unused=True)
    want_grads = torch.autograd.grad(want, want_leaves, grad_out)
    return torch.allclose(got, want, 1e-5, 1e-5) and all(
        g is not None and torch.allclose(g, w, 1e-4, 1e-5)
        for g, w in zip(grads, want_grads, strict=True)
    )


def _probe(module: nn.Module) -> tuple[NormSpec | None, str]:
    """The spec ``module`` computes exactly (see the module docstring), or why none."""
    if not computes_own_forward(module):
        return None, "a hook, a parametrization or an instance forward changes what it computes"
    if any(True for _ in module.children()):
        return None, "it holds submodules (a dropout, say) the replacement would drop"
    specs, reason = _candidates(module)
    if not specs:
        return None, reason
    g = torch.Generator().manual_seed(0)
    # Random weights in place of the module's own (which may be on the meta device).
    params = {
        name: 1 + 0.5 * torch.randn(p.shape, generator=g) for name, p in module.named_parameters()
    }
    rows = torch.randn((2, 3, *specs[0].shape), generator=g) + 0.3  # [b, s, h]
    for spec in specs:
        try:
            if all(_matches(module, spec, params, rows * scale) for scale in (1.0, 1e-3)):
                return spec, ""
        except Exception as error:  # any failure means "not a plain norm"
            return None, f"it cannot be called on rows alone ({type(error).__name__})"
    kinds = " or ".join(
        sorted({"a LayerNorm" if s.kind == "layer" else "an RMSNorm" for s in specs})
    ) + (" (scaled by weight or 1 + weight)" if specs[0].affine else "")
    epsilons = ", ".join(sorted({f"{s.eps:g}" for s in specs}))
    return None, (
        f"on probe rows [2, 3, {specs[0].shape[0]}] its output or gradients differ from "
        f"{kinds} (eps {epsilons})"
    )


#: Forward hooks that change no number, only mark the output as needing a gradient:
#: transformers' ``enable_input_require_grads`` (gradient checkpointing with frozen embeddings:
#: reentrant checkpointing needs an input that requires grad). ``parallelize`` carries them to
#: the module it puts in the hooked one's place (:func:`carry_marking_hooks`).
_MARKING_HOOKS = ("make_inputs_require_grads",)


def _marks_only(hook: object) -> bool:
    return getattr(hook, "__name__", None) in _MARKING_HOOKS


def computes_own_forward(module: nn.Module) -> bool:
    """Whether ``module`` computes only what its class's forward says.

    A forward hook, a forward set on the instance or a parametrization of a parameter
    changes what it computes; a tessera layer put in its place would not. Hooks that only
    mark the output as needing a gradient change nothing (:data:`_MARKING_HOOKS`).
    """
    return (
        "forward" not in vars(module)
        and all(_marks_only(hook) for hook in module._forward_hooks.values())
        and not module._forward_pre_hooks
        and not parametrize.is_parametrized(module)
    )


def carry_marking_hooks(old: nn.Module, new: nn.Module) -> None:
    """Register on ``new`` the hooks of ``old`` that only mark its output (see above).

    Without them a frozen embedding's output would not require grad, and reentrant
    checkpointing of the blocks after it would compute no gradient for them.
    """
    if new is old:
        return
    for hook in old._forward_hooks.values():
        if _marks_only(hook):
            new.register_forward_hook(hook)


def what_changes_forward(module: nn.Module, base: type[nn.Module]) -> str:
    """Why ``module`` does not compute as ``base`` does, in words, for an error message."""
    if "forward" in vars(module):
        return "a forward is set on the instance"
    if any(not _marks_only(hook) for hook in module._forward_hooks.values()):
        return "a forward hook is registered on it"
    if module._forward_pre_hooks:
        return "a forward pre-hook is registered on it"
    if parametrize.is_parametrized(module):
        return "a parameter of it is parametrized"
    return f"its class overrides {base.__module__.split('.')[0]}.nn.{base.__name__}.forward"


def computes_as(module: nn.Module, base: type[nn.Module]) -> bool:
    """Whether ``module`` is a ``base`` that computes as one: its class keeps ``base.forward``.

    A subclass with a forward of its own (an embedding that scales its output, a linear layer
    that adds a scaled residual) would lose what it adds once replaced by a tessera layer, and
    so would a hook, an instance forward or a parametrization.
    """
    return (
        isinstance(module, base)
        and type(module).forward is base.forward
        and computes_own_forward(module)
    )


def norm_spec(name: str, module: nn.Module) -> NormSpec:
    """The sizes of ``module``, a norm over the hidden dim that tessera computes exactly.

    ``nn.LayerNorm`` and ``nn.RMSNorm`` by class; any other module by a probe of what it
    computes (see the module docstring).

    Raises:
        TypeError: the module is not exactly a LayerNorm or an RMSNorm.
    """
    spec = _torch_norm(module)
    if spec is not None:
        return spec
    spec, reason = _probe(module)
    if spec is not None:
        return spec
    raise TypeError(
        f"parallelize: {name!r} ({type(module).__name__}) has role 'norm', which takes a module "
        f"computing exactly a LayerNorm or an RMSNorm (weight * x / rms(x)) over the hidden "
        f"size, but {reason}; give it a plan role of its own or replace it with nn.LayerNorm / "
        "nn.RMSNorm"
    )
