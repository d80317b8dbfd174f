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
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Literal

from torch import nn

from tessera.context import TensorMode, find_tensor_mode

from .converters import COLUMN_PARTS, is_conv1d, linear_shape
from .structure import infer_structure

__all__ = [
    "BUILTIN_PLANS",
    "COLUMN_ROLES",
    "FAMILIES",
    "ROLES",
    "Plan",
    "Role",
    "infer_plan",
    "inner_norms",
    "match_plan",
    "matches",
    "plan_for",
    "resolve_span",
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


def _torch_transformer_plan(model: nn.Module) -> Plan | None:
    """The plan of torch's own ``nn.TransformerEncoder`` / ``Decoder`` (or one layer of them).

    They take and return activations ``[b, s, h]`` (``batch_first=True``; ``[s, b, h]``
    under ``'1d'`` only): a ``"features"`` plan; a decoder's memory is split like ``tgt``
    (:func:`~.multihead.install_memory_split`). ``None`` for any other class (a subclass
    may compute otherwise).
    """
    if type(model) is nn.TransformerEncoderLayer:
        return Plan(_torch_layer_rules(""), name="nn.TransformerEncoderLayer plan")
    if type(model) is nn.TransformerEncoder:
        return Plan(
            {**_torch_layer_rules("layers.*."), "norm": "norm"},
            name="nn.TransformerEncoder plan",
            optional=("norm",),
        )
    if type(model) is nn.TransformerDecoderLayer:
        return Plan(
            _torch_layer_rules("", cross_attention=True), name="nn.TransformerDecoderLayer plan"
        )
    if type(model) is nn.TransformerDecoder:
        return Plan(
            {**_torch_layer_rules("layers.*.", cross_attention=True), "norm": "norm"},
            name="nn.TransformerDecoder plan",
            optional=("norm",),
        )
    if type(model) is nn.Transformer:
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
    return None


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
        f"{layer}.layer_norm1": "norm",
        f"{layer}.self_attn": "attention",
        f"{layer}.self_attn.q_proj": "col",
        f"{layer}.self_attn.k_proj": "col",
        f"{layer}.self_attn.v_proj": "col",
        f"{layer}.self_attn.out_proj": "row",
        f"{layer}.layer_norm2": "norm",
        f"{layer}.mlp.fc1": "col",
        f"{layer}.mlp.fc2": "row",
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


#: Plans shipped with tessera, by model class name (transformers' classes).
BUILTIN_PLANS: dict[str, Plan] = {
    "GPT2LMHeadModel": _gpt2("transformer.", causal_lm=True),
    "GPT2Model": _gpt2("", causal_lm=False),
    "LlamaForCausalLM": _llama("model.", causal_lm=True),
    "LlamaModel": _llama("", causal_lm=False),
    "BloomForCausalLM": _bloom("transformer.", causal_lm=True),
    "BloomModel": _bloom("", causal_lm=False),
    "Phi3ForCausalLM": _phi3("model.", causal_lm=True),
    "Phi3Model": _phi3("", causal_lm=False),
    "Qwen3ForCausalLM": _qwen3("model.", causal_lm=True),
    "Qwen3Model": _qwen3("", causal_lm=False),
    "CLIPVisionModel": _clip_vision(),
    "BertForMaskedLM": _bert("bert.", "masked_lm"),
    "BertModel": _bert("", "pooler"),
    "BertForSequenceClassification": _bert("bert.", "classifier"),
    "RobertaModel": _roberta(),
    "DistilBertModel": _distilbert(),
    "GPT2ForSequenceClassification": _gpt2_classifier(),
    "ViTForImageClassification": _vit("vit.", classifier=True),
    "ViTModel": _vit("", classifier=False),
    "BartForConditionalGeneration": _bart(),
    "T5ForConditionalGeneration": _t5(decoder=True),
    "T5EncoderModel": _t5(decoder=False),
}


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
    torch_plan = _torch_transformer_plan(model)
    if torch_plan is not None:
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
            boundary="tokens",
            sequence_span=read.sequence_span,
            causal_lm=read.head,
            name=f"plan read from the transformer blocks of {type(model).__name__}",
        )
    raise ValueError(
        f"parallelize: tessera ships no plan for {type(model).__name__} (plans for "
        f"{', '.join(sorted(BUILTIN_PLANS))}; and its modules are not laid out like one of "
        f"their families: {', '.join(FAMILIES)}; nor as the usual transformer block stack: "
        f"{read.reason}); pass plan={{'module.name.pattern': 'col', ...}} with roles "
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
    if found.causal_lm or found.boundary == "features":
        return ""
    return (
        f". Or parallelize only its base model, parallelize(model.{prefix}) "
        f"({type(inner).__name__}, the {found.name} plan): its outputs come back whole, and "
        f"the rest of {type(model).__name__} (its head, its own loss with labels) runs whole "
        "on every rank"
    )


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


#: Model families whose module layout other models share (Mistral and Qwen2 are laid out as
#: Llama; Pythia is GPT-NeoX; Phi-4-mini is Phi-3; Qwen2-MoE is Mixtral with a shared
#: expert), by the name of a module that marks each
#: family, what that module must be for the family's plan to hold, and the plan builder. Llama
#: comes before Qwen3, whose marker Llama's plan cannot cover (its head norms).
FAMILIES: dict[str, tuple[str, Callable[[nn.Module], bool], Callable[[str, bool], Plan]]] = {
    "Llama": ("layers.0.self_attn.q_proj", _any_module, _llama),
    "GPT-2": ("h.0.attn.c_attn", _gpt2_fused, _gpt2),
    "GPTBigCode": ("h.0.attn", _gpt_bigcode_attention, _gpt_bigcode),
    "GPT-NeoX": ("layers.0.attention.query_key_value", _any_module, _gpt_neox),
    "BLOOM": ("h.0.self_attention.query_key_value", _any_module, _bloom),
    "Falcon": ("h.0.self_attention.query_key_value", _any_module, _falcon),
    "Falcon with two norms": ("h.0.ln_mlp", _any_module, _falcon_two_norms),
    "Phi-3": ("layers.0.self_attn.qkv_proj", _plain_linear, _phi3),
    "GLM": ("layers.0.mlp.gate_up_proj", _plain_linear, _glm),
    "GLM-4": ("layers.0.post_mlp_layernorm", _any_module, _glm4),
    "Qwen3": ("layers.0.self_attn.q_norm", _any_module, _qwen3),
    "Mixtral": ("layers.0.mlp.experts", _any_module, _mixtral),
    "Qwen3-MoE": ("layers.0.mlp.experts", _any_module, _qwen3_moe),
    "Qwen2-MoE": ("layers.0.mlp.shared_expert", _any_module, _qwen2_moe),
    # blocks mixing dense and sparse MLPs (the first block may be either)
    "Qwen3-MoE with dense blocks": ("layers.0.self_attn.q_norm", _any_module, _qwen3_moe_dense),
    "Qwen2-MoE with dense blocks": ("layers.0.self_attn.q_proj", _any_module, _qwen2_moe_dense),
}


def infer_plan(model: nn.Module) -> Plan | None:
    """The plan of the family whose layout ``model`` has, if every parameter is covered by it.

    A model nobody wrote a plan for is often laid out as one that has one (transformers'
    Mistral and Qwen2 are Llama's modules under other class names). The family's plan is used
    only when all of its rules match and every module holding parameters is one the plan
    names (or inside one): a module it does not know (another norm, a bias the family lacks
    in a module of its own) would stay whole and see split activations, silently wrong, so
    such a model gets no plan and the caller must write one.
    """
    modules = dict(model.named_modules())
    for marker, laid_out, build in FAMILIES.values():
        found = [n for n in modules if n == marker or n.endswith("." + marker)]
        if not found or not laid_out(modules[found[0]]):
            continue
        prefix = found[0][: len(found[0]) - len(marker)]
        causal_lm = isinstance(getattr(model, "lm_head", None), nn.Linear) and prefix != ""
        plan = build(prefix, causal_lm)
        if _covers(model, plan):
            return replace(plan, name=f"{plan.name} plan inferred for {type(model).__name__}")
    return None


def _covers(model: nn.Module, plan: Plan) -> bool:
    """Every rule matches, and every module with parameters of its own is named by one.

    A module inside a named one counts as covered, except inside an ``attention`` module:
    its heads are split, so a parameter there that no rule names (a per-head norm of q and
    k, Qwen3's) would get a share of its gradient on each rank, and the replicas would drift.
    """
    names = [name for name, _ in model.named_modules() if name]
    named = {n: role for n in names for pattern, role in plan.rules.items() if matches(n, pattern)}
    if any(not any(matches(n, pattern) for n in names) for pattern in plan.rules):
        return False
    for name, module in model.named_modules():
        if not any(True for _ in module.parameters(recurse=False)):
            continue
        if name in named and named[name] != "attention":
            continue
        if not any(name.startswith(n + ".") and role != "attention" for n, role in named.items()):
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
