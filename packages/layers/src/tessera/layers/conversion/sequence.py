"""Sequence parallelism for a model someone else wrote: its attention goes around the ring.

Under ``tensor=dict(size=N, mode="sequence")`` (Li et al. 2021, "Sequence Parallelism: Long
Sequence Training from System Perspective") every rank keeps all of the weights and a chunk
``s/N`` of every sequence. Everything but attention is token-wise, so a model's linear layers,
norms, embeddings and head stay the plain modules; only attention must see the whole sequence.
transformers routes attention through a registry (``AttentionInterface``): ``parallelize``
registers :func:`sequence_attention` under :data:`ATTENTION_NAME`, points the model's config at
it and gives each attention module the group and the algorithm (ring, or DeepSpeed-Ulysses'
all-to-all), so the model's own code computes q, k, v and the output projection.

Every parameter is marked replicated over SEQUENCE with partial gradients (each rank saw only
its tokens); the engine's sequence-parallel gradient handler sums them.

Padding masks cannot go through transformers: it would build them from the local chunk (``c``
queries against ``c`` keys), while every query here looks at all ``s`` keys. So the boundary
takes ``attention_mask`` out of the call and leaves this rank's chunk of it in the model's
:class:`KeyPadding`, which every attention layer reads (gathered whole once per batch). Pipeline
stages, which run several microbatches at once, instead pass each block the whole key mask
as its ``attention_mask``, marked by :func:`key_mask_for_attention` so that it is told apart
from a mask transformers built.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tessera.context import ParallelContext

from ..sequence.attention import (
    AttentionImpl,
    additive_mask,
    attend_over_sequence,
    sequence_group,
)
from ..sequence.replicated import mark_sequence_replicated
from ..shared.context_access import GroupInfo
from .converters import QUERY_COUNTS, _first_count
from .key_padding import KeyPadding
from .sdpa_takeover import take_over_sdpa

__all__ = [
    "ATTENTION_NAME",
    "KEY_PADDING_ATTRIBUTE",
    "SEQUENCE_ATTRIBUTE",
    "TOKEN_MIXING",
    "KeyPadding",
    "check_attention_covered",
    "check_no_token_mixing",
    "install_sequence_attention",
    "key_mask_for_attention",
    "sequence_attention",
]

#: The name under which tessera's attention is registered with transformers.
ATTENTION_NAME = "tessera_sequence"
#: The attribute of an attention module holding its :class:`SequenceAttention`.
SEQUENCE_ATTRIBUTE = "_tessera_sequence_attention"
#: The attribute of a parallelized model holding its :class:`KeyPadding`.
KEY_PADDING_ATTRIBUTE = "_tessera_key_padding"
IMPLS: tuple[AttentionImpl, ...] = ("ring", "all_to_all")
#: The attribute marking a mask made by :func:`key_mask_for_attention`.
_KEY_MASK_MARK = "_tessera_whole_key_mask"


def key_mask_for_attention(padding: torch.Tensor) -> torch.Tensor:
    """``[b, s]`` padding mask of the whole sequence (nonzero: a token) -> ``[b, 1, 1, s]``.

    A keep-mask (bool, True: attend), marked so that :func:`sequence_attention` takes it as the
    key mask over every rank's tokens and makes it additive in the scores' own dtype (built
    in another dtype, e.g. fp32 under autocast, its lowest value would be ``-inf`` in half
    precision, and a query whose every visible key is padding would softmax to NaN). A
    pipeline stage passes one on every call, also without padding, so a block never falls
    back to the model's :class:`KeyPadding`, which stages do not set.
    """
    mask = padding[:, None, None, :].detach() != 0  # [b, 1, 1, s]
    setattr(mask, _KEY_MASK_MARK, True)
    return mask


@dataclass(frozen=True)
class SequenceAttention:
    """What one attention module needs to attend over the split sequence."""

    impl: AttentionImpl
    sequence: GroupInfo
    context: ParallelContext
    padding: KeyPadding


def sequence_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Transformers' attention-function signature, over the sequence split across ranks.

    Args:
        module: The attention module (its ``is_causal`` says whether to mask the future).
        query: ``[b, heads, s/N, d]`` (this rank's tokens).
        key: ``[b, heads, s/N, d]``.
        value: ``[b, heads, s/N, d]``.
        attention_mask: ``None`` (the boundary keeps padding masks in the model's
            :class:`KeyPadding`, and the causal mask is applied here from global positions),
            or a pipeline stage's whole key mask from :func:`key_mask_for_attention`.
        scaling: The score scale (default ``1 / sqrt(d)``).
        dropout: Dropout probability on the attention weights.
        **kwargs: Position ids and cache flags transformers passes along (ignored), and what
            changes the scores, checked by :func:`_check_score_options`.

    Returns:
        ``([b, s/N, heads, d], None)``: transformers' layout, no attention weights.

    Raises:
        ValueError: an option the ring does not compute would change the result (a sliding
            window shorter than the sequence, a soft cap of the scores, attention sinks).
    """
    spec = getattr(module, SEQUENCE_ATTRIBUTE, None)
    if not isinstance(spec, SequenceAttention):
        raise RuntimeError(
            f"{type(module).__name__} uses attention {ATTENTION_NAME!r} but was not converted "
            "by tessera.layers.parallelize under tensor mode 'sequence'"
        )
    _check_score_options(module, kwargs, query.shape[-2] * spec.sequence.world_size)
    if attention_mask is not None and getattr(attention_mask, _KEY_MASK_MARK, False):
        # a pipeline stage's, over every key: nothing masked, or additive in the scores' dtype
        key_mask = (
            None if bool(attention_mask.all()) else additive_mask(attention_mask, query.dtype)
        )
    elif attention_mask is None:
        key_mask = spec.padding.whole(query.shape[0], query.shape[-2], query.dtype)
    else:
        raise ValueError(
            f"{type(module).__name__} under tensor mode 'sequence' got an attention mask of "
            f"shape {list(attention_mask.shape)} from transformers; pass padding as the model's "
            "attention_mask=[b, s] argument, which tessera splits with the sequence"
        )
    if key.shape[1] != query.shape[1]:  # grouped-query attention: each kv head serves a group
        group = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(group, 1), value.repeat_interleave(group, 1)
    out = attend_over_sequence(
        query,
        key,
        value,
        impl=spec.impl,
        sequence=spec.sequence,
        causal=bool(getattr(module, "is_causal", False)),
        scale=scaling if scaling is not None else query.shape[-1] ** -0.5,
        dropout=dropout,
        context=spec.context,
        key_mask=key_mask,
        dropout_stream=False,  # parallelize forked the generator per rank (dropout.py)
    )  # [b, heads, s/N, d]
    return out.transpose(1, 2).contiguous(), None


#: Options transformers passes to an attention function that change its scores, and why the
#: ring cannot take them (it computes plain softmax attention, causal or under a key mask).
_SCORE_OPTIONS = {
    "softcap": "caps the scores (tanh(scores / cap) * cap, Gemma 2)",
    "s_aux": "adds attention sinks to the softmax",
    "sinks": "adds attention sinks to the softmax",
    "head_mask": "scales the attention weights of some heads",
}


def _check_score_options(module: nn.Module, options: dict[str, Any], length: int) -> None:
    """Refuse what would make the ring's attention differ from the model's own.

    A sliding window counts only where it is shorter than the whole sequence (``length``,
    every rank's tokens): a window that long leaves every key of a causal query in view. The
    window is the one passed, else the module's own ``sliding_window`` (Qwen2-MoE keeps it on
    its sliding layers and builds their masks with it, without passing it on).

    Raises:
        ValueError: naming the module, the option and what to use instead.
    """
    owner = type(module).__name__
    window = options.get("sliding_window")
    if window is None:
        window = getattr(module, "sliding_window", None)
    if isinstance(window, int) and not isinstance(window, bool) and window < length:
        raise ValueError(
            f"{owner} under tensor mode 'sequence' attends within a sliding window of {window} "
            f"tokens, shorter than the sequence of {length}, which the ring's attention does not "
            "compute (every query would see every earlier key); use tensor mode '1d' with "
            "sequence_parallel=True, or sequences no longer than the window"
        )
    for name, what in _SCORE_OPTIONS.items():
        if options.get(name) is not None:
            raise ValueError(
                f"{owner} under tensor mode 'sequence' passes {name}={options[name]!r} to its "
                f"attention, which {what}; the ring's attention does not compute that, so the "
                "result would differ from the model's: use tensor mode '1d' (with "
                "sequence_parallel=True for long sequences) or '2d' / '2.5d' / '3d'"
            )


def _looks_like_attention(module: nn.Module) -> bool:
    """Torch's ``nn.MultiheadAttention``, or a module whose class is named as attention.

    A name is all a model someone else wrote tells of its attention (``SelfAttention``,
    ``GPT2Attention``, ``CausalSelfAttn``...); such a module mixes tokens, which a rank
    holding a chunk of the sequence cannot do alone.
    """
    if isinstance(module, nn.MultiheadAttention):
        return True
    name = type(module).__name__.lower()
    return "attention" in name or "attn" in name


def check_attention_covered(model: nn.Module, attention: Iterable[str], plan_name: str) -> None:
    """Refuse a model whose attention would attend within this rank's chunk only.

    Under ``'sequence'`` every module but attention runs on this rank's tokens as it is. An
    attention module the plan does not convert would run too, without an error, on ``s/N``
    keys with positions restarting at 0: a model that trains differently from one process.
    Covered are the plan's attention modules and tessera's own :class:`RingSelfAttention`,
    with what is inside or around them (BERT's ``BertAttention`` wraps its self-attention).

    Raises:
        ValueError: naming the modules left out and what to do.
    """
    from ..sequence.attention import RingSelfAttention

    covered = [*attention]
    covered += [name for name, m in model.named_modules() if isinstance(m, RingSelfAttention)]

    def is_covered(name: str) -> bool:
        return any(
            name == c or name.startswith(c + ".") or c.startswith(name + ".") for c in covered
        )

    left = [
        name
        for name, module in model.named_modules()
        if name and _looks_like_attention(module) and not is_covered(name)
    ]
    if left:
        more = f" and {len(left) - 4} more" if len(left) > 4 else ""
        raise ValueError(
            f"parallelize under tensor mode 'sequence': {left[:4]}{more} attend over the tokens "
            f"but the {plan_name} converts none of them (role 'attention'), so each would attend "
            "within this rank's chunk of the sequence only, its positions restarting at 0. Give "
            "a transformers model's attention modules role 'attention', use "
            "tessera.layers.RingSelfAttention in your own model, or use tensor mode '1d' with "
            "sequence_parallel=True"
        )


#: torch's modules that mix the tokens of a sequence beyond attention: on a rank's chunk of
#: the tokens they would see ``s/N`` of them, the chunk's edges as the sequence's.
TOKEN_MIXING = (
    nn.Conv1d,
    nn.ConvTranspose1d,
    nn.RNNBase,
    nn.AvgPool1d,
    nn.MaxPool1d,
    nn.AdaptiveAvgPool1d,
    nn.AdaptiveMaxPool1d,
)


def check_no_token_mixing(model: nn.Module, region: set[str] | None, where: str) -> None:
    """Refuse modules that mix tokens where each rank holds a chunk of the sequence.

    A causal or depthwise convolution over the sequence (a hybrid model's short conv), a
    recurrent layer or a pooling over tokens would run on this rank's chunk without an
    error, blind to the tokens on the other ranks: a model that trains differently from one
    process.

    Args:
        model: The model.
        region: The modules whose tokens are split (the sequence span), or ``None``: all.
        where: The mode, for the message.

    Raises:
        ValueError: naming the modules and what to do.
    """
    mixing = [
        f"{name} ({type(module).__name__})"
        for name, module in model.named_modules()
        if isinstance(module, TOKEN_MIXING) and (region is None or name in region)
    ]
    if mixing:
        more = f" and {len(mixing) - 4} more" if len(mixing) > 4 else ""
        raise ValueError(
            f"parallelize under {where}: {mixing[:4]}{more} mix the tokens of a sequence, but "
            "each rank holds only its chunk of them, so each would read the chunk's edges as "
            "the sequence's; use tensor mode '1d' (without sequence_parallel), '2d', '2.5d' "
            "or '3d', which keep every sequence whole"
        )


def install_sequence_attention(
    model: nn.Module, attention: Iterable[str], context: ParallelContext, impl: AttentionImpl
) -> None:
    """Mark every parameter, and route the named attention modules through the ring.

    A transformers model's attention goes through its ``AttentionInterface``; any other
    model's attention modules get their ``F.scaled_dot_product_attention`` call taken over
    (:func:`~.sdpa_takeover.take_over_sdpa`).

    Raises:
        ValueError: ``impl`` is unknown, or all-to-all cannot split a module's heads.
        TypeError: a transformers model's class does not route attention through
            transformers' ``AttentionInterface``.
    """
    if impl not in IMPLS:
        raise ValueError(f"parallelize: sequence_attention must be one of {IMPLS}, got {impl!r}")
    sequence = sequence_group(context, "parallelize")
    names = list(attention)
    if names:
        config = getattr(model, "config", None)
        transformers_model = config is not None and hasattr(config, "_attn_implementation")
        if (
            transformers_model
            and getattr(type(model), "_supports_attention_backend", True) is False
        ):
            # its attention is written out in its own forward, which would attend within the
            # local chunk only: silently wrong, so refused
            raise TypeError(
                f"parallelize under tensor mode 'sequence' routes attention through "
                f"transformers' AttentionInterface, which {type(model).__name__} does not use "
                "(_supports_attention_backend is False); use tensor mode '1d' with "
                "sequence_parallel=True for long sequences of this model"
            )
        padding = KeyPadding(sequence)
        setattr(model, KEY_PADDING_ATTRIBUTE, padding)
        model.register_forward_hook(padding.watch_output)  # its backward ends its wait
        spec = SequenceAttention(impl, sequence, context, padding)
        for name in names:
            module = model.get_submodule(name)
            heads = _first_count(
                *(getattr(module, a, None) for a in QUERY_COUNTS),
                getattr(config, "num_attention_heads", None),
            )
            n = sequence.world_size
            if impl == "all_to_all" and heads is not None and heads % n != 0:
                raise ValueError(
                    f"parallelize: {name} has {heads} heads, which all-to-all attention cannot "
                    f"split over the {n} sequence ranks ({heads} % {n} = {heads % n}); use "
                    "sequence_attention='ring'"
                )
            if transformers_model:
                setattr(module, SEQUENCE_ATTRIBUTE, spec)
            else:
                take_over_sdpa(module, spec)
        if transformers_model:
            from transformers import AttentionInterface

            assert config is not None

            AttentionInterface.register(ATTENTION_NAME, sequence_attention)
            config._attn_implementation = ATTENTION_NAME
    mark_sequence_replicated(model, context)
