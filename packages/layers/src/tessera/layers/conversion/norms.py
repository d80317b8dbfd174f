"""Which norms ``parallelize`` can compute in a split layout, and with which sizes.

A norm over a split hidden dim has to be recomputed from partial sums (its statistics
gathered over the ranks that split the dim), so ``parallelize`` replaces it with a tessera
norm of the same kind, shape and epsilon. That is only right if the replaced module computes
exactly one of the two kinds tessera has: a LayerNorm (Ba et al. 2016) or an RMSNorm (Zhang and
Sennrich 2019), each with an optional elementwise weight (and, for LayerNorm, bias).

``nn.LayerNorm`` and ``nn.RMSNorm`` say so by their class, unless a subclass computes a forward
of its own (Nemotron's ``LayerNorm1P`` scales by ``1 + weight``). transformers defines one RMSNorm
class per model family (``LlamaRMSNorm``, ``MistralRMSNorm``, ``GraniteRMSNorm``, ...), most of
them copies of Llama's, but not all: Gemma's scales by ``1 + weight``, and OLMo's LayerNorm
has no parameters at all. A class name cannot tell them apart, so any other module is
*probed*: a copy of it, with random weights, is run on random rows at two scales (``1`` and
``1e-3``, where the epsilon dominates the mean square) and compared with both formulas. It is
accepted only if it matches one to float32 rounding; a norm that computes anything else is
refused by name, never approximated.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["NormSpec", "norm_spec"]

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


def _torch_norm(module: nn.Module) -> NormSpec | None:
    """The spec of a torch norm that computes as one (a subclass may not: it is probed)."""
    if type(module).forward is nn.LayerNorm.forward and isinstance(module, nn.LayerNorm):
        return NormSpec(
            "layer",
            tuple(module.normalized_shape),
            module.eps,
            module.elementwise_affine,
            module.bias is not None,
        )
    if type(module).forward is nn.RMSNorm.forward and isinstance(module, nn.RMSNorm):
        weight = module.weight
        dtype = weight.dtype if weight is not None else torch.get_default_dtype()
        eps = module.eps if module.eps is not None else torch.finfo(dtype).eps
        return NormSpec(
            "rms", tuple(module.normalized_shape), eps, module.elementwise_affine, False
        )
    return None


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
    named = [getattr(module, a, None) for a in EPSILON_ATTRIBUTES]
    epsilons = [float(e) for e in named if isinstance(e, float)][:1] or list(USUAL_EPSILONS)
    affine = weight is not None
    kinds = ("layer",) if bias is not None else ("layer", "rms")
    return [NormSpec(k, shape, e, affine, bias is not None) for k in kinds for e in epsilons], ""


def _formula(
    spec: NormSpec, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None
) -> torch.Tensor:
    if spec.kind == "layer":
        return F.layer_norm(x, spec.shape, weight, bias, spec.eps)
    y = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + spec.eps)
    return y if weight is None else y * weight


def _probe(module: nn.Module) -> tuple[NormSpec | None, str]:
    """The spec ``module`` computes exactly (see the module docstring), or why none."""
    specs, reason = _candidates(module)
    if not specs:
        return None, reason
    probe = copy.deepcopy(module).to_empty(device="cpu").float()  # meta weights have no values
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in probe.parameters():
            p.copy_(1 + 0.5 * torch.randn(p.shape, generator=g))
        params = dict(probe.named_parameters())
        weight, bias = params.get("weight"), params.get("bias")
        rows = torch.randn((4, *specs[0].shape), generator=g) + 0.3
        try:
            outputs = [(scale, probe(rows * scale)) for scale in (1.0, 1e-3)]
        except Exception as error:  # any failure means "not a plain norm"
            return None, f"it cannot be called on rows alone ({type(error).__name__})"
        for spec in specs:
            if all(
                isinstance(out, torch.Tensor)
                and out.shape == rows.shape
                and torch.allclose(out, _formula(spec, rows * scale, weight, bias), 1e-5, 1e-5)
                for scale, out in outputs
            ):
                return spec, ""
    kinds = " or ".join(
        sorted({"a LayerNorm" if s.kind == "layer" else "an RMSNorm" for s in specs})
    )
    epsilons = ", ".join(sorted({f"{s.eps:g}" for s in specs}))
    return None, f"on probe rows it computes something other than {kinds} (eps {epsilons})"


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
