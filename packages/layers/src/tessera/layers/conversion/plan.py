"""Plans: which module of a model someone else wrote plays which role under tensor parallelism.

A plan maps module-name patterns to roles. A pattern is matched against the names of
``model.named_modules()`` one dotted component at a time (``fnmatch`` within a component), so
``h.*.mlp.c_proj`` matches ``h.3.mlp.c_proj`` but not ``h.3.attn.c_proj``. ``parallelize``
swaps every matched module for the current mode's layer of that role, cutting its shards from the
module's own weights. The roles are what Megatron-LM (Shoeybi et al. 2019) and the 2D/2.5D
papers need to know of a transformer; every activation layout follows from them:

``"col"``
    A linear layer (``nn.Linear`` or transformers' ``Conv1D``) whose outputs are split: the
    first layer of an MLP, a query, key or value projection.
``"qkv"``
    A ``"col"`` layer whose output is q, k and v side by side (GPT-2's ``c_attn``, Phi-3's
    ``qkv_proj``): each of the three is split on its own, so a rank holds the same heads of all
    three. With grouped-query attention (fewer key/value heads than query heads, read from the
    ``"attention"`` module around it) the three differ in size; a rank still holds whole query
    heads with exactly the key/value heads they attend with.
``"gate_up"``
    A ``"col"`` layer whose output is an MLP's gate and up projections side by side (Phi-3's
    and GLM's ``gate_up_proj``, split in two halves by the model): each half is split on its
    own.
``"row"``
    A linear layer whose inputs are split: the second layer of an MLP, an attention output.
``"dense"``
    A linear layer that keeps the layout between blocks (BERT's prediction-head transform):
    replicated in 1D, a SUMMA layer on the mesh; 3D has none (its linear layers switch the
    layout).
``"embedding"``
    The token embedding (its table is split; a head tied to it stays tied).
``"position_embedding"``
    A learned position embedding, added to every row of the batch.
``"position_table"``
    1D only: a position module computing its rows in a forward of its own, kept whole: an
    ``nn.Embedding`` subclass (OPT's) or a module holding its table as a buffer (XGLM's
    sinusoidal ``embed_positions``); other modes refuse it
    (:mod:`~tessera.layers.conversion.position_table`).
``"norm"``
    A LayerNorm (or RMSNorm) over the hidden dim.
``"head_norm"``
    A LayerNorm (or RMSNorm) inside an ``"attention"`` module over one head's features, one
    weight for every head (Qwen3's ``q_norm`` and ``k_norm``, "QK normalization"): each rank
    normalizes its heads on its own, and the weight's gradient is summed over the tensor ranks.
``"head_bias"``
    An ``nn.Embedding`` inside an ``"attention"`` module with a column per head (T5's
    ``relative_attention_bias`` ``[buckets, heads]``): whole on every rank, each rank reading
    its heads' columns, the gradient summed over the tensor ranks
    (:mod:`~tessera.layers.conversion.head_bias`).
``"patch_embedding"``
    A ViT's embedding: patches, class token and position table (transformers'
    ``ViTEmbeddings``).
``"head"``
    The output projection to the vocabulary (tied to the ``"embedding"`` when it shares its
    weight, as GPT-2's ``lm_head``).
``"attention"``
    An attention module whose head counts (``num_heads``, ``split_size``, ...) become this
    rank's share.
``"experts"``
    1D only: transformers' experts of a mixture-of-experts block (``gate_up_proj`` ``[E, 2F,
    h]``, ``down_proj`` ``[E, h, F]``), every expert's MLP split as a ``gate_up`` and a ``row``
    layer (:mod:`~tessera.layers.conversion.experts`).
``"router"``
    1D only: the router of a mixture-of-experts block (or the gate of its shared expert),
    whole on every rank (with sequence parallelism it runs on this rank's tokens and its
    gradient is summed over the ranks).

A :class:`Plan` adds what happens at the model's boundary: ``"tokens"`` (the input is token ids,
split by batch where the mode splits the batch; the embedding makes the layout) or
``"features"`` (the input is a full activation ``[b, ..., h]``, split into the mode's layout
and the output gathered back) or ``"images"`` (pixel values, split by batch where the mode
splits the batch; the patch embedding makes the layout), and, for 1D sequence parallelism,
the span of modules whose activations are split along the sequence (Korthikanti et al. 2022).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Literal

from torch import nn

from tessera.context import TensorMode, find_tensor_mode

from .converters import COLUMN_PARTS, linear_shape
from .structure import infer_structure, scales_alone

__all__ = [
    "COLUMN_ROLES",
    "ROLES",
    "NoPlanError",
    "Plan",
    "Role",
    "infer_plan",
    "inner_norms",
    "match_plan",
    "matches",
    "parts_with_plans",
    "plan_for",
    "resolve_span",
    "returns_whole",
    "span_members",
]

Role = Literal[
    "col",
    "qkv",
    "gate_up",
    "row",
    "dense",
    "embedding",
    "position_embedding",
    "position_table",
    "norm",
    "head_norm",
    "head_bias",
    "head",
    "attention",
    "patch_embedding",
    "experts",
    "router",
]
#: Every role a plan may name.
ROLES: tuple[str, ...] = (
    "col",
    "qkv",
    "gate_up",
    "row",
    "dense",
    "embedding",
    "position_embedding",
    "position_table",
    "norm",
    "head_norm",
    "head_bias",
    "head",
    "attention",
    "patch_embedding",
    "experts",
    "router",
)
#: Roles of a linear layer whose outputs are split (a column layer, Megatron-LM's "A").
COLUMN_ROLES: tuple[str, ...] = tuple(COLUMN_PARTS)
Boundary = Literal["tokens", "features", "images"]


@dataclass(frozen=True)
class Plan:
    """Roles of a model's modules under tensor parallelism, and its boundary.

    Attributes:
        rules: ``{pattern: role}``; every pattern must match at least one module.
        boundary: ``"tokens"``, ``"features"`` or ``"images"`` (see the module docstring).
        sequence_span: 1D sequence parallelism only: ``(first, last)`` module names; the input
            of ``first`` is split along the sequence (dim 1) and the output of ``last``
            gathered (its first element, or ``last_hidden_state``, when it returns several), so
            everything in between (norms, residual adds) sees ``[b, s/p, h]``. An index ``-1``
            names the last entry of a ``ModuleList`` (``"encoder.layer.-1"``), so one plan
            fits every depth. ``None``: the plan cannot take sequence parallelism.
        causal_lm: The model ends in a ``head`` whose logits stay split (a language model's,
            a classifier's), and would compute its loss from them inside its forward when given
            ``labels``; that loss assumes whole logits, so ``parallelize`` replaces it with
            tessera's (:mod:`~tessera.layers.conversion.model_loss`), and ``labels`` of a loss
            it cannot replace become an error that points to
            :func:`~tessera.layers.causal_lm_loss` / :func:`~tessera.layers.token_loss`.
        name: How errors name the plan.
        optional: Patterns that may match no module (a part some configs leave out: BERT's
            pooler under ``add_pooling_layer=False``); every other pattern must match.
        whole_sequence: Why the model must see each sequence whole (a classifier's head reads
            one token of it, positions counted from a row's padding), or empty: tensor mode
            ``'sequence'``, which hands every rank a chunk of the tokens, refuses the plan
            with this reason.
        encoder: An encoder-decoder's encoder stack (``"model.encoder"``), or ``None``.
            ``generate()`` calls it on its own, outside the model's forward, so where the mode
            splits the batch its input is split there too (its output then stays in the
            mode's layout, as the decoder reads it through ``encoder_outputs``).
        logits_bias: Buffers ``[1, V]`` the model adds to its head's logits (BART's
            ``final_logits_bias``): under 1D, whose logits are split by vocabulary, each rank
            keeps its slice of them; the other modes keep the vocabulary whole.
    """

    rules: Mapping[str, str]
    boundary: Boundary = "features"
    sequence_span: tuple[str, str] | None = None
    causal_lm: bool = False
    name: str = field(default="user plan")
    optional: tuple[str, ...] = ()
    whole_sequence: str = ""
    encoder: str | None = None
    logits_bias: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for pattern, role in self.rules.items():
            if role not in ROLES:
                close = fnmatch.filter(ROLES, f"{role[:2]}*")
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise ValueError(
                    f"plan rule {pattern!r}: unknown role {role!r}{hint}; roles are "
                    f"{', '.join(ROLES)}"
                )
        if self.boundary not in ("tokens", "features", "images"):
            raise ValueError(
                f"plan boundary must be 'tokens', 'features' or 'images', got {self.boundary!r}"
            )


def plan_for(model: nn.Module, plan: Plan | Mapping[str, str] | None) -> Plan:
    """The plan to use: the given one (a dict becomes a ``"features"`` plan) or the model's.

    The model's: the plan shipped for its class (or for a base class, if that plan still
    covers every module with parameters), else the plan of the family it is laid out as
    (:func:`infer_plan`), else the roles read from its transformer blocks
    (:func:`~.structure.infer_structure`).

    Raises:
        ValueError: no plan is given and tessera ships none for the model's class.
    """
    if isinstance(plan, Plan):
        return plan
    if plan is not None:
        return _user_plan(model, dict(plan))
    from .families import BUILTIN_PLANS, FAMILIES, torch_transformer_plan  # they build Plans

    torch_base = torch_transformer_plan(model)
    if torch_base is not None:
        base, torch_plan = torch_base
        # a subclass keeps its torch base's plan while that plan names every module with
        # parameters (one it added would stay whole and read split activations)
        if base is type(model) or _covers(model, torch_plan):
            return torch_plan
    for cls in type(model).__mro__:
        if cls.__name__ in BUILTIN_PLANS:
            shipped = BUILTIN_PLANS[cls.__name__]
            # A subclass may add modules its base lacks (a norm inside attention): its base's
            # plan holds only if it still names every module with parameters.
            if cls is type(model) or _covers(model, shipped):
                return shipped
            break
    inferred = infer_plan(model)
    if inferred is not None:
        return inferred
    read = infer_structure(model)
    if read.rules is not None:
        return Plan(
            read.rules,
            boundary="features" if read.features else "tokens",
            whole_sequence=read.whole_sequence,
            sequence_span=read.sequence_span,
            causal_lm=read.head,
            name=f"plan read from the transformer blocks of {type(model).__name__}",
        )
    raise NoPlanError(  # what is nearly right first: the list of plans is long
        f"parallelize: tessera ships no plan for {type(model).__name__}{_near_families(model)} "
        f"(plans for {', '.join(sorted(BUILTIN_PLANS))}; and its modules are not laid out like "
        f"one of their families: {', '.join(FAMILIES)}; nor as the usual transformer block "
        f"stack: {read.reason}); pass plan={{'module.name.pattern': 'col', ...}} with roles "
        f"{', '.join(ROLES)}{_base_model_hint(model)}"
    )


def _base_model_hint(model: nn.Module) -> str:
    """How to run a model whose base model has a bare plan (a classifier nobody planned).

    transformers' task models hold their base model under ``base_model_prefix``
    (``RobertaForSequenceClassification.roberta``). A bare base model returns its outputs
    whole, so parallelizing it alone leaves the head and the model's own loss to run whole on
    every rank, as one process computes them. Empty where there is no such base model.
    """
    prefix = getattr(model, "base_model_prefix", "")
    inner = getattr(model, prefix, None) if isinstance(prefix, str) and prefix else None
    if not isinstance(inner, nn.Module) or inner is model:
        return ""
    try:
        found = plan_for(inner, None)
    except ValueError:
        return ""
    if not returns_whole(found):
        return ""
    return (
        f". Or parallelize only its base model, parallelize(model.{prefix}) "
        f"({type(inner).__name__}, the {found.name} plan): its outputs come back whole, and "
        f"the rest of {type(model).__name__} (its head, its own loss with labels) runs whole "
        "on every rank"
    )


class NoPlanError(ValueError):
    """No plan was given, and tessera ships, infers or reads none for the model's class."""


def returns_whole(plan: Plan) -> bool:
    """Whether a model under ``plan`` takes whole inputs and returns whole outputs.

    A bare model's (``"tokens"`` or ``"images"``, no head whose logits stay split): code
    around it can compute on its outputs as one process does.
    """
    return not plan.causal_lm


def parts_with_plans(model: nn.Module) -> list[tuple[str, Plan]]:
    """The outermost submodules of ``model`` whose plan returns whole outputs, by name.

    Their plan is :func:`plan_for`'s, and they return whole outputs under it
    (:func:`returns_whole`). A model nobody planned is often a wrapper around models that
    have plans: CLIP's towers under their projections, a researcher's head on a pretrained
    encoder. Each part can be parallelized alone; the rest computes on its whole outputs,
    the same on every rank.
    """
    found: list[tuple[str, Plan]] = []

    def visit(prefix: str, module: nn.Module) -> None:
        for name, child in module.named_children():
            if next(child.parameters(), None) is None:
                continue  # nothing to split in it
            try:
                plan = plan_for(child, None)
            except Exception:  # no plan, or one its modules do not fit: look inside it
                plan = None
            if plan is not None and returns_whole(plan):
                found.append((f"{prefix}{name}", plan))
            else:
                visit(f"{prefix}{name}.", child)

    visit("", model)
    return found


def _user_plan(model: nn.Module, rules: dict[str, str]) -> Plan:
    """A dict plan: ``"features"``, or ``"tokens"`` where it names a token embedding.

    A model with an ``embedding`` takes token ids, which no mode may split like an activation
    (under 2D they would be cut along the sequence as if it were the hidden size): the
    boundary keeps this rank's rows or tokens of them, and the embedding makes the mode's
    layout itself, as for a transformers model. Its logits then stay split (by vocabulary
    under 1D, by rows on the mesh and cube, by tokens under ``'sequence'``) for
    :func:`~tessera.layers.causal_lm_loss`, and 1D sequence parallelism spans its blocks as
    read from its structure (:func:`~.structure.infer_structure`), where they can be read.
    """
    if "embedding" not in rules.values():
        return Plan(rules)
    read = infer_structure(model)
    return Plan(
        rules,
        boundary="tokens",
        sequence_span=read.sequence_span,
        causal_lm="head" in rules.values(),
    )


def infer_plan(model: nn.Module) -> Plan | None:
    """The plan of the family whose layout ``model`` has, if every parameter is covered by it.

    A model nobody wrote a plan for is often laid out as one that has one (transformers'
    Mistral and Qwen2 are Llama's modules under other class names). The family's plan is used
    only when all of its rules match and every module holding parameters is one the plan
    names (or inside one): a module it does not know (another norm, a bias the family lacks
    in a module of its own) would stay whole and see split activations, silently wrong, so
    such a model gets no plan and the caller must write one.
    """
    from .families import FAMILIES  # they build Plans

    modules = dict(model.named_modules())
    for marker, laid_out, build in FAMILIES.values():
        found = [n for n in modules if n == marker or n.endswith("." + marker)]
        if not found or not laid_out(modules[found[0]]):
            continue
        prefix = found[0][: len(found[0]) - len(marker)]
        causal_lm = isinstance(getattr(model, "lm_head", None), nn.Linear) and prefix != ""
        plan = build(prefix, causal_lm)
        if _covers(model, plan) and _patch_embeddings_fit(model, plan):
            return replace(plan, name=f"{plan.name} plan inferred for {type(model).__name__}")
    return None


def _patch_embeddings_fit(model: nn.Module, plan: Plan) -> bool:
    """Whether every module of role ``patch_embedding`` is one the mode's embedding computes."""
    return _patch_embeddings_misfit(model, plan) is None


def _patch_embeddings_misfit(model: nn.Module, plan: Plan) -> str | None:
    """Why a module of role ``patch_embedding`` is not one the mode's embedding computes."""
    from .patch import patch_embedding_misfit

    for name, module in model.named_modules():
        if any(matches(name, p) and r == "patch_embedding" for p, r in plan.rules.items()):
            owner = model.get_submodule(name.rpartition(".")[0])
            why = patch_embedding_misfit(name, module, owner)
            if why is not None:
                return why
    return None


def _near_families(model: nn.Module) -> str:
    """The families ``model`` is laid out as but for its patch embedding, with why.

    For the error saying it gets no plan: a DeiT's distillation token under ViT's layers.
    """
    from .families import FAMILIES  # they build Plans

    modules = dict(model.named_modules())
    near = []
    for family, (marker, laid_out, build) in FAMILIES.items():
        found = [n for n in modules if n == marker or n.endswith("." + marker)]
        if not found or not laid_out(modules[found[0]]):
            continue
        plan = build(found[0][: len(found[0]) - len(marker)], False)
        why = _patch_embeddings_misfit(model, plan) if _covers(model, plan) else None
        if why is not None:
            near.append(f"; its layers are laid out as the {family} family's, but {why}")
    return "".join(near)


#: Parameters of a patch embedding's parent that the embedding computes with (timm's ViT).
_ADOPTED_BY_PATCH_EMBEDDING = frozenset({"cls_token", "pos_embed"})


def _covers(model: nn.Module, plan: Plan) -> bool:
    """Every rule matches, and every module with parameters of its own is named by one.

    A module inside a named one counts as covered, except inside an ``attention`` module:
    its heads are split, so a parameter there that no rule names (a per-head norm of q and
    k, Qwen3's) would get a share of its gradient on each rank, and the replicas would drift.
    torch's ``nn.MultiheadAttention`` is the exception: its fused projection and
    ``out_proj`` are split with it (multihead.py). Optional rules need not match. A module
    holding only scales and offsets (timm's ``LayerScale`` ``[h]``) outside attention needs
    no rule: left out, it runs under DTensor, its parameters replicated (:mod:`.left_out`).
    """
    names = [name for name, _ in model.named_modules() if name]
    named = {n: role for n in names for pattern, role in plan.rules.items() if matches(n, pattern)}
    required = [pattern for pattern in plan.rules if pattern not in plan.optional]
    if any(not any(matches(n, pattern) for n in names) for pattern in required):
        return False
    modules = dict(model.named_modules())
    split_whole = {n for n, role in named.items() if role == "attention"}
    split_whole = {n for n in split_whole if isinstance(modules[n], nn.MultiheadAttention)}
    # timm's ViT holds its class token and positions beside its patch embedding, which adopts
    # them (patch.TimmEmbeddingAdapter)
    adopting = {n.rpartition(".")[0] for n, role in named.items() if role == "patch_embedding"}
    for name, module in model.named_modules():
        own = {pname for pname, _ in module.named_parameters(recurse=False)}
        if not own or (name in adopting and own <= _ADOPTED_BY_PATCH_EMBEDDING):
            continue
        if name in named and named[name] != "attention":
            continue
        if name in split_whole or any(name.startswith(n + ".") for n in split_whole):
            continue
        if any(name.startswith(n + ".") and role != "attention" for n, role in named.items()):
            continue
        inside_attention = any(
            name.startswith(n + ".") for n, role in named.items() if role == "attention"
        )
        converted_inside = any(n.startswith(name + ".") for n in named)
        if inside_attention or converted_inside or not scales_alone(module):
            return False
    return True


def matches(name: str, pattern: str) -> bool:
    """Whether module ``name`` matches ``pattern``, one dotted component at a time."""
    parts, wanted = name.split("."), pattern.split(".")
    return len(parts) == len(wanted) and all(
        fnmatch.fnmatchcase(part, want) for part, want in zip(parts, wanted, strict=True)
    )


def _mode(name: str) -> TensorMode:
    found = find_tensor_mode(name)
    if found is None:
        raise ValueError(f"parallelize: tensor mode {name!r} is not registered")
    return found


def match_plan(model: nn.Module, plan: Plan, mode: str) -> dict[str, str]:
    """``{module name: role}`` for every module a rule matches.

    Raises:
        ValueError: a pattern matches no module, a module matches two patterns, or the mode
            is ``'sequence'`` and the plan needs whole sequences (``Plan.whole_sequence``).
    """
    if _mode(mode).splits_sequence and plan.whole_sequence:
        raise ValueError(
            f"parallelize: {type(model).__name__} ({plan.name}) cannot run under tensor mode "
            f"'sequence': {plan.whole_sequence}, which each rank's chunk of the tokens does "
            "not hold; use tensor mode '1d' (with sequence_parallel if activations must be "
            "split along the sequence), '2d', '2.5d' or '3d'"
        )
    names = [name for name, _ in model.named_modules() if name]
    roles: dict[str, str] = {}
    by: dict[str, str] = {}
    unmatched: list[str] = []
    for pattern, role in plan.rules.items():
        hits = [name for name in names if matches(name, pattern)]
        if not hits and pattern not in plan.optional:
            unmatched.append(pattern)
        for name in hits:
            if name in roles:
                raise ValueError(
                    f"parallelize: module {name!r} matches both {by[name]!r} "
                    f"({roles[name]}) and {pattern!r} ({role}) of the {plan.name}"
                )
            roles[name], by[name] = role, pattern
    if unmatched:
        raise ValueError(
            f"parallelize under tensor mode {mode!r}: the {plan.name} patterns {unmatched} "
            f"match no module of {type(model).__name__} (its modules include "
            f"{names[:8]}{' ...' if len(names) > 8 else ''})"
        )
    order = {name: i for i, name in enumerate(names)}
    ordered = _in_data_flow_order(dict(sorted(roles.items(), key=lambda item: order[item[0]])))
    _check_pairs(ordered, plan, mode)
    _check_mlp_widths(model, ordered, plan, mode)
    _check_norms_in_attention(ordered, plan, mode)
    _check_attention_covered(model, ordered, plan, mode)
    _check_no_hand_sliced_weights(model, mode)
    _check_experts_mode(ordered, plan, mode)
    return ordered


def _check_no_hand_sliced_weights(model: nn.Module, mode: str) -> None:
    """No module slices a layer's whole weight by hand (BLOOM's ``slow_but_exact``).

    With ``pretraining_tp > 1`` and ``slow_but_exact`` BLOOM's attention and MLP multiply
    slices of their output projection's weight themselves, as if it were whole: on a rank's
    shard that is another product, with no sum over the ranks.

    Raises:
        ValueError: naming the first such module.
    """
    if not _mode(mode).splits_weights:  # whole weights on every rank
        return
    for name, module in model.named_modules():
        tp = getattr(module, "pretraining_tp", 1)
        if isinstance(tp, int) and tp > 1 and getattr(module, "slow_but_exact", False) is True:
            raise ValueError(
                f"parallelize under tensor mode {mode!r}: {name!r} ({type(module).__name__}) "
                f"has pretraining_tp = {tp} with slow_but_exact, so it multiplies slices of its "
                "output projection's whole weight by hand; build the model with "
                "slow_but_exact=False in its config (that path also leaves out the projection's "
                "bias, so it computes another model)"
            )


def _check_attention_covered(
    model: nn.Module, roles: Mapping[str, str], plan: Plan, mode: str
) -> None:
    """Every module holding parameters inside a split attention has a role (or is in one).

    Where the heads are split, a plain module there sees this rank's heads only: a norm of
    each head with a weight per head would scale them by the first heads' weights (StableLM's
    list of norms zips its norms with the heads it is given), and any parameter would get a
    share of its gradient that nobody sums. Family plans cover their attention; a user's plan
    that leaves such a module out would train wrong without an error.

    Raises:
        ValueError: naming the first such module and the roles that take it.
    """
    if not _mode(mode).splits_weights:  # whole heads on every rank
        return
    for attention in (name for name, role in roles.items() if role == "attention"):
        if isinstance(model.get_submodule(attention), nn.MultiheadAttention):
            continue  # its fused projection and out_proj are split with it (multihead.py)
        inside = model.get_submodule(attention).named_modules(prefix=attention)
        for name, module in inside:
            if not any(True for _ in module.parameters(recurse=False)):
                continue
            owners = [n for n in roles if n != attention and (name + ".").startswith(n + ".")]
            if not owners and name == attention:
                raise ValueError(
                    f"parallelize under tensor mode {mode!r}: the attention module {name!r} "
                    f"({type(module).__name__}) holds parameters of its own, which no role "
                    "takes: its heads are split, so each rank would see a share of them"
                )
            if not owners:
                raise ValueError(
                    f"parallelize under tensor mode {mode!r}: {name!r} "
                    f"({type(module).__name__}) holds parameters inside the attention module "
                    f"{attention!r}, whose heads are split, but no rule of the {plan.name} "
                    "names it; as a plain module it would see this rank's heads only. Name "
                    "it: 'col' / 'qkv' / 'row' for a projection, 'head_norm' for a norm of "
                    "each head, 'head_bias' for a table with a column per head, 'norm' for a "
                    "norm over all the features of a projection"
                )


def _check_experts_mode(roles: Mapping[str, str], plan: Plan, mode: str) -> None:
    """Mixtures of experts run under 1D (experts split) and ``sequence`` (whole) only.

    On the 2D/2.5D mesh and the 3D cube a token's features are split over ranks, and a router
    needs all of them to pick the token's experts.

    Raises:
        ValueError: naming the first expert module or router and the modes that take them.
    """
    moe = [name for name, role in roles.items() if role in ("experts", "router")]
    if moe and _mode(mode).splits_activations:  # an expert takes a token's whole vector
        raise ValueError(
            f"parallelize: {moe[0]!r} has role {roles[moe[0]]!r} in the {plan.name}, which "
            f"tensor mode {mode!r} does not split: mixtures of experts run under '1d' (with or "
            "without sequence_parallel) and 'sequence'"
        )


def _check_norms_in_attention(roles: Mapping[str, str], plan: Plan, mode: str) -> None:
    """A ``head_norm`` or ``head_bias`` sits inside an attention module, which says its heads.

    Raises:
        ValueError: a ``head_norm`` or ``head_bias`` has no ``attention`` module around it.
    """
    attention = [name for name, role in roles.items() if role == "attention"]
    for name, role in roles.items():
        inside = any(name.startswith(f"{a}.") for a in attention)
        if role in ("head_norm", "head_bias") and not inside:
            raise ValueError(
                f"parallelize under tensor mode {mode!r}: {name!r} has role {role!r}, but no "
                f"module around it has role 'attention' in the {plan.name}; it serves the heads "
                "of the attention it sits in (name that module too)"
            )


def _check_mlp_widths(model: nn.Module, roles: Mapping[str, str], plan: Plan, mode: str) -> None:
    """Outside attention, a column layer makes no more than the row layer after it takes.

    An MLP that chunks a layer's output in two (``gate, up = x.chunk(2, -1)``) needs that
    layer's role to be ``gate_up``: as a plain ``col`` layer each rank would get the gate of
    some features and the up of others, and train wrong without an error. Its width tells: a
    ``col`` layer wider than what the row layer takes is refused, and a ``gate_up`` layer must
    make exactly twice that (its halves are split apart). Narrower ``col`` layers pass: q, k
    and v of grouped-query attention in a plan that names no ``attention`` module. Under
    ``sequence`` nothing is split and nothing is checked.

    Raises:
        ValueError: a column layer outside attention is wider than that, or a ``gate_up``
            layer is not twice its row layer's width.
    """
    if not _mode(mode).splits_weights:
        return
    attention = [name for name, role in roles.items() if role == "attention"]
    columns: list[str] = []
    for name, role in roles.items():
        if role in COLUMN_ROLES:
            if not any(name.startswith(f"{a}.") for a in attention):
                columns.append(name)
            continue
        if role != "row":
            continue
        row_width = _width(model, name, "row")
        if row_width is None:
            columns = []
            continue
        for column in columns:
            column_role, made = roles[column], _width(model, column, roles[column])
            if made is None or column_role == "qkv":
                continue  # q, k, v outside an attention module: a features plan's own block
            wanted = row_width * COLUMN_PARTS[column_role]
            if made == wanted or (column_role == "col" and made < wanted):
                continue
            hint = (
                " (a gate and an up projection in one layer, chunked in two by the model, "
                "need role 'gate_up')"
                if column_role == "col" and made == 2 * row_width
                else ""
            )
            raise ValueError(
                f"parallelize under tensor mode {mode!r}: the {column_role!r} layer {column!r} "
                f"makes {made} features, but the 'row' layer {name!r} after it takes "
                f"{row_width} (a 'col' layer makes at most what its row layer takes, a 'gate_up' "
                f"layer twice that) in the {plan.name}{hint}"
            )
        columns = []


def _width(model: nn.Module, name: str, role: str) -> int | None:
    """The features a linear layer makes (a column role) or takes (``row``); None: no linear."""
    try:
        shape = linear_shape(name, model.get_submodule(name), role)
    except TypeError:
        return None  # not a linear layer: the converter names what is wrong with it
    return shape.in_features if role == "row" else shape.out_features


def _in_data_flow_order(roles: dict[str, str]) -> dict[str, str]:
    """``roles``, the linear layers inside each attention module in data-flow order.

    Modules are listed in the order they were registered, which is the order data flows through
    them, except where an attention module registers its output projection first: Phi-3's
    creates ``o_proj`` before ``qkv_proj``. Inside an ``attention`` module the q, k and v
    projections (column roles) always run before the output projection (``row``), so there they
    are put first, each group in its own order. Nowhere else is the order changed: a row layer
    before its column layer anywhere else is the error :func:`_check_pairs` reports.
    """
    names = list(roles)
    for attention in (n for n, role in roles.items() if role == "attention"):
        inside = [i for i, n in enumerate(names) if n.startswith(f"{attention}.")]
        linear = [names[i] for i in inside if roles[names[i]] in (*COLUMN_ROLES, "row")]
        flow = [n for n in linear if roles[n] != "row"] + [n for n in linear if roles[n] == "row"]
        slots = [i for i in inside if roles[names[i]] in (*COLUMN_ROLES, "row")]
        for slot, name in zip(slots, flow, strict=True):
            names[slot] = name
    return {name: roles[name] for name in names}


def resolve_span(model: nn.Module, span: tuple[str, str]) -> tuple[str, str]:
    """``span`` with each ``-1`` index replaced by the last index of its ``ModuleList``.

    Raises:
        ValueError: a ``-1`` follows a module that is not a ``ModuleList`` or ``Sequential``,
            or one that is empty.
    """
    resolved: list[str] = []
    for end in span:
        parts = end.split(".")
        module: nn.Module | None = model
        for i, part in enumerate(parts):
            if part == "-1":
                if not isinstance(module, nn.ModuleList | nn.Sequential) or len(module) == 0:
                    owner = ".".join(parts[:i]) or type(model).__name__
                    raise ValueError(
                        f"sequence_span: {end!r}: '-1' must follow a non-empty ModuleList or "
                        f"Sequential, but {owner!r} is {type(module).__name__}"
                        + (" (empty)" if isinstance(module, nn.ModuleList | nn.Sequential) else "")
                    )
                parts[i] = str(len(module) - 1)
            module = getattr(module, parts[i], None)
            if module is None:
                break  # span_members names the missing module
        resolved.append(".".join(parts))
    return resolved[0], resolved[1]


def span_members(model: nn.Module, span: tuple[str, str]) -> set[str]:
    """The modules from ``span[0]`` through the end of ``span[1]``, in ``named_modules`` order.

    Under 1D sequence parallelism their activations are split along the sequence; modules
    before or after (an embedding's LayerNorm, a prediction head) see the whole sequence.

    Raises:
        ValueError: a span end names no module, or the span ends before it starts.
    """
    names = [name for name, _ in model.named_modules()]
    for end in span:
        if end not in names:
            raise ValueError(f"sequence_span: {end!r} is not a module of {type(model).__name__}")
    first, last = names.index(span[0]), names.index(span[1])
    if last < first:
        raise ValueError(f"sequence_span {span}: {span[1]!r} comes before {span[0]!r}")
    while last + 1 < len(names) and names[last + 1].startswith(f"{span[1]}."):
        last += 1
    return set(names[first : last + 1])


def inner_norms(roles: Mapping[str, str]) -> set[str]:
    """The ``norm`` modules between a ``col``/``qkv`` layer and the ``row`` layer after them.

    They normalize a column layer's output (the paper's Listing 1: Linear -> LayerNorm ->
    Linear): split features under 1D, layout ``"z"`` under 3D. A norm counts only when the
    nearest linear layer before it (in the modules' order) is a column layer *and* the nearest
    after it is a row layer, so a model that registers an MLP's layers out of data-flow order
    (``w1, w2, w3``) does not make the next block's input norm an inner one. A ``norm`` inside
    an ``attention`` module is always one: everything there between the q, k, v projections
    and the output projection is split by heads (OLMo-2's ``q_norm`` over all query features,
    registered after the output projection).
    """
    linear = (*COLUMN_ROLES, "row", "dense")
    names = list(roles)
    attention = [name for name, role in roles.items() if role == "attention"]
    inner: set[str] = set()
    for i, name in enumerate(names):
        if roles[name] != "norm":
            continue
        if any(name.startswith(f"{a}.") for a in attention):
            inner.add(name)
            continue
        before = next((roles[n] for n in reversed(names[:i]) if roles[n] in linear), None)
        after = next((roles[n] for n in names[i + 1 :] if roles[n] in linear), None)
        if before in COLUMN_ROLES and after == "row":
            inner.add(name)
    return inner


def _check_pairs(roles: Mapping[str, str], plan: Plan, mode: str) -> None:
    """Every ``row`` layer follows a ``col``/``qkv`` layer (in the modules' order).

    A row layer takes what a column layer left split: under 1D the features, under 3D layout
    ``"z"``. Without one before it the input is in the wrong layout, which 3D could not even
    see (its two layouts have the same shapes).

    Raises:
        ValueError: a ``row`` layer has no ``col``/``qkv`` layer since the previous ``row``.
    """
    open_col = False
    for name, role in roles.items():
        if role in COLUMN_ROLES:
            open_col = True
        elif role == "row":
            if not open_col:
                raise ValueError(
                    f"parallelize under tensor mode {mode!r}: {name!r} is a 'row' layer with no "
                    f"'col' or 'qkv' layer before it (since the previous 'row') in the "
                    f"{plan.name}; a row layer takes the split output of a column layer"
                )
            open_col = False
    if open_col:
        last = [name for name, role in roles.items() if role in COLUMN_ROLES][-1]
        raise ValueError(
            f"parallelize under tensor mode {mode!r}: the {plan.name} ends with the 'col' layer "
            f"{last!r} and no 'row' layer after it; its output would stay split (make the last "
            "linear layer a 'row' one, or leave it out of the plan)"
        )
