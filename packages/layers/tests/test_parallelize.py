"""``parallelize``: models nobody wrote for tessera, against the single-process model.

For each mode: the full state dict after converting equals the original one (names, forms,
tied weights); the loss and every parameter gradient equal the single-process model's from
the same weights and batch. One worker pool per world size runs every check of that size.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import re
import types
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hf_models import (
    BATCH,
    BERT_CONFIG,
    GPT2_CONFIG,
    NUM_CLASSES,
    SEQ,
    bart_lm,
    bert_causal_lm,
    bert_classifier,
    bert_encoder,
    bert_mlm,
    bloom_lm,
    cohere_lm,
    decoder_labels,
    distilbert_encoder,
    falcon_lm,
    gemma_lm,
    glm4_lm,
    glm_lm,
    gpt2_bare,
    gpt2_classifier,
    gpt2_lm,
    gpt_bigcode_lm,
    gpt_neo_lm,
    gpt_neox_lm,
    granite_lm,
    images,
    llama_lm,
    masked_labels,
    mistral_lm,
    mixtral_lm,
    nemotron_lm,
    olmo2_lm,
    olmo_lm,
    opt_lm,
    phi3_lm,
    phi_lm,
    qwen2_lm,
    qwen2_moe_lm,
    qwen3_lm,
    qwen3_moe_lm,
    roberta_encoder,
    stablelm_lm,
    t5_encoder,
    t5_lm,
    token_ids,
    token_types,
    vit_classifier,
    vit_encoder,
    xglm_lm,
)
from mesh_reference import sum_deferred
from plain_models import (
    OWN_MODULES_PLAN,
    PLAIN_PLAN,
    PLAIN_SPAN_PLAN,
    Block,
    GatedMLP,
    LastTokenLM,
    LastTokenNormLM,
    LayerScale,
    MaskedPoolLM,
    ProbabilitiesLM,
    SelfAttention,
    functional_norm_lm,
    own_modules_lm,
    plain_lm,
)
from torch import nn

from tessera.context import (
    ParallelContext,
    ParallelMode,
    create_context,
    defer_gradient_sums,
    original_names_of,
)
from tessera.context.planner import Layout, ModelShape
from tessera.context.planner.memory import block_parameters, embedding_parameters
from tessera.layers import (
    BUILTIN_PLANS,
    Linear3D,
    Plan,
    causal_lm_loss,
    gather_full_state_dict,
    gather_logits,
    keep_gathered_operands,
    load_full_state_dict,
    local_logits,
    meta_parameters,
    original_names,
    parallelize,
    pipeline_layers,
    split_batch,
    token_loss,
)
from tessera.layers.conversion.experts import Experts1D
from tessera.layers.conversion.repeated_heads import RepeatedHeads

pytest.importorskip("transformers")

TOL = dict(rtol=1e-5, atol=1e-5)

#: name -> the ``tensor`` block of the parallel config.
LAYOUTS: dict[str, dict[str, Any]] = {
    "1d": dict(size=2, mode="1d"),
    "1d-sp": dict(size=2, mode="1d", sequence_parallel=True),
    "1d-4": dict(size=4, mode="1d"),
    "2d": dict(size=4, mode="2d"),
    "2.5d": dict(size=8, mode="2.5d", depth=2),
    "3d": dict(size=8, mode="3d"),
    "sequence-ring": dict(size=2, mode="sequence"),
    "sequence-all-to-all": dict(size=4, mode="sequence"),
}


def _context(tensor: dict[str, Any]) -> ParallelContext:
    return create_context(dict(parallel=dict(tensor=tensor)), timeout=60.0)


def _full_grads(
    model: nn.Module, ctx: ParallelContext, *, mean_loss: bool = False
) -> dict[str, torch.Tensor]:
    """Every parameter's gradient in the original model's names and forms.

    Under 'sequence' each rank's gradient is partial: summed over SEQUENCE here, as the
    engine's handler does (divided by N when each rank's loss carries N times its share,
    ``causal_lm_loss``'s convention).
    """
    for p in model.parameters():
        if p.grad is None:  # unused (as on one process: the reference check says if it is)
            p.grad = torch.zeros_like(p)
    if ctx.config.tensor_mode == "sequence":
        world = ctx.get_world_size(ParallelMode.SEQUENCE)
        for p in model.parameters():
            assert p.grad is not None
            torch.distributed.all_reduce(p.grad, group=ctx.get_group(ParallelMode.SEQUENCE))
            if mean_loss:
                p.grad /= world
    saved = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        for n, p in model.named_parameters():
            assert p.grad is not None, f"{n} has no gradient"
            p.copy_(p.grad)
    grads = gather_full_state_dict(model, context=ctx)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(saved[n])
    return grads


def _input_grad(grad: torch.Tensor, ctx: ParallelContext) -> torch.Tensor:
    """The gradient of a features plan's whole input, as one process's.

    Under 'sequence' every rank computes the same loss from the whole output, so each rank's
    gradient is N times its own tokens' share (zeros elsewhere), the convention of the
    sequence gradient handler: summed over SEQUENCE and divided by N here, as it does.
    """
    if ctx.config.tensor_mode != "sequence":
        return grad
    summed = grad.clone()
    dist.all_reduce(summed, group=ctx.get_group(ParallelMode.SEQUENCE))
    return summed / ctx.get_world_size(ParallelMode.SEQUENCE)


def _assert_grads_are_one_process(model: nn.Module, ref: nn.Module, ctx: ParallelContext) -> None:
    """Every gradient of ``model`` (``ref`` parallelized) is ``ref``'s, each rank's loss whole
    (under 'sequence' each rank's gradient is then N times its share)."""
    grads = _full_grads(model, ctx, mean_loss=True)
    for name, p in ref.named_parameters():
        assert p.grad is not None, name
        torch.testing.assert_close(grads[name], p.grad, **TOL, msg=lambda m, n=name: f"{n}: {m}")


def _assert_same_state(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].shape == tensor.shape, (name, got[name].shape, tensor.shape)
        assert torch.equal(got[name], tensor), f"{name} differs after parallelize"


def _per_sample_positions(ctx: ParallelContext) -> list[float]:
    """Positions of each sample's own: GPT-2 (a position table) and Llama (rotary) as one process.

    Every row is offset differently and one row packs two sequences (positions restart, so
    transformers masks attention between them). Under 3d the embeddings read layout "y"'s
    rows and attention runs on layout "z"'s, which hold other samples: both must get theirs.
    """
    ids = token_ids()
    positions = torch.stack([torch.arange(ids.shape[1]) + row for row in range(ids.shape[0])])
    positions[1] = torch.arange(ids.shape[1]) % (ids.shape[1] // 2)  # two packed sequences
    if ctx.config.tensor_mode == "3d":  # positions changed on the way: their rows are unknown
        lm = parallelize(gpt2_lm(), context=ctx)
        lm.transformer.wpe.register_forward_pre_hook(lambda m, args: (args[0].view(-1, SEQ),))
        with pytest.raises(ValueError, match="changed the per-sample position_ids"):
            lm(ids, position_ids=positions)
    return [
        _lm_matches_reference(gpt2_lm(), ctx, position_ids=positions),
        _lm_matches_reference(llama_lm(), ctx, position_ids=positions),
    ]


#: Every check of a layout, each its own test on a fresh context (one failure hides no other).
#: Under 3d BERT's head transform keeps the layout (its output swaps with the mirror rank);
#: under 'sequence' the ViT's class token is gathered from its rank's chunk, and on 4 ranks
#: its 10 tokens (9 patches and the class token) are padded to 12, masked as keys.
CHECKS: dict[str, Callable[[ParallelContext], Any]] = {
    "gpt2": lambda ctx: _lm_matches_reference(gpt2_lm(), ctx, generate=True),
    "llama": lambda ctx: _lm_matches_reference(llama_lm(), ctx, generate=True),
    "qwen2 (inferred plan)": lambda ctx: _lm_matches_reference(qwen2_lm(), ctx),
    "fewer key/value heads than tensor ranks (repeated)": lambda ctx: _repeated_heads(ctx),
    "mixtures of experts (family plans, experts split under 1D)": lambda ctx: _experts(ctx),
    "norms of each head with a weight per head (stablelm, cohere)": lambda ctx: _weights_per_head(
        ctx
    ),
    "bloom (family plan, ALiBi slopes of each rank's heads)": lambda ctx: _alibi(ctx),
    "falcon (family plans, q/k/v fused per head or per key/value group)": lambda ctx: _falcon(ctx),
    "q, k and v fused, key/value heads repeated (gpt-bigcode multi-query, phi3)": lambda ctx: (
        _fused_repeats(ctx)
    ),
    "gpt-neo (plan read from its blocks)": lambda ctx: _lm_matches_reference(gpt_neo_lm(), ctx),
    "phi (plan read from its blocks, query and key heads normalized)": lambda ctx: (
        _lm_matches_reference(phi_lm(), ctx)
    ),
    "qwen3 (query and key heads normalized)": lambda ctx: _lm_matches_reference(qwen3_lm(), ctx),
    "olmo2 (plan read from its blocks, norms of all query and key features)": lambda ctx: (
        _lm_matches_reference(_with_plan(olmo2_lm(), "plan read from"), ctx)
    ),
    "gpt-neox (family plan, q/k/v fused by head)": lambda ctx: _lm_matches_reference(
        gpt_neox_lm(), ctx
    ),
    "olmo (family plan, norms without parameters)": lambda ctx: _lm_matches_reference(
        _with_plan(olmo_lm(), "Llama LM plan inferred"), ctx
    ),
    "granite (family plan, its own RMSNorm class)": lambda ctx: _lm_matches_reference(
        _with_plan(granite_lm(), "Llama LM plan inferred"), ctx
    ),
    "phi3 (fused q/k/v with grouped-query attention, fused gate/up)": lambda ctx: (
        _lm_matches_reference(phi3_lm(), ctx, then_attention="eager")  # built with sdpa
    ),
    "glm (family plan, fused gate/up)": lambda ctx: _lm_matches_reference(
        _with_plan(glm_lm(), "GLM LM plan inferred"), ctx
    ),
    "glm4 (family plan, fused gate/up, norms after attention and MLP)": lambda ctx: (
        _lm_matches_reference(_with_plan(glm4_lm(), "GLM-4 LM plan inferred"), ctx)
    ),
    "gemma (family plan, scaled token rows, norms scaling by 1 + weight)": lambda ctx: (
        _lm_matches_reference(_with_plan(gemma_lm(), "Llama LM plan inferred"), ctx)
    ),
    "gemma2 (plan read from its blocks, soft-capped scores)": lambda ctx: _lm_matches_reference(
        _with_plan(gemma_lm("Gemma2"), "plan read from"), ctx
    ),
    "gemma3 (plan read from its blocks, heads normalized by 1 + weight)": lambda ctx: (
        _lm_matches_reference(_with_plan(gemma_lm("Gemma3"), "plan read from"), ctx)
    ),
    "nemotron (plan read from its blocks, LayerNorms scaling by 1 + weight)": lambda ctx: (
        _lm_matches_reference(_with_plan(nemotron_lm(), "plan read from"), ctx)
    ),
    "position tables (xglm's sinusoidal, opt's shifted; plans read from the blocks)": lambda ctx: (
        _position_tables(ctx)
    ),
    "plain transformer (plan read from its blocks, learned positions, SDPA)": lambda ctx: (
        _plain_lm_matches_reference(ctx)
    ),
    "modules left out of the plan mixing split features, hidden layer and vocabulary": lambda ctx: (
        _plain_lm_loss(ctx, OWN_MODULES_PLAN, own_modules_lm)
    ),
    "clip vision encoder (patch conv, class token, pooler of the first token)": lambda ctx: (
        _clip_matches_reference(ctx)
    ),
    "parts parallelized, the rest whole (clip towers, CLIPModel, an own ViT's blocks)": (
        lambda ctx: _clip_parts_match_reference(ctx)
    ),
    "verify: outputs and gradients against the model before conversion": lambda ctx: _verified(ctx),
    "a mask beside the hidden states (own model: padded keys in SDPA, a masked mean)": lambda ctx: (
        _padded_pool_matches_reference(ctx)
    ),
    "torch nn.TransformerEncoder (nn.MultiheadAttention split by heads, padded)": lambda ctx: (
        _torch_encoders_match_reference(ctx)
    ),
    "bert": lambda ctx: _lm_matches_reference(bert_mlm(), ctx),
    "bert as a decoder (BertLMHeadModel: converted part by part, its logits whole)": lambda ctx: (
        _lm_matches_reference(bert_causal_lm(), ctx)
    ),
    "bare encoders (bert, roberta, distilbert, vit: hidden states and pooler whole)": lambda ctx: (
        _encoders_match_reference(ctx)
    ),
    "sequence classifiers (bert, gpt-2: labels give one process's loss)": lambda ctx: (
        _classifiers_match_reference(ctx)
    ),
    "vit": lambda ctx: _lm_matches_reference(vit_classifier(), ctx),
    "encoder-decoders (bart: two token streams, cross-attention, final_logits_bias)": lambda ctx: (
        _encoder_decoders(ctx)
    ),
    "encoder-decoders (t5 and its bare encoder: relative position bias per head, rescaled head)": (
        lambda ctx: _t5_models(ctx)
    ),
    "per-sample positions": _per_sample_positions,
    "sequences the ranks do not divide (padded under sequence parallelism)": lambda ctx: [
        _lm_matches_reference(gpt2_lm(), ctx, length=SEQ - 1),
        _lm_matches_reference(llama_lm(), ctx, length=SEQ - 1),
        _lm_matches_reference(bert_mlm(), ctx, length=SEQ - 1),
        *([_checkpointing_replays_each_batch_padding(ctx)] if _splits_sequence(ctx) else []),
    ],
    "activation checkpointing (transformers', reentrant, frozen embeddings)": lambda ctx: (
        _checkpointed_with_frozen_embeddings(ctx)
    ),
    "dropout": lambda ctx: _dropout_streams(ctx),
    "blocks": lambda ctx: _mlp_matches_reference(ctx),
    "meta": lambda ctx: _meta_built(ctx),
    "layers": lambda ctx: _as_pipeline_layers(ctx),
}

#: One layout of each mode (1D with and without sequence parallelism, the ring for 'sequence').
EACH_MODE = ("1d", "1d-sp", "2d", "2.5d", "3d", "sequence-ring")

#: The layouts a check runs under unless ONLY_UNDER names others: 1D on 4 ranks runs only the
#: checks whose head, key/value head or expert counts 2 ranks would divide too easily.
EVERY_CHECK = ("1d", "1d-sp", "2d", "2.5d", "3d", "sequence-ring", "sequence-all-to-all")


#: Checks whose models 2.5D cuts as 2D does (heads and features over the same q x q grid), so
#: its depth, the batch split once more, adds nothing to them: they run under 2D only. 2.5D
#: keeps the checks of the batch (per-sample pooling, masks, dropout, left-out modules, the
#: engine's blocks, pipeline layers) and both language models.
SAME_UNDER_DEPTH = (
    "plain transformer (plan read from its blocks, learned positions, SDPA)",
    "clip vision encoder (patch conv, class token, pooler of the first token)",
    "bert",
    "bare encoders (bert, roberta, distilbert, vit: hidden states and pooler whole)",
    "vit",
)


def _runs(check: str, layout: str) -> bool:
    """Whether ``check`` runs under ``layout`` (ONLY_UNDER, EVERY_CHECK, SAME_UNDER_DEPTH)."""
    if check in ONLY_UNDER:
        return _listed(ONLY_UNDER[check], layout)
    return layout in EVERY_CHECK and not (layout == "2.5d" and check in SAME_UNDER_DEPTH)


def _listed(names: tuple[str, ...], layout: str) -> bool:
    """Whether ``names`` (layouts, or tensor modes standing for all of theirs) hold ``layout``."""
    return bool({layout, LAYOUTS[layout]["mode"]} & set(names))


#: Checks that run under some tensor modes (or layouts, by name) only: a model without a plan
#: (Qwen2, GPT-Neo, Phi) under a few each, per-sample positions where the batch is split.
ONLY_UNDER = {
    # its logits come back whole ([b, s, V]) where the sequence loss split the targets anyway
    "bert as a decoder (BertLMHeadModel: converted part by part, its logits whole)": (
        "sequence-ring",
    ),
    "qwen2 (inferred plan)": ("1d", "2d", "sequence"),
    "fewer key/value heads than tensor ranks (repeated)": ("1d", "1d-4", "1d-sp", "2d", "3d"),
    "mixtures of experts (family plans, experts split under 1D)": (
        "1d",
        "1d-sp",
        "1d-4",
        "2d",
        "sequence-ring",
    ),
    "norms of each head with a weight per head (stablelm, cohere)": ("1d-sp", "3d"),
    # the boundary's padding is the ring's and the all-to-all's (the latter masks the padding
    # as keys in the padded BERT of every layout)
    "sequences the ranks do not divide (padded under sequence parallelism)": (
        "1d-sp",
        "sequence-ring",
    ),
    "modules left out of the plan mixing split features, hidden layer and vocabulary": EACH_MODE,
    "activation checkpointing (transformers', reentrant, frozen embeddings)": ("1d-sp", "2d"),
    "parts parallelized, the rest whole (clip towers, CLIPModel, an own ViT's blocks)": (EACH_MODE),
    "verify: outputs and gradients against the model before conversion": (
        "1d",
        "1d-sp",
        "2d",
        "3d",
        "sequence-ring",
    ),
    "bloom (family plan, ALiBi slopes of each rank's heads)": ("1d-sp", "3d"),
    "falcon (family plans, q/k/v fused per head or per key/value group)": ("1d-sp", "2d", "3d"),
    "q, k and v fused, key/value heads repeated (gpt-bigcode multi-query, phi3)": (
        "1d",
        "2d",
        "3d",
        "sequence-ring",
    ),
    "gpt-neo (plan read from its blocks)": ("1d", "2d"),
    "phi (plan read from its blocks, query and key heads normalized)": (
        "1d-sp",
        "3d",
        "sequence-ring",
    ),
    "qwen3 (query and key heads normalized)": ("1d", "2d"),
    "olmo2 (plan read from its blocks, norms of all query and key features)": ("1d", "3d"),
    "gpt-neox (family plan, q/k/v fused by head)": ("1d-4", "2d", "sequence-ring"),
    "olmo (family plan, norms without parameters)": ("1d-sp", "2d"),
    "granite (family plan, its own RMSNorm class)": ("3d",),
    "phi3 (fused q/k/v with grouped-query attention, fused gate/up)": ("1d-4", "1d-sp", "3d"),
    "glm (family plan, fused gate/up)": ("1d-4",),
    "glm4 (family plan, fused gate/up, norms after attention and MLP)": ("1d", "2d"),
    "gemma (family plan, scaled token rows, norms scaling by 1 + weight)": ("2d",),
    "gemma2 (plan read from its blocks, soft-capped scores)": ("1d-sp",),
    "gemma3 (plan read from its blocks, heads normalized by 1 + weight)": ("1d", "3d"),
    "nemotron (plan read from its blocks, LayerNorms scaling by 1 + weight)": ("1d-sp",),
    "per-sample positions": ("2d", "3d"),
    "a mask beside the hidden states (own model: padded keys in SDPA, a masked mean)": (
        "1d",
        "2d",
        "3d",
    ),
    "encoder-decoders (bart: two token streams, cross-attention, final_logits_bias)": EACH_MODE,
    "encoder-decoders (t5 and its bare encoder: relative position bias per head, rescaled head)": (
        EACH_MODE
    ),
    "position tables (xglm's sinusoidal, opt's shifted; plans read from the blocks)": (
        "1d",
        "1d-sp",
        "2d",
        "sequence",
    ),
}


def _with_plan(model: nn.Module, name: str) -> nn.Module:
    """``model``, after checking that the plan ``parallelize`` will pick is the one named."""
    from tessera.layers.conversion.plan import plan_for

    assert plan_for(model, None).name.startswith(name), plan_for(model, None).name
    return model


def _timm_vit_matches_reference(ctx: ParallelContext) -> float:
    """timm's ``VisionTransformer``, no plan given: the marker of its fused ``attn.qkv`` gives
    the timm ViT plan; its class token and positions (the model's own parameters) and its
    ``patch_embed`` compute as the mode's patch embedding under timm's names. The state dict,
    the logits, the loss and every gradient are one process's. Under 2d and 'sequence' the
    head reads the mean token (``norm`` then an Identity, ``fc_norm`` a LayerNorm)."""
    from hf_models import timm_vit

    mode, size = ctx.config.tensor_mode, ctx.get_world_size(ParallelMode.TENSOR)
    impl = "all_to_all" if mode == "sequence" and size == 4 else "ring"
    ref = timm_vit(global_pool="avg" if mode in ("2d", "sequence") else "token")
    model = parallelize(copy.deepcopy(ref), sequence_attention=impl, context=ctx)
    _assert_same_state(gather_full_state_dict(model, context=ctx), ref.state_dict())
    pixels, labels = images()
    ref_logits = ref(pixels)  # [b, C]
    ref_loss = F.cross_entropy(ref_logits, labels)
    logits = model(pixels)
    loss = token_loss(logits, labels, context=ctx)
    torch.testing.assert_close(loss, ref_loss, **TOL)
    torch.testing.assert_close(gather_logits(logits, context=ctx), ref_logits.detach(), **TOL)
    ref_loss.backward()
    loss.backward()
    _assert_grads_are_one_process(model, ref, ctx)
    _timm_entry_points(ref, model, pixels, ctx)
    if mode == "2d":  # a gated MLP's fc1 holds value and gate side by side: no plan
        from timm.layers import SwiGLUPacked

        with pytest.raises(ValueError, match="ships no plan for VisionTransformer"):
            parallelize(timm_vit(mlp_layer=SwiGLUPacked), context=ctx)
    return round(float(loss.detach()), 5)


def _timm_entry_points(
    ref: nn.Module, model: nn.Module, pixels: torch.Tensor, ctx: ParallelContext
) -> None:
    """timm's entry points besides forward, which the boundary does not see: run where they
    give one process's numbers (forward_intermediates under 1d only, forward_features where
    the span gathers the tokens at the final norm too), refused by name elsewhere (under 2d
    forward_intermediates returned this rank's features, without an error)."""
    kind = ctx.config.mode
    assert kind is not None
    sp = bool(ctx.config.tensor_args.get("sequence_parallel", False))
    whole = kind.replicated_activations and not sp
    with torch.no_grad():
        if whole:
            want = ref.forward_intermediates(pixels, indices=1)  # NCHW: [b, h, H/p, W/p]
            got = model.forward_intermediates(pixels, indices=1)
            torch.testing.assert_close(got[1][0], want[1][0], **TOL)
        else:
            with pytest.raises(ValueError, match=r"forward_intermediates of a model paral"):
                model.forward_intermediates(pixels)
        if whole or kind.splits_sequence or sp:
            torch.testing.assert_close(
                model.forward_features(pixels), ref.forward_features(pixels), **TOL
            )
        else:
            with pytest.raises(ValueError, match=r"forward_features of a model parallelized"):
                model.forward_features(pixels)


def _torchvision_vit_matches_reference(ctx: ParallelContext) -> float:
    """torchvision's ``VisionTransformer``, no plan given: no family is laid out like it, but
    its blocks are the usual ones in an ``nn.Sequential`` (``encoder.layers``), which get a
    features plan read from them; the model is converted part by part, its patch
    convolution, class token, positions and head whole on every rank. The logits come back
    whole; they, the loss and every gradient are one process's."""
    from hf_models import torchvision_vit

    mode, size = ctx.config.tensor_mode, ctx.get_world_size(ParallelMode.TENSOR)
    impl = "all_to_all" if mode == "sequence" and size == 4 else "ring"
    ref = torchvision_vit()
    model = parallelize(copy.deepcopy(ref), sequence_attention=impl, context=ctx)
    assert isinstance(model.conv_proj, nn.Conv2d)  # whole, outside the part
    _assert_same_state(gather_full_state_dict(model, context=ctx), ref.state_dict())
    pixels, labels = images()
    ref_logits = ref(pixels)  # [b, C]
    ref_loss = F.cross_entropy(ref_logits, labels)
    logits = model(pixels)
    torch.testing.assert_close(logits, ref_logits.detach(), **TOL)
    loss = F.cross_entropy(logits, labels)
    ref_loss.backward()
    loss.backward()
    _assert_grads_are_one_process(model, ref, ctx)
    return round(float(loss.detach()), 5)


def _timm_vit_variant_matches_reference(ctx: ParallelContext) -> float:
    """timm's ``VisionTransformer`` as DINOv2 and SigLIP lay it out: no class token, two
    register tokens (11 tokens, padded under 1D sequence parallelism and 'sequence'), the mean
    token pooled, a layer scale after attention and MLP, q and k normalized per head. The ViT
    plan's patch embedding takes none of the first three, so the model is converted part by
    part: its ``blocks`` (the family's blocks plan: q/k norms as head norms, each layer scale
    ``[h]`` left out, run under DTensor) split, the rest whole."""
    from hf_models import timm_vit

    mode, size = ctx.config.tensor_mode, ctx.get_world_size(ParallelMode.TENSOR)
    impl = "all_to_all" if mode == "sequence" and size == 4 else "ring"
    variant = dict(class_token=False, reg_tokens=2, init_values=0.5, qk_norm=True)
    ref = timm_vit(global_pool="avg", **variant)
    model = parallelize(copy.deepcopy(ref), sequence_attention=impl, context=ctx)
    assert isinstance(model.patch_embed.proj, nn.Conv2d)  # whole, outside the part
    _assert_same_state(gather_full_state_dict(model, context=ctx), ref.state_dict())
    pixels, labels = images()
    ref_logits = ref(pixels)  # [b, C], whole from the parts too
    logits = model(pixels)
    torch.testing.assert_close(logits, ref_logits.detach(), **TOL)
    F.cross_entropy(ref_logits, labels).backward()
    loss = F.cross_entropy(logits, labels)
    loss.backward()
    _assert_grads_are_one_process(model, ref, ctx)
    return round(float(loss.detach()), 5)


def _timm_vit_stages_match_reference(ctx: ParallelContext) -> float:
    """timm's ViT under its family's plan as pipeline layers (``pipeline_layers``): the first
    stage runs its patch embedding and adds its tokens and positions, the last its final norm
    and ``forward_head`` (the mean token, a layer scale and q/k norms in the blocks). Logits,
    loss and every gradient are one process's; under 'sequence' (its blocks take no mask of
    the padded chunks) and where the model was converted part by part, refused by name."""
    from hf_models import timm_vit

    ref = timm_vit(global_pool="avg", init_values=0.5, qk_norm=True)
    model = parallelize(copy.deepcopy(ref), context=ctx)
    kind = ctx.config.mode
    assert kind is not None
    if kind.splits_sequence:
        with pytest.raises(ValueError, match="its blocks take no mask of that padding"):
            pipeline_layers(model)
        return 0.0
    layers = pipeline_layers(model)
    assert sorted(set(original_names(layers, model).values())) == sorted(
        n for n, _ in model.named_parameters()
    )
    pixels, labels = images()
    ref_logits = ref(pixels)
    logits = layers(pixels)
    torch.testing.assert_close(gather_logits(logits, context=ctx), ref_logits.detach(), **TOL)
    loss = token_loss(logits, labels, context=ctx)
    F.cross_entropy(ref_logits, labels).backward()
    loss.backward()
    _assert_grads_are_one_process(model, ref, ctx)
    in_parts = parallelize(timm_vit(class_token=False, global_pool="avg"), context=ctx)
    with pytest.raises(ValueError, match="was converted part by part"):
        pipeline_layers(in_parts)
    from timm.models.deit import VisionTransformerDistilled

    # its own code reads a distillation token and a second head no stage would hold
    distilled = VisionTransformerDistilled(
        img_size=6, patch_size=2, embed_dim=16, depth=1, num_heads=4
    )
    with pytest.raises(ValueError, match=r"holds dist_token, head_dist.weight, head_dist.bias"):
        pipeline_layers(distilled, context=None)
    return round(float(loss.detach()), 5)


def _vision_transformers_match_reference(ctx: ParallelContext) -> list[float]:
    return [
        _timm_vit_matches_reference(ctx),
        _timm_vit_variant_matches_reference(ctx),
        _torchvision_vit_matches_reference(ctx),
        _timm_vit_stages_match_reference(ctx),
    ]


#: Checks of models whose library only the newest torch's environment holds (timm needs
#: torchvision); run by their own tests, which skip where the library is missing.
OPTIONAL_CHECKS: dict[str, Callable[[ParallelContext], Any]] = {
    "vision transformers": _vision_transformers_match_reference,
}


def _run_check(tensor: dict[str, Any], check: str) -> Any:
    ctx = _context(tensor)
    try:
        return {**CHECKS, **OPTIONAL_CHECKS}[check](ctx)
    finally:
        ctx.destroy()


def _lm_matches_reference(
    ref: nn.Module,
    ctx: ParallelContext,
    position_ids: torch.Tensor | None = None,
    *,
    then_attention: str | None = None,
    defer: bool = False,
    keep_gathered: bool = False,
    generate: bool = False,
    length: int = SEQ,
) -> float:
    """A transformers language model, parallelized, against itself on one process.

    ``then_attention``: both switch to this attention implementation after ``parallelize``
    (the converted attention modules must follow the model's config, as the masks do).
    ``defer``: the layers leave their gradient sums to the caller, which sums after the
    backward as the engine does at the step. ``keep_gathered``: under 3D every ``Linear3D``
    (also one a converted module runs outside its parameters) keeps its gathered operands.
    ``generate``: also greedy generation and the loss of whole logits (a causal LM).
    ``length``: the tokens of each row (1D sequence parallelism pads what its ranks do not
    divide).
    """
    mode, size = ctx.config.tensor_mode, ctx.get_world_size(ParallelMode.TENSOR)
    impl = "all_to_all" if mode == "sequence" and size == 4 else "ring"
    model = parallelize(copy.deepcopy(ref), sequence_attention=impl, context=ctx)
    if keep_gathered:
        kept = keep_gathered_operands(model)
        assert kept == sum(isinstance(m, Linear3D) for m in model.modules()) > 0
        repeats = [m.layer for m in model.modules() if isinstance(m, RepeatedHeads)]
        assert all(isinstance(r, Linear3D) and r.keep_gathered for r in repeats)
    sums = defer_gradient_sums([model]) if defer else {}
    if defer:
        assert sums, "nothing deferred"
    if then_attention is not None:
        for lm in (ref, model):
            lm.set_attn_implementation(then_attention)
        (attention,) = {
            m.config._attn_implementation for m in model.modules() if hasattr(m, "config")
        }
        assert attention == then_attention
    original = ref.state_dict()
    _assert_same_state(gather_full_state_dict(model, context=ctx), original)
    _assert_planner_counts(ref, model, ctx)
    if ref.get_output_embeddings() is not None:
        head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
        tied = ref.get_output_embeddings().weight is ref.get_input_embeddings().weight
        assert (head.weight is embedding.weight) == tied, "tying changed"

    ids = token_ids()[:, :length]
    if type(ref).__name__ == "ViTForImageClassification":  # one class per image
        pixels, labels = images()
        ref_logits = ref(pixels).logits
        ref_loss = F.cross_entropy(ref_logits, labels)
        logits = model(pixels).logits
        loss = token_loss(logits, labels, context=ctx)
        with torch.no_grad():  # its own loss (a loss_function reading [b, C]) is tessera's
            torch.testing.assert_close(model(pixels, labels=labels).loss, ref_loss, **TOL)
    elif type(ref).__name__ == "BertForMaskedLM":  # a masked LM with token types, padded
        padded = torch.ones_like(ids)
        padded[0, -3:], padded[-1, -1:] = 0, 0  # rows and tokens every layout splits apart
        types = token_types()[:, :length]
        inputs = dict(input_ids=ids, token_type_ids=types, attention_mask=padded)
        labels = masked_labels(ids)
        ref_logits = ref(**inputs).logits
        vocab = ref_logits.shape[-1]
        ref_loss = F.cross_entropy(ref_logits.reshape(-1, vocab), labels.reshape(-1))
        logits = model(**inputs).logits
        loss = token_loss(logits, labels, context=ctx)
        # its own loss builds nn.CrossEntropyLoss() inline: computed at the boundary instead
        with torch.no_grad():
            torch.testing.assert_close(model(**inputs, labels=labels).loss, ref_loss, **TOL)
        if mode != "sequence":  # the pair an engine with per_token_loss weighs globally
            total, count = token_loss(logits, labels, reduction="sum_and_count", context=ctx)
            assert int(count) == int((labels != -100).sum())
            torch.testing.assert_close(total.detach() / count, loss.detach(), **TOL)
    else:
        ref_logits = ref(ids, position_ids=position_ids).logits
        vocab = ref_logits.shape[-1]
        ref_loss = F.cross_entropy(ref_logits[:, :-1].reshape(-1, vocab), ids[:, 1:].reshape(-1))
        logits = model(ids, position_ids=position_ids).logits
        loss = causal_lm_loss(logits, ids, context=ctx)
    ref_loss.backward()
    loss.backward()
    sum_deferred(sums, ctx)
    torch.testing.assert_close(loss, ref_loss, **TOL)
    if logits.shape == ref_logits.shape:  # whole: a head outside the parts converted (parts.py)
        torch.testing.assert_close(logits, ref_logits.detach(), **TOL)
    else:
        if not (mode == "sequence" and length % size):  # else its chunks hold the padding
            torch.testing.assert_close(logits, _local_logits(ref_logits.detach(), ctx), **TOL)
        torch.testing.assert_close(gather_logits(logits, context=ctx), ref_logits.detach(), **TOL)

    grads = _full_grads(model, ctx, mean_loss=True)
    for name, p in ref.named_parameters(remove_duplicate=False):
        if p.grad is None:  # unused on one process too (BertLMHeadModel's cls.predictions.bias)
            assert not grads[name].any(), f"{name}: a gradient one process does not have"
            continue
        torch.testing.assert_close(grads[name], p.grad, **TOL, msg=lambda m, n=name: f"{n}: {m}")
    if generate:
        _whole_logits_loss(logits, ids, ref_loss, ctx)
        _generates_as_one_process(ref, model, ids, ctx)
        _labels_give_the_loss(model, ids, ref_loss)
        _soft_prompt_trains_as_one_process(ref, model, ids, ctx)
        if type(ref).__name__ == "GPT2LMHeadModel":
            _other_ranks_blocks_refused(model, ctx)
    # The original state dict loads back as it is (Conv1D orientation, fused q/k/v).
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    load_full_state_dict(model, original)
    _assert_same_state(gather_full_state_dict(model, context=ctx), original)
    return round(float(loss.detach()), 5)


def _plain_lm_matches_reference(ctx: ParallelContext) -> list[float]:
    """A transformer as a researcher writes it, no plan given (the plan read from its blocks,
    token and position tables told apart) and its dict plan (token ids kept whole): loss,
    logits and every gradient as one process. Under 'sequence' its SDPA call is taken over
    and its position table moved to the chunk."""
    return [_plain_lm_loss(ctx, plan) for plan in (None, PLAIN_PLAN)]


def _plain_lm_loss(
    ctx: ParallelContext,
    plan: Plan | dict[str, str] | None,
    build: Callable[[], nn.Module] = plain_lm,
) -> float:
    """Loss, logits and every gradient of ``build()`` parallelized with ``plan``, against one
    process. With :func:`own_modules_lm`: the modules the plan leaves out run under DTensor
    (conversion/left_out.py), where they computed on this rank's block as if whole (a loss
    off by 4e-4 under 2d and 3d, 5e-3 under 1d)."""
    mode, size = ctx.config.tensor_mode, ctx.get_world_size(ParallelMode.TENSOR)
    impl = "all_to_all" if mode == "sequence" and size == 4 else "ring"
    ref = build()
    model = parallelize(copy.deepcopy(ref), plan, sequence_attention=impl, context=ctx)
    _assert_same_state(gather_full_state_dict(model, context=ctx), ref.state_dict())
    ids = token_ids()
    ref_logits = ref(ids)  # [b, s, V]
    vocab = ref_logits.shape[-1]
    ref_loss = F.cross_entropy(ref_logits[:, :-1].reshape(-1, vocab), ids[:, 1:].reshape(-1))
    logits = model(ids)
    loss = causal_lm_loss(logits, ids, context=ctx)
    ref_loss.backward()
    loss.backward()
    torch.testing.assert_close(loss, ref_loss, **TOL)
    whole = gather_logits(logits, context=ctx)
    torch.testing.assert_close(whole, ref_logits.detach(), **TOL)
    kind = ctx.config.mode
    if kind is not None and kind.splits_activations and not kind.splits_sequence:
        # whole logits are one process's loss on the grids; this rank's rows with this
        # rank's targets are refused (their mean would be this rank's alone)
        torch.testing.assert_close(causal_lm_loss(whole, ids, context=ctx), ref_loss, **TOL)
        rows = split_batch(ids, context=ctx)
        with pytest.raises(ValueError, match="differ between the ranks that split the batch"):
            causal_lm_loss(logits.detach(), rows, context=ctx)
        if build is own_modules_lm:  # a module left out mixing a mask of this rank's rows
            masked = parallelize(MaskedPoolLM(), PLAIN_SPAN_PLAN, context=ctx)
            with pytest.raises(RuntimeError, match=r"'pool' \(a module the plan leaves out"):
                masked(ids)
    grads = _full_grads(model, ctx, mean_loss=True)
    for name, p in ref.named_parameters():
        assert p.grad is not None
        torch.testing.assert_close(grads[name], p.grad, **TOL, msg=lambda m, n=name: f"{n}: {m}")
    return round(float(loss.detach()), 5)


def _clip_matches_reference(ctx: ParallelContext) -> float:
    """``CLIPVisionModel`` with the plan shipped for it: its state dict in CLIP's names and
    shapes (class token ``[E]``, position ``nn.Embedding``, no patch bias), hidden states and
    the pooler's output of the class token whole, every gradient as one process."""
    from hf_models import clip_vision_encoder

    ref = clip_vision_encoder()
    model = parallelize(copy.deepcopy(ref), context=ctx)
    original = ref.state_dict()
    _assert_same_state(gather_full_state_dict(model, context=ctx), original)
    loss = _encoder_matches_reference(ref, dict(pixel_values=images()[0]), ctx)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    load_full_state_dict(model, original)
    _assert_same_state(gather_full_state_dict(model, context=ctx), original)
    return loss


def _verified(ctx: ParallelContext) -> list[str]:
    """``parallelize(..., verify=ids)``: the plain transformer passes under every layout; one
    that normalizes in its own forward, with no module a plan could name, is an error where
    the mode splits the features between blocks (2D, 2.5D, 3D) and passes where they are
    whole (1D) or split by tokens only (1D sequence parallelism, 'sequence').

    Without ``verify=``, the converted model's first call refuses the mean over the split
    features, naming it and the model's line (conversion/own_code.py); verify catches the
    same norm taken of ``x`` viewed as one head, which that check reads as a norm per head."""
    ids = token_ids()
    parallelize(plain_lm(), PLAIN_SPAN_PLAN, context=ctx, verify=(ids,))
    kind = ctx.config.mode
    assert kind is not None
    torch.manual_seed(0)
    probabilities = parallelize(ProbabilitiesLM(), PLAIN_SPAN_PLAN, context=ctx)
    if ctx.config.tensor_mode == "1d":  # the head's logits split by vocabulary
        with pytest.raises(ValueError, match=r"torch\.Tensor\.softmax over dim 2 of a "):
            probabilities(ids)
    else:  # the grids' logits split by rows, 'sequence''s by tokens: every class whole
        probabilities(ids)
    torch.manual_seed(0)
    last_token = parallelize(LastTokenLM(), PLAIN_SPAN_PLAN, context=ctx)
    if kind.splits_sequence:  # this rank's last token, returned or given to a norm
        with pytest.raises(ValueError, match=r"__getitem__ over dim 1 .* the model returns it"):
            last_token(ids)
        torch.manual_seed(0)
        normed = parallelize(LastTokenNormLM(), PLAIN_SPAN_PLAN, context=ctx)
        with pytest.raises(ValueError, match=r"over dim 1 .* it is given to 'ln_f', which comp"):
            normed(ids)
        rules = {k: v for k, v in PLAIN_PLAN.items() if k != "ln_f"}  # ln_f left out
        span = ("blocks.0", "blocks.-1")
        plan = Plan(rules, boundary="tokens", sequence_span=span, causal_lm=True)
        torch.manual_seed(0)
        normed = parallelize(LastTokenNormLM(), plan, context=ctx)
        # refused where the hooks running it under DTensor first read it
        with pytest.raises(ValueError, match=r"__getitem__ over dim 1 .*self\.ln_f\(x\[:, -1\]\)"):
            normed(ids)
    else:
        last_token(ids)
    if not kind.splits_activations or kind.splits_sequence:
        parallelize(functional_norm_lm(), PLAIN_SPAN_PLAN, context=ctx, verify=(ids,))
        parallelize(functional_norm_lm(reshaped=True), PLAIN_SPAN_PLAN, context=ctx)(ids)
        return ["passed"]
    model = parallelize(functional_norm_lm(), PLAIN_SPAN_PLAN, context=ctx)
    line = r"plain_models\.py:\d+ \(forward: mean_square = x\.pow\(2\)\.mean\(-1, keepdim=True\)"
    with pytest.raises(
        ValueError, match=rf"torch\.Tensor\.mean over dim 2 of a \[\d+, \d+, 8\] block.*{line}"
    ):
        model(ids)
    with pytest.raises(ValueError, match=r"verify=...\): output 0 \(gathered\) differs from one"):
        reshaped = functional_norm_lm(reshaped=True)
        parallelize(reshaped, PLAIN_SPAN_PLAN, context=ctx, verify=(ids,))
    return ["refused"]


def _clip_parts_match_reference(ctx: ParallelContext) -> list[float]:
    """CLIP's text tower (its plan), each tower under its projection and the two-tower
    ``CLIPModel`` (no plan: each tower parallelized as a part, the projections and the
    temperature whole): every floating output (the contrastive loss, the similarity logits,
    the embeddings, the hidden states) and every gradient as one process. The text tower reads
    each row's end-of-text token: refused by name under 'sequence'."""
    from hf_models import clip_models

    mode = ctx.config.tensor_mode
    ids, pixels = token_ids(), images()[0]
    mask = torch.ones_like(ids)
    mask[0, -3:] = 0  # a padded row
    losses = []
    for name, ref in clip_models().items():
        inputs: dict[str, Any] = {}
        if "Vision" not in name:
            inputs |= dict(input_ids=ids, attention_mask=mask)
        if "Text" not in name:
            inputs |= dict(pixel_values=pixels)
        if name == "CLIPModel":
            inputs |= dict(return_loss=True)
        if mode == "sequence" and "Vision" not in name:
            with pytest.raises(ValueError, match="end-of-text token, which each rank's chunk"):
                parallelize(copy.deepcopy(ref), context=ctx)
            continue
        model = parallelize(copy.deepcopy(ref), context=ctx)
        want, got = ref(**inputs), model(**inputs)
        fields = [
            k for k, v in want.items() if isinstance(v, torch.Tensor) and v.is_floating_point()
        ]
        for field in fields:
            torch.testing.assert_close(got[field], want[field], **TOL, msg=f"{name}.{field}")
        ref_loss = sum(want[k].pow(2).mean() for k in fields)
        loss = sum(got[k].pow(2).mean() for k in fields)
        ref_loss.backward()
        loss.backward()
        grads = _full_grads(model, ctx, mean_loss=True)
        for pname, p in ref.named_parameters():
            assert p.grad is not None, pname
            torch.testing.assert_close(
                grads[pname], p.grad, **TOL, msg=lambda m, n=f"{name}: {pname}": f"{n}: {m}"
            )
        losses.append(round(float(loss.detach()), 5))
    return [*losses, _patch_vit_matches_reference(ctx)]


def _patch_vit_matches_reference(ctx: ParallelContext) -> float:
    """An own ViT (:class:`PatchViT`): its blocks, called in a loop, each a part with a
    features plan read from it; the patch convolution, class token, positions, norm and
    classifier whole. Logits, loss and every gradient as one process."""
    from plain_models import PatchViT

    torch.manual_seed(3)
    ref = PatchViT()
    if ctx.config.tensor_mode == "sequence":  # its attention is code of its own
        with pytest.raises(ValueError, match=r"'attn' is code of its own and may count"):
            parallelize(copy.deepcopy(ref), context=ctx)
        return 0.0
    model = parallelize(copy.deepcopy(ref), context=ctx)
    pixels, labels = images()
    want, got = ref(pixels), model(pixels)
    torch.testing.assert_close(got, want, **TOL)
    F.cross_entropy(want, labels).backward()
    loss = F.cross_entropy(got, labels)
    loss.backward()
    _assert_grads_are_one_process(model, ref, ctx)
    return round(float(loss.detach()), 5)


def _torch_encoders_match_reference(ctx: ParallelContext) -> list[float]:
    """torch's own transformer: a bare ``nn.TransformerEncoder`` (its plan shipped for the
    class, a features plan) on a padded batch under a causal mask, in training and in eval
    mode (where torch's fast path would read whole weights), and a causal LM built from one
    (the plan read from its blocks, ``attention_mask`` padded). ``nn.MultiheadAttention``'s
    fused ``in_proj_weight`` is split by heads and saved in its own form. Under '1d' (and
    its sequence parallelism) also ``batch_first=False``, which the other modes refuse."""
    from plain_models import torch_decoder, torch_encoder, torch_encoder_lm, torch_transformer

    losses = [_torch_encoder_loss(torch_encoder(), ctx)]
    mode = ctx.config.tensor_mode
    if mode == "sequence":
        with pytest.raises(ValueError, match=r"'layers.0.multihead_attn' is the cross-attention"):
            parallelize(torch_decoder(), context=ctx)
    else:
        losses.append(_torch_decoder_loss(torch_decoder(), ctx))
    if mode == "sequence" or ctx.config.tensor_args.get("sequence_parallel", False):
        refused = r"multihead_attn' is the cross-attention|decoder reads its encoder's output"
        with pytest.raises(ValueError, match=refused):
            parallelize(torch_transformer(), context=ctx)
    else:  # src and tgt: the decoder's memory is the encoder's output
        losses.append(_torch_decoder_loss(torch_transformer(), ctx))
    if mode == "1d":
        losses.append(_torch_encoder_loss(torch_encoder(batch_first=False), ctx))
    else:
        with pytest.raises(ValueError, match=r"'layers.0.self_attn' .* takes \[s, b, h\]"):
            parallelize(torch_encoder(batch_first=False), context=ctx)
    ref = _with_plan(torch_encoder_lm(), "plan read from the transformer blocks")
    model = parallelize(copy.deepcopy(ref), context=ctx)
    _assert_same_state(gather_full_state_dict(model, context=ctx), ref.state_dict())
    return [*losses, _padded_lm_matches(ref, model, ctx)]


def _padded_lm_matches(ref: nn.Module, model: nn.Module, ctx: ParallelContext) -> float:
    """Loss, logits and every gradient of ``model`` (``ref`` parallelized) on a padded batch
    (``attention_mask``) against ``ref``; the loss."""
    text = _padded_text()
    ids, mask = text["input_ids"], text["attention_mask"]
    ref_logits = ref(ids, attention_mask=mask)
    vocab = ref_logits.shape[-1]
    ref_loss = F.cross_entropy(ref_logits[:, :-1].reshape(-1, vocab), ids[:, 1:].reshape(-1))
    logits = model(ids, attention_mask=mask)
    loss = causal_lm_loss(logits, ids, context=ctx)
    ref_loss.backward()
    loss.backward()
    torch.testing.assert_close(loss, ref_loss, **TOL)
    torch.testing.assert_close(gather_logits(logits, context=ctx), ref_logits.detach(), **TOL)
    grads = _full_grads(model, ctx, mean_loss=True)
    for name, p in ref.named_parameters():
        assert p.grad is not None
        torch.testing.assert_close(grads[name], p.grad, **TOL, msg=lambda m, n=name: f"{n}: {m}")
    return round(float(loss.detach()), 5)


def _padded_pool_matches_reference(ctx: ParallelContext) -> float:
    """A model of one's own reading its mask in attention (SDPA's ``attn_mask``) and beside
    its hidden states (a masked mean in its forward): loss, logits and every gradient as one
    process. Under 3d attention runs on other rows of the batch than the hidden states: the
    model gets its mask in the hidden states' rows and the SDPA call its own (with attention's
    rows the mean read other samples' masks: a wrong loss, without an error). An attention
    computing its scores itself is refused there by name."""
    from plain_models import ScoresAttention, padded_pool_lm

    ref = padded_pool_lm()
    model = parallelize(copy.deepcopy(ref), context=ctx)
    loss = _padded_lm_matches(ref, model, ctx)
    if ctx.config.tensor_mode == "3d":
        scores = parallelize(padded_pool_lm(attention=ScoresAttention), context=ctx)
        text = _padded_text()
        with pytest.raises(ValueError, match=r"ScoresAttention made no call to F\.scaled_dot"):
            scores(text["input_ids"], attention_mask=text["attention_mask"])
    return loss


def _torch_decoder_loss(ref: nn.Module, ctx: ParallelContext) -> float:
    """A bare ``nn.TransformerDecoder`` (or ``nn.Transformer``, its memory the encoder's
    output of src): a padded target under a causal mask attending to a padded memory of
    another length; outputs, both inputs' and every parameter's gradient."""
    model = parallelize(copy.deepcopy(ref), context=ctx)
    original = ref.state_dict()
    _assert_same_state(gather_full_state_dict(model, context=ctx), original)
    g = torch.Generator().manual_seed(6)
    tgt, memory = torch.randn(4, 8, 16, generator=g), torch.randn(4, 6, 16, generator=g)
    w = torch.randn(4, 8, 16, generator=g)
    keep = _padded_text()["attention_mask"].bool()  # [b, s]
    memory_padding = torch.zeros(4, 6, dtype=torch.bool)
    memory_padding[1, -2:] = True
    masks = dict(
        tgt_mask=nn.Transformer.generate_square_subsequent_mask(8),
        tgt_key_padding_mask=~keep,
        memory_key_padding_mask=memory_padding,
        memory_mask=torch.randn(4 * 4, 8, 6, generator=g),  # [b * heads, L, S]: rows and heads
    )
    inputs_ref = [t.clone().requires_grad_() for t in (tgt, memory)]
    inputs = [t.clone().requires_grad_() for t in (tgt, memory)]

    def call(m: nn.Module, tgt: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        if isinstance(ref, nn.Transformer):  # the memory is its encoder's output of src
            return m(memory, tgt, src_key_padding_mask=memory_padding, **masks)
        return m(tgt, memory, **masks)

    y_ref, y = call(ref, *inputs_ref), call(model, *inputs)
    torch.testing.assert_close(y, y_ref, **TOL)
    (y_ref * w * keep[..., None]).sum().backward()
    (y * w * keep[..., None]).sum().backward()
    for got, want in zip(inputs, inputs_ref, strict=True):
        assert got.grad is not None and want.grad is not None
        torch.testing.assert_close(got.grad, want.grad, **TOL)
    grads = _full_grads(model, ctx)
    for name, p in ref.named_parameters():
        assert p.grad is not None
        torch.testing.assert_close(grads[name], p.grad, **TOL, msg=lambda m, n=name: f"{n}: {m}")
    return round(float((y * w * keep[..., None]).sum().detach()), 4)


def _torch_encoder_loss(ref: nn.Module, ctx: ParallelContext) -> float:
    from tessera.context import get_shard_info

    model = parallelize(copy.deepcopy(ref), context=ctx)
    fused = model.layers[0].self_attn.in_proj_weight
    info = get_shard_info(fused)
    assert (info is not None and info.is_sharded) == (ctx.config.tensor_mode != "sequence")
    original = ref.state_dict()
    _assert_same_state(gather_full_state_dict(model, context=ctx), original)
    batch_first = ref.layers[0].self_attn.batch_first
    x = torch.randn(4, 8, 16, generator=torch.Generator().manual_seed(4))
    w = torch.randn(4, 8, 16, generator=torch.Generator().manual_seed(5))
    keep = _padded_text()["attention_mask"].bool()  # [b, s]
    padding, causal = ~keep, nn.Transformer.generate_square_subsequent_mask(8)
    x_ref, x_par = x.clone().requires_grad_(), x.clone().requires_grad_()

    def run(m: nn.Module, inputs: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        out = m(
            inputs if batch_first else inputs.transpose(0, 1),
            mask=mask,
            src_key_padding_mask=padding,
        )
        return out if batch_first else out.transpose(0, 1)  # [b, s, h]

    y_ref, y = run(ref, x_ref, causal), run(model, x_par, causal)
    torch.testing.assert_close(y, y_ref, **TOL)
    (y_ref * w * keep[..., None]).sum().backward()
    (y * w * keep[..., None]).sum().backward()
    assert x_ref.grad is not None and x_par.grad is not None
    torch.testing.assert_close(_input_grad(x_par.grad, ctx), x_ref.grad, **TOL)
    grads = _full_grads(model, ctx, mean_loss=ctx.config.tensor_mode == "sequence")
    for name, p in ref.named_parameters():
        assert p.grad is not None
        torch.testing.assert_close(grads[name], p.grad, **TOL, msg=lambda m, n=name: f"{n}: {m}")
    with torch.no_grad():  # eval: torch's fast path (nested tensors, fused kernel) stays off
        ref.eval(), model.eval()
        want, got = run(ref, x, None), run(model, x, None)
        torch.testing.assert_close(got * keep[..., None], want * keep[..., None], **TOL)
        for p in model.parameters():
            p.zero_()
    load_full_state_dict(model, original)
    _assert_same_state(gather_full_state_dict(model, context=ctx), original)
    return round(float((y * w * keep[..., None]).sum().detach()), 4)


def _checkpointed_with_frozen_embeddings(ctx: ParallelContext) -> float:
    """transformers' gradient checkpointing (reentrant, its default) with the embeddings frozen,
    as a fine-tune of adapters runs it: the hook transformers puts on the embedding, marking
    its output as needing a gradient so that the checkpointed blocks get theirs, is carried to
    tessera's embedding (refused before, as if it changed what the embedding computes)."""
    ref = llama_lm()
    ref.get_input_embeddings().weight.requires_grad_(False)
    enable = getattr(ref, "activation_checkpointing_enable", None)  # the newer name
    (enable or ref.gradient_checkpointing_enable)(dict(use_reentrant=True))
    return _lm_matches_reference(ref.train(), ctx)


def _splits_sequence(ctx: ParallelContext) -> bool:
    return ctx.config.tensor_mode == "sequence"


def _checkpointing_replays_each_batch_padding(ctx: ParallelContext) -> int:
    """Under 'sequence' the padding mask rides beside the activations, so attention recomputed
    by activation checkpointing must mask its own batch's padding: an evaluation of another
    padding between the forward and the backward changes no gradient (reentrant and not), and
    two batches of different padding awaiting one backward are refused, not mixed up."""
    ids = token_ids()[:, : SEQ - 1]  # padded to divide: every batch has a key mask
    left = torch.ones_like(ids)
    left[0, :3] = 0
    for reentrant in (True, False):
        ref = gpt2_lm()
        enable = getattr(ref, "activation_checkpointing_enable", None)  # the newer name
        (enable or ref.gradient_checkpointing_enable)(dict(use_reentrant=reentrant))
        model = parallelize(copy.deepcopy(ref).train(), context=ctx)
        ref.train()
        logits = ref(ids).logits[:, :-1]
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)).backward()
        loss = causal_lm_loss(model(ids).logits, ids, context=ctx)
        with torch.no_grad():
            model(ids, attention_mask=left)  # another padding, no graph
        loss.backward()
        grads = _full_grads(model, ctx, mean_loss=True)
        for name, p in ref.named_parameters():
            torch.testing.assert_close(
                grads[name], p.grad, **TOL, msg=lambda m, n=name: f"{n}: {m}"
            )
    first = causal_lm_loss(model(ids).logits, ids, context=ctx)
    second = causal_lm_loss(model(ids, attention_mask=left).logits, ids, context=ctx)
    with pytest.raises(ValueError, match="cannot tell which of the 2 batches"):
        (first + second).backward()
    return 2


def _padded_text() -> dict[str, torch.Tensor]:
    """A batch of token ids with a padding mask on rows and tokens every layout splits apart."""
    ids = token_ids()
    padded = torch.ones_like(ids)
    padded[0, -3:], padded[-1, -1:] = 0, 0
    return dict(input_ids=ids, attention_mask=padded)


def _encoders_match_reference(ctx: ParallelContext) -> list[float]:
    """The bare encoders a sentence embedding or an image embedding starts from, each with
    the plan shipped for its class: BertModel and RobertaModel (token types, pooler),
    DistilBertModel (neither) on a padded batch, ViTModel (pooler) on images; and a bare
    decoder, GPT2Model, whose own code views its output as ``[-1, s, h]`` after the span (under
    'sequence', gathered before that view, the tokens folded into the batch dim). RoBERTa
    counts its positions from each row's padding, which tensor mode 'sequence' refuses by
    name."""
    text = _padded_text()
    with_types = dict(text, token_type_ids=token_types())
    encoders = [(bert_encoder, with_types), (distilbert_encoder, text), (gpt2_bare, text)]
    encoders += [(roberta_encoder, with_types), (vit_encoder, dict(pixel_values=images()[0]))]
    if ctx.config.tensor_mode == "sequence":
        with pytest.raises(
            ValueError,
            match=r"RobertaModel \(RoBERTa\) cannot run under tensor mode 'sequence': it numbers",
        ):
            parallelize(roberta_encoder(), context=ctx)
        encoders.remove((roberta_encoder, with_types))
    _attention_weights(ctx, text)
    return [_encoder_matches_reference(build(), inputs, ctx) for build, inputs in encoders]


def _attention_weights(ctx: ParallelContext, inputs: dict[str, torch.Tensor]) -> None:
    """``output_attentions=True``: every attention's weights, gathered by heads under 1D
    (with sequence parallelism too); refused by name where attention splits them by rows or
    never forms them (the grids, 'sequence'), where they came back as blocks or empty."""
    sp = ctx.config.tensor_args.get("sequence_parallel", False)
    if ctx.get_world_size(ParallelMode.TENSOR) > 4 or (ctx.config.tensor_mode == "1d" and not sp):
        return  # a layout of each kind: 1D's heads (sequence parallel), the grid, 'sequence'
    ref = gpt2_bare()
    ref.set_attn_implementation("eager")  # the one that forms the weights
    model = parallelize(copy.deepcopy(ref), context=ctx)
    kind = ctx.config.mode
    assert kind is not None
    with torch.no_grad():
        if not kind.replicated_activations:
            with pytest.raises(ValueError, match=r"was asked for its attention weights \(at"):
                model(**inputs, output_attentions=True)
            return
        want, got = ref(**inputs, output_attentions=True), model(**inputs, output_attentions=True)
    assert len(got.attentions) == len(want.attentions) == 2
    for a, b in zip(want.attentions, got.attentions, strict=True):
        torch.testing.assert_close(b, a, **TOL)  # [b, heads, s, s]


def _encoder_matches_reference(
    ref: nn.Module, inputs: dict[str, torch.Tensor], ctx: ParallelContext
) -> float:
    """A bare encoder: its hidden states (and pooler output, where it has one) come back whole
    under every layout, and a loss on them (a mean pooling over the tokens the mask keeps, as
    sentence embeddings take) gives every gradient as one process. BERT and GPT-2 also return
    every layer's hidden states (``output_hidden_states``) whole, a middle one in the loss
    (conversion/output_fields.py: they were the mode's blocks or token chunks)."""
    mode, size = ctx.config.tensor_mode, ctx.get_world_size(ParallelMode.TENSOR)
    impl = "all_to_all" if mode == "sequence" and size == 4 else "ring"
    model = parallelize(copy.deepcopy(ref), sequence_attention=impl, context=ctx)
    mask = inputs.get("attention_mask")
    if type(ref).__name__ in ("BertModel", "GPT2Model"):  # an encoder's and a decoder's
        inputs = dict(inputs, output_hidden_states=True)

    def loss_of(out: Any) -> torch.Tensor:
        hidden = out.last_hidden_state  # [b, s, h]
        keep = torch.ones_like(hidden[..., :1]) if mask is None else mask.unsqueeze(-1).to(hidden)
        loss = ((hidden * keep).sum(1) / keep.sum(1)).pow(2).mean()
        if out.hidden_states is not None:  # [b, s, h] after the first block
            loss = loss + out.hidden_states[1].pow(2).mean()
        pooled = getattr(out, "pooler_output", None)
        return loss if pooled is None else loss + pooled.pow(2).mean()

    want, got = ref(**inputs), model(**inputs)
    for name in ("last_hidden_state", "pooler_output"):
        if getattr(want, name, None) is not None:
            torch.testing.assert_close(getattr(got, name), getattr(want, name), **TOL, msg=name)
    for i, (a, b) in enumerate(zip(want.hidden_states or (), got.hidden_states or (), strict=True)):
        torch.testing.assert_close(b, a, **TOL, msg=lambda m, i=i: f"hidden_states[{i}]: {m}")
    ref_loss, loss = loss_of(want), loss_of(got)
    ref_loss.backward()
    loss.backward()
    grads = _full_grads(model, ctx, mean_loss=True)
    for name, p in ref.named_parameters():
        assert p.grad is not None
        torch.testing.assert_close(grads[name], p.grad, **TOL, msg=lambda m, n=name: f"{n}: {m}")
    return round(float(loss.detach()), 5)


def _classifiers_match_reference(ctx: ParallelContext) -> list[float]:
    """Sequence classifiers (transformers' convention, the Trainer's): ``model(**inputs,
    labels=labels).loss`` is one process's and so is every gradient, for BERT's (its pooler
    reads the first token, its criterion built inline) and GPT-2's (each row's last token
    that is not padding). Under 'sequence' that token is on one rank only: refused by name."""
    if ctx.config.tensor_mode == "sequence":
        for build in (bert_classifier, gpt2_classifier):
            with pytest.raises(
                ValueError, match=r"under tensor mode 'sequence': its classifier reads"
            ):
                parallelize(build(), context=ctx)
        return []
    return [
        _classifier_matches_reference(build(), ctx) for build in (bert_classifier, gpt2_classifier)
    ]


def _classifier_matches_reference(ref: nn.Module, ctx: ParallelContext) -> float:
    model = parallelize(copy.deepcopy(ref), context=ctx)
    inputs = _padded_text()
    inputs["input_ids"] = inputs["input_ids"].masked_fill(inputs["attention_mask"] == 0, 0)
    labels = torch.arange(BATCH) % NUM_CLASSES
    want, got = ref(**inputs, labels=labels), model(**inputs, labels=labels)
    assert got.to_tuple()[0] is got.loss  # first, as transformers puts it
    torch.testing.assert_close(got.loss, want.loss, **TOL)
    torch.testing.assert_close(gather_logits(got.logits, context=ctx), want.logits.detach(), **TOL)
    want.loss.backward()
    got.loss.backward()
    grads = _full_grads(model, ctx)
    for name, p in ref.named_parameters():
        assert p.grad is not None
        torch.testing.assert_close(grads[name], p.grad, **TOL, msg=lambda m, n=name: f"{n}: {m}")
    with torch.no_grad():  # return_dict=False: the loss first in the tuple
        as_tuple = model(**inputs, labels=labels, return_dict=False)
    torch.testing.assert_close(as_tuple[0], want.loss.detach(), **TOL)
    return round(float(got.loss.detach()), 5)


def _encoder_decoders(
    ctx: ParallelContext, builds: list[Callable[[], nn.Module]] | None = None
) -> list[float]:
    """Encoder-decoders with the plans shipped for their classes: BART (learned positions
    read two rows on, one token table for both stacks and the head, ``final_logits_bias``
    added to the logits) by default; T5 (a relative position bias [1, heads, q, k] looked up
    in the first layer's table and added to every layer's scores, each rank its heads' columns;
    scores not scaled; RMS norms without bias; the decoder's output scaled by d_model ** -0.5
    before the tied head). Refused by name under 'sequence' (cross-attention reads the whole
    encoder output) and 1D sequence parallelism (two stacks, no single span)."""
    builds = builds or [bart_lm]
    mode = ctx.config.tensor_mode
    if mode == "sequence":
        for build in builds:
            with pytest.raises(ValueError, match=r"under tensor mode 'sequence': its decoder's"):
                parallelize(build(), context=ctx)
        return []
    if ctx.config.tensor_args.get("sequence_parallel", False):
        for build in builds:
            with pytest.raises(ValueError, match=r"sequence_parallel is on, but the .* names no"):
                parallelize(build(), context=ctx)
        return []
    return [_seq2seq_matches_reference(build(), ctx) for build in builds]


def _t5_models(ctx: ParallelContext) -> list[float]:
    """T5ForConditionalGeneration as the other encoder-decoders (:func:`_encoder_decoders`),
    and T5EncoderModel as the bare encoders (:func:`_encoder_matches_reference`), on a padded
    batch: its relative position bias, looked up for the whole sequence, refused by name under
    'sequence', and under 1D sequence parallelism (no span). Under 2D also T5 v1.1's gated MLP
    (``wi_0``, ``wi_1``)."""
    builds: list[Callable[[], nn.Module]] = [t5_lm]
    if ctx.config.tensor_mode == "2d":  # T5 v1.1's gated MLP: wi_0 and wi_1 split alike
        builds.append(lambda: t5_lm(feed_forward_proj="gated-gelu"))
    losses = _encoder_decoders(ctx, builds)
    if ctx.config.tensor_mode == "sequence":
        with pytest.raises(ValueError, match=r"under tensor mode 'sequence': its relative posit"):
            parallelize(t5_encoder(), context=ctx)
    elif ctx.config.tensor_args.get("sequence_parallel", False):
        with pytest.raises(ValueError, match=r"sequence_parallel is on, but the .* names no"):
            parallelize(t5_encoder(), context=ctx)
    else:
        losses.append(_encoder_matches_reference(t5_encoder(), _padded_text(), ctx))
    return losses


def _seq2seq_matches_reference(ref: nn.Module, ctx: ParallelContext) -> float:
    """An encoder-decoder, parallelized, against itself on one process: its encoder reads a
    padded batch, its decoder a stream of another length (padded too); the loss of split
    logits, the logits and every gradient; ``labels=`` (decoder input shifted from them) gives
    one process's loss; greedy ``generate()`` with and without the cache its tokens."""
    model = parallelize(copy.deepcopy(ref), context=ctx)
    original = ref.state_dict()
    _assert_same_state(gather_full_state_dict(model, context=ctx), original)
    tied = ref.get_output_embeddings().weight is ref.get_input_embeddings().weight
    assert (model.get_output_embeddings().weight is model.get_input_embeddings().weight) == tied
    inputs = _padded_text()
    labels = decoder_labels()
    decoder = dict(
        decoder_input_ids=ref.prepare_decoder_input_ids_from_labels(labels),
        decoder_attention_mask=(labels != -100).long(),
    )
    ref_out = ref(**inputs, **decoder)
    ref_logits = ref_out.logits  # [b, t, V]
    vocab = ref_logits.shape[-1]
    ref_loss = F.cross_entropy(ref_logits.reshape(-1, vocab), labels.reshape(-1))
    out = model(**inputs, **decoder)
    logits = out.logits
    # the encoder's output comes back whole, as one process returns it: [b, s, h]
    want_encoded = ref_out.encoder_last_hidden_state.detach()
    torch.testing.assert_close(out.encoder_last_hidden_state.detach(), want_encoded, **TOL)
    loss = token_loss(logits, labels, context=ctx)
    ref_loss.backward()
    loss.backward()
    torch.testing.assert_close(loss, ref_loss, **TOL)
    torch.testing.assert_close(gather_logits(logits, context=ctx), ref_logits.detach(), **TOL)
    grads = _full_grads(model, ctx)
    for name, p in ref.named_parameters(remove_duplicate=False):
        assert p.grad is not None
        torch.testing.assert_close(grads[name], p.grad, **TOL, msg=lambda m, n=name: f"{n}: {m}")
    with torch.no_grad():  # its own loss: an inline criterion, computed at the boundary
        want = ref(**inputs, labels=labels).loss
        got = model(**inputs, labels=labels)
        torch.testing.assert_close(got.loss, want, **TOL)
        torch.testing.assert_close(model(**inputs, **decoder, labels=labels).loss, ref_loss, **TOL)
    # greedy, with the cache: the encoder runs once on its own, each step feeds one token;
    # and without it: every step runs the whole decoder again (the encoder once)
    for cache in (True, False):
        kwargs = dict(max_new_tokens=4, do_sample=False, num_beams=1, use_cache=cache)
        want_tokens = ref.generate(**inputs, **kwargs)
        got_tokens = model.generate(**inputs, **kwargs)
        assert torch.equal(got_tokens, want_tokens), f"{cache}: {got_tokens} != {want_tokens}"
    return round(float(loss.detach()), 5)


def _labels_give_the_loss(model: nn.Module, ids: torch.Tensor, ref_loss: torch.Tensor) -> None:
    """``model(ids, labels=ids).loss`` is one process's, also as transformers' Trainer asks
    for it under gradient accumulation (``num_items_in_batch``: the sum over the labels)."""
    with torch.no_grad():
        torch.testing.assert_close(model(ids, labels=ids).loss, ref_loss.detach(), **TOL)
        items = 3 * ids[:, 1:].numel()  # as if the step held three such batches
        summed = model(ids, labels=ids, num_items_in_batch=items).loss
        torch.testing.assert_close(summed, ref_loss.detach() * ids[:, 1:].numel() / items, **TOL)


def _whole_logits_loss(
    logits: torch.Tensor, ids: torch.Tensor, ref_loss: torch.Tensor, ctx: ParallelContext
) -> None:
    """Whole logits under 1D: the plain loss given the vocabulary's size, else an error.

    The split logits refuse code of one's own reading the vocabulary whole (an argmax, a
    cross-entropy, a softmax: each would compute on this rank's slice without an error);
    ``local_logits`` takes that slice on purpose (conversion/split_logits.py). Under
    'sequence' the logits of this rank's chunk of the tokens refuse code reading the tokens
    whole (the last token's logits would be this chunk's last)."""
    if ctx.config.tensor_mode == "sequence":
        share = r"logits, which hold this rank's 1/\d of the tokens .* gather_logits"
        with pytest.raises(ValueError, match=rf"__getitem__ takes a part of dim 1 of .*{share}"):
            logits[:, -1].argmax(-1)
        with pytest.raises(ValueError, match=rf"Tensor\.mean reads dim 1 of .*{share}"):
            logits.float().mean()
        assert type(local_logits(logits)) is torch.Tensor
        whole = gather_logits(logits, context=ctx)  # a derived tensor keeps the padding's start
        torch.testing.assert_close(gather_logits(logits.float() * 2, context=ctx), whole * 2)
        return
    if ctx.config.tensor_mode != "1d":
        assert type(logits) is torch.Tensor, type(logits)
        return
    whole = gather_logits(logits, context=ctx)  # [b, s, V], alike on every rank
    vocab = whole.shape[-1]
    got = causal_lm_loss(whole, ids, vocab_size=vocab, context=ctx)
    torch.testing.assert_close(got, ref_loss.detach(), **TOL)
    with pytest.raises(ValueError, match=r"are the same on all \d ranks of the group"):
        causal_lm_loss(whole, ids, context=ctx)
    share = r"logits, which hold this rank's 1/\d of the vocabulary .* gather_logits"
    with pytest.raises(ValueError, match=rf"Tensor\.argmax reads dim 2 of .*{share}"):
        logits.float().argmax(-1)  # followed through a cast
    with pytest.raises(ValueError, match=rf"functional\.cross_entropy reads dim 1 of .*{share}"):
        F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    with pytest.raises(ValueError, match=rf"softmax reads dim 1 of .*{share}"):
        torch.softmax(logits[:, -1] / 0.7, dim=-1)
    banned = logits.detach().clone()  # a token banned by its id: this rank's column instead
    with pytest.raises(ValueError, match=rf"__setitem__ writes a part of dim 2 of .*{share}"):
        banned[..., 0] = float("-inf")
    part = local_logits(logits)
    assert type(part) is torch.Tensor
    torch.testing.assert_close(part, _local_logits(whole, ctx))


def _soft_prompt_trains_as_one_process(
    ref: nn.Module, model: nn.Module, ids: torch.Tensor, ctx: ParallelContext
) -> None:
    """Embeddings of one's own as ``inputs_embeds``: three learned vectors before the tokens'
    embeddings (a soft prompt; 11 tokens, padded under 'sequence'). The loss and the
    prompt's gradient are one process's, in every mode (the boundary splits them as the
    embedding would have; under 'sequence' the handler's convention, as a parameter's)."""
    size = (ids.shape[0], 3, ref.config.hidden_size)
    prompt = torch.randn(size, generator=torch.Generator().manual_seed(5)) * 0.5  # [b, 3, h]
    with torch.no_grad():  # whole, from the model before conversion (its table may be split)
        tokens = ref.get_input_embeddings()(ids)  # [b, s, h]
    targets = torch.cat([torch.full_like(ids[:, :3], -100), ids], 1)  # [b, 3 + s]
    results = []
    for m in (ref, model):
        learned = prompt.clone().requires_grad_()
        logits = m(inputs_embeds=torch.cat([learned, tokens], 1)).logits
        if m is ref:
            vocab = logits.shape[-1]
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, vocab), targets[:, 1:].reshape(-1))
        else:
            loss = causal_lm_loss(logits, targets, context=ctx)
        (grad,) = torch.autograd.grad(loss, [learned])
        results.append((loss.detach(), grad if m is ref else _input_grad(grad, ctx)))
    for got, want in zip(results[1], results[0], strict=True):
        torch.testing.assert_close(got, want, **TOL)


def _other_ranks_blocks_refused(model: nn.Module, ctx: ParallelContext) -> None:
    """Each rank's ``torch.save(model.state_dict())`` loads back into that rank's model; the
    file of another tensor rank (one saved by rank 0 alone, loaded everywhere) is refused,
    where its blocks would have replaced this rank's without an error (conversion/block_tags)."""
    world = ctx.get_world_size(ParallelMode.TENSOR)
    if ctx.config.tensor_mode == "sequence" or world > 4:  # nothing split; 8 ranks: as 2D's
        return
    # the whole model, and a submodule's own state dict (e.g. ``model.transformer``)
    for module in (model, next(iter(model.children()))):
        buffer = io.BytesIO()
        torch.save(module.state_dict(), buffer)
        files: list[Any] = [None] * world
        group = ctx.get_group(ParallelMode.TENSOR)
        dist.all_gather_object(files, buffer.getvalue(), group=group)
        rank = ctx.get_local_rank(ParallelMode.TENSOR)
        refused = []
        for other in (r for r in range(world) if r != rank):
            try:  # a rank holding the same blocks (2.5D's other depth) is as good as this one
                module.load_state_dict(torch.load(io.BytesIO(files[other])))
            except ValueError as error:
                assert "saved by another rank; this rank holds the one at" in str(error), error
                refused.append(other)
        assert refused, f"every other tensor rank's blocks were loaded into {type(module)}"
        module.load_state_dict(torch.load(io.BytesIO(files[rank])))  # its own, as saved


def _generates_as_one_process(
    ref: nn.Module, model: nn.Module, ids: torch.Tensor, ctx: ParallelContext
) -> None:
    """Greedy ``generate()``, with and without the cache, gives one process's tokens; refused
    by name where a cached step's one new token would be split over the sequence ranks."""
    prompt, kwargs = ids[:, :4], dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    splits_sequence = ctx.config.tensor_args.get("sequence_parallel", False)
    if ctx.config.tensor_mode == "sequence" or splits_sequence:
        with pytest.raises(ValueError, match="cannot be split over the ranks that split the seq"):
            model.generate(prompt, **kwargs)
        return
    for cache in (True, False):
        want = ref.generate(prompt, use_cache=cache, **kwargs)  # [b, 8]
        got = model.generate(prompt, use_cache=cache, **kwargs)
        assert torch.equal(got, want), f"use_cache={cache}: {got.tolist()} != {want.tolist()}"


def _assert_planner_counts(ref: nn.Module, model: nn.Module, ctx: ParallelContext) -> None:
    """The planner's parameter figures (tessera.context, torch-free) for a GPT-2, a GPT-NeoX,
    a Llama or a Qwen2 (biases on q, k and v alone) read from its config: the whole model's,
    and what ``parallelize`` left on this rank."""
    mode = ctx.config.tensor_mode
    if mode == "sequence" or ref.config.model_type not in ("gpt2", "gpt_neox", "llama", "qwen2"):
        return
    size = ctx.get_world_size(ParallelMode.TENSOR)
    layout = Layout(1, 1, size, mode, depth=ctx.config.tensor_depth)
    shape = ModelShape.from_config(ref.config.to_dict(), seq=SEQ, batch=BATCH)
    assert shape.parameters == sum(p.numel() for p in ref.parameters())
    held = sum(p.numel() for p in model.parameters())
    planned = shape.layers * block_parameters(shape, layout) + embedding_parameters(shape, layout)
    assert held == planned, f"{layout}: {held} parameters on this rank, the planner says {planned}"


def _repeated_heads(ctx: ParallelContext) -> list[float]:
    """Key/value heads fewer than the ranks splitting heads: each rank computes the one its
    query heads attend with (a Llama with one, multi-query; on 4 ranks a Qwen3 with 2, each
    key head normalized on its own), and a norm over all key features is refused. The repeats'
    gradients are summed in autograd under 1D, at the step (deferred) under 2.5D, 3D and for
    the Qwen3."""
    mode = ctx.config.tensor_mode
    llama = llama_lm(num_key_value_heads=1)
    torch.manual_seed(5)
    state = torch.get_rng_state()
    parallelize(copy.deepcopy(llama), context=ctx)
    assert torch.equal(torch.get_rng_state(), state), "parallelize drew random numbers"
    results = [_lm_matches_reference(llama, ctx, defer=mode in ("2.5d", "3d"))]
    _meta_built_matches(lambda: llama_lm(num_key_value_heads=1), ctx)
    if mode == "3d":  # biases on k and v, in autograd; the repeats' layers keep operands too
        qwen2 = qwen2_lm(num_key_value_heads=1)
        results.append(_lm_matches_reference(qwen2, ctx, keep_gathered=True))
    if mode == "1d" and not ctx.config.tensor_args.get("sequence_parallel", False):
        _width_counted_attention(ctx)
    if mode == "1d" and ctx.get_world_size(ParallelMode.TENSOR) == 4:
        results.append(_lm_matches_reference(qwen3_lm(num_key_value_heads=2), ctx, defer=True))
        olmo2 = _tiny("Olmo2", num_attention_heads=8, num_key_value_heads=2)
        with pytest.raises(ValueError, match="normalizes all key heads' features"):
            parallelize(olmo2, context=ctx)
    return results


def _falcon(ctx: ParallelContext) -> list[float]:
    """Falcon's layouts, each with its own ``FalconLinear`` class (a probe shows it computes
    ``x W^T + b``). Under every layout the new decoder architecture (Falcon-40B's: q, k and v
    fused per key/value group, attention beside the MLP on two norms, the attention output
    added into the MLP's in place) and multi-query Falcon (Falcon-7B's: its one key and value
    head fused after every query head, repeated on each rank beside the rank's queries). Under
    1D with sequence parallelism also the original one (fused per head, norms before
    attention and MLP, biases), the new one with one key/value group, the new one as pipeline
    layers, and ALiBi folded into the mask, refused by name."""
    grouped = _with_plan(falcon_lm(), "Falcon with two norms LM plan inferred")
    multi_query = falcon_lm(new_decoder_architecture=False, multi_query=True)
    results = [_lm_matches_reference(grouped, ctx), _lm_matches_reference(multi_query, ctx)]
    if ctx.config.tensor_mode != "1d":
        return results
    results.append(_lm_matches_reference(falcon_lm(num_kv_heads=1), ctx))
    layers = pipeline_layers(parallelize(copy.deepcopy(grouped), context=ctx))  # as stages
    ids = token_ids()
    with torch.no_grad():
        torch.testing.assert_close(layers(ids), _local_logits(grouped(ids).logits, ctx), **TOL)
    original = dict(new_decoder_architecture=False, multi_query=False, num_kv_heads=8)
    mha = falcon_lm(**original, parallel_attn=False, bias=True)
    results.append(_lm_matches_reference(_with_plan(mha, "Falcon LM plan inferred"), ctx))
    with pytest.raises(ValueError, match="alibi=True"):
        parallelize(falcon_lm(**original, alibi=True), context=ctx)
    return results


def _fused_repeats(ctx: ParallelContext) -> list[float]:
    """q, k and v fused in one projection with fewer key/value heads than the ranks that split
    heads: GPTBigCode multi-query (StarCoder's ``c_attn``, fused by group) and Phi-3 with one
    key/value head (``qkv_proj``, fused in turn and held in parts interleaved by group); each
    rank computes its query heads and the key and value head they attend with, from the whole
    weight. Under 1D also GPTBigCode with a key and value per head (a plain split of whole
    heads) and the multi-query one as pipeline layers (GPT-2's stages); under sequence
    parallelism (ring) GPTBigCode alone. Under 3D GPTBigCode's heads have 3 features, which
    the cube's side does not divide, but each rank's 18 (its 4 query heads, a key and a value
    head) it does; a key projection's 3 (one head, repeated) it does not, an error."""
    mode = ctx.config.tensor_mode
    defer = mode in ("2.5d", "3d")
    odd_heads = dict(n_embd=24, n_head=8) if mode == "3d" else {}
    bigcode = _with_plan(gpt_bigcode_lm(**odd_heads), "GPTBigCode LM plan inferred")
    if mode == "3d":
        odd = llama_lm(hidden_size=12, num_attention_heads=4, num_key_value_heads=1)
        with pytest.raises(ValueError, match=r"'model.layers.0.self_attn.k_proj' .* each rank's "):
            parallelize(odd, context=ctx)  # k_proj: one head of 3 features, repeated
    results = [_lm_matches_reference(bigcode, ctx, defer=defer)]
    if mode == "sequence":  # no heads split: GPTBigCode's attention runs on the ring
        return results
    if mode == "1d":
        results.append(_lm_matches_reference(gpt_bigcode_lm(multi_query=False), ctx))
        layers = pipeline_layers(parallelize(copy.deepcopy(bigcode), context=ctx))  # as stages
        ids = token_ids()
        with torch.no_grad():
            torch.testing.assert_close(layers(ids), _local_logits(bigcode(ids).logits, ctx), **TOL)
    phi3 = phi3_lm(num_key_value_heads=1)
    results.append(_lm_matches_reference(phi3, ctx, then_attention="eager", defer=defer))
    return results


def _position_tables(ctx: ParallelContext) -> list[float]:
    """Position modules computing their rows themselves, kept whole (role position_table).

    Under 1D XGLM (sinusoidal positions, a buffer) and OPT (a learned table read two rows
    past the positions it counts from the mask) run as one process does (OPT not with
    sequence parallelism: its final norm is registered before its blocks, so no span is
    read). Every other mode refuses them by name: their inputs reach them as this rank's
    rows or sequence chunk, and from their output positions shared by the batch cannot be
    told from one sample's."""
    mode = ctx.config.tensor_mode
    xglm = _with_plan(xglm_lm(), "plan read from")
    opt = _with_plan(opt_lm(), "plan read from")
    if mode != "1d":
        for model, table in ((xglm, "model.embed_positions"), (opt, "model.decoder.embed_pos")):
            with pytest.raises(ValueError, match=rf"\['{table}.*\] compute positions in a "):
                parallelize(model, context=ctx)
        return []
    results = [_lm_matches_reference(xglm, ctx)]
    if not ctx.config.tensor_args.get("sequence_parallel", False):
        results.append(_lm_matches_reference(opt, ctx))
    return results


def _alibi(ctx: ParallelContext) -> list[float]:
    """BLOOM builds its ALiBi bias for every head and passes it to each block: each rank's
    attention takes its heads' rows, whose slopes differ. Also with left padding, where the
    bias follows each sample's mask (under 3D in the rows of layout "z", where attention
    runs), and as pipeline layers."""
    ref = _with_plan(bloom_lm(), "BLOOM LM")
    results = [_lm_matches_reference(ref, ctx)]
    model = parallelize(copy.deepcopy(ref), context=ctx)
    ids = token_ids()
    mask = torch.ones_like(ids)
    mask[0, :3], mask[-1, :1] = 0, 0  # left padding in rows every layout splits apart
    logits = model(ids, attention_mask=mask).logits
    want = _local_logits(ref(ids, attention_mask=mask).logits, ctx)
    tokens = _local_logits(mask[..., None].expand_as(ref(ids).logits), ctx) > 0  # not padding
    torch.testing.assert_close(logits[tokens], want[tokens], **TOL)
    # as pipeline stages cut it: every block builds the bias from the mask that travels
    layers = pipeline_layers(parallelize(copy.deepcopy(ref), context=ctx))
    padded = dict(input_ids=ids, attention_mask=mask)
    with torch.no_grad():
        torch.testing.assert_close(layers(ids), _local_logits(ref(ids).logits, ctx), **TOL)
        got, want = layers(padded), _local_logits(ref(**padded).logits, ctx)
        torch.testing.assert_close(got[tokens], want[tokens], **TOL)
    return results


def _weights_per_head(ctx: ParallelContext) -> list[float]:
    """Norms of each query and key head with a weight of each head's own: StableLM's list of
    LayerNorms (heads on dim 1), Cohere's one ``[heads, head_dim]`` weight (heads on dim -2),
    each with grouped-query attention under one mode and one key/value head (repeated on
    every rank) under the other. Both plans read from the blocks; Cohere's sums deferred to
    the step under 3D; StableLM built on meta under 1D."""
    mode = ctx.config.tensor_mode
    one = dict(num_key_value_heads=1)  # one key/value head: repeated on every rank
    stablelm = _with_plan(stablelm_lm(**(one if mode == "3d" else {})), "plan read from")
    cohere = _with_plan(cohere_lm(**(one if mode == "1d" else {})), "plan read from")
    results = [_lm_matches_reference(stablelm, ctx)]
    results.append(_lm_matches_reference(cohere, ctx, defer=mode == "3d"))
    if mode == "1d":
        _meta_built_matches(stablelm_lm, ctx)
    return results


class _WidthCountedAttention(nn.Module):
    """An attention that knows its width and head size, not its head count."""

    def __init__(self, width: int = 16, head_dim: int = 4) -> None:
        super().__init__()
        self.embed_dim, self.size = width, head_dim
        self.q, self.k, self.v, self.o = (nn.Linear(width, width) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, -1, self.size).transpose(1, 2) for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, self.embed_dim))


def _width_counted_attention(ctx: ParallelContext) -> None:
    """No head counts: not taken for fewer key/value heads than ranks (nothing repeated)."""
    torch.manual_seed(0)
    ref = nn.Sequential(_WidthCountedAttention())
    plan = {"0": "attention", "0.q": "col", "0.k": "col", "0.v": "col", "0.o": "row"}
    model = parallelize(copy.deepcopy(ref), plan, context=ctx)
    x = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(model(x), ref(x), **TOL)


def _experts(ctx: ParallelContext) -> list[float]:
    """Mixtures of experts: Mixtral (on 2 ranks Qwen2-MoE, whose shared expert and its gate
    take the block's tokens flattened to [n, h]; on 4 ranks Qwen3-MoE) with every expert's MLP
    split under 1D, its router whole (with sequence parallelism on this rank's tokens, its
    gradient sum deferred), whole under 'sequence'; refused by name on the mesh."""
    mode = ctx.config.tensor_mode
    if mode == "2d":
        mixtral = _with_plan(mixtral_lm(), "Mixtral LM plan inferred")
        with pytest.raises(
            ValueError,
            match=r"'model.layers.0.mlp.gate' has role 'router' in the Mixtral LM plan inferred "
            r"for MixtralForCausalLM, which tensor mode '2d' does not split",
        ):
            parallelize(mixtral, context=ctx)
        assert isinstance(mixtral.model.layers[0].self_attn.q_proj, nn.Linear)  # left as it was
        return []
    sp = bool(ctx.config.tensor_args.get("sequence_parallel", False))
    results = [_lm_matches_reference(mixtral_lm(), ctx, defer=sp)]
    ref, plain = mixtral_lm(), mixtral_lm()
    torch.manual_seed(5)
    state = torch.get_rng_state()
    model = parallelize(plain, context=ctx)
    assert torch.equal(torch.get_rng_state(), state), "parallelize drew random numbers"
    model.eval()  # reaches the plain experts, whose forward runs inside Experts1D
    assert not any(m.training for m in model.modules())
    assert not any(e.experts[0].training for e in model.modules() if isinstance(e, Experts1D))
    model.train()
    if sp or mode == "sequence":  # each rank routes its own tokens
        with pytest.raises(ValueError, match="its load-balancing loss averages the routing"):
            model(token_ids(), output_router_logits=True)
    else:  # every rank routes every token: the model's own load-balancing loss
        torch.testing.assert_close(
            model(token_ids(), output_router_logits=True).aux_loss,
            ref(token_ids(), output_router_logits=True).aux_loss,
            **TOL,
        )
    if sp:  # the router is materialized before it is wrapped
        _meta_built_matches(mixtral_lm, ctx)
    if mode == "1d" and ctx.get_world_size(ParallelMode.TENSOR) == 2:  # flattened tokens
        qwen2_moe = _with_plan(qwen2_moe_lm(), "Qwen2-MoE LM plan inferred")
        results.append(_lm_matches_reference(qwen2_moe, ctx, defer=sp))
    if mode == "1d" and not sp:  # the first block dense, the second sparse
        mixed = qwen3_moe_lm(mlp_only_layers=[0], intermediate_size=64)
        mixed = _with_plan(mixed, "Qwen3-MoE with dense blocks LM plan inferred")
        results.append(_lm_matches_reference(mixed, ctx))
    if ctx.get_world_size(ParallelMode.TENSOR) == 4:
        qwen3_moe = _with_plan(qwen3_moe_lm(), "Qwen3-MoE LM plan inferred")
        results.append(_lm_matches_reference(qwen3_moe, ctx))
    return results


def _dropout_streams(ctx: ParallelContext) -> str:
    """Dropout masks on split activations differ across tensor ranks; replicated ones agree.

    Every dropout call (attention probabilities in eager attention, residual and embedding
    dropout) records the RNG state it draws from; the tensor ranks compare them.
    """
    mode = ctx.config.tensor_mode
    model = parallelize(
        gpt2_lm(resid_pdrop=0.5, embd_pdrop=0.5, attn_pdrop=0.5, attn_implementation="eager"),
        context=ctx,
    )
    model.train()
    model(token_ids())  # the first call checks the model's own code, re-entering F.dropout
    states: list[int] = []
    real = F.dropout

    def spy(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        states.append(int(torch.random.get_rng_state().float().sum()))  # a cheap fingerprint
        return real(x, *args, **kwargs)

    ctx.reseed()  # every tensor rank starts from the same default stream
    try:
        F.dropout = spy  # type: ignore[assignment]
        hidden = model(token_ids(), output_hidden_states=True).hidden_states[-2]
    finally:
        F.dropout = real  # type: ignore[assignment]
    # transformers' activation checkpointing replays the global generator, and so the masks
    grads = [_dropout_grads(ctx, checkpointing) for checkpointing in (False, True)]
    for plain, replayed in zip(*grads, strict=True):
        torch.testing.assert_close(replayed, plain, rtol=0, atol=0)
    group = ctx.get_cpu_group(ParallelMode.TENSOR)
    gathered: list[Any] = [None] * ctx.get_world_size(ParallelMode.TENSOR)
    dist.all_gather_object(gathered, (states, hidden.detach()), group=group)
    per_call = list(zip(*(s for s, _ in gathered), strict=True))  # each call: one per rank
    distinct = [len(set(call)) == len(call) for call in per_call]
    assert len(per_call) == 2 * 3 + 1, len(per_call)  # embedding + 2 layers x (attn, 2 resid)
    if mode == "1d" and not ctx.config.tensor_args.get("sequence_parallel"):
        # attention probabilities (split by heads) differ; residuals and embeddings agree,
        # so the replicated hidden state is the same on every tensor rank
        assert distinct == [False] + [True, False, False] * 2, distinct
        for _, other in gathered[1:]:
            torch.testing.assert_close(other, gathered[0][1], rtol=0, atol=0)
        return "1d: split distinct, replicated equal"
    if mode == "1d":  # sequence parallel: the embedding's output is whole, the rest split
        assert distinct == [False] + [True] * 6, distinct
        return "1d-sp: inside the span distinct"
    assert all(distinct), distinct  # every activation is split
    return f"{mode}: all distinct"


def _dropout_grads(ctx: ParallelContext, checkpointing: bool) -> list[torch.Tensor]:
    """The gradients of a parallelized GPT-2 with dropout, from a fixed generator state."""
    model = parallelize(
        gpt2_lm(resid_pdrop=0.5, embd_pdrop=0.5, attn_pdrop=0.5, attn_implementation="eager"),
        context=ctx,
    )
    model.train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ctx.reseed()
    ids = token_ids()
    causal_lm_loss(model(ids).logits, ids, context=ctx).backward()
    return [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]


def _local_logits(full: torch.Tensor, ctx: ParallelContext) -> torch.Tensor:
    """This rank's block of the single-process logits ``[b, s, V]``."""
    mode, size = ctx.config.tensor_mode, ctx.get_world_size(ParallelMode.TENSOR)
    rank = ctx.get_local_rank(ParallelMode.TENSOR)
    if mode == "1d":  # [b, s, V/p]: this rank's classes
        return full.chunk(size, -1)[rank]
    if mode == "sequence" and full.dim() == 2:  # [b, C]: a classifier's, whole everywhere
        return full
    if mode == "sequence":  # [b, s/N, V]: this rank's tokens
        return full.chunk(size, 1)[rank]
    return split_batch(full, ctx)  # [b/B, s, V]: this rank's rows


#: The weights the first and the last stage share: heads tied to the token embedding.
TIED_ACROSS_STAGES = {
    "gpt2_lm": ["transformer.wte.weight"],
    "bert_mlm": ["bert.embeddings.word_embeddings.weight"],
}


def _vit_stages_train_like_one_process(ctx: ParallelContext, impl: str) -> None:
    """A ViT's layers under 'sequence': loss and every gradient as one process; the model
    itself, whose token split the stages took over, refuses a call."""
    ref = vit_classifier()
    model = parallelize(vit_classifier(), context=ctx, sequence_attention=impl)
    layers = pipeline_layers(model)
    pixels, labels = images()
    ref_loss = F.cross_entropy(ref(pixels).logits, labels)
    ref_loss.backward()
    loss = token_loss(layers(pixels), labels, context=ctx)
    loss.backward()
    torch.testing.assert_close(loss, ref_loss, **TOL)
    grads = _full_grads(model, ctx, mean_loss=True)
    for name, p in ref.named_parameters():
        assert p.grad is not None
        torch.testing.assert_close(grads[name], p.grad, **TOL, msg=lambda m, n=name: f"{n}: {m}")
    with pytest.raises(ValueError, match="cut into pipeline layers"):
        model(pixels)


def _as_pipeline_layers(ctx: ParallelContext) -> int:
    """Each family, parallelized, as a sequence of layers (what pipeline stages cut) computes
    the single-process logits, and every parameter maps back to the model's own name; a head
    tied to the embedding is marked for the engine (the first and last stage hold copies)."""
    from tessera.context import pipeline_shared_key

    # 1D sequence parallelism: the stages carry [b, s/p, h] between the first block and the
    # final norm (BERT: the last block); under 'sequence' this rank's chunk of the tokens, from
    # the embedding to the head (a ViT's 10 tokens padded to 12 on 4 ranks, the padding mask
    # travelling with them).
    ring = ctx.config.tensor_mode == "sequence"
    ids = token_ids()
    padded = torch.ones_like(ids)
    padded[0, -3:], padded[-1, -1:] = 0, 0
    bert_inputs = dict(input_ids=ids, token_type_ids=token_types(), attention_mask=padded)
    cases = [
        (llama_lm, ids),
        (gpt2_lm, ids),
        (gpt2_lm, dict(input_ids=ids, attention_mask=padded)),  # a padding mask travels
        (bert_mlm, bert_inputs),
        (vit_classifier, images()[0]),
    ]
    impl = "all_to_all" if ring and ctx.get_world_size(ParallelMode.TENSOR) == 4 else "ring"
    for build, inputs in cases:
        ref = build()
        model = parallelize(build(), context=ctx, sequence_attention=impl)
        layers = pipeline_layers(model)
        want = ref(**inputs) if isinstance(inputs, dict) else ref(inputs)
        with torch.no_grad():
            torch.testing.assert_close(layers(inputs), _local_logits(want.logits, ctx), **TOL)
        names = original_names(layers, model)
        assert sorted(set(names.values())) == sorted(
            n for n, _ in model.named_parameters(remove_duplicate=False)
        )
        assert original_names_of([layers]) == names  # what engine checkpoints export under
        tied = [n for n, p in model.named_parameters() if pipeline_shared_key(p) is not None]
        assert tied == TIED_ACROSS_STAGES.get(build.__name__, []), tied
    with pytest.raises(TypeError, match="knows these model families"):
        pipeline_layers(nn.Sequential(nn.Linear(2, 2)))
    if ring:
        _vit_stages_train_like_one_process(ctx, impl)
        # a call of the whole model leaves its padding in the model for its attention layers;
        # stages, which run several microbatches at once, must never read it
        ref, model = gpt2_lm(), parallelize(gpt2_lm(), context=ctx, sequence_attention=impl)
        layers = pipeline_layers(model)
        with torch.no_grad():
            model(input_ids=ids, attention_mask=padded)
            torch.testing.assert_close(layers(ids), _local_logits(ref(ids).logits, ctx), **TOL)
        return len(layers)  # its attention dropout is the ring's own (the sequence layers' tests)
    layers = pipeline_layers(parallelize(llama_lm(), context=ctx))
    # Attention dropout (on probabilities split by heads) draws another mask on every rank
    # also when a pipeline runs the layers without the model's own forward.
    dropping = pipeline_layers(
        parallelize(llama_lm(attention_dropout=0.5, attn_implementation="eager"), context=ctx)
    ).train()
    states: list[int] = []
    real = F.dropout

    def spy(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        states.append(int(torch.random.get_rng_state().float().sum()))
        return real(x, *args, **kwargs)

    ctx.reseed()
    try:
        F.dropout = spy  # type: ignore[assignment]
        dropping(ids)
    finally:
        F.dropout = real  # type: ignore[assignment]
    gathered: list[Any] = [None] * ctx.get_world_size(ParallelMode.TENSOR)
    dist.all_gather_object(gathered, states, group=ctx.get_cpu_group(ParallelMode.TENSOR))
    assert len(states) == 2  # one attention per layer
    assert all(len(set(call)) == len(call) for call in zip(*gathered, strict=True)), gathered
    return len(layers)


def _meta_built(ctx: ParallelContext) -> int:
    """Built with its parameters on the meta device: only shards are allocated, all initialized;
    loaded with the full weights, the model computes what the plain one does."""
    for build in (gpt2_lm, llama_lm):
        _meta_built_matches(build, ctx)
    return 2


def _meta_built_matches(build: Callable[..., nn.Module], ctx: ParallelContext) -> None:
    """``build()`` made on the meta device and parallelized: every parameter materialized;
    loaded with ``build()``'s weights it computes the same logits."""
    ref = build()
    with meta_parameters():
        empty = build()
    assert all(p.is_meta for p in empty.parameters())
    model = parallelize(empty, context=ctx)
    for name, p in model.named_parameters():
        assert not p.is_meta and bool(torch.isfinite(p).all()), f"{name} not materialized"
    load_full_state_dict(model, ref.state_dict())
    ids = token_ids()
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, _local_logits(ref(ids).logits, ctx), **TOL)


#: The transformers models every layout runs, built alike on every rank.
def _plain_block(*layers: Callable[[], nn.Module]) -> nn.Sequential:
    """The layers built after seeding, so every rank holds the same block."""
    torch.manual_seed(3)
    ref = nn.Sequential(*(build() for build in layers))
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn(p.shape) * 0.1)
    return ref


def _listing_1() -> nn.Sequential:
    """The paper's Listing 1: Linear -> LayerNorm -> Linear."""
    return _plain_block(
        lambda: nn.Linear(16, 32), lambda: nn.LayerNorm(32), lambda: nn.Linear(32, 16)
    )


def _mlp_matches_reference(ctx: ParallelContext) -> int:
    """Plain torch blocks with a user's dict plan: full input in, full output out.

    The first is a pre-norm MLP; the second the paper's Listing 1 (Linear -> LayerNorm ->
    Linear), whose LayerNorm takes the column layer's output.
    """
    mlp = _plain_block(
        lambda: nn.LayerNorm(16),
        lambda: nn.Linear(16, 32),
        nn.GELU,
        lambda: nn.Linear(32, 16),
    )
    checked = _block_matches_reference(ctx, mlp, {"0": "norm", "1": "col", "3": "row"})
    torch.manual_seed(0)  # blocks with a final norm: their plan read from them
    stack = nn.Sequential(Block(16, 4, causal=False), Block(16, 4), nn.LayerNorm(16))
    if ctx.config.tensor_mode == "sequence":  # attention written out: positions unknown
        with pytest.raises(ValueError, match=r"'0\.attn' is code of its own"):
            parallelize(stack, context=ctx)
        checked += 34  # the parameters the stack holds, as under the other modes
    else:
        checked += _block_matches_reference(ctx, stack, None)
    listing_1 = _listing_1()
    checked += _block_matches_reference(ctx, listing_1, {"0": "col", "1": "norm", "2": "row"})
    # left out of the plan, each run under DTensor, its parameters replicated, their
    # gradients summed over the split rows: Listing 1's norm and a linear layer of the
    # researcher's own between the column and the row layer (a partial product there, summed
    # into the column layout), and a layer scale and a linear layer after the row layer
    torch.manual_seed(0)
    first, norm, last = _listing_1()
    own = nn.Sequential(first, norm, nn.Linear(32, 32), last, LayerScale(16), nn.Linear(16, 16))
    checked += _block_matches_reference(ctx, own, {"0": "col", "3": "row"})
    if ctx.config.tensor_mode in ("2d", "2.5d", "3d"):  # every activation is split there
        attention = nn.MultiheadAttention(16, 4, batch_first=True)
        left_out = nn.Sequential(nn.Linear(16, 16), attention, nn.Linear(16, 32), nn.Linear(32, 16))
        with pytest.raises(ValueError, match=r"\['1'\] hold parameters but are not in the"):
            parallelize(left_out, {"0": "dense", "2": "col", "3": "row"}, context=ctx)
    return checked + _dispatching_listing_1(ctx)


def _dispatching_listing_1(ctx: ParallelContext) -> int:
    """Listing 1 written with the dispatching layers, no layout argument but the 3D one."""
    from tessera.layers import LayerNorm, Linear, gather_activation, split_activation

    ref = _listing_1()
    model = nn.Sequential(
        Linear(16, 32, parallel="col", context=ctx),
        LayerNorm(32, parallel_input=True, context=ctx),
        Linear(32, 16, parallel="row", context=ctx),
    )
    load_full_state_dict(model, ref.state_dict())
    x = torch.randn(4, 8, 16, generator=torch.Generator().manual_seed(4))
    w = torch.randn(4, 8, 16, generator=torch.Generator().manual_seed(5))
    y_ref = ref(x)
    y = gather_activation(model(split_activation(x, ctx)), ctx)
    torch.testing.assert_close(y, y_ref, **TOL)
    (y_ref * w).sum().backward()
    (y * w).sum().backward()
    grads = _full_grads(model, ctx)
    for name, p in ref.named_parameters():
        assert p.grad is not None
        torch.testing.assert_close(grads[name], p.grad, **TOL, msg=lambda m, n=name: f"{n}: {m}")
    if ctx.config.tensor_mode in ("2d", "2.5d", "3d"):  # the whole batch where a block is due
        from tessera.layers import Embedding

        embedding = Embedding(16, 16, context=ctx)
        ids = token_ids() % 16  # the same on every rank
        whole = r"same input \[4, 8\] on all \d ranks of its batch group"
        with pytest.raises(ValueError, match=whole):
            embedding(ids)
    if ctx.config.tensor_mode == "3d":  # the same shapes in both layouts: the mark tells
        unmarked = nn.Sequential(model[0], LayerNorm(32, context=ctx))
        with pytest.raises(ValueError, match=r"input is in layout 'z'.*parallel_input=True"):
            unmarked(split_activation(x, ctx))
    return len(grads)


def _block_matches_reference(
    ctx: ParallelContext, ref: nn.Module, plan: dict[str, str] | None
) -> int:
    model = parallelize(copy.deepcopy(ref), plan, context=ctx)
    x = torch.randn(4, 8, 16, generator=torch.Generator().manual_seed(4))
    x_ref, x_par = x.clone().requires_grad_(), x.clone().requires_grad_()
    w = torch.randn(4, 8, 16, generator=torch.Generator().manual_seed(5))
    y_ref, y_par = ref(x_ref), model(x_par)
    (y_ref * w).sum().backward()
    (y_par * w).sum().backward()
    torch.testing.assert_close(y_par, y_ref, **TOL)
    assert x_par.grad is not None and x_ref.grad is not None
    torch.testing.assert_close(_input_grad(x_par.grad, ctx), x_ref.grad, **TOL)
    grads = _full_grads(model, ctx, mean_loss=ctx.config.tensor_mode == "sequence")
    for name, p in ref.named_parameters():
        assert p.grad is not None
        torch.testing.assert_close(grads[name], p.grad, **TOL, msg=lambda m, n=name: f"{n}: {m}")
    return len(grads)


#: The layouts split between the two torches CI tests, so each torch runs every tensor mode
#: once and none twice at more ranks: on the pinned one 1D on 4 ranks, the all-to-all beside
#: the ring, 2.5D (2D's code with a depth) and 3D (whose compiled step runs on the newest);
#: on the newest one 2D. 1D, 1D with sequence parallelism and the ring run on both.
PINNED_TORCH_ONLY = ("1d-4", "2.5d", "3d", "sequence-all-to-all")
NEWEST_TORCH_ONLY = ("2d",)


def _torch_marks(layout: str) -> list[pytest.MarkDecorator]:
    if layout in PINNED_TORCH_ONLY:
        return [pytest.mark.pinned_torch_only]
    return [pytest.mark.newest_torch_only] if layout in NEWEST_TORCH_ONLY else []


@pytest.mark.parametrize(
    ("layout", "check"),
    [
        pytest.param(layout, check, marks=_torch_marks(layout))
        for layout, tensor in LAYOUTS.items()
        for check in CHECKS
        if _runs(check, layout)
    ],
)
def test_transformers_models_and_plain_blocks_equal_single_process(
    dist, layout: str, check: str
) -> None:
    tensor = LAYOUTS[layout]
    results = dist.run(_run_check, world_size=tensor["size"], args=(tensor, check), timeout=240.0)
    expected = {"blocks": 63, "meta": 2, "layers": 4}
    if check in expected:
        assert results[0] == expected[check]
    assert all(r == results[0] for r in results)  # losses agree on every rank


@pytest.mark.parametrize("layout", ["1d", "1d-sp", "2d", "3d", "sequence-ring"])
def test_timm_vision_transformer_equals_single_process(dist, layout: str) -> None:
    pytest.importorskip("timm")  # with torchvision: nox's tests_newest environment
    tensor = LAYOUTS[layout]
    results = dist.run(
        _run_check, world_size=tensor["size"], args=(tensor, "vision transformers"), timeout=240.0
    )
    assert all(r == results[0] for r in results)


class _ScaledEmbedding(nn.Embedding):
    """An embedding that scales its rows in a forward of its own (as Gemma's does)."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids) * 4.0


def _errors() -> list[str]:
    """Each misuse raises before any collective, naming what to do."""
    from transformers import GPT2LMHeadModel

    caught: list[str] = []

    def expect(error: type[Exception], text: str, fn: Any) -> None:
        with pytest.raises(error, match=text):
            fn()
        caught.append(text)

    ctx = _context(dict(size=2, mode="1d"))
    try:
        torch.manual_seed(dist.get_rank())  # built without a common seed: each rank its own
        differing = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 16))
        expect(
            ValueError,
            r"tensor ranks \[0, 1\] hold different weights of Sequential \(0.bias, 0.weight, "
            r"1.bias, 1.weight differ .* seeding every rank alike",
            lambda: parallelize(differing, {"0": "col", "1": "row"}, context=ctx),
        )
        torch.manual_seed(0)  # the same block on every rank
        lm = parallelize(gpt2_lm(), context=ctx)
        expect(
            ValueError,
            r"GPT2LMHeadModel.resize_token_embeddings after parallelize: .* before parallelize",
            lambda: lm.resize_token_embeddings(80),
        )
        block = nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
        expect(
            ValueError,
            r"patterns \['fc9'\] match no module",
            lambda: parallelize(copy.deepcopy(block), {"1": "col", "fc9": "row"}, context=ctx),
        )
        expect(
            ValueError,
            r"'1' is a 'row' layer with no 'col'",
            lambda: parallelize(copy.deepcopy(block), {"1": "row", "3": "col"}, context=ctx),
        )
        expect(
            ValueError,
            "splits no parameter",
            lambda: parallelize(copy.deepcopy(block), {"0": "norm"}, context=ctx),
        )
        expect(
            TypeError,
            "takes an nn.Linear",
            lambda: parallelize(copy.deepcopy(block), {"0": "col", "3": "row"}, context=ctx),
        )
        scaled = nn.ModuleDict({"embed": _ScaledEmbedding(16, 8)})
        expect(
            TypeError,
            r"'embed' \(_ScaledEmbedding\) has role 'embedding', but its class overrides "
            r"torch.nn.Embedding.forward",
            lambda: parallelize(scaled, {"embed": "embedding"}, context=ctx),
        )
        expect(
            TypeError,
            r"'1' \(Linear\) has role 'experts', which takes transformers' experts .* it holds "
            r"\['bias', 'weight'\]",
            lambda: parallelize(copy.deepcopy(block), {"1": "experts"}, context=ctx),
        )
        expect(
            ValueError,
            "ends with the 'col' layer '1'",
            lambda: parallelize(copy.deepcopy(block), {"1": "col"}, context=ctx),
        )
        # torch's attention between a column and a row layer, left out: it would read this
        # rank's 16 of the 32 features as if they were all of them
        attention = nn.MultiheadAttention(32, 4, batch_first=True)
        inner = nn.Sequential(nn.Linear(16, 32), attention, nn.Linear(32, 16))
        guarded = parallelize(inner, {"0": "col", "2": "row"}, context=ctx)
        expect(
            ValueError,
            r"'1' holds torch's nn.MultiheadAttention but is not in the plan, and it takes a "
            r"\[2, 4, 16\] block of a column tensor split over the tensor ranks "
            r"\(Shard\(dim=2\)\)",
            lambda: guarded(torch.ones(2, 4, 16)),
        )
        torch.manual_seed(0)  # the forward stopped inside 1D's forked generator (dropout.py)
        from hf_models import clip_models

        two_towers = parallelize(clip_models()["CLIPModel"], context=ctx)  # its towers as parts
        expect(
            RuntimeError,
            r"text_model.encoder.layers.0.mlp.fc1 is a split layer of 'text_model' "
            r"\(CLIPTextModel\), which parallelize converted as a whole",
            lambda: two_towers.text_model.encoder.layers[0].mlp.fc1(torch.ones(2, 16)),
        )
        tied = nn.ModuleDict({"embed": nn.Embedding(16, 8), "head": nn.Linear(8, 16, bias=False)})
        tied["head"].weight = tied["embed"].weight
        expect(
            ValueError,
            "embed.weight is tied to a parameter the plan converted",
            lambda: parallelize(tied, {"head": "head"}, context=ctx),
        )
        expect(
            ValueError,
            "ships no plan for Sequential",
            lambda: parallelize(copy.deepcopy(block), context=ctx),
        )
        twice = parallelize(copy.deepcopy(block), {"1": "col", "3": "row"}, context=ctx)
        expect(ValueError, "already parallelized", lambda: parallelize(twice, context=ctx))
        odd_heads = gpt2_lm(n_embd=18, n_head=3)
        expect(
            ValueError,
            r"num_heads = 3 is not divisible by the 2 ranks",
            lambda: parallelize(odd_heads, context=ctx),
        )
        three_kv = llama_lm(hidden_size=24, num_attention_heads=6, num_key_value_heads=3)
        expect(
            ValueError,
            r"num_key_value_heads = 3 is not divisible by the 2 ranks that split the heads "
            r"under tensor mode '1d' \(nor, for key/value heads, a divisor of it\)",
            lambda: parallelize(three_kv, context=ctx),
        )
        odd_mqa = _tiny("Phi3", num_key_value_heads=1)  # 4 query heads of 4, 1 key/value
        odd_mqa.model.layers[0].self_attn.qkv_proj = nn.Linear(16, 20, bias=False)  # 5 heads
        expect(
            ValueError,
            r"'model.layers.0.self_attn.qkv_proj' of 'model.layers.0.self_attn' \(role 'qkv'\) "
            r"makes 20 features, none of its 4 query heads' \(16\), its 1 key/value heads' "
            r"\(4\) or all of them fused \(4 \+ 2 \* 1 heads = 24\), 4 features each. Its 1 "
            r"key/value heads are repeated over the 2 ranks",
            lambda: parallelize(odd_mqa, context=ctx),
        )
        gated = _tiny("Qwen3", num_attention_heads=2, num_key_value_heads=1, head_dim=8)
        # a query with a gate per head: as wide as q, k and v fused, beside k_proj and v_proj
        gated.model.layers[0].self_attn.q_proj = nn.Linear(16, 32, bias=False)
        expect(
            ValueError,
            r"'model.layers.0.self_attn.q_proj' of 'model.layers.0.self_attn' \(role 'col'\) "
            r"makes 32 features, as many as all its heads fused \(2 \+ 2 \* 1 heads of 8\), "
            r"but 'model.layers.0.self_attn' also has the column layers "
            r"\['model.layers.0.self_attn.k_proj', 'model.layers.0.self_attn.v_proj'\]",
            lambda: parallelize(gated, context=ctx),
        )
        olmo2 = _tiny("Olmo2")  # its q_norm and k_norm span all heads' features
        layers = "model.layers.*"
        olmo2_plan = {
            rule: role
            for rule, role in BUILTIN_PLANS["Qwen3ForCausalLM"].rules.items()
            if "layernorm" not in rule
        }
        olmo2_plan |= {f"{layers}.post_attention_layernorm": "norm"}
        olmo2_plan |= {f"{layers}.post_feedforward_layernorm": "norm"}
        expect(
            ValueError,
            r"'model.layers.0.self_attn.q_norm' has role 'head_norm', which normalizes one "
            r"head's features \('model.layers.0.self_attn''s heads have 4\), but it normalizes 16",
            lambda: parallelize(olmo2, olmo2_plan, context=ctx),
        )
        qwen3 = _tiny("Qwen3")  # q_norm as a plain norm: kept whole, it would see 2 of 4 heads
        as_norm = {**BUILTIN_PLANS["Qwen3ForCausalLM"].rules}
        as_norm["model.layers.*.self_attn.q_norm"] = "norm"
        expect(
            ValueError,
            r"'model.layers.0.self_attn.q_norm' has role 'norm' inside the attention module "
            r"'model.layers.0.self_attn', but it normalizes one head's 4 features; .*'head_norm'",
            lambda: parallelize(qwen3, as_norm, context=ctx),
        )
        lm = parallelize(gpt2_lm(), context=ctx)
        assert isinstance(lm, GPT2LMHeadModel)
        ids = token_ids()
        # a classifier's loss tessera does not compute on split logits (multi-label) is refused
        vit = parallelize(vit_classifier(), context=ctx)
        pixels, labels = images()
        multi = F.one_hot(labels, int(vit.config.num_labels)).float()
        expect(ValueError, "single_label_classification", lambda: vit(pixels, labels=multi))
    finally:
        ctx.destroy()
    sp = _context(dict(size=2, mode="1d", sequence_parallel=True))
    try:  # a block's own scale: its module computes plain, each rank on its tokens
        expect(
            ValueError,
            r"\['0'\] hold parameters but are not in the user plan",
            lambda: parallelize(
                nn.Sequential(GatedMLP(16, own_gate=True)),
                {"*.fc1": "col", "*.fc2": "row"},
                context=sp,
            ),
        )
        # a gate of its own taking no input: no layout to run it under DTensor with
        gated = parallelize(GatedMLP(16), {"fc1": "col", "fc2": "row"}, context=sp)
        expect(
            ValueError,
            r"'gate' holds parameters but is not in the plan, and none of its inputs \[\]",
            lambda: gated(torch.ones(2, 4, 16)),
        )
        from transformers import GPT2Config, GPT2DoubleHeadsModel

        # Laid out as GPT-2 but for a head no plan knows: its GPT-2 is a part with a plan, but
        # the language-model head outside it is tied to the part's embedding (parts.py).
        two_heads = GPT2DoubleHeadsModel(GPT2Config(**GPT2_CONFIG))
        expect(
            ValueError,
            r"lm_head.weight \(tied into 'transformer'\) would keep the whole tensor",
            lambda: parallelize(two_heads, context=sp),
        )
    finally:
        sp.destroy()
    seq = _context(dict(size=2, mode="sequence"))
    try:
        expect(
            ValueError,
            r"3 heads, which all-to-all attention cannot split over the 2 sequence ranks",
            lambda: parallelize(
                gpt2_lm(n_embd=18, n_head=3), sequence_attention="all_to_all", context=seq
            ),
        )
        # Attention of a model that is not transformers' is taken over through its SDPA call:
        # one that computes its scores itself is an error at its forward.
        manual = parallelize(copy.deepcopy(block), {"1": "attention"}, context=seq)
        expect(
            ValueError,
            "Linear under tensor mode 'sequence' made no call to F.scaled_dot_product_attention",
            lambda: manual(torch.zeros(4, 8, 16)),
        )
        # A model counting positions itself with no position table to move is refused.
        no_table = plain_lm()
        del no_table.pos_emb
        no_table.forward = types.MethodType(
            lambda self, ids: self.head(self.tok_emb(ids)), no_table
        )
        expect(
            ValueError,
            "PlainLM.forward takes no position_ids and no module has role 'position_embedding'",
            lambda: parallelize(no_table, context=seq),
        )
        from transformers import GPT2Config, GPT2DoubleHeadsModel

        # 'sequence' splits no parameter: a head tied across a part's edge stays tied (parts.py)
        two_heads = parallelize(GPT2DoubleHeadsModel(GPT2Config(**GPT2_CONFIG)), context=seq)
        assert two_heads.lm_head.weight is two_heads.transformer.wte.weight
        # a short convolution over the sequence (a hybrid model's) would see this rank's chunk
        conv = nn.Sequential(nn.Linear(16, 32), nn.Conv1d(32, 32, 3), nn.Linear(32, 16))
        expect(
            ValueError,
            r"\['1 \(Conv1d\)'\] mix the tokens of a sequence, but each rank holds only its chunk",
            lambda: parallelize(conv, {"0": "col", "2": "row"}, context=seq),
        )
        nothing_known = nn.Sequential(nn.Linear(16, 16), nn.ReLU())
        expect(
            ValueError,
            "ships no plan for Sequential .* not laid out like one of",
            lambda: parallelize(nothing_known, context=seq),
        )
        expect(
            ValueError,
            "'sum_and_count' is not supported under tensor mode 'sequence'",
            lambda: token_loss(torch.zeros(4, 4, 32), ids, reduction="sum_and_count", context=seq),
        )
        # Gemma 2 soft-caps its scores, and a sliding window shorter than the sequence hides
        # keys: the ring computes neither, so the model's first attention call is refused.
        gemma2 = parallelize(gemma_lm("Gemma2"), context=seq)
        expect(ValueError, r"passes softcap=50.0 to its attention", lambda: gemma2(ids))
        windowed = parallelize(mistral_lm(sliding_window=4), context=seq)
        expect(
            ValueError,
            "sliding window of 4 tokens, shorter than the sequence of 8",
            lambda: windowed(ids),
        )
        # Qwen2-MoE keeps the window on its sliding layers without passing it to attention.
        sliding = dict(use_sliding_window=True, sliding_window=4, max_window_layers=2)
        windowed_moe = parallelize(qwen2_moe_lm(**sliding), context=seq)
        expect(
            ValueError,
            "Qwen2MoeAttention under tensor mode 'sequence' attends within a sliding window of 4",
            lambda: windowed_moe(ids),
        )
        # Attention the plan leaves out would attend within this rank's chunk: refused, for a
        # researcher's own module (found by its name) and torch's nn.MultiheadAttention.
        expect(
            ValueError,
            r"\['1'\] attend over the tokens but the user plan converts none of them",
            lambda: parallelize(_own_attention_block(), {"2": "col", "3": "row"}, context=seq),
        )
        layer = nn.TransformerEncoderLayer(16, 4, 32, batch_first=True)
        encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        mlp = {"layers.*.linear1": "col", "layers.*.linear2": "row"}
        expect(
            ValueError,
            r"\['layers.0.self_attn', 'layers.1.self_attn'\] attend over the tokens",
            lambda: parallelize(encoder, mlp, context=seq),
        )
        # GPT-Neo writes its attention out in its forward: the ring cannot reach it.
        expect(TypeError, "does not use", lambda: parallelize(gpt_neo_lm(), context=seq))
        lm = parallelize(gpt2_lm(), context=seq)
        padded = torch.ones_like(ids)
        padded[0, -2:] = 0
        expect(
            ValueError,
            r"attention_mask must be \[b, s\] = \[4, 8\] like input_ids",
            lambda: lm(ids, attention_mask=padded[:, None, None, :]),
        )
    finally:
        seq.destroy()
    return caught


def _own_attention_block() -> nn.Sequential:
    """A researcher's own attention (q/k/v/o around SDPA) between a norm and an MLP."""
    return nn.Sequential(
        nn.LayerNorm(16), SelfAttention(16, 4), nn.Linear(16, 32), nn.Linear(32, 16)
    )


def test_misuse_is_a_clear_error(dist) -> None:
    results = dist.run(_errors, world_size=2, timeout=120.0)
    assert len(results[0]) == 37


def _offset_norms() -> int:
    """Norms scaling by ``1 + weight`` (Gemma's): built on meta they start at a scale of 1, and
    in bf16 they add the 1 in fp32, as Gemma does (in bf16 a weight of 0.003 would vanish)."""
    from tessera.layers import HeadRMSNorm, RMSNorm1D
    from tessera.layers.shared.norm_over_group import ParallelNorm

    ctx = _context(dict(size=2, mode="1d", sequence_parallel=True))
    try:
        with meta_parameters():
            empty = gemma_lm("Gemma3")
        model = parallelize(empty, context=ctx)
        offset = [m for m in model.modules() if isinstance(m, ParallelNorm) and m.weight_offset]
        assert any(isinstance(m, HeadRMSNorm) for m in offset)
        assert any(isinstance(m, RMSNorm1D) for m in offset)  # the sequence span's norms
        for norm in offset:
            assert norm.weight is not None and bool((norm.weight == 0).all()), norm
        gemma = _norm("gemma", "GemmaRMSNorm", 16).to(torch.bfloat16)
        ours = RMSNorm1D(16, 1e-6, dtype=torch.bfloat16, context=ctx)
        ours.weight_offset = 1.0
        with torch.no_grad():
            for norm in (gemma, ours):
                norm.weight.fill_(0.003)
        x = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(0)).bfloat16()
        scale = (ours(x).float() / gemma._norm(x.float())).mean()
        assert abs(float(scale) - 1.003) < 5e-4, float(scale)
        torch.testing.assert_close(ours(x), gemma(x), rtol=0.0, atol=0.0)
    finally:
        ctx.destroy()
    return len(offset)


def test_norms_scaling_by_one_plus_weight_start_and_compute_as_gemmas(dist) -> None:
    results = dist.run(_offset_norms, world_size=2, timeout=120.0)
    assert results[0] > 0


def test_inner_norms_follow_a_column_layer_and_precede_a_row_layer() -> None:
    from tessera.layers.conversion.plan import inner_norms

    listing_1 = {"fc1": "col", "norm": "norm", "fc2": "row"}
    assert inner_norms(listing_1) == {"norm"}
    # w1, w2, w3 registered out of data-flow order: w3 is still open at the next block's norm
    out_of_order = {"w1": "col", "w2": "row", "w3": "col", "next.norm": "norm", "wq": "col"}
    assert inner_norms({**out_of_order, "wo": "row"}) == set()


def test_a_sequence_span_names_the_last_block_by_minus_one() -> None:
    from tessera.layers.conversion.plan import resolve_span

    model = nn.Module()
    model.blocks = nn.ModuleList(nn.Linear(2, 2) for _ in range(3))
    model.norm = nn.LayerNorm(2)
    model.empty = nn.ModuleList()
    assert resolve_span(model, ("blocks.0", "blocks.-1")) == ("blocks.0", "blocks.2")
    assert resolve_span(model, ("blocks.1", "norm")) == ("blocks.1", "norm")
    with pytest.raises(ValueError, match=r"'norm' is LayerNorm"):
        resolve_span(model, ("blocks.0", "norm.-1"))
    with pytest.raises(ValueError, match=r"'empty' is ModuleList \(empty\)"):
        resolve_span(model, ("blocks.0", "empty.-1"))


def test_a_plan_with_an_unknown_role_is_refused() -> None:
    from tessera.layers import Plan

    with pytest.raises(ValueError, match=r"unknown role 'column'.*did you mean 'col'"):
        Plan({"fc1": "column"})


def _tiny(family: str, **overrides: Any) -> nn.Module:
    import transformers

    small = dict(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1)
    small |= dict(num_attention_heads=4, max_position_embeddings=16)
    configs = {
        "OPT": dict(small, ffn_dim=32, word_embed_proj_dim=16),
        "GPTNeoX": small,
        "Nemotron": dict(small, num_key_value_heads=4, head_dim=4),
        "GPTBigCode": dict(vocab_size=32, n_embd=16, n_layer=1, n_head=4, n_positions=16),
        "GPTJ": dict(vocab_size=32, n_embd=16, n_layer=1, n_head=4, n_positions=16, rotary_dim=4),
        "Phi": dict(small, qk_layernorm=True),
        "StableLm": dict(small, qk_layernorm=True, partial_rotary_factor=0.5),
        "Cohere": dict(small, use_qk_norm=True, bos_token_id=None, eos_token_id=None),
        "Qwen3": dict(small, num_key_value_heads=2, head_dim=4),
        "Olmo2": dict(small, num_key_value_heads=2, pad_token_id=None, eos_token_id=None),
        "Glm": dict(small, num_key_value_heads=2, pad_token_id=None),
        "Glm4": dict(small, num_key_value_heads=2, pad_token_id=None),
        "Phi3": dict(small, num_key_value_heads=2, pad_token_id=None),
    }
    config = getattr(transformers, f"{family}Config")(**{**configs[family], **overrides})
    return getattr(transformers, f"{family}ForCausalLM")(config)  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    ("family", "reason"),
    [
        ("OPT", r"model\.decoder\.layers\.0\.self_attn\.q_proj is not a linear layer from the"),
        ("GPTNeoX", "0 attention modules with separate q, k and v projections"),
        ("GPTBigCode", "0 attention modules with separate q, k and v projections"),
        ("Glm", r"gate_up_proj makes 64 features where .*down_proj takes 32: .*'gate_up'"),
    ],
)
def test_a_model_unlike_the_usual_block_stack_gets_no_plan_and_the_reason(
    family: str, reason: str
) -> None:
    # OPT-350m's embeddings are narrower than its blocks (project_in, project_out between),
    # GPT-NeoX and GPTBigCode fuse q, k, v in an order their shapes do not tell (their family
    # plans, which know the order, take them): each would train wrong, silently, under a
    # guessed plan.
    from tessera.layers.conversion.structure import infer_structure

    # GLM's MLP chunks its gate_up_proj in two halves: a plain column split gave each rank
    # the gate of some features and the up of others, and trained wrong without an error.
    overrides = {"word_embed_proj_dim": 8} if family == "OPT" else {}
    report = infer_structure(_tiny(family, **overrides))
    assert report.rules is None
    assert re.search(reason, report.reason), report.reason


class _MaskedBlock(Block):
    """A block whose forward also takes a mask: a features plan would hand it whole."""

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        return super().forward(x)


class _TupleBlock(Block):
    """A block returning ``(x,)``: a features plan's boundary gathers one tensor."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor]:  # type: ignore[override]
        return (super().forward(x),)


class _SequenceFirstBlock(Block):
    """A block taking ``[s, b, h]``: a features plan would cut its tokens as the batch."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.transpose(0, 1)).transpose(0, 1)


class _PositionsAround(nn.Module):
    """Positions counted in a forward of its own around its blocks (``x.shape[1]``)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("table", torch.randn(1, 32, 16))
        self.blocks = nn.ModuleList(Block(16, 4) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.table[:, : x.shape[1]]
        for block in self.blocks:
            x = block(x)
        return x


def test_blocks_alone_get_a_features_plan_and_a_model_around_them_parts() -> None:
    """Blocks with nothing around them but norms (an nn.Sequential, or one block) get a
    features plan read from them; a model holding its own parameters beside them is cut into
    parts (the Sequential, or each block its loop calls); a block also taking a mask, a
    module holding a parameter, and a ModuleList (no forward) get none."""
    from plain_models import PatchViT

    from tessera.layers.conversion.plan import NoPlanError, parts_with_plans, plan_for

    stack = nn.Sequential(Block(16, 4), Block(16, 4), nn.LayerNorm(16))
    found = plan_for(nn.Sequential(Block(16, 4), Block(16, 4)), None)
    assert found.boundary == "features" and found.rules["*.attn.q"] == "col", found
    assert found.rules["*.fc2"] == "row" and found.rules["*.ln1"] == "norm"
    assert plan_for(Block(16, 4), None).rules["attn.o"] == "row"
    assert plan_for(stack, None).rules["2"] == "norm"  # a final norm after the blocks
    assert [name for name, _ in parts_with_plans(PatchViT())] == ["blocks.0", "blocks.1"]
    with pytest.raises(NoPlanError, match="holds parameters itself"):
        plan_for(PatchViT(), None)
    with pytest.raises(NoPlanError, match=r"takes more than the activation alone"):
        plan_for(_MaskedBlock(16, 4), None)
    for apart in (_TupleBlock(16, 4), nn.Sequential(_SequenceFirstBlock(16, 4))):
        with pytest.raises(NoPlanError, match=r"does not keep the samples of dim 0 apart"):
            plan_for(apart, None)
    # code of its own around the blocks runs whole: each block its loop calls is a part
    with pytest.raises(NoPlanError, match=r"not blocks alone"):
        plan_for(_PositionsAround(), None)
    assert [name for name, _ in parts_with_plans(_PositionsAround())] == ["blocks.0", "blocks.1"]
    # attention written out may count positions from the chunk: refused under 'sequence'
    assert "is code of its own" in found.whole_sequence
    layer = nn.TransformerEncoderLayer(16, 4, 32, batch_first=True)
    assert plan_for(nn.Sequential(layer, copy.deepcopy(layer)), None).whole_sequence == ""
    with pytest.raises(NoPlanError, match="a list of blocks without a forward"):
        plan_for(nn.ModuleList([Block(16, 4), Block(16, 4)]), None)


@pytest.mark.parametrize(
    ("family", "plan"),
    [("Phi3", "Phi-3 LM"), ("Glm", "GLM LM plan inferred"), ("Glm4", "GLM-4 LM plan inferred")],
)
def test_fused_projection_families_get_plans_naming_their_fused_roles(
    family: str, plan: str
) -> None:
    """Phi-3 (q/k/v and gate/up fused), GLM and GLM-4 (gate/up fused) by class or layout."""
    from tessera.layers.conversion.plan import plan_for

    chosen = plan_for(_tiny(family), None)
    assert chosen.name == plan or chosen.name.startswith(plan), chosen.name
    assert chosen.rules["model.layers.*.mlp.gate_up_proj"] == "gate_up"
    if family == "Phi3":
        assert chosen.rules["model.layers.*.self_attn.qkv_proj"] == "qkv"


def test_norms_of_each_head_get_role_head_norm_inside_attention_only() -> None:
    """Qwen3's ``q_norm``/``k_norm`` by its family plan, Phi's ``q_layernorm`` read from its
    blocks, OLMo-2's norms over all query and all key features a plain ``norm`` inside the
    attention; a ``head_norm`` outside attention is refused."""
    from dataclasses import replace

    from tessera.layers.conversion.plan import match_plan, plan_for

    qwen3 = _tiny("Qwen3")
    plan = plan_for(qwen3, None)
    assert plan.name == "Qwen3 LM"
    for norm in ("q_norm", "k_norm"):
        assert plan.rules[f"model.layers.*.self_attn.{norm}"] == "head_norm"
    read = plan_for(_tiny("Phi"), None)
    assert read.name.startswith("plan read from the transformer blocks"), read.name
    for norm in ("q_layernorm", "k_layernorm"):
        assert read.rules[f"model.layers.*.self_attn.{norm}"] == "head_norm"
    olmo2 = plan_for(_tiny("Olmo2"), None)
    for norm in ("q_norm", "k_norm"):
        assert olmo2.rules[f"model.layers.*.self_attn.{norm}"] == "norm"
    for family, norms in (("StableLm", ("q_layernorm", "k_layernorm")), ("Cohere", ("q_norm",))):
        per_head = plan_for(_tiny(family), None)  # a weight per head: a list, or [heads, d]
        for norm in norms:
            assert per_head.rules[f"model.layers.*.self_attn.{norm}"] == "head_norm"
        assert not any(".norms." in pattern for pattern in per_head.rules)
    no_attention = {k: v for k, v in plan.rules.items() if v != "attention"}
    with pytest.raises(
        ValueError,
        match=r"'model.layers.0.self_attn.q_norm' has role 'head_norm', but no module around it "
        "has role 'attention'",
    ):
        match_plan(qwen3, replace(plan, rules=no_attention), "2d")


def test_a_plan_leaving_out_a_module_with_parameters_inside_attention_is_refused() -> None:
    """Left out, StableLM's list of per-head norms would scale this rank's heads by the first
    heads' weights (it zips its norms with the heads it is given), without an error."""
    from dataclasses import replace

    from tessera.layers.conversion.plan import match_plan, plan_for

    model = _tiny("StableLm")
    plan = plan_for(model, None)
    left_out = {k: v for k, v in plan.rules.items() if not k.endswith("k_layernorm")}
    with pytest.raises(
        ValueError,
        match=r"'model.layers.0.self_attn.k_layernorm.norms.0' \(LayerNorm\) holds parameters "
        r"inside the attention module 'model.layers.0.self_attn', whose heads are split",
    ):
        match_plan(model, replace(plan, rules=left_out), "1d")
    match_plan(model, replace(plan, rules=left_out), "sequence")  # whole heads: nothing split


class _FalconLike(nn.Linear):
    """Falcon's way: the product written out."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.T + self.bias


class _DroppedWeights(nn.Linear):
    """DropConnect: the weight dropped in training only, like the plain layer in eval mode."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, F.dropout(self.weight, 0.5, self.training), self.bias)


def test_a_linear_subclass_is_taken_only_when_it_computes_a_linear_layer() -> None:
    from tessera.layers.conversion.converters import linear_shape

    assert linear_shape("fc", _FalconLike(4096, 8192), "col").out_features == 8192  # probed small
    with pytest.raises(TypeError, match=r"'fc' \(_DroppedWeights\) .*overrides torch.nn.Linear"):
        linear_shape("fc", _DroppedWeights(3, 4).eval(), "col")  # differs in training only


def test_bloom_slicing_its_weights_by_hand_is_refused() -> None:
    """``pretraining_tp > 1`` with ``slow_but_exact``: attention and MLP multiply slices of
    their whole output weights themselves, which a rank's shard is not."""
    from tessera.layers.conversion.plan import match_plan, plan_for

    model = bloom_lm(pretraining_tp=2, slow_but_exact=True)
    with pytest.raises(
        ValueError, match=r"'transformer.h.0.self_attention' .*slow_but_exact=False"
    ):
        match_plan(model, plan_for(model, None), "1d")


def test_bloom_stages_count_alibi_positions_exactly_in_bf16() -> None:
    """Built from a mask of ones in bf16, positions past 256 would round."""
    model = bloom_lm().to(torch.bfloat16)
    ids = torch.randint(0, 32, (1, 300), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(pipeline_layers(model)(ids), model(ids).logits)


def test_a_fused_gate_and_up_named_as_a_plain_column_layer_is_refused() -> None:
    """Its width tells: a ``col`` layer makes what the row layer takes, ``gate_up`` twice."""
    from dataclasses import replace

    from tessera.layers.conversion.plan import match_plan, plan_for

    model = _tiny("Glm")
    plan = plan_for(model, None)
    match_plan(model, plan, "2d")  # the family's plan: gate_up_proj is 'gate_up'
    as_col = replace(plan, rules={**plan.rules, "model.layers.*.mlp.gate_up_proj": "col"})
    with pytest.raises(
        ValueError,
        match=r"under tensor mode '2d': the 'col' layer 'model.layers.0.mlp.gate_up_proj' makes "
        r"64 features, but the 'row' layer 'model.layers.0.mlp.down_proj' after it takes 32 .*"
        r"need role 'gate_up'",
    ):
        match_plan(model, as_col, "2d")
    gated = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(16, 8))  # halves of 16
    match_plan(gated, replace(plan, rules={"0": "gate_up", "2": "row"}), "1d")
    plain = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
    with pytest.raises(ValueError, match=r"the 'gate_up' layer '0' makes 16 features, but"):
        match_plan(plain, replace(plan, rules={"0": "gate_up", "2": "row"}), "1d")
    match_plan(model, as_col, "sequence")  # nothing is split under 'sequence'
    # q, k, v narrower than the output projection: grouped-query attention named without its
    # attention module (Llama's reshapes by -1 heads) is no MLP and passes
    llama = _tiny("Qwen3")
    attention_only = {
        f"model.layers.0.self_attn.{name}": role
        for name, role in [
            ("q_proj", "col"),
            ("k_proj", "col"),
            ("v_proj", "col"),
            ("o_proj", "row"),
        ]
    }
    match_plan(llama, replace(plan, rules=attention_only), "1d")


def test_an_attention_module_sees_its_share_of_the_heads_and_follows_the_model_config() -> None:
    """A view, not a copy: switching the model's attention implementation reaches it."""
    import pickle

    from transformers import GPT2Config

    from tessera.layers.conversion.head_share import HeadShareConfig

    shared = GPT2Config(n_head=4, n_embd=16)
    view = HeadShareConfig(shared, 2)
    assert (view.num_attention_heads, view.n_head, shared.n_head, view.n_embd) == (2, 2, 4, 16)
    shared._attn_implementation = "eager"
    assert view._attn_implementation == "eager"
    view.use_cache = False  # a write reaches the model's config
    assert shared.use_cache is False
    holder = nn.Module()
    holder.config, holder.view = shared, view
    copied = copy.deepcopy(holder)
    assert isinstance(copied.view, HeadShareConfig) and copied.view.n_head == 2
    copied.config._attn_implementation = "sdpa"
    assert copied.view._attn_implementation == "sdpa"  # still a view of the copied config
    assert pickle.loads(pickle.dumps(view)).num_attention_heads == 2


def test_an_attention_registering_its_output_projection_first_is_read_in_data_flow_order() -> None:
    from tessera.layers.conversion.plan import match_plan, plan_for

    model = _tiny("Phi3")
    roles = list(match_plan(model, plan_for(model, None), "1d"))
    attention = [n for n in roles if ".self_attn." in n]
    assert [n.rsplit(".", 1)[1] for n in attention] == ["qkv_proj", "o_proj"]
    registered = list(model.model.layers[0].self_attn._modules)
    assert registered == ["o_proj", "qkv_proj"]  # the other way round


def test_parts_of_unequal_sizes_are_held_interleaved_by_group() -> None:
    """A rank's block of the grouped form is its share of each part: q, k, v heads in turn."""
    from tessera.context import grouped, parts_in_turn
    from tessera.layers import FullForm
    from tessera.layers.state.sections import SectionOrder

    sections = (32, 8, 8)  # 8 query heads and 2 key/value heads of 4
    original = torch.randn(48, 5)
    form = FullForm((48, 5), sections=sections)
    full = form.from_original(original, (48, 5))
    assert torch.equal(form.to_original(full), original)
    assert not torch.equal(full, original)
    for rank in range(2):
        block = full[rank * 24 : (rank + 1) * 24]  # a column split over 2 ranks
        want = torch.cat(
            [
                original[rank * 16 : (rank + 1) * 16],  # query heads 4 rank .. 4 rank + 3
                original[32 + rank * 4 : 32 + (rank + 1) * 4],  # the key head they share
                original[40 + rank * 4 : 40 + (rank + 1) * 4],  # the value head they share
            ]
        )
        assert torch.equal(parts_in_turn(block, sections, dim=0), want)
        x = torch.randn(3, 5)
        hook = SectionOrder(sections)
        torch.testing.assert_close(hook(nn.Identity(), (x,), x @ block.t()), x @ want.t())
    features = torch.randn(2, 3, 48)
    assert torch.equal(parts_in_turn(grouped(features, sections), sections), features)
    transposed = FullForm((5, 48), transposed=True, sections=sections)  # a Conv1D's [in, out]
    assert torch.equal(
        transposed.to_original(transposed.from_original(original.t(), (48, 5))), original.t()
    )
    with pytest.raises(ValueError, match="two or more positive sizes"):
        FullForm((48, 5), sections=(48,))
    # the engine reads the form through tessera.context (it knows no layer) and records it
    assert FullForm.from_json(json.loads(json.dumps(form.to_json()))) == form


def _doubled_logits(model: nn.Module) -> nn.Module:
    """``model`` as an instance of a subclass whose forward doubles the logits."""

    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = super(type(self), self).forward(*args, **kwargs)
        out.logits = out.logits * 2
        return out

    model.__class__ = type("DoubledLlama", (type(model),), {"forward": forward})
    return model


def test_pipeline_layers_compute_what_the_model_computes_or_are_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What a family member's forward does beyond its modules: done, or caught by the probe.

    Before, Granite's multipliers, Gemma 2's capped logits and Mistral's window were left out
    by the stages, which trained wrong without an error (logits 1.4, 0.002 and 1.7 off).
    """
    ids = token_ids()
    windowed = {"sliding_window": 4}  # shorter than the 8 tokens: a key falls out of view
    for model in (
        granite_lm(),
        gemma_lm("Gemma2", sliding_window=4),  # capped logits, every other block windowed
        mistral_lm(**windowed),  # every block windowed
        # Mistral's config carries layer_types, which its forward ignores: every block slides
        mistral_lm(layer_types=["full_attention"] * 2, **windowed),
        qwen2_lm(use_sliding_window=True, max_window_layers=1, **windowed),
        gemma_lm("Gemma3", sliding_window=4),  # a rotary embedding per kind of block
    ):
        model.eval()
        with torch.no_grad():
            torch.testing.assert_close(pipeline_layers(model)(ids), model(ids).logits, **TOL)
    with pytest.raises(ValueError, match=r"DoubledLlama compute other logits than its forward"):
        pipeline_layers(_doubled_logits(llama_lm()))
    from tessera.layers.conversion import stages

    def fails(self: Any, carried: Any) -> Any:
        raise TypeError("a block wants what its stage does not pass")

    monkeypatch.setattr(stages.BlockStage, "forward", fails)
    with pytest.raises(ValueError, match=r"LlamaForCausalLM cannot run as its forward does "):
        pipeline_layers(llama_lm())


def test_a_subclass_keeps_its_base_class_plan_only_while_that_plan_covers_it() -> None:
    from tessera.layers.conversion.families import BUILTIN_PLANS
    from tessera.layers.conversion.plan import plan_for

    model = llama_lm(distinct=False)
    model.__class__ = type("ExtendedLlama", (type(model),), {})
    assert plan_for(model, None) is BUILTIN_PLANS["LlamaForCausalLM"]
    for layer in model.model.layers:  # a per-head norm of q its base class lacks
        layer.self_attn.q_norm = nn.LayerNorm(4)
    read = plan_for(model, None)  # not Llama's: read from the blocks, the norm a head norm
    assert read.name.startswith("plan read from the transformer blocks of ExtendedLlama")
    assert read.rules["model.layers.*.self_attn.q_norm"] == "head_norm"
    for layer in model.model.layers:  # a module no role describes
        layer.self_attn.gate = nn.Linear(4, 4)
    with pytest.raises(ValueError, match=r"no plan for ExtendedLlama .* inside the attention"):
        plan_for(model, None)


def test_a_classifier_without_a_plan_is_told_to_parallelize_its_base_model() -> None:
    """RoBERTa's classifier has no plan, but its base model has a bare one: the error says to
    parallelize that alone (its outputs whole, the head and its loss then run whole)."""
    from transformers import RobertaConfig, RobertaForSequenceClassification

    from tessera.layers.conversion.plan import plan_for

    model = RobertaForSequenceClassification(RobertaConfig(**BERT_CONFIG))
    base = r"parallelize\(model\.roberta\) \(RobertaModel, the RoBERTa plan\): its outputs"
    with pytest.raises(ValueError, match=rf"no plan for RobertaForSequenceClassification .*{base}"):
        plan_for(model, None)


@pytest.mark.parametrize("multi_query", [False, True])
def test_gpt_bigcode_gets_its_own_plan_not_gpt2s(multi_query: bool) -> None:
    # GPTBigCode's modules have GPT-2's names (h.0.attn.c_attn, ...), but its c_attn is an
    # nn.Linear holding q, k, v side by side per head, or one shared key and value. Cut as
    # GPT-2's [3, heads, d] it ran without an error and trained 3.6% off one process (1D, 2
    # ranks); its own plan takes c_attn as a column layer of whole groups.
    from tessera.layers.conversion.plan import plan_for

    plan = plan_for(_tiny("GPTBigCode", multi_query=multi_query), None)
    assert plan.name == "GPTBigCode LM plan inferred for GPTBigCodeForCausalLM"
    assert plan.rules["transformer.h.*.attn.c_attn"] == "col"
    assert plan_for(gpt2_lm(), None).rules["transformer.h.*.attn.c_attn"] == "qkv"
    # a GPT-2 with its Conv1D layers swapped for nn.Linear holds q, k, v in turn: its class's
    # plan splits them as such, and no family plan is inferred from its layout (GPTBigCode's,
    # by name, would split it by groups and mix them)
    from tessera.layers.conversion.plan import infer_plan

    linear_gpt2 = gpt2_lm(n_layer=1)
    for attention in (block.attn for block in linear_gpt2.transformer.h):
        width, fused = attention.c_attn.weight.shape
        attention.c_attn = nn.Linear(width, fused)
    assert plan_for(linear_gpt2, None).rules["transformer.h.*.attn.c_attn"] == "qkv"
    assert infer_plan(linear_gpt2) is None


@pytest.mark.parametrize("by_group", [False, True])
def test_each_rank_of_repeated_heads_reads_its_heads_rows(by_group: bool) -> None:
    # 8 query heads, 2 key/value heads (groups of 4), 4 ranks: rank t's query heads 2t, 2t + 1
    # and the key and value head of group t // 2, read from the weight's rows as laid out
    from tessera.context import FullForm
    from tessera.layers.conversion.repeated_heads import HeadRepeats, _held_rows

    query, kv, d, share = 8, 2, 3, 4
    repeats = HeadRepeats(kv, d, share, query, by_group=by_group)
    if by_group:  # [kv, q/kv + 2, d]: each group's queries, then its key and value
        heads = torch.arange(kv * (query // kv + 2)).view(kv, -1)
        q_heads, k_heads, v_heads = heads[:, :-2].flatten(), heads[:, -2], heads[:, -1]
    else:  # [q heads; k heads; v heads]
        q_heads, k_heads = torch.arange(query), torch.arange(query, query + kv)
        v_heads = torch.arange(query + kv, query + 2 * kv)
    want = torch.cat(
        [
            torch.cat((q_heads[2 * t : 2 * t + 2], k_heads[t // 2 :][:1], v_heads[t // 2 :][:1]))
            for t in range(share)
        ]
    )
    rows = repeats.rows()
    assert torch.equal(rows.view(-1, d), want[:, None] * d + torch.arange(d))
    assert rows.numel() == share * repeats.segment and repeats.whole_rows == (query + 2 * kv) * d
    # held in tessera's form of parts interleaved by group: the same rows, wherever they went
    sections = (query * d, kv * d, kv * d)
    weight = torch.randn(repeats.whole_rows, 5)
    held = FullForm(tuple(weight.shape), sections=sections).from_original(weight, weight.shape)
    assert torch.equal(held[_held_rows(rows, repeats.whole_rows, sections)], weight[rows])


def _norm(family: str, cls: str, *args: Any, device: str = "cpu") -> nn.Module:
    import importlib

    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    with torch.device(device):
        return getattr(module, cls)(*args)  # type: ignore[no-any-return]


def test_norms_are_recognized_by_what_they_compute() -> None:
    from tessera.layers.conversion.norms import NormSpec, norm_spec

    # Copies of Llama's RMSNorm under other names, on the meta device too (probed with
    # random weights), and OLMo's LayerNorm without parameters or an epsilon attribute.
    granite = NormSpec("rms", (8,), 1e-6, True, False)
    assert norm_spec("n", _norm("granite", "GraniteRMSNorm", 8)) == granite
    assert norm_spec("n", _norm("granite", "GraniteRMSNorm", 8, 1e-5, device="meta")) == (
        NormSpec("rms", (8,), 1e-5, True, False)
    )
    assert norm_spec("n", _norm("olmo", "OlmoLayerNorm", 8)) == (
        NormSpec("layer", (8,), 1e-5, False, False)
    )
    # Gemma's RMSNorm scales by 1 + weight; Nemotron's is an nn.LayerNorm subclass that does
    # the same in a forward of its own: tessera's norms take it as weight_offset=1.
    assert norm_spec("n", _norm("gemma", "GemmaRMSNorm", 8)) == (
        NormSpec("rms", (8,), 1e-6, True, False, offset=1.0)
    )
    assert norm_spec("n", _norm("nemotron", "NemotronLayerNorm1P", 8)) == (
        NormSpec("layer", (8,), 1e-5, True, True, offset=1.0)
    )


class _OverSequence(nn.Module):
    """An RMSNorm over dim 1 (the sequence): equal to one over the hidden dim on 2-D rows."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(hidden)), 1e-6

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * x * torch.rsqrt(x.square().mean(1, keepdim=True) + self.eps)


class _DetachedRMS(_OverSequence):
    """An RMSNorm whose statistics carry no gradient: the same output, other gradients."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = torch.rsqrt(x.square().mean(-1, keepdim=True) + self.eps).detach()
        return self.weight * x * scale


class _NormWithDropout(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm, self.drop = nn.LayerNorm(hidden), nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.norm(x))  # type: ignore[no-any-return]


def _marks_inputs_require_grads(module: nn.Module, args: Any, output: torch.Tensor) -> None:
    output.requires_grad_(True)


_marks_inputs_require_grads.__name__ = "make_inputs_require_grads"  # transformers' name


def test_a_norm_that_computes_something_else_is_refused() -> None:
    from tessera.layers.conversion.converters import linear_shape
    from tessera.layers.conversion.norms import computes_as, norm_spec

    with pytest.raises(TypeError, match=r"_OverSequence.* differ from"):
        norm_spec("n", _OverSequence(8))
    with pytest.raises(TypeError, match=r"_DetachedRMS.* differ from"):
        norm_spec("n", _DetachedRMS(8))
    with pytest.raises(TypeError, match="holds submodules"):
        norm_spec("n", _NormWithDropout(8).eval())
    hooked = nn.LayerNorm(8)
    hooked.register_forward_hook(lambda m, args, out: out * 2)
    with pytest.raises(TypeError, match="a hook, a parametrization or an instance forward"):
        norm_spec("n", hooked)
    linear = nn.Linear(8, 8)
    linear.register_forward_pre_hook(lambda m, args: (args[0] * 2,))
    with pytest.raises(TypeError, match=r"but a forward pre-hook is registered on it"):
        linear_shape("fc", linear, "col")
    # transformers' hook marking an embedding's output as needing a gradient changes nothing
    embedding = nn.Embedding(8, 4)
    embedding.register_forward_hook(_marks_inputs_require_grads)
    assert computes_as(embedding, nn.Embedding)


def test_a_gpt2_layout_without_a_shipped_plan_gets_the_gpt2_family_plan() -> None:
    from tessera.layers.conversion.plan import infer_plan

    plan = infer_plan(gpt2_lm(distinct=False))  # Conv1D c_attn: GPT-2's fused layout
    assert plan is not None and plan.name.startswith("GPT-2 LM plan inferred")


def test_a_vit_layout_gets_the_vit_plan_only_where_its_embeddings_compute_vits() -> None:
    """ViT-MSN (ViT's modules and embeddings under its own classes) gets the ViT plan; ViT-MAE
    (the same parameters, its embeddings masking patches at random) and DeiT (a distillation
    token) do not: the mode's patch embedding would compute otherwise (sweep_image_classifiers
    runs ViT-MSN against one process under every layout)."""
    import transformers
    from hf_models import VIT_CONFIG

    from tessera.layers.conversion.plan import NoPlanError, infer_plan, plan_for

    sizes = {k: VIT_CONFIG[k] for k in ("image_size", "patch_size", "hidden_size")}
    sizes.update(num_hidden_layers=1, num_attention_heads=4, intermediate_size=32)
    for name, gets in [
        ("ViTMSNForImageClassification", "ViT image classifier plan inferred"),
        ("ViTMSNModel", "ViT encoder plan inferred"),
        ("ViTMAEModel", None),
        ("DeiTForImageClassification", None),
    ]:
        cls = getattr(transformers, name)
        model = cls(cls.config_class(**sizes))
        plan = infer_plan(model)
        assert (plan and plan.name[: len(gets or "")]) == gets, (name, plan and plan.name)
    # the error says which module keeps it from the family's plan
    with pytest.raises(NoPlanError, match=r"as the ViT family's, but 'deit.embeddings' \(DeiT"):
        plan_for(model, None)


def test_the_usual_block_stack_is_read_into_megatron_roles() -> None:
    from tessera.layers.conversion.structure import infer_structure

    report = infer_structure(_tiny("GPTJ"))
    assert report.rules == {
        "transformer.wte": "embedding",
        "transformer.ln_f": "norm",
        "lm_head": "head",
        "transformer.h.*.attn": "attention",
        "transformer.h.*.attn.q_proj": "col",
        "transformer.h.*.attn.k_proj": "col",
        "transformer.h.*.attn.v_proj": "col",
        "transformer.h.*.attn.out_proj": "row",
        "transformer.h.*.mlp.fc_in": "col",
        "transformer.h.*.mlp.fc_out": "row",
        "transformer.h.*.ln_1": "norm",
    }
    assert report.sequence_span == ("transformer.h.0", "transformer.ln_f") and report.head


def test_a_position_table_computes_its_rows_in_a_forward_of_its_own() -> None:
    """XGLM's sinusoidal positions (a buffer) and OPT's shifted learned ones (an nn.Embedding
    subclass) get the role; integer position ids, rotary tables, plain embeddings and other
    modules with parameters do not."""
    from tessera.layers.conversion.plan import plan_for
    from tessera.layers.conversion.position_table import is_position_table

    xglm = xglm_lm()
    assert plan_for(xglm, None).rules["model.embed_positions"] == "position_table"
    assert is_position_table(xglm.model.embed_positions, 16)
    opt = opt_lm()
    assert plan_for(opt, None).rules["model.decoder.embed_positions"] == "position_table"
    assert not is_position_table(nn.Embedding(8, 16), 16)  # a plain one: position_embedding
    holder = nn.Module()  # a table one module down is its module's, not its holder's
    holder.inner = xglm.model.embed_positions
    assert not is_position_table(holder, 16)
    llama = llama_lm()  # rotary_emb: inv_freq [head_dim / 2], float
    assert not is_position_table(llama.model.rotary_emb, 32)
    ids = nn.Module()
    ids.register_buffer("position_ids", torch.arange(16).view(1, 16))  # [1, hidden], integer
    assert not is_position_table(ids, 16)
    learned = nn.Module()
    learned.table = nn.Parameter(torch.zeros(8, 16))
    learned.register_buffer("rows", torch.zeros(8, 16))
    assert not is_position_table(learned, 16)


def test_multihead_attention_it_cannot_split_is_refused_by_name() -> None:
    """What ``HeadsAttention`` does not compute is refused before anything changes: keys of
    other sizes, ``add_bias_kv``, ``add_zero_attn``; a direct call asking for the weights
    averaged over heads (``need_weights=True``, ``nn.MultiheadAttention``'s default)."""
    from tessera.layers.conversion.multihead import HeadsAttention, install_heads_attention

    for kwargs, why in (
        (dict(kdim=8, vdim=8), "kdim / vdim"),
        (dict(add_bias_kv=True), "add_bias_kv=True"),
        (dict(add_zero_attn=True), "add_zero_attn=True"),
    ):
        model = nn.Sequential(nn.MultiheadAttention(16, 4, batch_first=True, **kwargs))
        with pytest.raises(ValueError, match=rf"'0' \(nn.MultiheadAttention\) has .*{why}"):
            install_heads_attention(model, ["0"], "2d")
        assert isinstance(model[0], nn.MultiheadAttention)
    attention = HeadsAttention(nn.MultiheadAttention(16, 4, batch_first=True))
    x = torch.randn(2, 3, 16)
    with pytest.raises(ValueError, match="call it with need_weights=False"):
        attention(x, x, x)
    ref = nn.MultiheadAttention(16, 4, batch_first=True)
    whole = HeadsAttention(copy.deepcopy(ref))  # the same computation on one process
    mask = torch.randn(2 * 4, 3, 3)
    padding = torch.tensor([[0.0, 0.0, float("-inf")], [0.0, 0.0, 0.0]])  # additive
    want = ref(x, x, x, attn_mask=mask, key_padding_mask=padding, need_weights=False)[0]
    got = whole(x, x, x, attn_mask=mask, key_padding_mask=padding, need_weights=False)[0]
    torch.testing.assert_close(got, want, **TOL)


def test_a_subclass_of_a_torch_transformer_class_keeps_its_plan_while_it_covers_it() -> None:
    """A researcher's subclass of ``nn.TransformerEncoderLayer`` (or the others) gets torch's
    plan; one that adds a module with parameters the plan does not name gets none of it."""
    from tessera.layers.conversion.plan import plan_for

    class MyLayer(nn.TransformerEncoderLayer):
        pass

    class MyEncoder(nn.TransformerEncoder):
        pass

    layer = MyLayer(16, 4, 32, batch_first=True)
    assert plan_for(layer, None).name == "nn.TransformerEncoderLayer plan"
    block = nn.TransformerEncoderLayer(16, 4, 32, batch_first=True)
    encoder = MyEncoder(block, 2, enable_nested_tensor=False)
    whole = nn.TransformerEncoder(block, 2, enable_nested_tensor=False)
    assert plan_for(encoder, None).rules == plan_for(whole, None).rules

    class Gated(nn.TransformerEncoderLayer):
        def __init__(self) -> None:
            super().__init__(16, 4, 32, batch_first=True)
            self.gate = nn.Linear(16, 16)  # no rule names it

    found = None
    with contextlib.suppress(ValueError):
        found = plan_for(Gated(), None)
    assert found is None or found.name != "nn.TransformerEncoderLayer plan"
