"""``PerHeadNorm``: a norm of each attention head's features, with a weight of its own per head.

Cohere's ``q_norm``/``k_norm`` (``use_qk_norm``) hold one ``[heads, head_dim]`` weight;
StableLM's ``q_layernorm``/``k_layernorm`` (``qk_layernorm``) a list of ``heads`` LayerNorms over
``head_dim``. Either way head ``i`` is normalized over its own features and scaled by weight
``i`` ("QK normalization", Dehghani et al. 2023, section 3.1, with a scale per head). The
statistics of a head are its own, so no mode needs them from another rank; each rank needs the
rows of the heads it holds.

The parameters stay whole on every tensor rank, in the plain module's names (their ``ShardInfo``
says replicated over TENSOR), so a state dict needs no conversion. At each forward they are
stacked to ``[heads, head_dim]`` and routed through Megatron's f (``copy_to_group`` over
TENSOR) before this rank's rows are taken: a rank's gradient holds its heads' rows over its
block of the batch and zeros elsewhere, and the sum over TENSOR is each row's whole gradient in
every mode, since the ranks holding a head between them hold every row of the batch. That is
one all-reduce of ``heads * head_dim`` elements per norm and backward (or, deferred, per step).

Which module computes this is probed, never guessed from its class (as
:mod:`~tessera.layers.conversion.norms` does for a norm over the hidden size): its output and
gradients on random rows and weights are compared with the formula, heads on dim 1 (``[b,
heads, s, d]``, StableLM's) and on dim -2 (``[b, s, heads, d]``, Cohere's).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from tessera.context import ParallelContext, ParallelMode, set_shard_info

from ..shared.base import ParallelModule
from ..shared.context_access import GroupInfo, group_info
from ..shared.shards import shard_info
from ..shared.tensor_sum import SumsOverTensor
from .norms import NormSpec, computes_formula, computes_own_forward, epsilons_of, normalized

__all__ = [
    "PerHeadNorm",
    "PerHeadSpec",
    "holds_weights_per_head",
    "per_head_norm_spec",
    "rank_heads",
]

#: The dims a per-head norm's input may keep its heads on: ``[b, heads, s, d]`` or
#: ``[b, s, heads, d]``.
HEAD_AXES = (1, -2)


@dataclass(frozen=True)
class PerHeadSpec:
    """What a norm with a weight per head computes, and where its parameters are.

    Attributes:
        norm: The kind, ``(head_dim,)``, epsilon, affine, bias and weight offset.
        heads: Heads (rows of the stacked weight).
        head_axis: The input's dim holding the heads (1 or -2).
        weights: Parameter names in head order: one ``[heads, head_dim]`` or ``heads`` of
            ``[head_dim]``; empty without a weight.
        biases: The same for the bias.
    """

    norm: NormSpec
    heads: int
    head_axis: int
    weights: tuple[str, ...]
    biases: tuple[str, ...]


def holds_weights_per_head(module: nn.Module) -> bool:
    """Whether ``module`` may hold a weight per head: submodules, or a parameter of 2 dims."""
    return any(True for _ in module.children()) or any(
        p.dim() >= 2 for p in module.parameters(recurse=False)
    )


def stacked(params: Mapping[str, torch.Tensor], names: tuple[str, ...], dim: int) -> torch.Tensor:
    """The parameters ``names`` as one ``[heads, dim]`` tensor, in head order."""
    if len(names) == 1:
        return params[names[0]].reshape(-1, dim)
    return torch.stack([params[n] for n in names])


def per_head_formula(
    spec: PerHeadSpec, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None
) -> torch.Tensor:
    """``x`` (heads on ``spec.head_axis``) normalized per head, scaled by its row of ``weight``.

    ``weight`` and ``bias`` are ``[heads in x, head_dim]``. Computed in fp32 and cast back, as
    Cohere's norm computes.
    """
    axis = spec.head_axis % x.dim()
    shape = (-1, *[1] * (x.dim() - axis - 2), x.shape[-1])  # [heads, 1.., d] against x
    y = normalized(spec.norm, x.float())
    if weight is not None:
        y = y * (weight.float() + spec.norm.offset).view(shape)
    if bias is not None:
        y = y + bias.float().view(shape)
    return y.to(x.dtype)


def _parameter_names(module: nn.Module, kind: str, dim: int) -> tuple[tuple[str, ...], int] | str:
    """The names of ``module``'s ``kind`` parameters in head order and the heads, or why not."""
    found = [(n, p) for n, p in module.named_parameters() if n.rsplit(".", 1)[-1] == kind]
    if not found:
        return (), 0
    names = tuple(n for n, _ in found)
    if len(found) == 1 and found[0][1].dim() == 2 and found[0][1].shape[-1] == dim:
        return names, found[0][1].shape[0]
    if all(tuple(p.shape) == (dim,) for _, p in found):
        return names, len(found)
    shapes = sorted({tuple(p.shape) for _, p in found})
    return f"its {kind}s {shapes} are neither one [heads, {dim}] nor one [{dim}] per head"


def per_head_norm_spec(name: str, module: nn.Module, dim: int) -> PerHeadSpec:
    """What ``module``, a norm with a weight per head of ``dim`` features, computes.

    Raises:
        TypeError: it holds other parameters, buffers or hooks, or its output or gradients
            differ from a LayerNorm's or an RMSNorm's of each head with its own weight.
    """
    reason = _refusal(module, dim)
    if not reason:
        weights = _parameter_names(module, "weight", dim)
        biases = _parameter_names(module, "bias", dim)
        if isinstance(weights, str) or isinstance(biases, str):
            reason = weights if isinstance(weights, str) else str(biases)
        elif biases[1] not in (0, weights[1]) or weights[1] == 0:
            reason = "it holds no weight per head, or biases for another number of heads"
        else:
            found = _probe(module, dim, weights, biases)
            if isinstance(found, PerHeadSpec):
                return found
            reason = found
    raise TypeError(
        f"parallelize: {name!r} ({type(module).__name__}) has role 'head_norm' with a weight "
        f"per head, which takes a module normalizing each head's {dim} features as a LayerNorm "
        f"or an RMSNorm scaled by that head's weight, but {reason}; give it a plan role of its "
        "own"
    )


def _refusal(module: nn.Module, dim: int) -> str:
    """Why ``module`` cannot be probed as a per-head norm ("" if it can).

    Its submodules may only hold its parameters (a norm per head) or list them: the
    replacement computes the formula and runs none of them, so a dropout there, which a probe
    in eval mode would not see, is refused.
    """
    if not all(computes_own_forward(m) for m in module.modules()):
        return "a hook, a parametrization or an instance forward changes what it computes"
    if any(True for _ in module.buffers()):
        return "it holds buffers"
    idle = [
        type(m).__name__
        for m in module.modules()
        if not isinstance(m, nn.ModuleList | nn.ModuleDict)
        and not any(True for _ in m.parameters(recurse=False))
        and m is not module
    ]
    if idle:
        return f"it holds submodules without parameters ({', '.join(sorted(set(idle)))})"
    others = {n for n, _ in module.named_parameters()} - {
        n for n, _ in module.named_parameters() if n.rsplit(".", 1)[-1] in ("weight", "bias")
    }
    return f"it holds parameters {sorted(others)} besides weights and biases" if others else ""


def _probe(
    module: nn.Module,
    dim: int,
    weights: tuple[tuple[str, ...], int],
    biases: tuple[tuple[str, ...], int],
) -> PerHeadSpec | str:
    """The spec ``module`` computes exactly (see the module docstring), or why none."""
    (weight_names, heads), (bias_names, _) = weights, biases
    epsilons = epsilons_of(module.modules())
    kinds = ("layer",) if bias_names else ("layer", "rms")
    g = torch.Generator().manual_seed(0)
    params = {n: 1 + 0.5 * torch.randn(p.shape, generator=g) for n, p in module.named_parameters()}
    seq = heads + 1  # a size of its own, so the heads' dim is not mistaken for the sequence's
    # With one head both axes may pass (a [1, d] weight scales wherever the head is); a list
    # of norms splitting dim 1 passes on dim 1 only.
    for axis in HEAD_AXES:
        rows = torch.randn((2, heads, seq, dim) if axis == 1 else (2, seq, heads, dim), generator=g)
        for offset in (0.0, 1.0):
            for kind in kinds:
                for eps in epsilons:
                    norm = NormSpec(kind, (dim,), eps, True, bool(bias_names), offset)
                    spec = PerHeadSpec(norm, heads, axis, weight_names, bias_names)
                    if _computes(module, spec, params, rows + 0.3):
                        return spec
    return (
        f"on probe rows of {heads} heads of {dim} (on dim 1 or -2) its output or gradients differ "
        f"from a LayerNorm's or an RMSNorm's of each head scaled by its weight (eps "
        f"{', '.join(f'{e:g}' for e in epsilons)})"
    )


def _computes(
    module: nn.Module, spec: PerHeadSpec, params: dict[str, torch.Tensor], rows: torch.Tensor
) -> bool:
    """Whether ``module`` computes ``spec`` on ``rows`` and on ``rows`` scaled to ``1e-3``."""

    def formula(x: torch.Tensor, values: Mapping[str, torch.Tensor]) -> torch.Tensor:
        weight = stacked(values, spec.weights, x.shape[-1])
        bias = stacked(values, spec.biases, x.shape[-1]) if spec.biases else None
        return per_head_formula(spec, x, weight, bias)

    try:
        return all(computes_formula(module, formula, params, rows * s) for s in (1.0, 1e-3))
    except Exception:  # any failure (a shape the module rejects) means "not this spec"
        return False


class PerHeadNorm(SumsOverTensor, ParallelModule):
    """A norm of each head with its own weight, for this rank's heads (see the module docstring).

    Parameters: the plain module's, under its names, whole and equal on every tensor rank.

    Args:
        plain: The plain module (its parameters and submodules become this module's).
        spec: What it computes (:func:`per_head_norm_spec`).
        first: The first of this rank's heads.
        count: This rank's heads.
        context: The ParallelContext (default the current one).
    """

    def __init__(
        self,
        plain: nn.Module,
        spec: PerHeadSpec,
        first: int,
        count: int,
        *,
        context: ParallelContext | None = None,
    ) -> None:
        weight = next(plain.parameters())
        super().__init__(context, None if weight.is_meta else weight.device)
        for child_name, child in plain.named_children():
            self.add_module(child_name, child)
        for param_name, param in plain.named_parameters(recurse=False):
            self.register_parameter(param_name, param)
        self.spec, self.first, self.count = spec, first, count
        self.train(plain.training)
        self.tensor: GroupInfo = group_info(self.context, ParallelMode.TENSOR)
        if weight.is_meta:  # a scale of 1 and a shift of 0, as every norm starts
            self.to_empty(device=self.device)
            with torch.no_grad():
                for names, value in ((spec.weights, 1.0 - spec.norm.offset), (spec.biases, 0.0)):
                    for n in names:
                        self.get_parameter(n).fill_(value)
        for param in self.parameters():
            set_shard_info(param, shard_info(self.context, param.shape, replicated=(self.mode,)))

    @property
    def mode(self) -> str:
        """The mode whose ranks hold the same parameters and sum their gradients: TENSOR."""
        return self.tensor.mode

    def tensor_summed_parameters(self) -> list[nn.Parameter]:
        """Every parameter: the plain module's, each whole on every tensor rank."""
        return list(self.parameters())

    def _rows(self, names: tuple[str, ...]) -> torch.Tensor | None:
        """This rank's rows ``[count, head_dim]`` of the parameters ``names``, gradient summed."""
        if not names:
            return None
        params = dict(self.named_parameters())
        whole = stacked(params, names, self.spec.norm.shape[0])  # [heads, head_dim]
        return self.summed_over_tensor(whole)[self.first : self.first + self.count]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[b, heads, s, d]`` or ``[b, s, heads, d]`` (this rank's heads) -> the same shape."""
        heads = x.shape[self.spec.head_axis]
        if heads != self.count and self.spec.heads > 1:
            raise ValueError(
                f"PerHeadNorm: the input {list(x.shape)} holds {heads} heads on dim "
                f"{self.spec.head_axis}, but this rank normalizes {self.count} (heads "
                f"{self.first}..{self.first + self.count - 1} of {self.spec.heads})"
            )
        return per_head_formula(
            self.spec, x, self._rows(self.spec.weights), self._rows(self.spec.biases)
        )

    def extra_repr(self) -> str:
        """The summary shown by ``print(module)``."""
        norm = self.spec.norm
        kind = "LayerNorm" if norm.kind == "layer" else "RMSNorm"
        return (
            f"{kind} of heads {self.first}..{self.first + self.count - 1} of {self.spec.heads} "
            f"(dim {self.spec.head_axis}), {norm.shape[0]} features each, eps={norm.eps}, "
            f"summed over {self.tensor.world_size} tensor ranks"
        )


def rank_heads(heads: int, share: int, block: int) -> tuple[int, int]:
    """``(first, count)``: the heads of ``heads`` that block ``block`` of ``share`` ranks holds.

    ``heads`` fewer than ``share`` are repeated (key/value heads): ``share / heads`` ranks hold
    one each, the one their query heads attend with.
    """
    if heads >= share:
        count = heads // share
        return block * count, count
    return block // (share // heads), 1
