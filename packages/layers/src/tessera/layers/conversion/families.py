"""What tessera knows of each model family, one record per family.

A family's plan rules (which module takes which role), the transformers classes it ships
plans for, the module that shows another class is laid out as it is (Mistral and Qwen2 are
Llama's modules under other names), and where its task models keep what pipeline stages need
are one :class:`ModelFamily` here, next to the functions that build its plans. The rest of
``parallelize`` is generic: plan.py matches and checks a plan, converters.py builds each role,
stages.py cuts a model into stages, and they read these records through the tables derived at
the end (``BUILTIN_PLANS``, ``FAMILIES``, ``STAGE_FAMILIES``).

Adding a family is adding a record (and its plan builder) in this file.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Literal, NamedTuple

import torch
from torch import nn

from .converters import is_conv1d
from .plan import Plan

__all__ = [
    "BUILTIN_PLANS",
    "FAMILIES",
    "MODEL_FAMILIES",
    "STAGE_FAMILIES",
    "Marker",
    "ModelFamily",
    "StageLayout",
    "torch_transformer_plan",
]


class Marker(NamedTuple):
    """How a model of another class shows it is laid out as a family.

    Attributes:
        module: A module name (at any prefix) only this family's layout has.
        fits: What that module must be for the family's plan to hold.
        build: The plan at the prefix found, ending in ``lm_head`` or not (``causal_lm``).
    """

    module: str
    fits: Callable[[nn.Module], bool]
    build: Callable[[str, bool], Plan]


@dataclass(frozen=True)
class StageLayout:
    """Where a transformers task model keeps what its pipeline stages need (stages.py).

    Attributes:
        name: For messages.
        inner: The base model's attribute on the task model (``"model"``, ``"transformer"``).
        embeds: The base model's modules that make the first hidden states, in call order.
        blocks: Where the ``nn.ModuleList`` of repeated blocks sits under the base model, the
            first path that exists (transformers releases moved some).
        final: Base-model modules applied after the last block (a final norm), or none.
        head: The task model's head module.
        inputs: ``"tokens"`` or ``"images"``.
        mask: The attention mask each block takes: ``"causal"``, ``"bidirectional"``, none.
        rotary: The base model's rotary embedding module, or none.
        alibi: What each block takes as ``alibi``: ``"built"``, the ALiBi bias of every head,
            which the base model builds from the padding mask (BLOOM; ``build_alibi_tensor``);
            ``"none"``, ``None`` (Falcon with rotary positions); ``None``: no such argument.
        own_parameters: Parameters the base model holds itself that the first stage computes
            with (timm's class token and positions), held by that stage.
        head_modules: Base-model modules the head's code calls besides ``final`` and ``head``
            (timm's ``fc_norm``), those the model has.
        embed_code: What the base model's forward does from its input to the first block,
            given the base model and the (split) input; ``None``: its ``embeds`` in order.
        head_code: What it does after ``final`` (a pooling, then the head), given the base
            model and the hidden states; ``None``: the head on the first token (a ViT's class
            token) or on every token.
    """

    name: str
    inner: str
    embeds: tuple[str, ...]
    blocks: tuple[str, ...]
    final: tuple[str, ...]
    head: str
    inputs: Literal["tokens", "images"]
    mask: Literal["causal", "bidirectional"] | None
    rotary: str | None = None
    alibi: Literal["built", "none"] | None = None
    own_parameters: tuple[str, ...] = ()
    head_modules: tuple[str, ...] = ()
    embed_code: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None = None
    head_code: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None = None

    def fits(self, model: nn.Module) -> bool:
        """Whether ``model`` holds every module this family names."""
        inner = getattr(model, self.inner, None) if self.inner else model
        if not isinstance(inner, nn.Module) or not isinstance(
            getattr(model, self.head, None), nn.Module
        ):
            return False
        rotary = (self.rotary,) if self.rotary else ()
        found = dict(inner.named_modules(remove_duplicate=False))
        blocks = self.blocks_of(inner)
        return isinstance(blocks, nn.ModuleList | nn.Sequential) and all(
            n in found for n in (*self.embeds, *self.final, *rotary)
        )

    def blocks_of(self, inner: nn.Module) -> nn.Module | None:
        """The base model's list of repeated blocks (``None``: not found)."""
        found = dict(inner.named_modules(remove_duplicate=False))
        return next((found[path] for path in self.blocks if path in found), None)


@dataclass(frozen=True)
class ModelFamily:
    """Everything tessera knows of one model family.

    Attributes:
        name: The family's name, for messages.
        plans: The plans shipped for its transformers classes, by class name.
        marker: How models of other classes show they are laid out as this family (tried in
            the order of :data:`MODEL_FAMILIES`), or ``None``: its own classes only.
        stack_marker: How a stack of the family's blocks alone shows it (an ``nn.Sequential``
            a model of its own code calls), whose plan is a features plan, or ``None``.
        stages: Where its task models keep what ``pipeline_layers`` needs, or ``None``.
    """

    name: str
    plans: Mapping[str, Plan] = field(default_factory=dict)
    marker: Marker | None = None
    stack_marker: Marker | None = None
    stages: StageLayout | None = None


# ------------------------------------------------------------------------- plan builders


def _token_model(
    rules: dict[str, str], prefix: str, blocks: str, final: str, causal_lm: bool, name: str
) -> Plan:
    """A decoder's plan: its ``rules`` (and ``lm_head`` as the ``head`` if ``causal_lm``).

    It takes token ids; its sequence span runs from block 0 of ``blocks`` to the ``final`` norm.
    """
    if causal_lm:
        rules = {**rules, "lm_head": "head"}
    return Plan(
        rules,
        boundary="tokens",
        sequence_span=(f"{prefix}{blocks}.0", f"{prefix}{final}"),
        causal_lm=causal_lm,
        name=name + (" LM" if causal_lm else ""),
    )


def _gpt2(prefix: str, causal_lm: bool) -> Plan:
    block = f"{prefix}h.*"
    rules = {
        f"{prefix}wte": "embedding",
        f"{prefix}wpe": "position_embedding",
        f"{block}.ln_1": "norm",
        f"{block}.ln_2": "norm",
        f"{block}.attn": "attention",
        f"{block}.attn.c_attn": "qkv",
        f"{block}.attn.c_proj": "row",
        f"{block}.mlp.c_fc": "col",
        f"{block}.mlp.c_proj": "row",
        f"{prefix}ln_f": "norm",
    }
    return _token_model(rules, prefix, "h", "ln_f", causal_lm, "GPT-2")


def _gpt_bigcode(prefix: str, causal_lm: bool) -> Plan:
    """GPTBigCode (StarCoder, SantaCoder): GPT-2's modules, its ``c_attn`` an ``nn.Linear``.

    q, k and v are fused by group: each head's q, k and v side by side, or (multi-query) every
    query head beside the one key and value head, so ``c_attn`` is a column layer of whole
    groups, its one key/value head repeated over the ranks splitting heads.
    """
    rules = {**_gpt2(prefix, causal_lm).rules, f"{prefix}h.*.attn.c_attn": "col"}
    return _token_model(rules, prefix, "h", "ln_f", causal_lm, "GPTBigCode")


def _llama(prefix: str, causal_lm: bool) -> Plan:
    block = f"{prefix}layers.*"
    rules = {
        f"{prefix}embed_tokens": "embedding",
        f"{block}.input_layernorm": "norm",
        f"{block}.self_attn": "attention",
        f"{block}.self_attn.q_proj": "col",
        f"{block}.self_attn.k_proj": "col",
        f"{block}.self_attn.v_proj": "col",
        f"{block}.self_attn.o_proj": "row",
        f"{block}.post_attention_layernorm": "norm",
        f"{block}.mlp.gate_proj": "col",
        f"{block}.mlp.up_proj": "col",
        f"{block}.mlp.down_proj": "row",
        f"{prefix}norm": "norm",
    }
    return _token_model(rules, prefix, "layers", "norm", causal_lm, "Llama")


def _gpt_neox(prefix: str, causal_lm: bool) -> Plan:
    block = f"{prefix}layers.*"
    rules = {
        f"{prefix}embed_in": "embedding",
        f"{block}.input_layernorm": "norm",
        f"{block}.post_attention_layernorm": "norm",
        f"{block}.attention": "attention",
        # q, k and v side by side per head ([heads, 3, d]): a plain column split keeps whole
        # heads on each rank, where GPT-2's [3, heads, d] needs the "qkv" role
        f"{block}.attention.query_key_value": "col",
        f"{block}.attention.dense": "row",
        f"{block}.mlp.dense_h_to_4h": "col",
        f"{block}.mlp.dense_4h_to_h": "row",
        f"{prefix}final_layer_norm": "norm",
    }
    return _token_model(rules, prefix, "layers", "final_layer_norm", causal_lm, "GPT-NeoX")


def _bloom(prefix: str, causal_lm: bool) -> Plan:
    """BLOOM: GPT-NeoX's q, k, v fused by head, a norm after the token embedding, ALiBi.

    The attention's ALiBi bias (one slope per head, Press et al. 2022) is built for every head
    by the model and passed to each block; ``parallelize`` gives each attention module its
    heads' rows (:class:`~tessera.layers.conversion.alibi.AlibiHeads`).
    """
    block = f"{prefix}h.*"
    rules = {
        f"{prefix}word_embeddings": "embedding",
        f"{prefix}word_embeddings_layernorm": "norm",
        f"{block}.input_layernorm": "norm",
        f"{block}.self_attention": "attention",
        f"{block}.self_attention.query_key_value": "col",  # [heads, 3, d], as GPT-NeoX's
        f"{block}.self_attention.dense": "row",
        f"{block}.post_attention_layernorm": "norm",
        f"{block}.mlp.dense_h_to_4h": "col",
        f"{block}.mlp.dense_4h_to_h": "row",
        f"{prefix}ln_f": "norm",
    }
    return _token_model(rules, prefix, "h", "ln_f", causal_lm, "BLOOM")


def _falcon(
    prefix: str, causal_lm: bool, *, norms: str = "*_layernorm", name: str = "Falcon"
) -> Plan:
    """Falcon: q, k and v fused so that a plain column split keeps whole heads.

    Fused per head (``[heads, 3, d]``) or, in the new decoder architecture (Falcon-40B,
    -180B), per key/value group (``[kv, q/kv + 2, d]``, whole groups). Multi-query Falcon
    (one key and value beside all queries, ``[q + 2, d]``) is one group: split over more
    ranks than groups, each rank computes its query heads and its group's key and value heads
    (repeated). ``alibi=True`` is refused by the converter.

    ``norms``: the blocks' norms, ``input_layernorm`` (and ``post_attention_layernorm``
    unless attention and MLP run side by side), or ``ln_attn`` and ``ln_mlp``.
    """
    block = f"{prefix}h.*"
    rules = {
        f"{prefix}word_embeddings": "embedding",
        f"{block}.{norms}": "norm",
        f"{block}.self_attention": "attention",
        f"{block}.self_attention.query_key_value": "col",
        f"{block}.self_attention.dense": "row",
        f"{block}.mlp.dense_h_to_4h": "col",
        f"{block}.mlp.dense_4h_to_h": "row",
        f"{prefix}ln_f": "norm",
    }
    return _token_model(rules, prefix, "h", "ln_f", causal_lm, name)


def _falcon_two_norms(prefix: str, causal_lm: bool) -> Plan:
    """Falcon's new decoder architecture: a norm for attention, one for the MLP."""
    return _falcon(prefix, causal_lm, norms="ln_*", name="Falcon with two norms")


def _fused_llama(prefix: str, causal_lm: bool, *, qkv: bool, name: str) -> Plan:
    """Llama's block with its projections fused.

    Gate and up in ``mlp.gate_up_proj`` (``[gate; up]``, chunked in two by the MLP) and, with
    ``qkv``, q, k and v in ``self_attn.qkv_proj`` (``[q heads; k heads; v heads]``, fewer k/v
    heads than q heads under grouped-query attention).
    """
    block = f"{prefix}layers.*"
    fused = (".gate_proj", ".up_proj", *((".q_proj", ".k_proj", ".v_proj") if qkv else ()))
    llama = _llama(prefix, causal_lm)
    rules = {k: v for k, v in llama.rules.items() if not k.endswith(fused)}
    rules[f"{block}.mlp.gate_up_proj"] = "gate_up"
    if qkv:
        rules[f"{block}.self_attn.qkv_proj"] = "qkv"
    return replace(llama, rules=rules, name=name + (" LM" if causal_lm else ""))


def _phi3(prefix: str, causal_lm: bool) -> Plan:
    """Phi-3 and Phi-4-mini: q, k, v fused, gate and up fused."""
    return _fused_llama(prefix, causal_lm, qkv=True, name="Phi-3")


def _glm(prefix: str, causal_lm: bool) -> Plan:
    """GLM: gate and up fused."""
    return _fused_llama(prefix, causal_lm, qkv=False, name="GLM")


def _glm4(prefix: str, causal_lm: bool) -> Plan:
    """GLM-4: GLM's block with a norm after attention and one after the MLP."""
    glm = _fused_llama(prefix, causal_lm, qkv=False, name="GLM-4")
    block = f"{prefix}layers.*"
    norms = {f"{block}.post_self_attn_layernorm": "norm", f"{block}.post_mlp_layernorm": "norm"}
    return replace(glm, rules={**glm.rules, **norms})


def _qwen3(prefix: str, causal_lm: bool) -> Plan:
    """Qwen3: Llama's block with its query and key heads normalized (``q_norm``, ``k_norm``)."""
    llama = _llama(prefix, causal_lm)
    attention = f"{prefix}layers.*.self_attn"
    norms = {f"{attention}.q_norm": "head_norm", f"{attention}.k_norm": "head_norm"}
    return replace(
        llama, rules={**llama.rules, **norms}, name="Qwen3" + (" LM" if causal_lm else "")
    )


def _with_experts(plan: Plan, prefix: str, name: str, *, dense: bool = False) -> Plan:
    """``plan``'s blocks with a mixture of experts (router ``mlp.gate``) for the MLP.

    ``dense``: some blocks keep ``plan``'s MLP (Qwen3-MoE's ``mlp_only_layers``, a
    ``decoder_sparse_step`` above 1), so its rules stay beside the experts'.
    """
    block = f"{prefix}layers.*"
    mlp = (".gate_proj", ".up_proj", ".down_proj")
    rules = {k: v for k, v in plan.rules.items() if dense or not k.endswith(mlp)}
    rules |= {f"{block}.mlp.gate": "router", f"{block}.mlp.experts": "experts"}
    name += " with dense blocks" if dense else ""
    return replace(plan, rules=rules, name=name + (" LM" if plan.causal_lm else ""))


def _mixtral(prefix: str, causal_lm: bool) -> Plan:
    """Mixtral: Llama's block with a mixture of experts for the MLP."""
    return _with_experts(_llama(prefix, causal_lm), prefix, "Mixtral")


def _qwen3_moe(prefix: str, causal_lm: bool) -> Plan:
    """Qwen3-MoE: Qwen3's block with a mixture of experts for the MLP."""
    return _with_experts(_qwen3(prefix, causal_lm), prefix, "Qwen3-MoE")


def _qwen3_moe_dense(prefix: str, causal_lm: bool) -> Plan:
    """Qwen3-MoE with some blocks keeping a dense MLP."""
    return _with_experts(_qwen3(prefix, causal_lm), prefix, "Qwen3-MoE", dense=True)


def _qwen2_moe(prefix: str, causal_lm: bool) -> Plan:
    """Qwen2-MoE: Mixtral's block with a shared expert beside the routed ones.

    The shared expert is a Llama MLP on the block's tokens flattened to ``[n, h]``; its
    output is scaled by a one-feature gate, whole on every rank like the router.
    """
    return _qwen2_moe_blocks(prefix, causal_lm, dense=False)


def _qwen2_moe_dense(prefix: str, causal_lm: bool) -> Plan:
    """Qwen2-MoE with some blocks keeping a dense MLP (``mlp_only_layers``)."""
    return _qwen2_moe_blocks(prefix, causal_lm, dense=True)


def _qwen2_moe_blocks(prefix: str, causal_lm: bool, *, dense: bool) -> Plan:
    """Qwen2-MoE's plan, with the dense MLP's rules too where ``dense``."""
    plan = _with_experts(_llama(prefix, causal_lm), prefix, "Qwen2-MoE", dense=dense)
    mlp = f"{prefix}layers.*.mlp"
    shared = {
        f"{mlp}.shared_expert.gate_proj": "col",
        f"{mlp}.shared_expert.up_proj": "col",
        f"{mlp}.shared_expert.down_proj": "row",
        f"{mlp}.shared_expert_gate": "router",
    }
    return replace(plan, rules={**plan.rules, **shared})


BertHead = Literal["masked_lm", "pooler", "classifier"]


def _bert(prefix: str, head: BertHead, name: str = "BERT") -> Plan:
    """BERT's encoder, and what it ends in: a masked-LM head, its pooler, or a classifier.

    ``"pooler"``: the bare encoder (sentence embeddings), whose pooler over the first token
    some configs leave out (``add_pooling_layer=False``). ``"classifier"``: the pooler, and a
    ``head`` onto the classes reading it (``BertForSequenceClassification``), whose logits
    stay split like a language model's; it reads the first token, so tensor mode
    ``'sequence'`` is refused. RoBERTa's modules carry BERT's names.
    """
    layer = f"{prefix}encoder.layer.*"
    rules = {
        f"{prefix}embeddings.word_embeddings": "embedding",
        f"{prefix}embeddings.position_embeddings": "position_embedding",
        f"{prefix}embeddings.token_type_embeddings": "position_embedding",
        f"{prefix}embeddings.LayerNorm": "norm",
        f"{layer}.attention.self": "attention",
        f"{layer}.attention.self.query": "col",
        f"{layer}.attention.self.key": "col",
        f"{layer}.attention.self.value": "col",
        f"{layer}.attention.output.dense": "row",
        f"{layer}.attention.output.LayerNorm": "norm",
        f"{layer}.intermediate.dense": "col",
        f"{layer}.output.dense": "row",
        f"{layer}.output.LayerNorm": "norm",
    }
    if head == "masked_lm":
        rules |= {
            "cls.predictions.transform.dense": "dense",
            "cls.predictions.transform.LayerNorm": "norm",
            "cls.predictions.decoder": "head",
        }
    else:  # the pooler over the first token
        rules |= {f"{prefix}pooler.dense": "dense"}
    if head == "classifier":
        rules |= {"classifier": "head"}
    suffix = {"masked_lm": " masked LM", "pooler": "", "classifier": " sequence classifier"}
    return Plan(
        rules,
        boundary="tokens",
        # the blocks themselves, not their container: pipeline stages call the blocks only
        sequence_span=(f"{prefix}encoder.layer.0", f"{prefix}encoder.layer.-1"),
        causal_lm=head != "pooler",
        name=name + suffix[head],
        optional=(f"{prefix}pooler.dense",) if head == "pooler" else (),
        whole_sequence="its classifier reads the first token" if head == "classifier" else "",
    )


def _roberta() -> Plan:
    """The bare RoBERTa encoder: BERT's modules and names, positions counted from the padding.

    RoBERTa numbers each row's tokens from its padding (``padding_idx + 1`` onward, padding
    itself at ``padding_idx``); a rank holding a chunk of the sequence cannot count them, so
    tensor mode ``'sequence'`` is refused.
    """
    bert = _bert("", "pooler", name="RoBERTa")
    reason = "it numbers each row's positions from its padding (padding_idx + 1 onward)"
    return replace(bert, whole_sequence=reason)


def _distilbert() -> Plan:
    """The bare DistilBERT encoder: BERT's block under other names, no token types, no pooler."""
    layer = "transformer.layer.*"
    rules = {
        "embeddings.word_embeddings": "embedding",
        "embeddings.position_embeddings": "position_embedding",
        "embeddings.LayerNorm": "norm",
        f"{layer}.attention": "attention",
        f"{layer}.attention.q_lin": "col",
        f"{layer}.attention.k_lin": "col",
        f"{layer}.attention.v_lin": "col",
        f"{layer}.attention.out_lin": "row",
        f"{layer}.sa_layer_norm": "norm",
        f"{layer}.ffn.lin1": "col",
        f"{layer}.ffn.lin2": "row",
        f"{layer}.output_layer_norm": "norm",
    }
    return Plan(
        rules,
        boundary="tokens",
        sequence_span=("transformer.layer.0", "transformer.layer.-1"),
        name="DistilBERT",
    )


def _gpt2_classifier() -> Plan:
    """``GPT2ForSequenceClassification``: GPT-2 and a ``head`` onto the classes (``score``).

    The head runs on every token and the model keeps each row's last token that is not
    padding, found from the ``input_ids`` it is given: the rows the mode kept, whose logits
    those are. Under ``'sequence'`` that token may sit on another rank: refused.
    """
    gpt2 = _gpt2("transformer.", causal_lm=False)
    return replace(
        gpt2,
        rules={**gpt2.rules, "score": "head"},
        causal_lm=True,
        name="GPT-2 sequence classifier",
        whole_sequence="its classifier reads each row's last token that is not padding",
    )


def _torch_layer_rules(prefix: str, cross_attention: bool = False) -> dict[str, str]:
    """Roles of torch's ``nn.TransformerEncoderLayer`` (or ``DecoderLayer``) at ``prefix``.

    Its ``nn.MultiheadAttention`` modules take role ``attention``: ``parallelize`` splits
    their fused ``in_proj_weight`` by heads (:mod:`~tessera.layers.conversion.multihead`).
    """
    rules = {
        f"{prefix}self_attn": "attention",
        f"{prefix}linear1": "col",
        f"{prefix}linear2": "row",
        f"{prefix}norm1": "norm",
        f"{prefix}norm2": "norm",
    }
    if cross_attention:
        rules |= {f"{prefix}multihead_attn": "attention", f"{prefix}norm3": "norm"}
    return rules


def _torch_encoder_decoder() -> Plan:
    encoder, decoder = "encoder.layers.*.", "decoder.layers.*."
    return Plan(
        {
            **_torch_layer_rules(encoder),
            **_torch_layer_rules(decoder, cross_attention=True),
            "encoder.norm": "norm",
            "decoder.norm": "norm",
        },
        name="nn.Transformer plan",
        optional=("encoder.norm", "decoder.norm"),
    )


#: torch's own transformer classes and their plans.
TORCH_PLANS: dict[type[nn.Module], Plan] = {
    nn.TransformerEncoderLayer: Plan(
        _torch_layer_rules(""), name="nn.TransformerEncoderLayer plan"
    ),
    nn.TransformerEncoder: Plan(
        {**_torch_layer_rules("layers.*."), "norm": "norm"},
        name="nn.TransformerEncoder plan",
        optional=("norm",),
    ),
    nn.TransformerDecoderLayer: Plan(
        _torch_layer_rules("", cross_attention=True), name="nn.TransformerDecoderLayer plan"
    ),
    nn.TransformerDecoder: Plan(
        {**_torch_layer_rules("layers.*.", cross_attention=True), "norm": "norm"},
        name="nn.TransformerDecoder plan",
        optional=("norm",),
    ),
    nn.Transformer: _torch_encoder_decoder(),
}


def torch_transformer_plan(model: nn.Module) -> tuple[type[nn.Module], Plan] | None:
    """The plan of torch's own ``nn.TransformerEncoder`` / ``Decoder`` (or one layer of them).

    They take and return activations ``[b, s, h]`` (``batch_first=True``; ``[s, b, h]``
    under ``'1d'`` only): a ``"features"`` plan; a decoder's memory is split like ``tgt``
    (:func:`~.multihead.install_memory_split`). For a subclass, the plan of the torch class
    it derives from, with that class (the caller checks the plan still covers it); ``None``
    for any other model.
    """
    for cls in type(model).__mro__:
        if cls in TORCH_PLANS:
            return cls, TORCH_PLANS[cls]
    return None


def _clip_text() -> Plan:
    """``CLIPTextModel``: CLIP's text tower, causal pre-norm blocks under CLIP's names.

    Learned positions (a position ``nn.Embedding`` read through its ``position_ids``), a
    final norm; ``pooler_output`` is the final norm's output at each row's end-of-text token,
    found from the ``input_ids`` it is given (the rows the mode kept: those rows' hidden
    states). Both outputs come back whole. Under ``'sequence'`` that token may sit on
    another rank: refused.
    """
    layer = "encoder.layers.*"
    rules = {
        "embeddings.token_embedding": "embedding",
        "embeddings.position_embedding": "position_embedding",
        **_clip_layer_rules(layer),
        "final_layer_norm": "norm",
    }
    return Plan(
        rules,
        boundary="tokens",
        sequence_span=("encoder.layers.0", "encoder.layers.-1"),
        name="CLIP text encoder",
        whole_sequence="its pooled output reads each row's end-of-text token",
    )


def _clip_layer_rules(layer: str) -> dict[str, str]:
    """Roles of CLIP's encoder layer at ``layer`` (either tower's)."""
    return {
        f"{layer}.layer_norm1": "norm",
        f"{layer}.self_attn": "attention",
        f"{layer}.self_attn.q_proj": "col",
        f"{layer}.self_attn.k_proj": "col",
        f"{layer}.self_attn.v_proj": "col",
        f"{layer}.self_attn.out_proj": "row",
        f"{layer}.layer_norm2": "norm",
        f"{layer}.mlp.fc1": "col",
        f"{layer}.mlp.fc2": "row",
    }


def _clip_vision() -> Plan:
    """``CLIPVisionModel``: a ViT under CLIP's names, pre-norm blocks, a norm before them.

    Its embeddings (class token ``[E]``, a patch convolution without bias, a position
    ``nn.Embedding``) are the mode's patch embedding under CLIP's names. It returns the last
    block's hidden states as ``last_hidden_state`` and ``post_layernorm`` of the class token
    as ``pooler_output``, both whole under every mode; under ``'sequence'`` the tokens are
    gathered after the last block, before the class token is read.
    """
    layer = "encoder.layers.*"
    rules = {
        "embeddings": "patch_embedding",
        "pre_layrnorm": "norm",
        **_clip_layer_rules(layer),
        "post_layernorm": "norm",
    }
    return Plan(
        rules,
        boundary="images",
        sequence_span=("encoder.layers.0", "encoder.layers.-1"),
        name="CLIP vision encoder",
    )


def _vit(prefix: str, classifier: bool) -> Plan:
    """A ViT encoder (``ViTModel``, its pooler optional) or image classifier.

    The classifier's logits ``[b, C]`` stay split like a language model's, its own loss
    replaced by tessera's; the bare encoder returns its hidden states whole.
    """
    layer = f"{prefix}layers.*"
    rules = {
        f"{prefix}embeddings": "patch_embedding",
        f"{layer}.layernorm_before": "norm",
        f"{layer}.attention": "attention",
        f"{layer}.attention.q_proj": "col",
        f"{layer}.attention.k_proj": "col",
        f"{layer}.attention.v_proj": "col",
        f"{layer}.attention.o_proj": "row",
        f"{layer}.layernorm_after": "norm",
        f"{layer}.mlp.fc1": "col",
        f"{layer}.mlp.fc2": "row",
        f"{prefix}layernorm": "norm",
        **({"classifier": "head"} if classifier else {f"{prefix}pooler.dense": "dense"}),
    }
    return Plan(
        rules,
        boundary="images",
        sequence_span=(f"{prefix}layers.0", f"{prefix}layernorm"),
        causal_lm=classifier,  # its own loss (labels=...) is replaced by tessera's
        name="ViT image classifier" if classifier else "ViT encoder",
        optional=() if classifier else (f"{prefix}pooler.dense",),
    )


#: What a transformers ViT layer holds parameters in, and nothing else (ViT-MSN's, DeiT's).
_VIT_LAYER_MODULES = frozenset({
    "layernorm_before", "attention.q_proj", "attention.k_proj", "attention.v_proj",
    "attention.o_proj", "layernorm_after", "mlp.fc1", "mlp.fc2",
})  # fmt: skip


def _vit_layer(module: nn.Module) -> bool:
    """A layer laid out as transformers' ``ViTLayer``: pre-norm, q/k/v/o, a plain MLP.

    Its parameters sit in those modules alone (BEiT's layer scales and relative position bias
    beside them are not ViT's). Whether the embeddings compute ViT's is the patch embedding's
    own check (``patch.patch_sizes``).
    """
    holding = {
        name
        for name, m in module.named_modules()
        if next(m.parameters(recurse=False), None) is not None
    }
    return holding == _VIT_LAYER_MODULES and type(getattr(module, "mlp", None)).__name__.endswith(
        "MLP"
    )


def _vit_inferred(prefix: str, causal_lm: bool) -> Plan:
    """The ViT plan at ``prefix``: an image classifier's under a base model, else a bare one."""
    del causal_lm  # an image classifier has no lm_head; its prefix says it has a head
    return _vit(prefix, classifier=prefix != "")


def _timm_vit(prefix: str, causal_lm: bool) -> Plan:
    """The ``VisionTransformer`` of timm: pre-norm blocks, q, k and v fused in ``attn.qkv``.

    Its ``patch_embed`` and the class token and positions of the model itself are the mode's
    patch embedding (:class:`~.patch.TimmEmbeddingAdapter`); its ``attn_dim`` and
    ``num_heads`` are rescaled to each rank's heads. The classifier's logits ``[b, C]`` stay
    split like a language model's (``gather_logits``, ``token_loss``), as the plan's
    ``causal_lm`` says (the marker's own flag reads an ``lm_head``, which timm has not).
    """
    rules = {
        f"{prefix}patch_embed": "patch_embedding",
        **_timm_block_rules(f"{prefix}blocks.*"),
        f"{prefix}norm": "norm",
        f"{prefix}fc_norm": "norm",  # after an average over the tokens (norm is then Identity)
        f"{prefix}head": "head",
    }
    return Plan(
        rules,
        boundary="images",
        sequence_span=(f"{prefix}blocks.0", f"{prefix}norm"),
        causal_lm=True,  # the head's logits come back split, not gathered as hidden states
        name="timm ViT classifier",
        optional=_timm_optional(f"{prefix}blocks.*"),
    )


def _timm_block_rules(block: str) -> dict[str, str]:
    """Roles of a timm ``Block`` named ``block``: pre-norm, q, k and v fused in ``attn.qkv``."""
    return {
        f"{block}.norm1": "norm",
        f"{block}.attn": "attention",
        f"{block}.attn.qkv": "qkv",
        f"{block}.attn.q_norm": "head_norm",  # nn.Identity without qk_norm
        f"{block}.attn.k_norm": "head_norm",
        f"{block}.attn.proj": "row",
        f"{block}.norm2": "norm",
        f"{block}.mlp.fc1": "col",
        f"{block}.mlp.fc2": "row",
    }


def _timm_blocks(prefix: str, causal_lm: bool) -> Plan:
    """An ``nn.Sequential`` of timm's ``Block`` alone: ``VisionTransformer.blocks``.

    A features plan: it takes and returns the activation ``[b, N, h]``. It is what a timm
    model whose embedding or pooling the ViT plan cannot take keeps between them (register
    tokens, no class token, a distillation token, attention pooling): that model is then
    converted part by part (:mod:`.parts`), its blocks split, the code around them whole.
    """
    del causal_lm  # blocks alone have no head
    return Plan(
        _timm_block_rules(f"{prefix}*"),
        boundary="features",
        name="timm ViT blocks",
        optional=_timm_optional(f"{prefix}*"),
    )


def _timm_optional(block: str) -> tuple[str, ...]:
    """The rules of a timm ``Block`` its releases before q/k norms lack (``qk_norm``)."""
    return (f"{block}.attn.q_norm", f"{block}.attn.k_norm")


def _timm_embed(model: nn.Module, pixels: torch.Tensor) -> torch.Tensor:
    """The part of timm's ``forward_features`` before its blocks: patches, tokens, positions."""
    x = model.get_submodule("patch_embed")(pixels)
    x = model._pos_embed(x)  # type: ignore[operator]  # a method of the model's own
    x = model.get_submodule("patch_drop")(x)
    out: torch.Tensor = model.get_submodule("norm_pre")(x)
    return out


def _timm_head(model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """What timm's ``forward_head`` does: pooling (class token, mean, attention), norm, head.

    Called on the class, not the instance: ``parallelize`` guards the instance's entry points
    against calls from outside its own forward (entry_points.py), which a stage is not.
    """
    out: torch.Tensor = type(model).forward_head(model, hidden)  # type: ignore[attr-defined]
    return out


def _timm_block(module: nn.Module) -> bool:
    """A block of timm's ``VisionTransformer``: its ``Attention`` and its plain ``Mlp``.

    The attention holds q, k and v fused in one ``nn.Linear`` ``qkv``. A gated MLP
    (``SwiGLUPacked``'s ``GluMlp``) chunks ``fc1``'s output into value and gate, which a
    column split would pair wrongly on each rank: no plan.
    """
    attn, mlp = getattr(module, "attn", None), getattr(module, "mlp", None)
    qkv = getattr(attn, "qkv", None)
    return (
        type(module).__module__.startswith("timm.")
        and type(attn).__name__ == "Attention"
        and type(mlp).__name__ == "Mlp"
        and type(qkv) is nn.Linear
        and qkv.out_features % 3 == 0
    )


#: Why an encoder-decoder cannot run under tensor mode ``'sequence'``.
_ENCODER_DECODER_SEQUENCE = (
    "its decoder's cross-attention reads every token of the encoder's output, a sequence of "
    "its own length, which the ring and all-to-all attention (self-attention over one "
    "sequence) do not split"
)


def _bart() -> Plan:
    """``BartForConditionalGeneration``: an encoder and a decoder of post-LN blocks.

    Both stacks and the head read one token table (``model.shared``, the ``embed_tokens`` of
    each stack, tied to ``lm_head``). Learned positions are read two rows past each position
    by a forward of their own (``BartLearnedPositionalEmbedding``): whole under 1D, the mode's
    table on the mesh and the cube, looked up at the ids that forward computes. The decoder's
    cross-attention (``encoder_attn``) takes its keys and values from the encoder's output,
    in the mode's layout like any activation. The logits get ``final_logits_bias`` ``[1, V]``
    added, split by vocabulary under 1D. Under 1D sequence parallelism two stacks of blocks
    would need two spans: no ``sequence_span``, refused by name.
    """
    rules: dict[str, str] = {
        "model.shared": "embedding",
        "lm_head": "head",
    }
    for stack in ("encoder", "decoder"):
        layer = f"model.{stack}.layers.*"
        rules |= {
            f"model.{stack}.embed_tokens": "embedding",
            f"model.{stack}.embed_positions": "position_embedding",
            f"model.{stack}.layernorm_embedding": "norm",
        }
        attentions = ("self_attn", "encoder_attn") if stack == "decoder" else ("self_attn",)
        for attention in attentions:
            rules |= {
                f"{layer}.{attention}": "attention",
                f"{layer}.{attention}.q_proj": "col",
                f"{layer}.{attention}.k_proj": "col",
                f"{layer}.{attention}.v_proj": "col",
                f"{layer}.{attention}.out_proj": "row",
                f"{layer}.{attention}_layer_norm": "norm",
            }
        rules |= {
            f"{layer}.fc1": "col",
            f"{layer}.fc2": "row",
            f"{layer}.final_layer_norm": "norm",
        }
    return Plan(
        rules,
        boundary="tokens",
        causal_lm=True,
        name="BART sequence-to-sequence LM",
        whole_sequence=_ENCODER_DECODER_SEQUENCE,
        encoder="model.encoder",
        logits_bias=("final_logits_bias",),
    )


def _t5(*, decoder: bool) -> Plan:
    """``T5ForConditionalGeneration`` (``decoder``) or ``T5EncoderModel``: pre-LN blocks.

    Both stacks and the head read one token table (``shared``, the ``embed_tokens`` of each
    stack; the head is tied to it where ``tie_word_embeddings``, the decoder's output scaled
    by ``d_model ** -0.5`` before it in T5's forward). Positions are a relative bias ``[1,
    heads, q, k]`` the first layer's self-attention of each stack looks up in its
    ``relative_attention_bias`` ``[buckets, heads]`` and hands on to every later layer: role
    ``head_bias``, each rank reading its heads' columns. Attention does not scale its scores;
    the norms are T5LayerNorm (an RMSNorm without bias, recognized by what it computes).
    """
    rules: dict[str, str] = {"shared": "embedding"}
    stacks = ("encoder", "decoder") if decoder else ("encoder",)
    for stack in stacks:
        block = f"{stack}.block.*"
        rules |= {
            f"{stack}.embed_tokens": "embedding",
            f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias": "head_bias",
            f"{stack}.final_layer_norm": "norm",
        }
        attentions = (
            ("SelfAttention", "EncDecAttention") if stack == "decoder" else ("SelfAttention",)
        )
        for i, attention in enumerate(attentions):
            rules |= {
                f"{block}.layer.{i}.{attention}": "attention",
                f"{block}.layer.{i}.{attention}.q": "col",
                f"{block}.layer.{i}.{attention}.k": "col",
                f"{block}.layer.{i}.{attention}.v": "col",
                f"{block}.layer.{i}.{attention}.o": "row",
                f"{block}.layer.{i}.layer_norm": "norm",
            }
        ff = f"{block}.layer.{len(attentions)}"
        rules |= {
            f"{ff}.DenseReluDense.wi": "col",
            f"{ff}.DenseReluDense.wi_0": "col",
            f"{ff}.DenseReluDense.wi_1": "col",
            f"{ff}.DenseReluDense.wo": "row",
            f"{ff}.layer_norm": "norm",
        }
    gated = tuple(k for k in rules if k.endswith(("wi", "wi_0", "wi_1")))
    if not decoder:
        return Plan(
            rules,
            boundary="tokens",
            name="T5 encoder",
            optional=gated,
            whole_sequence=_T5_ENCODER_SEQUENCE,
        )
    return Plan(
        {**rules, "lm_head": "head"},
        boundary="tokens",
        causal_lm=True,
        name="T5 sequence-to-sequence LM",
        optional=gated,
        whole_sequence=_ENCODER_DECODER_SEQUENCE,
        encoder="encoder",
    )


#: Why T5's encoder cannot run under tensor mode ``'sequence'``.
_T5_ENCODER_SEQUENCE = (
    "its relative position bias [1, heads, q, k] is looked up for the whole sequence's pairs "
    "of positions, which a rank's chunk of the tokens does not read"
)


def _any_module(module: nn.Module) -> bool:
    return True


def _gpt_bigcode_attention(module: nn.Module) -> bool:
    """GPTBigCode's attention: an ``nn.Linear`` ``c_attn`` and the ``multi_query`` flag.

    A GPT-2 whose ``Conv1D`` layers were swapped for ``nn.Linear`` has the same names, but its
    ``c_attn`` holds q, k and v in turn: split as GPTBigCode's groups it would mix them.
    """
    return (
        isinstance(getattr(module, "c_attn", None), nn.Linear)
        and isinstance(getattr(module, "multi_query", None), bool)
        and isinstance(getattr(module, "kv_heads", None), int)
    )


def _plain_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear)


def _gpt2_fused(module: nn.Module) -> bool:
    """GPT-2's ``c_attn`` is a transformers ``Conv1D`` whose rows are q, k, v in turn.

    GPTBigCode (StarCoder, SantaCoder) has modules of the same names, but its ``c_attn`` is an
    ``nn.Linear`` holding each head's q, k and v side by side, or one shared key and value
    (multi-query): cut as GPT-2's, every head would mix, without an error. It has its own
    plan.
    """
    return is_conv1d(module)


# ---------------------------------------------------------------------------- the records


#: Every family, in the order models of unknown classes are tried against their markers
#: (Llama before Qwen3, whose marker Llama's plan cannot cover: its head norms), and the
#: order ``pipeline_layers`` tries their stage layouts.
MODEL_FAMILIES: tuple[ModelFamily, ...] = (
    ModelFamily(
        "Llama",
        plans={
            "LlamaForCausalLM": _llama("model.", causal_lm=True),
            "LlamaModel": _llama("", causal_lm=False),
        },
        marker=Marker("layers.0.self_attn.q_proj", _any_module, _llama),
        stages=StageLayout(
            name="Llama-style causal LM",
            inner="model",
            embeds=("embed_tokens",),
            blocks=("layers",),
            final=("norm",),
            head="lm_head",
            inputs="tokens",
            mask="causal",
            rotary="rotary_emb",
        ),
    ),
    ModelFamily(
        "GPT-2",
        plans={
            "GPT2LMHeadModel": _gpt2("transformer.", causal_lm=True),
            "GPT2Model": _gpt2("", causal_lm=False),
            "GPT2ForSequenceClassification": _gpt2_classifier(),
        },
        marker=Marker("h.0.attn.c_attn", _gpt2_fused, _gpt2),
        stages=StageLayout(
            name="GPT-2",
            inner="transformer",
            embeds=("wte", "wpe", "drop"),
            blocks=("h",),
            final=("ln_f",),
            head="lm_head",
            inputs="tokens",
            mask="causal",
        ),
    ),
    ModelFamily("GPTBigCode", marker=Marker("h.0.attn", _gpt_bigcode_attention, _gpt_bigcode)),
    ModelFamily(
        "GPT-NeoX", marker=Marker("layers.0.attention.query_key_value", _any_module, _gpt_neox)
    ),
    ModelFamily(
        "BLOOM",
        plans={
            "BloomForCausalLM": _bloom("transformer.", causal_lm=True),
            "BloomModel": _bloom("", causal_lm=False),
        },
        marker=Marker("h.0.self_attention.query_key_value", _any_module, _bloom),
        stages=StageLayout(
            name="BLOOM",
            inner="transformer",
            embeds=("word_embeddings", "word_embeddings_layernorm"),
            blocks=("h",),
            final=("ln_f",),
            head="lm_head",
            inputs="tokens",
            mask="causal",
            alibi="built",
        ),
    ),
    ModelFamily(
        "Falcon",
        marker=Marker("h.0.self_attention.query_key_value", _any_module, _falcon),
        stages=StageLayout(
            name="Falcon",
            inner="transformer",
            embeds=("word_embeddings",),
            blocks=("h",),
            final=("ln_f",),
            head="lm_head",
            inputs="tokens",
            mask="causal",
            rotary="rotary_emb",
            alibi="none",
        ),
    ),
    ModelFamily(
        "Falcon with two norms", marker=Marker("h.0.ln_mlp", _any_module, _falcon_two_norms)
    ),
    ModelFamily(
        "Phi-3",
        plans={
            "Phi3ForCausalLM": _phi3("model.", causal_lm=True),
            "Phi3Model": _phi3("", causal_lm=False),
        },
        marker=Marker("layers.0.self_attn.qkv_proj", _plain_linear, _phi3),
    ),
    ModelFamily("GLM", marker=Marker("layers.0.mlp.gate_up_proj", _plain_linear, _glm)),
    ModelFamily("GLM-4", marker=Marker("layers.0.post_mlp_layernorm", _any_module, _glm4)),
    ModelFamily(
        "Qwen3",
        plans={
            "Qwen3ForCausalLM": _qwen3("model.", causal_lm=True),
            "Qwen3Model": _qwen3("", causal_lm=False),
        },
        marker=Marker("layers.0.self_attn.q_norm", _any_module, _qwen3),
    ),
    ModelFamily("Mixtral", marker=Marker("layers.0.mlp.experts", _any_module, _mixtral)),
    ModelFamily("Qwen3-MoE", marker=Marker("layers.0.mlp.experts", _any_module, _qwen3_moe)),
    ModelFamily("Qwen2-MoE", marker=Marker("layers.0.mlp.shared_expert", _any_module, _qwen2_moe)),
    # blocks mixing dense and sparse MLPs (the first block may be either)
    ModelFamily(
        "Qwen3-MoE with dense blocks",
        marker=Marker("layers.0.self_attn.q_norm", _any_module, _qwen3_moe_dense),
    ),
    ModelFamily(
        "Qwen2-MoE with dense blocks",
        marker=Marker("layers.0.self_attn.q_proj", _any_module, _qwen2_moe_dense),
    ),
    ModelFamily(
        "BERT",
        plans={
            "BertForMaskedLM": _bert("bert.", "masked_lm"),
            "BertModel": _bert("", "pooler"),
            "BertForSequenceClassification": _bert("bert.", "classifier"),
        },
        stages=StageLayout(
            name="BERT masked LM",
            inner="bert",
            embeds=("embeddings",),
            blocks=("encoder.layer",),
            final=(),
            head="cls",
            inputs="tokens",
            mask="bidirectional",
        ),
    ),
    ModelFamily("RoBERTa", plans={"RobertaModel": _roberta()}),
    ModelFamily("DistilBERT", plans={"DistilBertModel": _distilbert()}),
    ModelFamily(
        "ViT",
        plans={
            "ViTForImageClassification": _vit("vit.", classifier=True),
            "ViTModel": _vit("", classifier=False),
        },
        marker=Marker("layers.0", _vit_layer, _vit_inferred),
        stages=StageLayout(
            name="ViT classifier",
            inner="vit",
            embeds=("embeddings",),
            blocks=("layers", "encoder.layer"),
            final=("layernorm",),
            head="classifier",
            inputs="images",
            mask=None,
        ),
    ),
    ModelFamily("CLIP", plans={"CLIPVisionModel": _clip_vision(), "CLIPTextModel": _clip_text()}),
    # timm's VisionTransformer (torchvision has a class of that name laid out otherwise)
    ModelFamily(
        "timm ViT",
        marker=Marker("blocks.0", _timm_block, _timm_vit),
        stack_marker=Marker("0", _timm_block, _timm_blocks),
        stages=StageLayout(
            name="timm ViT classifier",
            inner="",
            embeds=("patch_embed", "pos_drop", "patch_drop", "norm_pre"),
            blocks=("blocks",),
            final=("norm",),
            head="head",
            inputs="images",
            mask=None,
            own_parameters=("cls_token", "reg_token", "pos_embed"),
            head_modules=("fc_norm", "head_drop", "attn_pool"),
            embed_code=_timm_embed,
            head_code=_timm_head,
        ),
    ),
    ModelFamily("BART", plans={"BartForConditionalGeneration": _bart()}),
    ModelFamily(
        "T5",
        plans={
            "T5ForConditionalGeneration": _t5(decoder=True),
            "T5EncoderModel": _t5(decoder=False),
        },
    ),
)

#: Plans shipped with tessera, by model class name (transformers' classes).
BUILTIN_PLANS: dict[str, Plan] = {
    cls: plan for family in MODEL_FAMILIES for cls, plan in family.plans.items()
}
#: The families a model of another class may be laid out as, by name, in the order tried.
FAMILIES: dict[str, Marker] = {
    **{f.name: f.marker for f in MODEL_FAMILIES if f.marker},
    **{f"{f.name} blocks": f.stack_marker for f in MODEL_FAMILIES if f.stack_marker},
}
#: The stage layouts ``pipeline_layers`` knows, in the order tried.
STAGE_FAMILIES: tuple[StageLayout, ...] = tuple(f.stages for f in MODEL_FAMILIES if f.stages)
