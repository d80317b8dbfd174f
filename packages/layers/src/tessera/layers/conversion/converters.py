"""Swap one plain module for the current mode's layer of its role, with the module's weights.

Each converter builds the tessera layer without drawing weights (a no-op initializer), then
loads its shard from the plain module's ``state_dict`` through :func:`load_full_state_dict`,
so the shard is cut from the existing values, never re-initialized. Where the plain module
holds a parameter in another form than tessera's (transformers' ``Conv1D`` stores
``[in, out]``; a fused q/k/v projection is kept as ``[3, out/3, in]``), the parameter gets a
:class:`~tessera.context.FullForm`, so full state dicts still speak the original
form.

Modes: ``"1d"`` (Megatron-LM, Shoeybi et al. 2019, with sequence parallelism by Korthikanti et
al. 2022) and the 2D/2.5D mesh (Xu et al. 2021; Wang et al. 2021).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TypedDict

import torch
import torch.nn.functional as F
from torch import nn

from tessera.context import FullForm, ParallelContext, set_full_form

from ..cube.embedding import Embedding3D
from ..shared.head_norm import HeadLayerNorm, HeadRMSNorm
from ..shared.initializers import Initializer
from ..shared.mode_layers import find_mode_layers
from ..shared.norm_over_group import ParallelNorm
from ..state.sections import SectionOrder
from ..state.state_dict import load_full_state_dict
from .alibi import AlibiHeads, takes_alibi
from .embedding_scale import ScaledRows, embedding_scale
from .experts import Experts1D, TokenRouter, expert_sizes
from .head_bias import HeadColumns
from .head_share import HEAD_COUNTS, HeadShareConfig
from .norms import (
    NormSpec,
    computes_as,
    computes_formula,
    computes_own_forward,
    norm_spec,
    what_changes_forward,
)
from .own_positions import OwnPositionIds, reads_own_ids
from .patch import PatchEmbeddingAdapter, TimmEmbeddingAdapter, patch_sizes, timm_patch_sizes
from .per_head_norm import PerHeadNorm, holds_weights_per_head, per_head_norm_spec, rank_heads
from .position_table import table_width
from .repeated_heads import HeadRepeats, RepeatedHeads

__all__ = ["Converter", "LinearShape", "linear_shape"]

#: Attributes of an attention module that count its query heads: transformers' names, and
#: the ones people write their own attention with (nanoGPT's ``n_head``, ``nn.Transformer``'s
#: ``nhead``).
QUERY_COUNTS = ("num_heads", "num_attention_heads", "n_head", "n_heads", "nhead", "heads")
#: Attributes of an attention module that count heads or their total width.
HEAD_ATTRIBUTES = (
    *QUERY_COUNTS,
    "num_key_value_heads",
    "num_kv_heads",
    "kv_heads",
    "split_size",
    "embed_dim",
    "all_head_size",
    "attn_dim",
)


#: ``NormSpec.kind`` -> the key of the mode's class (``ModeLayers.classes``).
NORM_CLASSES = {"layer": "LayerNorm", "rms": "RMSNorm"}


class _Made(TypedDict):
    dtype: torch.dtype
    weight_initializer: Initializer | None
    bias_initializer: Initializer | None
    device: torch.device
    context: ParallelContext


#: The count of key/value heads (an attribute of the module or of its config).
KEY_VALUE_COUNT = "num_key_value_heads"
#: Its names: transformers' usual one, Falcon's and GPTBigCode's.
KEY_VALUE_COUNTS = (KEY_VALUE_COUNT, "num_kv_heads", "kv_heads")
#: Query heads per key/value head, which transformers' attention modules keep.
KEY_VALUE_GROUPS = "num_key_value_groups"
#: Head counts of a transformers config (an attention module sees its share of them).
CONFIG_HEAD_ATTRIBUTES = HEAD_COUNTS
#: Roles of a linear layer whose outputs are split (a column layer), and how many equal parts
#: each splits on its own: q, k and v side by side (GPT-2's ``c_attn``), an MLP's gate and up
#: projections side by side (Phi-3's and GLM's ``gate_up_proj``).
COLUMN_PARTS = {"col": 1, "qkv": 3, "gate_up": 2}


@dataclass(frozen=True)
class Heads:
    """An attention module's head counts before ``parallelize`` divides them."""

    query: int
    key_value: int
    dim: int | None

    def repeated_over(self, share: int) -> bool:
        """Whether the key/value heads are fewer than ``share`` ranks (each then repeated).

        ``False`` where the counts are unknown (0: a module that holds only widths).
        """
        return 0 < self.key_value < share


def _first_count(*values: object) -> int | None:
    """The first of ``values`` that is a count (an ``int``, not a ``bool``), else ``None``."""
    for value in values:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def _is_count(value: object) -> bool:
    return _first_count(value) is not None


def _heads_of(module: nn.Module, found: dict[str, int], config: object) -> Heads:
    """The whole head counts of an attention module (its own attributes, else its config)."""
    query = _first_count(
        *(found.get(name) for name in QUERY_COUNTS),
        getattr(config, "num_attention_heads", None),
    )
    key_value = _first_count(
        *(found.get(name) for name in KEY_VALUE_COUNTS),
        *(getattr(config, name, None) for name in KEY_VALUE_COUNTS),
        query,
    )
    dim = _first_count(getattr(module, "head_dim", None), getattr(config, "head_dim", None))
    return Heads(query or 0, key_value or 0, dim)


def _no_init(tensor: torch.Tensor, fan_in: int, fan_out: int) -> None:
    """Leave the tensor as allocated: the converter loads the plain module's values next."""


@dataclass(frozen=True)
class LinearShape:
    """A linear layer's sizes, whatever class holds it.

    Attributes:
        in_features: Inputs.
        out_features: Outputs.
        bias: Whether it has a bias.
        transposed: The weight is stored ``[in, out]`` (transformers' ``Conv1D``).
    """

    in_features: int
    out_features: int
    bias: bool
    transposed: bool


def is_conv1d(module: nn.Module) -> bool:
    """Transformers' ``Conv1D`` (recognized by shape, so transformers need not be installed)."""
    return (
        type(module).__name__ == "Conv1D"
        and hasattr(module, "nf")
        and isinstance(getattr(module, "weight", None), torch.Tensor)
    )


def _overrides(name: str, module: nn.Module, base: type[nn.Module], role: str) -> TypeError:
    return TypeError(
        f"parallelize: {name!r} ({type(module).__name__}) has role {role!r}, but "
        f"{what_changes_forward(module, base)}, so what it computes is not what tessera's "
        "layer of that role would compute; leave it out of the plan or give it a plain module"
    )


def linear_shape(name: str, module: nn.Module, role: str) -> LinearShape:
    """The sizes of ``module``, an ``nn.Linear`` or a ``Conv1D``.

    Raises:
        TypeError: the module is neither, or overrides ``nn.Linear.forward``.
    """
    if isinstance(module, nn.Linear) and not (
        computes_as(module, nn.Linear) or computes_linear(module)
    ):
        raise _overrides(name, module, nn.Linear, role)
    if isinstance(module, nn.Linear):
        return LinearShape(module.in_features, module.out_features, module.bias is not None, False)
    if is_conv1d(module) and not computes_own_forward(module):
        raise _overrides(name, module, nn.Linear, role)
    if is_conv1d(module):
        in_features, out_features = _tensor(module, "weight").shape
        return LinearShape(in_features, out_features, module.bias is not None, True)
    raise TypeError(
        f"parallelize: {name!r} ({type(module).__name__}) has role {role!r}, which takes an "
        "nn.Linear or a transformers Conv1D"
    )


def computes_linear(module: nn.Linear) -> bool:
    """Whether a subclass of ``nn.Linear`` with a forward of its own computes ``x W^T + b``.

    Falcon's ``FalconLinear`` writes the product out (``x @ W.T + b``): the same layer, which
    tessera's layers can replace. Any other computation (a scaled residual, a dropout of the
    weight) would be lost. Its class is probed once (per class and bias), the way norms are
    (:func:`~tessera.layers.conversion.norms.computes_formula`): on small random weights in
    fp64, whatever the layer's size, with 2-D and 3-D rows at three scales, in train and eval
    mode, output and gradients against ``F.linear``'s.

    Returns:
        ``False`` also for a module holding submodules, buffers, hooks or other parameters.
    """
    if (
        not computes_own_forward(module)
        or any(True for _ in module.children())
        or any(True for _ in module.buffers())
        or {n for n, _ in module.named_parameters()} - {"weight", "bias"}
    ):
        return False
    return _probe_linear_class(type(module), module.bias is not None, module)


_LINEAR_CLASSES: dict[tuple[type[nn.Module], bool], bool] = {}


def _probe_linear_class(cls: type[nn.Module], bias: bool, module: nn.Linear) -> bool:
    """The probe of :func:`computes_linear` for ``cls``, remembered."""
    if (cls, bias) in _LINEAR_CLASSES:
        return _LINEAR_CLASSES[(cls, bias)]
    g = torch.Generator().manual_seed(0)
    params = {"weight": torch.randn(5, 7, generator=g, dtype=torch.float64)}  # [out, in]
    if bias:
        params["bias"] = torch.randn(5, generator=g, dtype=torch.float64)
    shapes = ((4, 7), (2, 3, 7))

    def linear(x: torch.Tensor, values: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return F.linear(x, values["weight"], values.get("bias"))

    training = module.training
    try:
        found = all(
            computes_formula(module.train(mode), linear, params, rows * scale)
            for mode in (True, False)
            for rows in (torch.randn(shape, generator=g, dtype=torch.float64) for shape in shapes)
            for scale in (1.0, 1e-3, 1e3)
        )
    except Exception:  # any failure means "not a plain linear layer"
        found = False
    finally:
        module.train(training)
    _LINEAR_CLASSES[(cls, bias)] = found
    return found


def _tensor(module: nn.Module, name: str) -> torch.Tensor:
    value = getattr(module, name)
    assert isinstance(value, torch.Tensor), f"{type(module).__name__}.{name} is not a tensor"
    return value


def _adopt(new: nn.Module, old: nn.Module, forms: dict[str, FullForm]) -> nn.Module:
    """Give ``new`` the values of ``old`` (through ``forms``) and its training state.

    A plain module on the meta device has no values: ``new`` keeps its initializer's.
    """
    for pname, form in forms.items():
        set_full_form(getattr(new, pname), form)
    if not any(p.is_meta for p in old.parameters()):
        load_full_state_dict(new, old.state_dict())
    frozen = {n for n, p in old.named_parameters() if not p.requires_grad}
    for pname, p in new.named_parameters():
        p.requires_grad_(pname not in frozen)
    new.train(old.training)
    return new


def _offset(new: ParallelNorm, spec: NormSpec, weight: torch.Tensor) -> ParallelNorm:
    """``new`` scaling by ``offset + weight``, as the module it replaces (Gemma's ``1 + w``).

    Built from a module on the meta device (no values to load), its weight starts where the
    module's own initialization starts it, at ``1 - offset`` (a scale of 1), not at 1.
    """
    new.weight_offset = spec.offset
    if spec.offset and weight.is_meta and new.weight is not None:
        with torch.no_grad():
            new.weight.fill_(1.0 - spec.offset)
    return new


class Converter:
    """Builds the mode's layer for each role (see :mod:`tessera.layers.conversion.plan`).

    Args:
        context: The ParallelContext.
        mode: ``"1d"``, ``"2d"`` or ``"2.5d"``.
        sequence_parallel: 1D only: layers take and return sequence-split activations.
        inner_norms: The norms between a column layer and its row layer (they take the
            column layer's output).
        attention: The attention modules. Under sequence parallelism their input is gathered
            whole by the boundary (the module reshapes by its input's length), so the column
            layers inside them take whole sequences.
        sequence_span: Under 1D sequence parallelism, the modules whose activations are split
            along the sequence (see :func:`~tessera.layers.conversion.plan.span_members`).
        roles: Every converted module's role, by name (tells a fused q/k/v projection from a
            layer beside separate ones).
        model: The model the modules are in (timm's patch embedding reads its parent's class
            token and positions).
    """

    def __init__(
        self,
        context: ParallelContext,
        mode: str,
        sequence_parallel: bool,
        inner_norms: set[str] | None = None,
        attention: tuple[str, ...] = (),
        sequence_span: set[str] | None = None,
        roles: Mapping[str, str] | None = None,
        model: nn.Module | None = None,
    ) -> None:
        self.context, self.mode, self.sequence_parallel = context, mode, sequence_parallel
        self.model = model
        layers = find_mode_layers(mode)
        kind = context.config.mode
        if layers is None or layers.roles is None or kind is None:
            raise ValueError(f"parallelize: tensor mode {mode!r} has no layers to convert to")
        #: The mode's layer classes and role builders (its folder's ``mode.py``).
        self.layers, self.builders, self.kind = layers, layers.roles, kind
        self.roles: Mapping[str, str] = roles or {}
        self.sequence_span = sequence_span or set()
        self.inner_norms = inner_norms or set()
        self.attention_modules = attention
        #: ``id(plain parameter) -> tessera parameter``, for heads tied to an embedding.
        self.replaced: dict[int, nn.Parameter] = {}
        #: Attention module name -> its whole head counts (read before they are divided).
        self.heads: dict[str, Heads] = {}

    @property
    def share(self) -> int:
        """How many ranks split a hidden dim (and so the heads): p in 1D, q on the mesh."""
        return self.context.config.tensor_dim

    @property
    def feature_split(self) -> int:
        """How many ranks split again the features of one rank's heads (3D's cube: q)."""
        config = self.context.config
        return self.kind.hidden_blocks(config.tensor_size, config.tensor_args) // self.share

    def convert(self, name: str, module: nn.Module, role: str) -> nn.Module:
        """The module to put in place of ``module`` (``module`` itself if it stays)."""
        if role in COLUMN_PARTS or role == "row":
            return self.linear(name, module, role)
        if role == "dense":
            return self.dense(name, module)
        if role == "attention":
            return self.attention(name, module)
        if role in ("embedding", "position_embedding"):
            return self.embedding(name, module, role)
        if role == "position_table":
            return self.position_table(name, module)
        if role == "norm":
            # a norm the model's config left out (timm's fc_norm or norm, by pooling) is exact
            # on any block
            return module if type(module) is nn.Identity else self.norm(name, module)
        if role == "head_norm":
            return self.head_norm(name, module)
        if role == "head_bias":
            return self.head_bias(name, module)
        if role == "patch_embedding":
            return self.patch_embedding(name, module)
        if role in ("experts", "router"):
            return self.mixture_of_experts(name, module, role)
        return self.head(name, module)

    def _device(self, weight: torch.Tensor) -> torch.device:
        """Where the converted module lives: the plain one's device, or the context's for meta."""
        return self.context.device if weight.is_meta else weight.device

    def _made_like(self, weight: torch.Tensor) -> _Made:
        """Keywords every converted linear layer and head is built with.

        The shard is drawn by the layer's own initializer only for a plain module on the meta
        device (there are no values to cut it from).
        """
        init = None if weight.is_meta else _no_init
        return _Made(
            dtype=weight.dtype,
            weight_initializer=init,
            bias_initializer=init,
            device=self._device(weight),
            context=self.context,
        )

    def linear(self, name: str, module: nn.Module, role: str) -> nn.Module:
        """``col`` / ``qkv`` / ``gate_up`` / ``row``: the mode's linear layer.

        Under 3D a ``col`` layer takes layout ``"y"`` (between blocks) and returns ``"z"``; a
        ``row`` layer takes ``"z"`` back to ``"y"`` (Bian et al. 2021). A ``qkv`` layer of
        grouped-query attention (fewer key/value heads than query heads: parts of unequal
        sizes) is held interleaved by group and its output put back in q, k, v order
        (:class:`~tessera.layers.state.sections.SectionOrder`). A column layer of attention
        making key/value heads fewer than the ranks splitting heads repeats them
        (:meth:`repeated_heads`).

        Raises:
            ValueError: a column layer of attention with repeated key/value heads makes
                features that are not heads of its attention (:meth:`_head_repeats`).
        """
        shape = linear_shape(name, module, role)
        owner = self._attention_around(name)
        if owner is not None and role in ("col", "qkv"):
            repeats = self._head_repeats(name, owner, role, shape.out_features)
            if repeats is not None:
                return self.repeated_heads(name, module, shape, repeats)
        fused = COLUMN_PARTS.get(role, 1)
        sections = self._qkv_sections(name, shape) if role == "qkv" else ()
        if sections:
            fused = 1
        weight = _tensor(module, "weight")
        dims = (shape.in_features, shape.out_features, shape.bias)
        new = self._mode_linear(name, role, dims, fused, self._made_like(weight))
        if sections:
            new.register_forward_hook(SectionOrder(sections))
        return _adopt(new, module, self._forms(shape, weight, fused, sections))

    def _forms(
        self, shape: LinearShape, weight: torch.Tensor, fused: int, sections: tuple[int, ...]
    ) -> dict[str, FullForm]:
        """The original forms of a linear layer's weight and bias, where tessera's differ."""
        forms: dict[str, FullForm] = {}
        if shape.transposed or fused > 1 or sections:
            forms["weight"] = FullForm(tuple(weight.shape), shape.transposed, sections)
        if shape.bias and (fused > 1 or sections):
            forms["bias"] = FullForm((shape.out_features,), sections=sections)
        return forms

    def _mode_linear(
        self, name: str, role: str, dims: tuple[int, int, bool], fused: int, made: _Made
    ) -> nn.Module:
        """The mode's linear layer of ``role`` for the plain layer ``name``."""
        in_span = self.sequence_parallel and name in self.sequence_span
        row = role == "row"
        in_attention = any(name.startswith(f"{a}.") for a in self.attention_modules)
        # a column layer inside attention takes the whole sequence (the boundary gathered it)
        split = in_span if row else in_span and not in_attention
        return self.builders.linear(dims, row=row, fused=fused, sequence_parallel=split, **made)

    def _repeats(self, owner: str, width: int) -> bool:
        """Whether ``width`` features are all key (or value) heads of ``owner``, repeated.

        They are repeated where ``owner`` has fewer key/value heads than the ranks splitting
        heads; ``width`` tells a key or value projection (or a norm over its output) from a
        query one.
        """
        heads = self.heads[owner]
        return (
            heads.repeated_over(self.share)
            and heads.dim is not None
            and width == heads.key_value * heads.dim
        )

    def _head_repeats(self, name: str, owner: str, role: str, width: int) -> HeadRepeats | None:
        """The repeats a column layer of attention computes (``None``: none, split it).

        With key/value heads fewer than the ranks splitting heads, a ``col`` layer of
        ``kv * head_dim`` features is a key or value projection; one of all heads' features
        fuses q, k and v, by group for ``col`` (Falcon's and GPTBigCode's rows, which a plain
        split would otherwise keep whole) or in turn for ``qkv`` (Phi-3's).

        Raises:
            ValueError: ``width`` is none of those (a split of its rows would cut through the
                key and value heads every rank needs whole, without an error), or a ``col``
                layer is as wide as all heads fused beside other column layers of ``owner``
                (then it is no fused q/k/v, whatever its width).
        """
        heads, share = self.heads[owner], self.share
        if not heads.repeated_over(share) or heads.dim is None:
            return None
        query, kv, dim = heads.query, heads.key_value, heads.dim
        if role == "col" and width == kv * dim:
            return HeadRepeats(kv, dim, share)
        if role == "col" and width == query * dim:
            return None  # the query heads: split like any column layer
        if width == (query + 2 * kv) * dim:
            beside = self._column_layers_beside(name, owner)
            if role == "qkv" or not beside:
                return HeadRepeats(kv, dim, share, query, by_group=role == "col")
            raise ValueError(
                f"parallelize: {name!r} of {owner!r} (role 'col') makes {width} features, as "
                f"many as all its heads fused ({query} + 2 * {kv} heads of {dim}), but "
                f"{owner!r} also has the column layers {beside}, so it is not q, k and v "
                f"fused. Its {kv} key/value heads are repeated over the {share} ranks that "
                f"split heads under tensor mode {self.mode!r}, and a split of its rows may cut "
                "through what each rank needs (a query with a gate per head?); give it a role "
                f"of its own, or use at most {kv} ranks to split heads"
            )
        raise ValueError(
            f"parallelize: {name!r} of {owner!r} (role {role!r}) makes {width} features, "
            f"none of its {query} query heads' ({query * dim}), its {kv} key/value heads' "
            f"({kv * dim}) or all of them fused ({query} + 2 * {kv} heads = "
            f"{(query + 2 * kv) * dim}), {dim} features each. Its {kv} key/value heads are "
            f"repeated over the {share} ranks that split heads under tensor mode {self.mode!r}, "
            "so every rank needs whole key and value heads, which a split of these rows would "
            f"cut (at most {kv} ranks splitting heads split them instead)"
        )

    def repeated_heads(
        self, name: str, module: nn.Module, shape: LinearShape, repeats: HeadRepeats
    ) -> nn.Module:
        """A column layer of attention whose key/value heads are repeated over the ranks.

        Each rank computes its segment (its query heads if fused, then the one key/value
        head they attend with) by the mode's column layer of ``share`` segments, from the
        whole weight (see
        :class:`~tessera.layers.conversion.repeated_heads.RepeatedHeads`). A fused q/k/v in
        turn (role ``qkv``) is held in tessera's form of its parts, as when it is split.
        """
        weight = _tensor(module, "weight")
        made = self._made_like(weight)
        dim, share = repeats.head_dim, self.share
        segment = repeats.segment
        if segment % self.feature_split != 0:  # the cube splits a segment's rows again
            raise ValueError(
                f"parallelize: {name!r} holds {repeats.key_value} key/value heads of {dim} "
                f"features, repeated over the {share} ranks that split heads under tensor "
                f"mode '3d', where each rank's {segment} features of them (its heads: "
                f"{repeats.describe()}) are split again over {share} ranks of the cube "
                f"({segment} % {share} = {segment % share})"
            )
        in_turn = repeats.query and not repeats.by_group
        sections = (repeats.query * dim, *(2 * (repeats.key_value * dim,))) if in_turn else ()
        layer_dims = (shape.in_features, share * repeats.segment, True)
        blocks: _Made = {**made, "weight_initializer": _no_init, "bias_initializer": _no_init}
        layer = self._mode_linear(name, "col", layer_dims, 1, blocks)
        new = RepeatedHeads(
            layer,
            repeats,
            shape.bias,
            weight.dtype,
            made["weight_initializer"],  # no draw unless on meta (no values to load)
            made["bias_initializer"],
            sections=sections,
            device=made["device"],
            context=self.context,
        )
        return _adopt(new, module, self._forms(shape, weight, 1, sections))

    def _column_layers_beside(self, name: str, owner: str) -> list[str]:
        """The other column layers (``col``, ``qkv``) of attention ``owner``, by name."""
        return sorted(
            other
            for other, role in self.roles.items()
            if role in ("col", "qkv") and other != name and self._attention_around(other) == owner
        )

    def _attention_around(self, name: str) -> str | None:
        """The innermost converted attention module holding ``name``, if any."""
        return max((a for a in self.heads if name.startswith(f"{a}.")), key=len, default=None)

    def _qkv_sections(self, name: str, shape: LinearShape) -> tuple[int, ...]:
        """The sizes of q, k and v in a fused projection of grouped-query attention.

        ``()`` where they are equal thirds (the fused layer's own ``[3, out/3, in]`` form
        holds them) or the layer is in no attention module of the plan.

        Raises:
            ValueError: the attention's head counts do not add up to the layer's outputs.
        """
        owner = self._attention_around(name)
        if owner is None:
            return ()
        heads = self.heads[owner]
        if heads.query == 0 or heads.key_value == heads.query:
            return ()
        per_head = shape.out_features // (heads.query + 2 * heads.key_value)
        dim = heads.dim if heads.dim is not None else per_head
        sections = (heads.query * dim, heads.key_value * dim, heads.key_value * dim)
        if sum(sections) != shape.out_features:
            raise ValueError(
                f"parallelize: {name!r} has role 'qkv', but its {shape.out_features} outputs "
                f"are not q, k and v of {owner!r}'s {heads.query} query and {heads.key_value} "
                f"key/value heads of {dim} ({heads.query} * {dim} + 2 * {heads.key_value} * "
                f"{dim} = {sum(sections)})"
            )
        return sections

    def dense(self, name: str, module: nn.Module) -> nn.Module:
        """``dense``: a linear layer that keeps the layout between blocks.

        Under 3D the product switches to layout ``"z"`` and the output is swapped back to
        ``"y"`` with the mirror rank (``Linear3D(output_layout="y")``).
        """
        shape = linear_shape(name, module, "dense")
        weight = _tensor(module, "weight")
        dims = (shape.in_features, shape.out_features, shape.bias)
        new = self.builders.dense(dims, **self._made_like(weight))
        if new is None:
            return module  # replicated activations in, replicated out
        return _adopt(new, module, self._forms(shape, weight, 1, ()))

    def attention(self, name: str, module: nn.Module) -> nn.Module:
        """``attention``: head counts and widths become this rank's share (in place).

        Counts the module holds (``num_heads``, ``split_size``, ...) are divided. Its
        transformers config is shared by every layer and the model, so the module gets a view
        of it holding its share of the config's counts (:class:`~.head_share.HeadShareConfig`).

        Key/value heads fewer than the ranks (a divisor of their number) are repeated: each
        rank keeps one, the one its query heads attend with (see :meth:`repeated_heads`).

        Raises:
            ValueError: a count is not divisible by the number of ranks splitting the heads (a
                key/value count: nor divides it), or heads to repeat have no known size.
        """
        from .multihead import HeadsAttention

        if isinstance(module, HeadsAttention):  # torch's nn.MultiheadAttention, written out
            return self.heads_attention(name, module)
        share = self.share
        found = {
            a: getattr(module, a) for a in HEAD_ATTRIBUTES if _is_count(getattr(module, a, None))
        }
        config = getattr(module, "config", None)
        from_config = {
            f"config.{a}": getattr(config, a)
            for a in CONFIG_HEAD_ATTRIBUTES
            if _is_count(getattr(config, a, None))
        }
        if not found and not from_config:
            raise TypeError(
                f"parallelize: attention module {name!r} ({type(module).__name__}) has none of "
                f"the head attributes {', '.join(HEAD_ATTRIBUTES)} and no config with "
                f"{', '.join(CONFIG_HEAD_ATTRIBUTES)}: its heads cannot be checked"
            )
        for attr, value in {**found, **from_config}.items():
            key_value = attr.endswith(KEY_VALUE_COUNTS)
            if value % share == 0 or (key_value and share % value == 0):
                continue  # key/value heads fewer than the ranks are repeated, one per rank
            also = " (nor, for key/value heads, a divisor of it)" if key_value else ""
            raise ValueError(
                f"parallelize: {name}.{attr} = {value} is not divisible by the {share} "
                f"ranks that split the heads under tensor mode {self.mode!r}{also} "
                f"({value} % {share} = {value % share}); each rank needs whole heads"
            )
        heads = self.heads[name] = _heads_of(module, found, config)
        if heads.repeated_over(share) and heads.dim is None:
            raise ValueError(
                f"parallelize: attention module {name!r} has {heads.key_value} key/value heads "
                f"for {share} ranks, so each is repeated on {share // heads.key_value} ranks, "
                "but neither the module nor its config says how many features a head has "
                "(head_dim), so its key and value projections cannot be told from its query one"
            )
        if getattr(getattr(module, "config", None), "alibi", False) is True:
            raise ValueError(
                f"parallelize: attention module {name!r} ({type(module).__name__}) has a config "
                "with alibi=True; this family folds the ALiBi bias of every head into its "
                "attention mask, which parallelize does not cut to this rank's heads"
            )
        if takes_alibi(module):  # the model builds the bias for every head
            first, count = rank_heads(heads.query, share, self._head_block())
            module.register_forward_pre_hook(
                AlibiHeads(heads.query, first, count), with_kwargs=True
            )
        for attr, value in found.items():
            setattr(module, attr, max(value // share, 1))
        if heads.repeated_over(share) and _is_count(getattr(module, KEY_VALUE_GROUPS, None)):
            setattr(module, KEY_VALUE_GROUPS, heads.query // share)  # this rank's queries, one kv
        if from_config:  # a view: this rank's head counts, everything else the model's
            setattr(module, "config", HeadShareConfig(config, share))  # noqa: B010
        return module

    def heads_attention(self, name: str, module: nn.Module) -> nn.Module:
        """``attention`` of torch's ``nn.MultiheadAttention``: its heads split (in place).

        Its fused ``in_proj_weight [3E, E]`` becomes the mode's ``qkv`` column layer (q, k and
        v each split by heads) and ``out_proj`` the mode's ``row`` layer, under the original
        names (see :class:`~tessera.layers.conversion.multihead.HeadsAttention`).

        Raises:
            ValueError: the heads do not divide by the ranks splitting them.
        """
        from .multihead import HeadsAttention

        assert isinstance(module, HeadsAttention)
        share, heads = self.share, module.num_heads
        if heads % share != 0:
            raise ValueError(
                f"parallelize: {name}.num_heads = {heads} is not divisible by the {share} "
                f"ranks that split the heads under tensor mode {self.mode!r} ({heads} % "
                f"{share} = {heads % share}); each rank needs whole heads"
            )
        self.heads[name] = Heads(heads, heads, module.head_dim)
        weight = _tensor(module, "in_proj_weight")
        bias = module.in_proj_bias
        fused = nn.Linear(
            module.embed_dim, 3 * module.embed_dim, bias=bias is not None, device="meta"
        )
        fused.weight = weight
        if bias is not None:
            fused.bias = bias
        in_proj = self.linear(f"{name}.in_proj", fused, "qkv")
        out_name = f"{name}.out_proj"
        out_proj = self.linear(out_name, module.get_submodule("out_proj"), "row")
        in_span = self.sequence_parallel and out_name in self.sequence_span
        module.split(in_proj, out_proj, self.context, self.mode, in_span, self._head_block(), share)
        return module

    def embedding(self, name: str, module: nn.Module, role: str) -> nn.Module:
        """``embedding`` / ``position_embedding``: the mode's embedding table."""
        if not isinstance(module, nn.Embedding):
            raise TypeError(
                f"parallelize: {name!r} ({type(module).__name__}) has role {role!r}, which "
                "takes an nn.Embedding"
            )
        scale = embedding_scale(module) if role == "embedding" else None
        # learned positions read at ids its own forward counts (BART's): the mode's table reads
        # them there (own_positions.py)
        own_ids = (
            role == "position_embedding"
            and not computes_as(module, nn.Embedding)
            and reads_own_ids(module)
        )
        if scale is None and not own_ids and not computes_as(module, nn.Embedding):
            raise _overrides(name, module, nn.Embedding, role)
        if module.max_norm is not None or module.sparse:
            raise ValueError(
                f"parallelize: {name!r} uses max_norm or sparse gradients, which tessera's "
                "embeddings do not support"
            )
        if self.kind.replicated_activations and role == "position_embedding":
            return module  # small; replicated like the activations it adds to
        new = self.layers.classes["TokenEmbedding"](
            module.num_embeddings,
            module.embedding_dim,
            module.padding_idx,
            module.weight.dtype,
            None if module.weight.is_meta else _no_init,
            device=self._device(module.weight),
            context=self.context,
        )
        _adopt(new, module, {})
        tied = self.replaced.get(id(module.weight))
        if tied is not None:  # one table under several names (T5's and BART's shared one)
            new.weight = tied
        if own_ids:
            new.register_forward_pre_hook(  # first: the table's own checks read the ids
                OwnPositionIds(module, self._device(module.weight)), with_kwargs=True, prepend=True
            )
        if scale is not None and scale != 1.0:  # Gemma's rows times sqrt(hidden)
            new.register_forward_hook(ScaledRows(scale))
        if role == "position_embedding":  # one row of positions serves every batch block
            setattr(new, "check_split_batch", False)  # noqa: B010  (a GridModule's flag)
            if isinstance(new, Embedding3D):  # per-sample ones come in layout "z"'s rows
                new.reads_positions = True
        assert isinstance(new.weight, nn.Parameter)
        self.replaced[id(module.weight)] = new.weight
        return new

    def position_table(self, name: str, module: nn.Module) -> nn.Module:
        """``position_table``: the module itself, whole.

        1D only (see :mod:`~tessera.layers.conversion.position_table`).

        Raises:
            TypeError: it holds no table (an ``nn.Embedding``, or a float buffer of 2+ dims).
        """
        if table_width(module) is None:
            raise TypeError(
                f"parallelize: {name!r} ({type(module).__name__}) has role 'position_table', "
                "which takes an nn.Embedding or a module holding its table as a floating-point "
                "buffer [positions, hidden]"
            )
        return module

    def norm(self, name: str, module: nn.Module) -> nn.Module:
        """``norm``: a LayerNorm or RMSNorm over the hidden dim in the mode's layout.

        Inside an attention module it normalizes a projection's output over all its heads'
        features (OLMo-2's ``q_norm``), split like the heads: statistics over the ranks.

        Raises:
            ValueError: inside an attention module it normalizes one head's features (as a
                plain norm of this rank's heads it would get only their share of its gradient).
        """
        spec = norm_spec(name, module)
        owner = self._attention_around(name)
        if owner is not None and spec.shape == (self.heads[owner].dim,):
            raise ValueError(
                f"parallelize: {name!r} has role 'norm' inside the attention module {owner!r}, "
                f"but it normalizes one head's {spec.shape[0]} features; a norm of each head "
                "(q_norm, k_norm) takes role 'head_norm'"
            )
        if owner is not None and self._repeats(owner, spec.shape[-1]):
            raise ValueError(
                f"parallelize: {name!r} normalizes all key heads' features of {owner!r}, whose "
                f"{self.heads[owner].key_value} key/value heads are repeated over the "
                f"{self.share} ranks that split heads under tensor mode {self.mode!r}: no rank "
                "holds a share of those features to normalize; use a tensor size that divides "
                "the key/value heads"
            )
        inner = name in self.inner_norms
        in_span = self.sequence_parallel and name in self.sequence_span
        weight = _tensor(module, "weight") if spec.affine else torch.empty(0)
        args = (spec.shape, spec.eps, spec.affine, spec.bias, weight.dtype)
        cls = self.layers.classes[NORM_CLASSES[spec.kind]]
        where = {"device": self._device(weight), "context": self.context}
        new = self.builders.norm(cls, args, inner=inner, sequence_parallel=in_span, **where)
        if new is None:
            return module  # replicated activations: the plain norm is already right
        assert isinstance(new, ParallelNorm)
        return _adopt(_offset(new, spec, weight), module, {})

    def head_norm(self, name: str, module: nn.Module) -> nn.Module:
        """``head_norm``: a norm of each head's features, its weight summed over the ranks.

        The plan put it inside an ``attention`` module (``match_plan`` checks), converted
        before it (modules come in ``named_modules`` order), so that module's head size is known.

        Raises:
            ValueError: the norm normalizes another size than one head's features (a norm
                over all heads' features, OLMo-2's ``q_norm``, would need statistics from every
                rank holding some of them).
            TypeError: the module does not compute exactly a LayerNorm or an RMSNorm.
        """
        if type(module) is nn.Identity:  # a norm a model's config turned off (timm's qk_norm)
            return module
        owner = self._attention_around(name)
        assert owner is not None, f"{name}: match_plan lets no head_norm outside attention"
        dim = self.heads[owner].dim
        if dim is None:
            raise ValueError(
                f"parallelize: {name!r} has role 'head_norm', but neither the attention module "
                f"{owner!r} nor its config says how many features a head has (head_dim)"
            )
        if holds_weights_per_head(module):
            return self.per_head_norm(name, module, owner, dim)
        spec = norm_spec(name, module)
        if spec.shape != (dim,):
            raise ValueError(
                f"parallelize: {name!r} has role 'head_norm', which normalizes one head's "
                f"features ({owner!r}'s heads have {dim}), but it normalizes {spec.shape[0]}; "
                "a norm over several heads' features needs statistics from every rank holding "
                "some of them, which this role does not gather"
            )
        weight = _tensor(module, "weight") if spec.affine else torch.empty(0)
        cls = HeadRMSNorm if spec.kind == "rms" else HeadLayerNorm
        new = cls(
            spec.shape,
            spec.eps,
            spec.affine,
            spec.bias,
            weight.dtype,
            device=self._device(weight),
            context=self.context,
        )
        return _adopt(_offset(new, spec, weight), module, {})

    def per_head_norm(self, name: str, module: nn.Module, owner: str, dim: int) -> nn.Module:
        """``head_norm`` with a weight per head: this rank's heads, each with its own weight.

        See :class:`~tessera.layers.conversion.per_head_norm.PerHeadNorm`.

        Raises:
            ValueError: it holds weights for neither the query nor the key/value heads.
            TypeError: it does not compute a LayerNorm or an RMSNorm of each head.
        """
        spec = per_head_norm_spec(name, module, dim)
        heads = self.heads[owner]
        if spec.heads not in (heads.query, heads.key_value):
            raise ValueError(
                f"parallelize: {name!r} holds a weight for each of {spec.heads} heads, but "
                f"{owner!r} has {heads.query} query and {heads.key_value} key/value heads"
            )
        first, count = rank_heads(spec.heads, self.share, self._head_block())
        return PerHeadNorm(module, spec, first, count, context=self.context)

    def head_bias(self, name: str, module: nn.Module) -> nn.Module:
        """``head_bias``: a table with a column per head, read at this rank's heads' columns.

        T5's ``relative_attention_bias`` ``[buckets, heads]``; see
        :class:`~tessera.layers.conversion.head_bias.HeadColumns`.

        Raises:
            TypeError: it is not an ``nn.Embedding`` (nor computes as one).
            ValueError: its columns are not the attention module's query heads.
        """
        owner = self._attention_around(name)
        assert owner is not None, f"{name}: match_plan lets no head_bias outside attention"
        if not isinstance(module, nn.Embedding) or not computes_as(module, nn.Embedding):
            raise _overrides(name, module, nn.Embedding, "head_bias")
        if module.max_norm is not None or module.sparse:
            raise ValueError(
                f"parallelize: {name!r} has role 'head_bias' with max_norm or sparse gradients, "
                "which the table read at this rank's heads does not reproduce"
            )
        heads = self.heads[owner].query
        if module.embedding_dim != heads:
            raise ValueError(
                f"parallelize: {name!r} has role 'head_bias', a column per head, but holds "
                f"{module.embedding_dim} columns for the {heads} heads of {owner!r}"
            )
        first, count = rank_heads(heads, self.share, self._head_block())
        return HeadColumns(module, first, count, context=self.context)

    def _head_block(self) -> int:
        """This rank's block of the heads: its index among the ranks splitting a column output.

        1D: its 1D rank; the mesh: its rank in the ROW group (ROW splits the hidden dim); the
        cube: its rank on the axis splitting layout ``"z"``, a column layer's output (Bian et
        al. 2021).
        """
        return self.builders.head_block(self.context)

    def mixture_of_experts(self, name: str, module: nn.Module, role: str) -> nn.Module:
        """``experts`` / ``router``: a mixture-of-experts block's parts, under 1D.

        The experts become :class:`~tessera.layers.conversion.experts.Experts1D`; the router
        stays whole (under sequence parallelism a
        :class:`~tessera.layers.conversion.experts.TokenRouter`, its gradient summed).

        ``match_plan`` refused them under other modes.

        Raises:
            TypeError: the router holds no parameters, or the experts are not transformers'
                gated experts (:func:`~tessera.layers.conversion.experts.expert_sizes`).
        """
        assert not self.kind.splits_activations, f"{name}: match_plan lets no {role} in here"
        in_span = self.sequence_parallel and name in self.sequence_span
        if role == "router":
            if not any(True for _ in module.parameters(recurse=False)):
                raise TypeError(f"parallelize: the router {name!r} holds no parameters")
            return TokenRouter(module, context=self.context) if in_span else module
        sizes = expert_sizes(name, module)
        ranks = self.share
        if sizes.intermediate % ranks != 0:
            raise ValueError(
                f"parallelize: {name!r} holds {sizes.experts} experts of {sizes.intermediate} "
                f"intermediate features (the config's intermediate or moe_intermediate size), "
                f"not divisible by the {ranks} ranks of tensor mode '1d' "
                f"({sizes.intermediate} % {ranks} = {sizes.intermediate % ranks})"
            )
        weight = _tensor(module, "down_proj")
        return Experts1D(
            module,
            sizes,
            weight.dtype,
            sequence_parallel=in_span,
            device=self._device(weight),
            context=self.context,
        )

    def patch_embedding(self, name: str, module: nn.Module) -> nn.Module:
        """``patch_embedding``: a ViT's embeddings, computed by the mode's patch embedding.

        Under 1D the output is whole (the plan's sequence span, if any, splits it later).
        CLIP's embeddings (:func:`~.patch.clip_patch_sizes`) are the same computation under
        other names and shapes (:meth:`clip_patch_embedding`).
        """
        from .patch import clip_patch_sizes

        clip = clip_patch_sizes(name, module)
        if clip is not None:
            return self.clip_patch_embedding(module, clip)
        owner = None if self.model is None else self.model.get_submodule(name.rpartition(".")[0])
        timm = timm_patch_sizes(name, module, owner)
        if timm is not None and owner is not None:
            return self.timm_patch_embedding(module, owner, timm)
        image, patch, channels, embed = patch_sizes(name, module)
        weight = _tensor(module.get_submodule("patch_embeddings.projection"), "weight")
        init = None if weight.is_meta else _no_init
        args = (image, patch, channels, embed, weight.dtype, init, init, init)
        where = {"device": self._device(weight), "context": self.context}
        inner = self.layers.classes["PatchEmbedding"](*args, **where)
        state = module.state_dict()
        if not any(p.is_meta for p in module.parameters()):
            load_full_state_dict(
                inner,
                {
                    "weight": state["patch_embeddings.projection.weight"],
                    "bias": state["patch_embeddings.projection.bias"],
                    "cls_token": state["cls_token"],
                    "pos_embed": state["position_embeddings"],
                },
            )
        dropout = getattr(module, "dropout", None)
        adapter = PatchEmbeddingAdapter(inner, dropout if isinstance(dropout, nn.Module) else None)
        adapter.train(module.training)
        return adapter

    def clip_patch_embedding(
        self, module: nn.Module, sizes: tuple[int, int, int, int]
    ) -> nn.Module:
        """``patch_embedding`` of a CLIP vision model: the mode's patch embedding, CLIP's names.

        See :class:`~tessera.layers.conversion.patch.ClipEmbeddingAdapter`.
        """
        from .patch import ClipEmbeddingAdapter

        conv = module.get_submodule("patch_embedding")
        inner, bias = self._mode_patch_embedding(conv, sizes)
        embed, positions = sizes[3], (sizes[0] // sizes[1]) ** 2 + 1
        set_full_form(_tensor(inner, "cls_token"), FullForm((embed,)))
        set_full_form(_tensor(inner, "pos_embed"), FullForm((positions, embed)))
        if not any(p.is_meta for p in module.parameters()):
            state = module.state_dict()
            whole = {
                "weight": state["patch_embedding.weight"],
                "cls_token": state["class_embedding"],
                "pos_embed": state["position_embedding.weight"],
            }
            if bias:
                whole["bias"] = state["patch_embedding.bias"]
            load_full_state_dict(inner, whole, strict=False)
        adapter = ClipEmbeddingAdapter(inner, bias)
        frozen = {n for n, p in module.named_parameters() if not p.requires_grad}
        for pname, p in adapter.named_parameters():
            p.requires_grad_(pname not in frozen)
        adapter.train(module.training)
        return adapter

    def _mode_patch_embedding(
        self, conv: nn.Module, sizes: tuple[int, int, int, int]
    ) -> tuple[nn.Module, bool]:
        """The mode's patch embedding for ``conv``'s patches, and whether ``conv`` has a bias.

        Without one, the tessera module's bias stays zero and frozen. Its weights are drawn
        (meta) or left for the caller to load.
        """
        weight = _tensor(conv, "weight")
        init = None if weight.is_meta else _no_init
        args = (*sizes, weight.dtype, init, init, init)
        where = {"device": self._device(weight), "context": self.context}
        inner = self.layers.classes["PatchEmbedding"](*args, **where)
        bias = getattr(conv, "bias", None) is not None
        if not bias:
            with torch.no_grad():
                _tensor(inner, "bias").zero_()
            _tensor(inner, "bias").requires_grad_(False)
        return inner, bias

    def timm_patch_embedding(
        self, module: nn.Module, owner: nn.Module, sizes: tuple[int, int, int, int]
    ) -> nn.Module:
        """``patch_embedding`` of timm's ViT: the mode's patch embedding, timm's names.

        The class token and positions ``owner`` (the ``VisionTransformer``) holds become the
        tessera module's. See :class:`~tessera.layers.conversion.patch.TimmEmbeddingAdapter`.
        """
        conv = module.get_submodule("proj")
        inner, bias = self._mode_patch_embedding(conv, sizes)
        timm_params = {
            "weight": conv.get_parameter("weight"),
            "cls_token": owner.get_parameter("cls_token"),
            "pos_embed": owner.get_parameter("pos_embed"),
        }
        if bias:
            timm_params["bias"] = conv.get_parameter("bias")
        if not any(p.is_meta for p in timm_params.values()):
            whole = {key: p.detach() for key, p in timm_params.items()}
            load_full_state_dict(inner, whole, strict=False)
        for key, p in timm_params.items():
            _tensor(inner, key).requires_grad_(p.requires_grad)
        adapter = TimmEmbeddingAdapter(inner, owner, bias, (sizes[0], sizes[0]))
        adapter.train(module.training)
        return adapter

    def head(self, name: str, module: nn.Module) -> nn.Module:
        """``head``: vocabulary logits, tied to the converted embedding when it was."""
        if not isinstance(module, nn.Linear):
            raise TypeError(
                f"parallelize: {name!r} ({type(module).__name__}) has role 'head', which takes "
                "an nn.Linear"
            )
        if not computes_as(module, nn.Linear):
            raise _overrides(name, module, nn.Linear, "head")
        tied = self.replaced.get(id(module.weight))
        dims = (module.in_features, module.out_features, tied, module.bias is not None)
        made = self._made_like(module.weight)
        new = self.layers.classes["Head"](*dims, **made)
        return _adopt(new, module, {})
