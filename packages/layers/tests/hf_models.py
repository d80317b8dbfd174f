"""Tiny transformers models shared by every parallelize test (one config for every mode).

Built from configs with fixed seeds (same full weights on every rank), random weights, nothing
downloaded. Dropout is 0 so the parallel and the single-process runs compute the same thing.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

#: One GPT-2 for every mode: hidden 16 (divisible by q*q = 4 on a 2x2 mesh), 4 heads
#: (divisible by 1D sizes 2 and 4 and by q = 2), vocabulary 32.
GPT2_CONFIG: dict[str, Any] = dict(
    vocab_size=32,
    n_positions=16,
    n_embd=16,
    n_layer=2,
    n_head=4,
    resid_pdrop=0.0,
    embd_pdrop=0.0,
    attn_pdrop=0.0,
    bos_token_id=None,
    eos_token_id=None,
)
#: One Llama for every mode: grouped-query attention (8 heads, 4 key/value heads: divisible by
#: the 1D sizes 2 and 4 and by q = 2), hidden 32 (divisible by q*q = 4), RMSNorm, rotary
#: positions, an untied head.
LLAMA_CONFIG: dict[str, Any] = dict(
    vocab_size=32,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=16,
    tie_word_embeddings=False,
)
#: One BERT for every mode (post-LN encoder, token types, a masked-LM head tied to the
#: word embeddings), sized like the GPT-2.
BERT_CONFIG: dict[str, Any] = dict(
    vocab_size=32,
    hidden_size=16,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=32,
    max_position_embeddings=16,
    type_vocab_size=2,
    hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
)
#: One ViT for every mode: 6x6 images in 2x2 patches (9 patches + the class token = 10 tokens,
#: divisible by 2 for 1D sequence parallelism), hidden 16, 8 classes (divisible by 2 and 4).
VIT_CONFIG: dict[str, Any] = dict(
    image_size=6,
    patch_size=2,
    num_channels=3,
    hidden_size=16,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=32,
    num_labels=8,
    hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
)
#: A batch every layout divides: 4 rows (2.5D: depth 2 x q 2), 8 tokens (1D sequence: 2 or 4).
BATCH, SEQ = 4, 8


def gpt2_lm(seed: int = 0, *, distinct: bool = True, **overrides: Any) -> nn.Module:
    """``GPT2LMHeadModel`` from :data:`GPT2_CONFIG`, its weights drawn from ``seed``."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    model = GPT2LMHeadModel(GPT2Config(**{**GPT2_CONFIG, **overrides}))
    return _distinct(model, seed) if distinct else model


def llama_lm(seed: int = 0, *, distinct: bool = True, **overrides: Any) -> nn.Module:
    """``LlamaForCausalLM`` from :data:`LLAMA_CONFIG`, its weights drawn from ``seed``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**{**LLAMA_CONFIG, **overrides}))
    return _distinct(model, seed) if distinct else model


def qwen2_lm(seed: int = 0, **overrides: Any) -> nn.Module:
    """``Qwen2ForCausalLM`` (no plan of its own: laid out as Llama, biases on q, k, v)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(Qwen2Config(**{**LLAMA_CONFIG, **overrides}))
    return _distinct(model, seed)


def mistral_lm(seed: int = 0, **overrides: Any) -> nn.Module:
    """``MistralForCausalLM`` (laid out as Llama, attending within a sliding window)."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(seed)
    model = MistralForCausalLM(MistralConfig(**{**LLAMA_CONFIG, "head_dim": 4, **overrides}))
    return _distinct(model, seed)


#: One GPT-Neo (no plan of its own: read from its blocks; learned positions, its attention a
#: module inside the block's, written out in its forward) and one Phi (read from its blocks:
#: attention and MLP side by side on one norm, biases, partial rotary, head counts in the
#: config only, each query and key head normalized by a LayerNorm), sized like the GPT-2.
GPT_NEO_CONFIG: dict[str, Any] = dict(
    vocab_size=32,
    max_position_embeddings=16,
    hidden_size=16,
    num_layers=2,
    num_heads=4,
    attention_types=[[["global", "local"], 1]],
    window_size=4,
    intermediate_size=32,
    resid_dropout=0.0,
    embed_dropout=0.0,
    attention_dropout=0.0,
    bos_token_id=None,
    eos_token_id=None,
)
PHI_CONFIG: dict[str, Any] = dict(
    vocab_size=32,
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=16,
    partial_rotary_factor=0.5,
    qk_layernorm=True,
    resid_pdrop=0.0,
    embd_pdrop=0.0,
    attention_dropout=0.0,
)


#: One GPT-NeoX (Pythia's layout): q, k and v fused per head, attention and MLP side by side,
#: partial rotary, an untied head named ``embed_out``; sized like the GPT-2.
GPT_NEOX_CONFIG: dict[str, Any] = dict(
    vocab_size=32,
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=16,
    rotary_pct=0.5,
    hidden_dropout=0.0,
    attention_dropout=0.0,
    bos_token_id=None,
    eos_token_id=None,
)


def gpt_neox_lm(seed: int = 0) -> nn.Module:
    """``GPTNeoXForCausalLM`` from :data:`GPT_NEOX_CONFIG`, its weights drawn from ``seed``."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    torch.manual_seed(seed)
    return _distinct(GPTNeoXForCausalLM(GPTNeoXConfig(**GPT_NEOX_CONFIG)), seed)


def gpt_neo_lm(seed: int = 0) -> nn.Module:
    """``GPTNeoForCausalLM`` from :data:`GPT_NEO_CONFIG`, its weights drawn from ``seed``."""
    from transformers import GPTNeoConfig, GPTNeoForCausalLM

    torch.manual_seed(seed)
    return _distinct(GPTNeoForCausalLM(GPTNeoConfig(**GPT_NEO_CONFIG)), seed)


def xglm_lm(seed: int = 0) -> nn.Module:
    """``XGLMForCausalLM``: GPT-2's sizes, scaled token rows, sinusoidal positions (a module
    holding its table as a buffer, no parameters), pre-LN blocks with separate q, k and v."""
    from transformers import XGLMConfig, XGLMForCausalLM

    torch.manual_seed(seed)
    sizes = dict(vocab_size=32, d_model=16, num_layers=2, attention_heads=4, ffn_dim=64)
    dropouts = dict(dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)
    config = XGLMConfig(**sizes, **dropouts, max_position_embeddings=16, pad_token_id=0)
    return _distinct(XGLMForCausalLM(config), seed)


def opt_lm(seed: int = 0) -> nn.Module:
    """``OPTForCausalLM``: pre-LN blocks, a ReLU MLP, a tied head, and learned
    positions read two rows past each position by its own ``nn.Embedding`` subclass."""
    from transformers import OPTConfig, OPTForCausalLM

    torch.manual_seed(seed)
    sizes = dict(vocab_size=32, hidden_size=16, num_hidden_layers=2, num_attention_heads=4)
    sizes |= dict(ffn_dim=64, word_embed_proj_dim=16, max_position_embeddings=16)
    dropouts = dict(dropout=0.0, attention_dropout=0.0, layerdrop=0.0)
    config = OPTConfig(**sizes, **dropouts, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return _distinct(OPTForCausalLM(config), seed)


def phi_lm(seed: int = 0) -> nn.Module:
    """``PhiForCausalLM`` from :data:`PHI_CONFIG`, its weights drawn from ``seed``."""
    from transformers import PhiConfig, PhiForCausalLM

    torch.manual_seed(seed)
    return _distinct(PhiForCausalLM(PhiConfig(**PHI_CONFIG)), seed)


def olmo_lm(seed: int = 0) -> nn.Module:
    """``OlmoForCausalLM`` (laid out as Llama; its LayerNorms have no parameters and no
    epsilon attribute: recognized by what they compute), sized like :data:`LLAMA_CONFIG`."""
    from transformers import OlmoConfig, OlmoForCausalLM

    torch.manual_seed(seed)
    return _distinct(OlmoForCausalLM(OlmoConfig(**LLAMA_CONFIG)), seed)


def olmo2_lm(seed: int = 0) -> nn.Module:
    """``Olmo2ForCausalLM`` (norms after attention and MLP, none before; RMSNorms over all
    query features and all key features, ``q_norm`` and ``k_norm``), sized like Llama's."""
    from transformers import Olmo2Config, Olmo2ForCausalLM

    torch.manual_seed(seed)
    config = Olmo2Config(**LLAMA_CONFIG, pad_token_id=None, bos_token_id=None, eos_token_id=None)
    return _distinct(Olmo2ForCausalLM(config), seed)


def granite_lm(seed: int = 0) -> nn.Module:
    """``GraniteForCausalLM`` (laid out as Llama; its own RMSNorm class, recognized by what it
    computes; embedding, residual, attention and logit multipliers), sized like Llama's."""
    from transformers import GraniteConfig, GraniteForCausalLM

    torch.manual_seed(seed)
    config = GraniteConfig(
        **LLAMA_CONFIG,
        embedding_multiplier=2.0,
        residual_multiplier=0.5,
        attention_multiplier=0.3,
        logits_scaling=4.0,
    )
    return _distinct(GraniteForCausalLM(config), seed)


def phi3_lm(seed: int = 0, **overrides: Any) -> nn.Module:
    """``Phi3ForCausalLM`` (q, k and v fused in ``qkv_proj`` with grouped-query attention: 8
    query and 4 key/value heads; gate and up fused in ``gate_up_proj``), sized like Llama's."""
    from transformers import Phi3Config, Phi3ForCausalLM

    torch.manual_seed(seed)
    tokens = dict(pad_token_id=None, bos_token_id=None, eos_token_id=None)
    config = Phi3Config(**{**LLAMA_CONFIG, **tokens, **overrides})
    return _distinct(Phi3ForCausalLM(config), seed)


def qwen3_lm(seed: int = 0, **overrides: Any) -> nn.Module:
    """``Qwen3ForCausalLM`` (Llama's layout with each query and key head normalized by an
    RMSNorm over its 4 features, ``q_norm`` and ``k_norm``), sized like Llama's."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(**{**LLAMA_CONFIG, "head_dim": 4, "pad_token_id": None, **overrides})
    return _distinct(Qwen3ForCausalLM(config), seed)


def gemma_lm(family: str = "Gemma", seed: int = 0, **overrides: Any) -> nn.Module:
    """``GemmaForCausalLM``, ``Gemma2ForCausalLM`` or ``Gemma3ForCausalLM`` (text), sized like
    Llama's: token rows scaled by sqrt(hidden) in the embedding's own forward, RMSNorms scaling
    by ``1 + weight``, a head tied to the embedding; Gemma 2 and 3 add norms before and after
    the MLP, soft caps of the scores (2) or norms of each query and key head (3)."""
    import transformers

    torch.manual_seed(seed)
    config_class = "Gemma3TextConfig" if family == "Gemma3" else f"{family}Config"
    sizes = {**LLAMA_CONFIG, "head_dim": 4, "pad_token_id": None, **overrides}
    config = getattr(transformers, config_class)(**sizes)
    model = getattr(transformers, f"{family}ForCausalLM")(config)
    return _distinct(model, seed)


def nemotron_lm(seed: int = 0) -> nn.Module:
    """``NemotronForCausalLM`` (LayerNorms scaling by ``1 + weight`` in a forward of their own,
    an MLP of up and down projections, partial rotary), sized like Llama's."""
    from transformers import NemotronConfig, NemotronForCausalLM

    torch.manual_seed(seed)
    config = NemotronConfig(**LLAMA_CONFIG, head_dim=4, bos_token_id=None, eos_token_id=None)
    return _distinct(NemotronForCausalLM(config), seed)


def glm_lm(seed: int = 0) -> nn.Module:
    """``GlmForCausalLM`` (gate and up fused in ``gate_up_proj``; partial rotary), sized like
    Llama's."""
    from transformers import GlmConfig, GlmForCausalLM

    torch.manual_seed(seed)
    config = GlmConfig(**LLAMA_CONFIG, pad_token_id=None, bos_token_id=None, eos_token_id=None)
    return _distinct(GlmForCausalLM(config), seed)


def glm4_lm(seed: int = 0) -> nn.Module:
    """``Glm4ForCausalLM`` (gate and up fused in ``gate_up_proj``, chunked in two by the MLP; a
    norm after attention and after the MLP; partial rotary), sized like Llama's."""
    from transformers import Glm4Config, Glm4ForCausalLM

    torch.manual_seed(seed)
    config = Glm4Config(**LLAMA_CONFIG, pad_token_id=None, bos_token_id=None, eos_token_id=None)
    return _distinct(Glm4ForCausalLM(config), seed)


def bloom_lm(seed: int = 0, **overrides: Any) -> nn.Module:
    """``BloomForCausalLM`` sized like the GPT-2: ALiBi for positions (a slope per head),
    q, k and v fused by head, a norm after the token embedding, a tied head."""
    from transformers import BloomConfig, BloomForCausalLM

    torch.manual_seed(seed)
    sizes = dict(vocab_size=32, hidden_size=16, n_layer=2, n_head=4)
    no_dropout = dict(hidden_dropout=0.0, attention_dropout=0.0)
    config = BloomConfig(**{**sizes, **no_dropout, **overrides})
    return _distinct(BloomForCausalLM(config), seed)


def falcon_lm(seed: int = 0, **overrides: Any) -> nn.Module:
    """``FalconForCausalLM`` with Llama's sizes: by default the new decoder architecture
    (Falcon-40B's: q, k, v fused per key/value group, attention and MLP side by side on two
    norms), rotary positions, its own ``FalconLinear`` class, a tied head."""
    from transformers import FalconConfig, FalconForCausalLM

    torch.manual_seed(seed)
    sizes = dict(
        vocab_size=32,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_kv_heads=4,
        new_decoder_architecture=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bos_token_id=None,
        eos_token_id=None,
    )
    return _distinct(FalconForCausalLM(FalconConfig(**{**sizes, **overrides})), seed)


def gpt_bigcode_lm(seed: int = 0, **overrides: Any) -> nn.Module:
    """``GPTBigCodeForCausalLM`` (StarCoder's) with GPT-2's config keys and Llama's 8 heads of
    4: by default multi-query (every query head beside one key and one value head in the
    ``nn.Linear`` ``c_attn``), a tied head."""
    from transformers import GPTBigCodeConfig, GPTBigCodeForCausalLM

    torch.manual_seed(seed)
    sizes = dict(GPT2_CONFIG, n_embd=32, n_head=8, multi_query=True)
    return _distinct(GPTBigCodeForCausalLM(GPTBigCodeConfig(**{**sizes, **overrides})), seed)


def stablelm_lm(seed: int = 0, **overrides: Any) -> nn.Module:
    """``StableLmForCausalLM``: Llama's sizes, LayerNorms with biases, partial rotary, and
    each query and key head normalized by a LayerNorm of its own (``qk_layernorm``)."""
    from transformers import StableLmConfig, StableLmForCausalLM

    torch.manual_seed(seed)
    sizes = dict(partial_rotary_factor=0.5, qk_layernorm=True, hidden_dropout=0.0)
    config = StableLmConfig(**{**LLAMA_CONFIG, **sizes, **overrides})
    return _distinct(StableLmForCausalLM(config), seed)


def cohere_lm(seed: int = 0, **overrides: Any) -> nn.Module:
    """``CohereForCausalLM``: Llama's sizes, attention and MLP side by side on one norm, scaled
    logits, a tied head, and each query and key head normalized with a weight row of its own
    (``use_qk_norm``: one ``[heads, head_dim]`` weight)."""
    from transformers import CohereConfig, CohereForCausalLM

    torch.manual_seed(seed)
    sizes = dict(use_qk_norm=True, tie_word_embeddings=True, bos_token_id=None, eos_token_id=None)
    config = CohereConfig(**{**LLAMA_CONFIG, **sizes, **overrides})
    return _distinct(CohereForCausalLM(config), seed)


def bert_mlm(seed: int = 0, **overrides: Any) -> nn.Module:
    """``BertForMaskedLM`` from :data:`BERT_CONFIG`, its weights drawn from ``seed``."""
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(seed)
    return _distinct(BertForMaskedLM(BertConfig(**{**BERT_CONFIG, **overrides})), seed)


def bert_causal_lm(seed: int = 0) -> nn.Module:
    """``BertLMHeadModel`` (BERT as a decoder) from :data:`BERT_CONFIG`, weights from ``seed``."""
    from transformers import BertConfig, BertLMHeadModel

    torch.manual_seed(seed)
    return _distinct(BertLMHeadModel(BertConfig(**BERT_CONFIG, is_decoder=True)), seed)


def bert_encoder(seed: int = 0, **overrides: Any) -> nn.Module:
    """The bare ``BertModel`` (with its pooler) from :data:`BERT_CONFIG`, weights from ``seed``."""
    from transformers import BertConfig, BertModel

    torch.manual_seed(seed)
    return _distinct(BertModel(BertConfig(**{**BERT_CONFIG, **overrides})), seed)


def roberta_encoder(seed: int = 0) -> nn.Module:
    """The bare ``RobertaModel`` from :data:`BERT_CONFIG` (positions counted past the padding
    token 1, so :data:`SEQ` + 2 of the 16 learned positions are used)."""
    from transformers import RobertaConfig, RobertaModel

    torch.manual_seed(seed)
    return _distinct(RobertaModel(RobertaConfig(**BERT_CONFIG)), seed)


def distilbert_encoder(seed: int = 0) -> nn.Module:
    """The bare ``DistilBertModel`` sized as :data:`BERT_CONFIG` (no token types, no pooler)."""
    from transformers import DistilBertConfig, DistilBertModel

    torch.manual_seed(seed)
    sizes = dict(dim=16, n_layers=2, n_heads=4, hidden_dim=32, max_position_embeddings=16)
    config = DistilBertConfig(vocab_size=32, **sizes, dropout=0.0, attention_dropout=0.0)
    return _distinct(DistilBertModel(config), seed)


def gpt2_bare(seed: int = 0) -> nn.Module:
    """The bare ``GPT2Model`` from :data:`GPT2_CONFIG` (a decoder's hidden states for a head
    of one's own: token classification, a reward model)."""
    from transformers import GPT2Config, GPT2Model

    torch.manual_seed(seed)
    return _distinct(GPT2Model(GPT2Config(**GPT2_CONFIG)), seed)


def vit_encoder(seed: int = 0) -> nn.Module:
    """The bare ``ViTModel`` (with its pooler) from :data:`VIT_CONFIG`."""
    from transformers import ViTConfig, ViTModel

    torch.manual_seed(seed)
    return _distinct(ViTModel(ViTConfig(**VIT_CONFIG)), seed)


def clip_vision_encoder(seed: int = 0) -> nn.Module:
    """``CLIPVisionModel`` sized as :data:`VIT_CONFIG` (the same images)."""
    from transformers import CLIPVisionConfig, CLIPVisionModel

    sizes = ("image_size", "patch_size", "num_channels", "hidden_size", "intermediate_size")
    config = CLIPVisionConfig(
        **{k: VIT_CONFIG[k] for k in sizes},
        num_hidden_layers=2,
        num_attention_heads=4,
        attention_dropout=0.0,
    )
    torch.manual_seed(seed)
    return _distinct(CLIPVisionModel(config), seed)


def _clip_configs() -> tuple[Any, Any]:
    """CLIP's text config (hidden 16, 4 heads, vocabulary 32, 2 layers; its end-of-text token
    id 2 selects the legacy pooling: each row's largest id) and vision config."""
    from transformers import CLIPTextConfig, CLIPVisionConfig

    sizes = ("image_size", "patch_size", "num_channels", "hidden_size", "intermediate_size")
    common = dict(num_hidden_layers=2, num_attention_heads=4, attention_dropout=0.0)
    text = CLIPTextConfig(
        vocab_size=GPT2_CONFIG["vocab_size"],
        hidden_size=16,
        intermediate_size=32,
        max_position_embeddings=16,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        projection_dim=8,
        **common,
    )
    vision = CLIPVisionConfig(**{k: VIT_CONFIG[k] for k in sizes}, projection_dim=8, **common)
    return text, vision


def clip_models(seed: int = 0) -> dict[str, nn.Module]:
    """CLIP's text tower, each tower under its projection, and the two-tower ``CLIPModel``:
    models tessera has no plan for but of parts (the towers) it has, by class name."""
    from transformers import (
        CLIPConfig,
        CLIPModel,
        CLIPTextModel,
        CLIPTextModelWithProjection,
        CLIPVisionModelWithProjection,
    )

    text, vision = _clip_configs()
    built: dict[str, nn.Module] = {}
    for cls, config in (
        (CLIPTextModel, text),
        (CLIPTextModelWithProjection, text),
        (CLIPVisionModelWithProjection, vision),
        (
            CLIPModel,
            CLIPConfig(
                text_config=text.to_dict(),
                vision_config=vision.to_dict(),
                projection_dim=8,
                logit_scale_init_value=0.0,  # a temperature of 1: rounding not scaled by 14
            ),
        ),
    ):
        torch.manual_seed(seed)
        built[cls.__name__] = _distinct(cls(config), seed)
    return built


#: Classes of the sequence classifiers: divisible by the 1D sizes 2 and 4, which split the head.
NUM_CLASSES = 4


def bert_classifier(seed: int = 0) -> nn.Module:
    """``BertForSequenceClassification`` from :data:`BERT_CONFIG` (its pooler, then a head onto
    :data:`NUM_CLASSES` classes; its loss built inline)."""
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(seed)
    config = BertConfig(**BERT_CONFIG, num_labels=NUM_CLASSES)
    return _distinct(BertForSequenceClassification(config), seed)


def gpt2_classifier(seed: int = 0) -> nn.Module:
    """``GPT2ForSequenceClassification`` from :data:`GPT2_CONFIG`: a head onto
    :data:`NUM_CLASSES` classes on every token, each row's last token that is not padding
    (token 0) read."""
    from transformers import GPT2Config, GPT2ForSequenceClassification

    torch.manual_seed(seed)
    config = GPT2Config(**GPT2_CONFIG, num_labels=NUM_CLASSES, pad_token_id=0)
    return _distinct(GPT2ForSequenceClassification(config), seed)


def vit_classifier(seed: int = 0, **overrides: Any) -> nn.Module:
    """``ViTForImageClassification`` from :data:`VIT_CONFIG`, its weights drawn from ``seed``."""
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(seed)
    config = ViTConfig(**{**VIT_CONFIG, **overrides})
    return _distinct(ViTForImageClassification(config), seed)


def timm_vit(seed: int = 0, global_pool: str = "token", **overrides: Any) -> nn.Module:
    """timm's ``VisionTransformer`` sized as :data:`VIT_CONFIG` (a class token, positions
    covering it, q/k/v fused in ``attn.qkv``; the class token read by the head, or ``"avg"``:
    the mean of the other tokens, normalized by ``fc_norm``), its weights drawn from ``seed``.
    timm imports torchvision, which only the newest torch's environment holds (noxfile)."""
    from timm.models.vision_transformer import VisionTransformer

    torch.manual_seed(seed)
    model = VisionTransformer(
        img_size=VIT_CONFIG["image_size"],
        patch_size=VIT_CONFIG["patch_size"],
        in_chans=VIT_CONFIG["num_channels"],
        num_classes=VIT_CONFIG["num_labels"],
        embed_dim=VIT_CONFIG["hidden_size"],
        depth=VIT_CONFIG["num_hidden_layers"],
        num_heads=VIT_CONFIG["num_attention_heads"],
        mlp_ratio=VIT_CONFIG["intermediate_size"] / VIT_CONFIG["hidden_size"],
        global_pool=global_pool,
        **overrides,
    )
    return _distinct(model, seed)


def torchvision_vit(seed: int = 0) -> nn.Module:
    """torchvision's ``VisionTransformer`` sized as :data:`VIT_CONFIG`: a patch convolution,
    class token and positions of its own, its blocks (``nn.MultiheadAttention``, an MLP
    ``nn.Sequential``) in the ``nn.Sequential`` ``encoder.layers``, its weights drawn from
    ``seed``. torchvision is only in the newest torch's environment (noxfile)."""
    from torchvision.models import VisionTransformer

    torch.manual_seed(seed)
    model = VisionTransformer(
        image_size=VIT_CONFIG["image_size"],
        patch_size=VIT_CONFIG["patch_size"],
        num_layers=VIT_CONFIG["num_hidden_layers"],
        num_heads=VIT_CONFIG["num_attention_heads"],
        hidden_dim=VIT_CONFIG["hidden_size"],
        mlp_dim=VIT_CONFIG["intermediate_size"],
        num_classes=VIT_CONFIG["num_labels"],
    )
    return _distinct(model, seed)


def images(seed: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    """``[BATCH, 3, 6, 6]`` images and their ``[BATCH]`` labels (the whole batch)."""
    g = torch.Generator().manual_seed(seed)
    pixels = torch.randn(BATCH, VIT_CONFIG["num_channels"], 6, 6, generator=g)
    return pixels, torch.randint(0, VIT_CONFIG["num_labels"], (BATCH,), generator=g)


def _distinct(model: nn.Module, seed: int) -> nn.Module:
    """transformers' init leaves biases and norm weights at 0 / 1: give every tensor distinct
    values, so a wrong block or a wrong gradient cannot hide behind a constant."""
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed + 1)
        for _, p in sorted(model.named_parameters()):
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
    return model


def token_ids(seed: int = 7) -> torch.Tensor:
    """``[BATCH, SEQ]`` token ids (the same on every rank: the whole batch)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, GPT2_CONFIG["vocab_size"], (BATCH, SEQ), generator=g)


def masked_labels(ids: torch.Tensor, seed: int = 8) -> torch.Tensor:
    """BERT's labels for ``ids``: the token at about half the positions, -100 elsewhere."""
    keep = torch.rand(ids.shape, generator=torch.Generator().manual_seed(seed)) < 0.5
    return torch.where(keep, ids, torch.full_like(ids, -100))


def token_types(seed: int = 9) -> torch.Tensor:
    """``[BATCH, SEQ]`` token type ids (0 or 1)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2, (BATCH, SEQ), generator=g)


#: Experts for the mixtures of experts, sized like Llama's MLP: 4 experts of 32 -> 64 (64
#: divisible by the 1D sizes 2 and 4), each token routed to 2.
MOE_CONFIG: dict[str, Any] = dict(num_experts_per_tok=2, router_jitter_noise=0.0)


def mixtral_lm(seed: int = 0) -> nn.Module:
    """``MixtralForCausalLM``: Llama's block with a mixture of 4 experts for the MLP."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(seed)
    config = MixtralConfig(**LLAMA_CONFIG, **MOE_CONFIG, num_local_experts=4)
    return _distinct(MixtralForCausalLM(config), seed)


def qwen3_moe_lm(seed: int = 0, **overrides: Any) -> nn.Module:
    """``Qwen3MoeForCausalLM``: Qwen3's block with a mixture of 4 experts for the MLP."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    experts = dict(num_experts=4, moe_intermediate_size=64, decoder_sparse_step=1)
    config = Qwen3MoeConfig(**{**LLAMA_CONFIG, **MOE_CONFIG, **experts, "head_dim": 4, **overrides})
    return _distinct(Qwen3MoeForCausalLM(config), seed)


def qwen2_moe_lm(seed: int = 0, **overrides: Any) -> nn.Module:
    """``Qwen2MoeForCausalLM``: Mixtral's block with a shared expert beside the 4 routed ones,
    its output scaled by a gate of one feature; biases on q, k and v."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    torch.manual_seed(seed)
    experts = dict(num_experts=4, moe_intermediate_size=64, decoder_sparse_step=1)
    config = Qwen2MoeConfig(
        **{**LLAMA_CONFIG, **MOE_CONFIG, **experts, "shared_expert_intermediate_size": 64},
        **overrides,
    )
    return _distinct(Qwen2MoeForCausalLM(config), seed)


#: One BART for every mode: an encoder and a decoder of 2 post-LN blocks each, hidden 16, 4
#: heads (divisible by the 1D sizes 2 and 4 and by q = 2), vocabulary 32 (divisible by 8), one
#: token table for both stacks and the head, learned positions read two rows on.
BART_CONFIG: dict[str, Any] = dict(
    vocab_size=32,
    d_model=16,
    encoder_layers=2,
    decoder_layers=2,
    encoder_attention_heads=4,
    decoder_attention_heads=4,
    encoder_ffn_dim=32,
    decoder_ffn_dim=32,
    max_position_embeddings=16,
    dropout=0.0,
    attention_dropout=0.0,
    activation_dropout=0.0,
    pad_token_id=1,
    bos_token_id=0,
    eos_token_id=2,
    decoder_start_token_id=2,
    forced_eos_token_id=None,
)
#: Decoder tokens of the encoder-decoders: a length of their own, not the encoder's SEQ.
DECODER_SEQ = 6


def bart_lm(seed: int = 0, **overrides: Any) -> nn.Module:
    """``BartForConditionalGeneration`` from :data:`BART_CONFIG`; its ``final_logits_bias``
    ``[1, V]`` (a buffer, zeros as built) drawn too, so a bias added to the wrong logits shows."""
    from transformers import BartConfig, BartForConditionalGeneration

    torch.manual_seed(seed)
    model = BartForConditionalGeneration(BartConfig(**{**BART_CONFIG, **overrides}))
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed + 2)
        model.final_logits_bias.copy_(torch.randn(model.final_logits_bias.shape, generator=g))
    return _distinct(model, seed)


def decoder_labels(seed: int = 11) -> torch.Tensor:
    """``[BATCH, DECODER_SEQ]`` target ids of the decoder, -100 (ignored) at the end of a row."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(3, GPT2_CONFIG["vocab_size"], (BATCH, DECODER_SEQ), generator=g)
    labels[1, -2:] = -100
    return labels


#: One T5 for every mode: an encoder and a decoder of 2 pre-LN blocks each, d_model 32, 4
#: heads of 8 (divisible by the 1D size 2 and by q = 2), vocabulary 64 (divisible by 8), one
#: token table for both stacks and the head (the decoder's output scaled by d_model ** -0.5
#: before it), a relative position bias of 8 buckets in each stack's first layer.
T5_CONFIG: dict[str, Any] = dict(
    vocab_size=64,
    d_model=32,
    d_kv=8,
    d_ff=64,
    num_layers=2,
    num_decoder_layers=2,
    num_heads=4,
    relative_attention_num_buckets=8,
    relative_attention_max_distance=16,
    dropout_rate=0.0,
    pad_token_id=0,
    eos_token_id=1,
    decoder_start_token_id=0,
    tie_word_embeddings=True,
)


def t5_lm(seed: int = 0, **overrides: Any) -> nn.Module:
    """``T5ForConditionalGeneration`` from :data:`T5_CONFIG`."""
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(seed)
    model = T5ForConditionalGeneration(T5Config(**{**T5_CONFIG, **overrides}))
    return _distinct(model, seed)


def t5_encoder(seed: int = 0, **overrides: Any) -> nn.Module:
    """``T5EncoderModel`` from :data:`T5_CONFIG`."""
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(seed)
    return _distinct(T5EncoderModel(T5Config(**{**T5_CONFIG, **overrides})), seed)
