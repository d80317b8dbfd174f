"""``parallelize``: put the current tensor mode on a model someone else wrote.

torchtitan keeps ``model.py`` free of parallelism and applies it from ``parallelize.py``;
torch's ``parallelize_module`` does the same for 1D. ``parallelize`` does it for tessera's
modes: it swaps the plain modules a :class:`~tessera.layers.conversion.plan.Plan` names for
the mode's layers, cut from the modules' own weights, and installs the boundary hooks.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tessera.context import (
    TENSOR_MODES,
    ParallelContext,
    ParallelMode,
    find_tensor_mode,
    get_shard_info,
    tensor_mode_names,
)

from ..sequence.attention import AttentionImpl
from ..shared.block_tags import install_block_tags
from ..shared.context_access import current_or_none, sequence_parallel_default, tensor_mode
from ..shared.errors import ModeNotImplementedError
from ..shared.mode_layers import MODE_LAYERS, find_mode_layers
from .boundary import install_boundary
from .converters import Converter
from .drop_path import install_per_sample_draws
from .dropout import install_dropout_streams
from .encoder_decoder import install_encoder_rows, split_logits_bias
from .entry_points import install_entry_points
from .generation import install_generation
from .left_out import install_left_out, left_out_modules
from .mask_rows import install_mask_rows
from .meta import check_meta_buffers, materialize_whole_modules
from .model_loss import install_model_loss
from .norms import carry_marking_hooks
from .own_code import install_own_code_check
from .parts import parallelize_parts
from .plan import (
    NoPlanError,
    Plan,
    inner_norms,
    match_plan,
    parts_with_plans,
    plan_for,
    resolve_span,
    span_members,
)
from .resize_method import install_resize_refusal
from .save_method import install_save_method
from .sequence import (
    check_attention_covered,
    check_no_token_mixing,
    install_sequence_attention,
)
from .sequence_positions import forward_takes_positions, install_chunk_positions
from .split_logits import install_split_logits
from .structure import holds_torch_attention
from .verify import Inputs, check_verify_inputs, verify_conversion, whole_copy

__all__ = [
    "CONTEXT_ATTR",
    "PARALLELIZED_ATTR",
    "SEQUENCE_SPAN_ATTR",
    "SUPPORTED_MODES",
    "parallelize",
]

#: tessera's own tensor modes, which ``parallelize`` converts models to; a mode of your own
#: is converted to when its ``ModeLayers`` say how (``roles``).
SUPPORTED_MODES = TENSOR_MODES
#: Set on a parallelized model: the tensor mode it was converted to.
PARALLELIZED_ATTR = "_tessera_parallelized"
#: Set on a parallelized model: the ParallelContext it was converted for.
CONTEXT_ATTR = "_tessera_context"
#: The attribute holding the span split along the sequence under 1D sequence parallelism.
SEQUENCE_SPAN_ATTR = "_tessera_sequence_span"


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)


#: Modules that compute with their parameters in their own forward: one holding a parameter
#: tied to a converted one must be converted too (it would compute with a shard).
COMPUTING = (nn.Linear, nn.Embedding, nn.LayerNorm, nn.RMSNorm, nn.Conv2d)


def _retie(model: nn.Module, replaced: dict[int, nn.Parameter]) -> None:
    """Point every other holder of a converted parameter at its replacement.

    A parameter tied to a converted one (BERT's ``cls.predictions.bias`` is its decoder's
    bias) would otherwise stay the plain tensor, and the tie would silently break.

    Raises:
        ValueError: the other holder computes with the parameter but was not converted (the
            plan names one side of a tie only).
    """
    for name, module in model.named_modules():
        for pname, param in list(module._parameters.items()):
            if param is None or id(param) not in replaced:
                continue
            new = replaced[id(param)]
            if isinstance(module, COMPUTING) and tuple(new.shape) != tuple(param.shape):
                raise ValueError(
                    f"parallelize: {name}.{pname} is tied to a parameter the plan converted, but "
                    f"{name!r} is not in the plan; name both sides of the tie (e.g. the "
                    "'embedding' and the 'head')"
                )
            module._parameters[pname] = new


def _has_roles(mode: str) -> bool:
    """Whether ``mode``'s registered ``ModeLayers`` say how ``parallelize`` builds each role."""
    layers = find_mode_layers(mode)
    return layers is not None and layers.roles is not None


def _modes_with_whole_activations() -> list[str]:
    """The registered modes whose activations are whole between blocks (1D's)."""
    found = (find_tensor_mode(name) for name in tensor_mode_names())
    return [m.name for m in found if m is not None and m.replicated_activations]


def _check_no_plain_parameters(
    model: nn.Module,
    span: set[str],
    plan: Plan,
    roles: Mapping[str, str],
    mode: str,
    *,
    sequence_parallel: bool,
) -> None:
    """Where activations are split, no module the plan left out may hold parameters plain.

    A module left out whole (no role at, above or below it: a norm, a layer scale, a linear
    layer of the model's own) runs under DTensor, its parameters replicated
    (:mod:`.left_out`), where the mode states the layout of its activations
    (``ModeLayers.activation_cuts``); but for torch's ``nn.MultiheadAttention``, whose CPU
    backward DTensor does not shard. A parameter of a module with converted children (a
    block's own ``gamma``) is refused: its module computes plain.

    Under 1D sequence parallelism (inside the span) a module left out computes on
    ``[b, s/p, h]`` and gets a partial gradient nobody sums: the replicas would drift apart.
    Under 2D, 2.5D and 3D every activation is a block of rows and features: a module left out
    sees ``h/q`` features (``nn.MultiheadAttention`` fails in its own assert, a convolution
    reads a block of the image as the whole, a linear layer's product is a partial one).

    Raises:
        ValueError: naming the plain modules with parameters, and what to do.
    """
    layers = find_mode_layers(mode)
    placed = layers is not None and layers.activation_cuts is not None
    _, holding = left_out_modules(model, roles)
    # run under DTensor, their parameters replicated (left_out.py)
    placed_whole = (
        [n for n in holding if not holds_torch_attention(model.get_submodule(n))] if placed else []
    )
    plain = sorted(
        name
        for name, module in model.named_modules()
        if name in span
        and not any(name == s or name.startswith(f"{s}.") for s in placed_whole)
        and any(get_shard_info(p) is None for p in module.parameters(recurse=False))
    )
    # the outermost ones: "1" rather than "1" and "1.out_proj"
    plain = [n for n in plain if not any(n.startswith(o + ".") for o in plain)]
    if not plain:
        return
    more = f" and {len(plain) - 4} more" if len(plain) > 4 else ""
    if sequence_parallel:
        raise ValueError(
            f"parallelize with 1d sequence parallelism: {plain[:4]}{more} hold parameters but "
            f"are not in the {plan.name}; inside the sequence span each rank sees only its "
            "tokens, so name them ('col', 'row', 'norm', ...)"
        )
    raise ValueError(
        f"parallelize under tensor mode {mode!r}: {plain[:4]}{more} hold parameters but are "
        f"not in the {plan.name}; under {mode!r} every activation is a block of rows and "
        "features, which a module left out would read as whole ones. Name them with a role "
        "('col', 'row', 'embedding', 'attention', ...), or use tensor mode '1d', which keeps "
        "activations whole outside its column-to-row pairs"
    )


def check_same_weights(model: nn.Module, context: ParallelContext) -> None:
    """Every tensor rank holds the same full weights, since each cuts its shard from its own.

    Built without a common seed (or loaded from different files), the ranks' shards would
    come from different models: the parallel model would equal none of them and train on,
    silently. One all-gather of a checksum per tensor over the TENSOR group (meta tensors,
    which hold no values, are skipped).

    Raises:
        ValueError: on every tensor rank, naming the first tensors that differ and the ranks.
    """
    sums: dict[str, tuple[float, float]] = {}
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if tensor.is_meta or not tensor.is_floating_point():
            continue
        flat = tensor.detach().reshape(-1).double()
        weights = torch.arange(1, flat.numel() + 1, dtype=torch.float64, device=flat.device)
        sums[name] = (float(flat.sum()), float((flat * weights).sum()))
    group = context.get_cpu_group(ParallelMode.TENSOR)
    everyone: list[Any] = [None] * context.get_world_size(ParallelMode.TENSOR)
    dist.all_gather_object(everyone, sums, group=group)
    ranks = context.get_ranks_in_group(ParallelMode.TENSOR)
    differ = [
        (name, rank)
        for rank, theirs in zip(ranks[1:], everyone[1:], strict=True)
        for name in sums
        if theirs.get(name) != everyone[0].get(name)
    ]
    if differ:
        names = sorted({name for name, _ in differ})
        shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
        raise ValueError(
            f"parallelize: the tensor ranks {ranks} hold different weights of "
            f"{type(model).__name__} ({shown} differ from rank {ranks[0]}'s on ranks "
            f"{sorted({rank for _, rank in differ})}); each rank cuts its shard from its own "
            "copy, so build the model after seeding every rank alike (torch.manual_seed) or "
            "load the same weights on every rank before parallelize"
        )


def parallelize(
    model: nn.Module,
    plan: Plan | Mapping[str, str] | None = None,
    *,
    sequence_attention: AttentionImpl = "ring",
    context: ParallelContext | None = None,
    verify: Inputs | None = None,
) -> nn.Module:
    """Convert ``model`` in place to the context's tensor mode; returns it.

    Every shard is cut from the module's existing weights: ``gather_full_state_dict(model)``
    afterwards equals the ``state_dict()`` before, in the original names and forms, and tied
    weights stay tied. A model built inside :func:`meta_parameters` gets only this rank's
    shards allocated (initialized, to be loaded with ``load_full_state_dict``). Without tensor
    parallelism the model is returned unchanged (built on meta, it stays there:
    ``load_pretrained`` allocates what the rank holds, after ``pipeline_layers`` or ZeRO-3's
    ``initialize`` where they apply).

    Args:
        model: A plain torch model (``nn.Linear``, ``nn.LayerNorm``, ``nn.Embedding``,
            transformers' ``Conv1D``).
        plan: ``{module-name pattern: role}`` (a ``"features"`` plan: the model takes and
            returns full activations), a :class:`Plan`, or ``None`` for the plan tessera ships
            for the model's class (transformers' GPT-2). A model with none, made of models
            that have one and return whole outputs (``CLIPModel``'s towers, an encoder under
            a head of your own), has each of those converted and the rest kept whole
            (:mod:`~tessera.layers.conversion.parts`).
        sequence_attention: Under tensor mode ``'sequence'``: ``"ring"`` (ring self-attention,
            Li et al. 2021) or ``"all_to_all"`` (DeepSpeed-Ulysses, heads divisible by N).
        context: The ParallelContext (default the current one).
        verify: Example inputs, the whole batch on every rank (``model(*verify)``, or
            ``model(**verify)`` for a mapping): the converted model's outputs and gradients
            are compared with the model's own before it returns
            (:mod:`~tessera.layers.conversion.verify`), so code no plan covers cannot make it
            compute something else unnoticed. Costs a copy of the whole model per rank while
            it runs.

    Raises:
        ModeNotImplementedError: the tensor mode is not one of :data:`SUPPORTED_MODES`, nor
            one whose registered ``ModeLayers`` have ``roles``.
        ValueError: a pattern matches nothing, a size does not divide, the plan leaves every
            parameter whole, the model was parallelized already, the tensor ranks hold
            different weights (each would cut its shard from another model), or ``verify``
            found an output or a gradient that differs from the model's own.
        TypeError: a module cannot take the role its pattern gives it.
    """
    ctx = current_or_none(context)
    if verify is None or ctx is None or tensor_mode(ctx) is None:
        return _convert(model, plan, sequence_attention, ctx)
    check_verify_inputs(verify, ctx)
    whole = whole_copy(model)
    _convert(model, plan, sequence_attention, ctx)
    verify_conversion(whole, model, verify, ctx)
    return model


def _convert(
    model: nn.Module,
    plan: Plan | Mapping[str, str] | None,
    sequence_attention: AttentionImpl,
    ctx: ParallelContext | None,
) -> nn.Module:
    """:func:`parallelize` without its verification."""
    mode = tensor_mode(ctx)
    if ctx is None or mode is None:
        return model
    done = getattr(model, PARALLELIZED_ATTR, None)
    if done is not None:
        raise ValueError(f"parallelize: {type(model).__name__} is already parallelized ({done})")
    if mode not in SUPPORTED_MODES and not _has_roles(mode):
        converts = [*SUPPORTED_MODES, *(m for m in MODE_LAYERS if _has_roles(m))]
        raise ModeNotImplementedError("parallelize", mode, sorted(set(converts)))
    kind = ctx.config.mode
    assert kind is not None  # a registered mode: the context was built from it
    parts: list[tuple[str, Plan]] = []
    try:
        chosen = plan_for(model, plan)
    except NoPlanError:
        parts = parts_with_plans(model)
        if not parts:
            raise
    if parts:
        check_same_weights(model, ctx)  # the whole modules around the parts too

        def convert(part: nn.Module, part_plan: Plan) -> nn.Module:
            return parallelize(part, part_plan, sequence_attention=sequence_attention, context=ctx)

        # 'sequence' splits no parameter: a tie across a part stays whole on both sides
        parallelize_parts(model, parts, convert, ties_split=not kind.splits_sequence)
        install_save_method(model, ctx)
        if kind.splits_weights:
            install_resize_refusal(model, mode)
        install_block_tags(model)
        setattr(model, PARALLELIZED_ATTR, mode)
        setattr(model, CONTEXT_ATTR, ctx)
        return model
    roles = match_plan(model, chosen, mode)
    if kind.splits_sequence:  # before any collective: attention left out would see its chunk
        check_attention_covered(
            model, [n for n, r in roles.items() if r == "attention"], chosen.name
        )
    check_meta_buffers(model)
    check_same_weights(model, ctx)
    from .multihead import install_heads_attention, install_memory_split  # torch's attention

    install_heads_attention(model, [n for n, r in roles.items() if r == "attention"], mode)
    install_memory_split(model, ctx, mode)
    sequence_parallel = "sequence_parallel" in kind.arguments and sequence_parallel_default(ctx)
    bare = chosen.boundary == "tokens" and not chosen.causal_lm  # its hidden states whole
    splits_tokens = sequence_parallel or (
        kind.splits_sequence and (chosen.boundary == "images" or bare)
    )
    if splits_tokens and chosen.sequence_span is not None:  # the only modes that read it
        chosen = replace(chosen, sequence_span=resolve_span(model, chosen.sequence_span))
    if sequence_parallel and chosen.boundary == "tokens" and chosen.sequence_span is None:
        raise ValueError(
            f"parallelize: tensor.sequence_parallel is on, but the {chosen.name} names no "
            "sequence_span (the blocks whose activations are split along the sequence)"
        )
    attention = tuple(name for name, role in roles.items() if role == "attention")
    tables = sorted(name for name, role in roles.items() if role == "position_table")
    if tables and not kind.replicated_activations:
        raise ValueError(
            f"parallelize: {tables} compute positions in a forward of their own (role "
            f"'position_table'), which tensor mode {mode!r} cannot split: the ids, mask and "
            "position ids they read reach them as this rank's rows or sequence chunk, so "
            "positions shared by the batch could not be told from one sample's (and a "
            "learned table would get this rank's part of its gradient); use tensor mode "
            f"{' or '.join(repr(m) for m in _modes_with_whole_activations())}"
        )
    if kind.splits_sequence:  # token-wise modules stay; attention goes around the ring
        # an images model embeds whole images; its span's blocks hold chunks of the tokens
        tokens_span = chosen.sequence_span if chosen.boundary == "images" else None
        split = None if tokens_span is None else span_members(model, tokens_span)
        check_no_token_mixing(model, split, f"tensor mode {mode!r}")
        materialize_whole_modules(model, ctx.device, seed=ctx.base_seed)
        install_sequence_attention(model, attention, ctx, sequence_attention)
        if chosen.boundary == "tokens" and not forward_takes_positions(model):
            tables = [name for name, role in roles.items() if role == "position_embedding"]
            install_chunk_positions(model, tables, ctx)
        install_dropout_streams(model, ctx, mode, roles)
        install_per_sample_draws(model, ctx)
        # the tokens are split only inside the span where one gathers them (a bare model's, an
        # images model's), everywhere for a language model's split logits
        chunked = chosen.sequence_span if splits_tokens else None
        split_span = None if chunked is None else span_members(model, chunked)
        left_out = install_left_out(model, roles, ctx, mode, split_span)
        install_own_code_check(model, roles, left_out, ctx, mode, split_span)
        install_boundary(model, chosen, ctx, mode, sequence_parallel=False)
        install_entry_points(model, ctx, mode, sequence_parallel=False)
        if chosen.causal_lm:
            install_generation(model, ctx, mode, sequence_parallel=False)
            install_model_loss(model, ctx)
        install_save_method(model, ctx)
        install_block_tags(model)
        setattr(model, PARALLELIZED_ATTR, mode)
        setattr(model, CONTEXT_ATTR, ctx)
        return model
    span = (
        span_members(model, chosen.sequence_span)
        if sequence_parallel and chosen.sequence_span is not None
        else {name for name, _ in model.named_modules()}  # a features plan: all of it
    )
    if sequence_parallel:
        check_no_token_mixing(model, span, f"tensor mode {mode!r} with sequence_parallel")
    routers = [name for name, role in roles.items() if role == "router"]
    materialize_whole_modules(model, ctx.device, routers, seed=ctx.base_seed)  # kept whole
    converter = Converter(
        ctx, mode, sequence_parallel, inner_norms(roles), attention, span, roles=roles, model=model
    )
    replaced: dict[int, nn.Parameter] = {}
    # The plain parameters stay alive, so no id() in ``replaced`` is reused by a new one (a
    # converted module may drop its plain module's parameters, as Experts1D does).
    kept: list[dict[str, nn.Parameter]] = []
    # Embeddings first: a head tied to one (registered before it or not) then shares its shard.
    ordered = sorted(roles.items(), key=lambda item: item[1] not in ("embedding",))
    for name, role in ordered:
        old = model.get_submodule(name)
        before = dict(old.named_parameters(remove_duplicate=False))
        new = converter.convert(name, old, role)
        if new is not old:
            carry_marking_hooks(old, new)
            _replace(model, name, new)
            kept.append(before)
            after = dict(new.named_parameters(remove_duplicate=False))
            for pname, param in before.items():
                if pname in after and after[pname] is not param:
                    replaced[id(param)] = after[pname]
    _retie(model, replaced)
    materialize_whole_modules(model, ctx.device, seed=ctx.base_seed)
    if sequence_parallel:
        _check_no_plain_parameters(model, span, chosen, roles, mode, sequence_parallel=True)
    elif kind.splits_activations:
        everything = {n for n, _ in model.named_modules()}
        _check_no_plain_parameters(model, everything, chosen, roles, mode, sequence_parallel=False)
    if not any(
        (info := get_shard_info(p)) is not None and info.is_sharded for p in model.parameters()
    ):
        raise ValueError(
            f"parallelize under tensor mode {mode!r}: the {chosen.name} splits no parameter of "
            f"{type(model).__name__}; name its linear layers ('col'/'row') or embeddings"
        )
    install_dropout_streams(model, ctx, mode, roles, sequence_parallel, chosen.sequence_span)
    install_per_sample_draws(model, ctx)
    left_out = install_left_out(model, roles, ctx, mode, span if sequence_parallel else None)
    install_own_code_check(model, roles, left_out, ctx, mode, span if sequence_parallel else None)
    own_masks = install_mask_rows(model, attention, ctx) if chosen.boundary == "tokens" else None
    install_boundary(model, chosen, ctx, mode, sequence_parallel, attention, own_masks)
    install_entry_points(model, ctx, mode, sequence_parallel)
    if chosen.logits_bias and kind.replicated_activations:  # logits split by vocabulary only
        split_logits_bias(model, chosen, ctx)
    if chosen.encoder is not None and kind.splits_activations:  # generate() calls it alone
        install_encoder_rows(model, chosen, ctx)
    if chosen.causal_lm:
        install_generation(model, ctx, mode, sequence_parallel)
        install_model_loss(model, ctx)
    heads = [name for name, role in roles.items() if role == "head"]
    install_split_logits(model, heads, mode, ctx)
    install_save_method(model, ctx)
    if kind.splits_weights:
        install_resize_refusal(model, mode)
    install_block_tags(model)
    setattr(model, PARALLELIZED_ATTR, mode)
    setattr(model, CONTEXT_ATTR, ctx)
    if sequence_parallel:
        setattr(model, SEQUENCE_SPAN_ATTR, chosen.sequence_span)
    return model
