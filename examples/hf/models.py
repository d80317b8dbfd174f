"""transformers models from small configs: random weights, nothing downloaded, no dropout."""

from __future__ import annotations

import torch
from torch import nn

#: The model kinds :func:`build` makes.
KINDS = (
    "gpt2",
    "gpt_bigcode",
    "llama",
    "phi3",
    "qwen3",
    "mixtral",
    "gemma2",
    "bloom",
    "falcon",
    "stablelm",
    "cohere",
)
#: Kinds whose every query head has its own key and value head (``kv_heads`` is refused).
WITHOUT_GROUPED_QUERIES = ("gpt2", "bloom")


def build(
    vocab: int,
    *,
    kind: str,
    seq_len: int,
    hidden: int,
    depth: int,
    heads: int,
    seed: int,
    kv_heads: int | None = None,
) -> nn.Module:
    """``GPT2LMHeadModel``, ``GPTBigCodeForCausalLM``, ``LlamaForCausalLM``,
    ``Phi3ForCausalLM``, ``Qwen3ForCausalLM``, ``MixtralForCausalLM``, ``Gemma2ForCausalLM``,
    ``BloomForCausalLM``, ``FalconForCausalLM``, ``StableLmForCausalLM`` or
    ``CohereForCausalLM`` (:data:`KINDS`).

    Weights drawn from ``seed``. All but GPT-2, GPTBigCode and BLOOM use grouped-query
    attention with ``kv_heads`` key/value heads (default half the query heads; 1 is multi-query
    attention); ``kv_heads`` given for GPT-2 and BLOOM is refused. GPTBigCode (StarCoder's
    layout) is multi-query unless ``kv_heads`` equals ``heads``.

    Built the same way on every rank (and with no context current: transformers' classes do
    not read tessera's), so every layout starts from the same full weights.
    """
    if kind in WITHOUT_GROUPED_QUERIES and kv_heads is not None:
        raise ValueError(
            f"model.kv_heads={kv_heads}: {kind} has no grouped-query attention (every query "
            "head has its own key and value head); leave kv_heads unset"
        )
    torch.manual_seed(seed)
    if kind == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(
            vocab_size=vocab,
            n_positions=seq_len,
            n_embd=hidden,
            n_layer=depth,
            n_head=heads,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=None,
            eos_token_id=None,
        )
        return GPT2LMHeadModel(config)
    if kind == "gpt_bigcode":  # StarCoder's: every query head beside one key and value head
        return _gpt_bigcode(vocab, seq_len, hidden, depth, heads, kv_heads)
    # Llama's block and its relatives', grouped-query attention
    sizes = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=depth,
        num_attention_heads=heads,
        num_key_value_heads=heads // 2 if kv_heads is None else kv_heads,
        max_position_embeddings=seq_len,
    )
    if kind == "bloom":  # ALiBi positions (a slope per head), q, k, v fused by head
        from transformers import BloomConfig, BloomForCausalLM

        bloom = dict(vocab_size=vocab, hidden_size=hidden, n_layer=depth, n_head=heads)
        return BloomForCausalLM(BloomConfig(**bloom, hidden_dropout=0.0, attention_dropout=0.0))
    if kind == "falcon":  # Falcon-40B's layout: q, k, v fused per key/value group
        from transformers import FalconConfig, FalconForCausalLM

        renamed = {"num_key_value_heads": "num_kv_heads"}  # its MLP is 4 x hidden
        falcon = {renamed.get(k, k): v for k, v in sizes.items() if k != "intermediate_size"}
        groups = dict(new_decoder_architecture=True, bos_token_id=None, eos_token_id=None)
        return FalconForCausalLM(FalconConfig(**falcon, **groups))
    if kind == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        return LlamaForCausalLM(LlamaConfig(**sizes))
    if kind == "phi3":  # q, k, v fused; gate and up fused
        from transformers import Phi3Config, Phi3ForCausalLM

        no_ids = dict(pad_token_id=None, bos_token_id=None, eos_token_id=None)
        return Phi3ForCausalLM(Phi3Config(**sizes, **no_ids))
    if kind == "qwen3":  # each query and key head normalized (q_norm, k_norm)
        from transformers import Qwen3Config, Qwen3ForCausalLM

        return Qwen3ForCausalLM(Qwen3Config(**sizes, head_dim=hidden // heads, pad_token_id=None))
    if kind == "mixtral":  # a mixture of 4 experts for the MLP, each token routed to 2
        from transformers import MixtralConfig, MixtralForCausalLM

        experts = dict(num_local_experts=4, num_experts_per_tok=2)
        return MixtralForCausalLM(MixtralConfig(**sizes, **experts))
    if kind == "stablelm":  # each query and key head normalized by a LayerNorm of its own
        from transformers import StableLmConfig, StableLmForCausalLM

        per_head = dict(qk_layernorm=True, partial_rotary_factor=0.5)
        return StableLmForCausalLM(StableLmConfig(**sizes, **per_head))
    if kind == "cohere":  # heads normalized with a weight row each; attention beside the MLP
        from transformers import CohereConfig, CohereForCausalLM

        no_ids = dict(pad_token_id=None, bos_token_id=None, eos_token_id=None)
        return CohereForCausalLM(CohereConfig(**sizes, use_qk_norm=True, **no_ids))
    if kind == "gemma2":  # rows scaled by sqrt(hidden), norms by 1 + weight, capped logits
        from transformers import Gemma2Config, Gemma2ForCausalLM

        head_dim = hidden // heads
        return Gemma2ForCausalLM(Gemma2Config(**sizes, head_dim=head_dim, pad_token_id=None))
    raise ValueError(f"model.kind must be one of {', '.join(KINDS)}, got {kind!r}")


def _gpt_bigcode(
    vocab: int, seq_len: int, hidden: int, depth: int, heads: int, kv_heads: int | None
) -> nn.Module:
    """``GPTBigCodeForCausalLM``: multi-query (``kv_heads`` unset or 1) or one per head."""
    from transformers import GPTBigCodeConfig, GPTBigCodeForCausalLM

    if kv_heads not in (None, 1, heads):
        raise ValueError(
            f"model.kv_heads={kv_heads}: gpt_bigcode has one key/value head (multi-query: "
            f"leave kv_heads unset or 1) or one per query head ({heads})"
        )
    config = GPTBigCodeConfig(
        vocab_size=vocab,
        n_positions=seq_len,
        n_embd=hidden,
        n_layer=depth,
        n_head=heads,
        multi_query=kv_heads != heads,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=None,
        eos_token_id=None,
    )
    return GPTBigCodeForCausalLM(config)
