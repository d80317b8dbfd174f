"""A parallelized transformers model as a sequence of layers, for pipeline stages.

A pipeline (``tessera.pipeline.build_pipeline_model``) cuts a model given as a sequence of
layers. transformers' models are one ``forward`` that also computes positions, masks and rotary
embeddings, so :func:`pipeline_layers` restates one as ``[embed, layer 0, ..., layer N-1,
head]``, holding the model's own modules (the parameters are the same tensors):

* ``embed`` takes what the model takes (token ids, or a dict of ``input_ids``,
  ``attention_mask``, ``token_type_ids``; or images) and applies the model's boundary: this
  rank's rows where the mode splits the batch, a padding mask in the rows attention runs on.
* each layer recomputes from its input what every layer needs alike (positions from 0, the
  causal or padding mask, the rotary embedding); the only side input that travels between
  stages is a padding mask, as ``(hidden, mask)`` (the pipeline's payloads carry tuples);
* ``head`` is what the model does after its last block (final norm, the vocabulary or class
  projection).

Families, found by their modules: Llama-style causal LMs (Llama, Mistral, Qwen2), GPT-2,
BLOOM (each block gets the ALiBi bias of every head, built from the padding mask), Falcon,
BERT's masked LM, the ViT classifier and timm's ViT (whose own code around its modules, the
tokens and positions it adds, its pooling, the family's record gives: ``StageLayout``).
A family member may do more in its forward than its
modules do; what the stages know of is done as the model does it (a block's sliding window,
from ``config.layer_types`` or ``config.sliding_window``; Granite's embedding and logit
multipliers, Cohere's logit scale, Gemma 2's soft cap of the logits), and anything else is
caught by :func:`pipeline_layers` itself, which runs the model and its layers once on a small
batch and refuses layers that compute something else, naming the difference. A head tied to
the token embedding is marked ``mark_pipeline_shared``: the first and the last stage each hold
a copy, and the engine sums the two gradients (Narayanan et al. 2021), so the copies train as
the one tied weight.

Tensor modes: 1D, 2D, 2.5D and 3D (the activations between stages are the mode's blocks, the
same shape on every stage). Under 1D sequence parallelism (Korthikanti et al. 2022) the first
block splits the sequence and the final norm gathers it, as in the model's own forward, so the
stages carry ``[b, s/p, h]``; each block builds its mask and rotary embedding for the whole
sequence, which its attention sees gathered. Under ``'sequence'`` (Li et al. 2021) every stage
carries this rank's chunk ``[b, s/N, h]`` from the embedding to the head: the first stage embeds
the chunk at its global positions, each block passes its chunk's positions (rotary) and the
whole padding mask (which travels as ``[b, s]``) to the ring attention, and the head returns the
chunk's logits ``[b, s/N, V]``, which ``causal_lm_loss`` / ``token_loss`` take as they are. A
ViT's first stage embeds the whole images and keeps its chunk of the tokens (padded to a
multiple of the ranks, the keep-mask travelling as ``[b, s + pad]``), and its head gathers the
final norm's output to read the class token.
"""

from __future__ import annotations

import inspect
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tessera.context import (
    TENSOR_MODES,
    ParallelContext,
    ParallelMode,
    mark_pipeline_shared,
    set_original_names,
)

from ..comm.ops import gather_along_dim
from ..dispatch.activations import split_batch
from ..sequence.replicated import split_sequence_activation
from ..state.pretrained import mark_pretrained_source
from .api import CONTEXT_ATTR, PARALLELIZED_ATTR, SEQUENCE_SPAN_ATTR
from .boundary import TOKEN_SPAN_ATTRIBUTE, TokenSpan, rank_rows, split_tokens
from .dropout import fork_each_layer
from .families import STAGE_FAMILIES, StageLayout
from .sequence import key_mask_for_attention
from .token_padding import TOKEN_COUNT_ATTR, TokenCount

__all__ = ["original_names", "pipeline_layers"]

#: The modes whose activations between stages keep the same layout and length everywhere:
#: tessera's own (a mode of your own carries its stages with its own layers).
STAGE_MODES = (None, *TENSOR_MODES)

#: What flows between stages: the hidden states, with the padding mask when one was given.
Carried = torch.Tensor | tuple[torch.Tensor, torch.Tensor]


def _adopt(stage: nn.Module, root: nn.Module, names: tuple[str, ...]) -> list[nn.Module]:
    """Register ``root``'s submodules ``names`` on ``stage``, each under its last component.

    A stage's parameter names then end like the model's. Returns the modules in order.
    """
    modules = [root.get_submodule(n) for n in names]
    for name, module in zip(names, modules, strict=True):
        stage.add_module(name.rsplit(".", 1)[-1], module)
    return modules


class EmbedStage(nn.Module):
    """The model's input -> the first block's input, in the mode's layout.

    Token models take ids ``[b, s]`` or a dict of ``input_ids`` ``[b, s]``, ``attention_mask``
    ``[b, s]`` (1: a token, 0: padding) and ``token_type_ids`` ``[b, s]``, always the whole
    batch; image models take pixels ``[b, C, H, W]``. Returns ``[b', s, h']`` or, when a
    padding mask was given (always for BERT), ``([b', s, h'], [b', s])``.
    """

    def __init__(
        self, family: StageLayout, inner: nn.Module, context: ParallelContext | None
    ) -> None:
        super().__init__()
        self.family = family
        _adopt(self, inner, family.embeds)
        for name in family.own_parameters:  # timm's class token and positions
            held = inner._parameters.get(name)
            if held is not None:
                self.register_parameter(name, held)
        self._inner = [inner]  # the model's own code (embed_code) reads it; not a child
        self._context = [context]  # not a module attribute torch would traverse
        mode = None if context is None else context.config.mode  # looked up once, not per call
        #: Whether the mode splits the sequence's tokens, or the batch's rows (mesh and cube).
        self._splits = (
            mode is not None and mode.splits_sequence,
            mode is not None and mode.splits_activations,
        )
        config = getattr(inner, "config", None)
        # Granite multiplies the token rows in its model's forward, not in a module
        self.embedding_multiplier = getattr(config, "embedding_multiplier", None)

    def forward(self, inputs: torch.Tensor | Mapping[str, torch.Tensor]) -> Carried:
        """See the class docstring."""
        context = self._context[0]
        tokens_split, rows_split = self._splits
        splitting = context if rows_split else None
        if self.family.inputs == "images":
            pixels = inputs if isinstance(inputs, torch.Tensor) else inputs["pixel_values"]
            if tokens_split:  # every rank embeds the whole images, keeps its tokens
                assert context is not None
                return self._token_chunk(self._embed_images(pixels), context)
            if splitting is not None:
                pixels = split_batch(pixels, splitting)  # [b', C, H, W]: this rank's images
            return self._embed_images(pixels)
        given = {"input_ids": inputs} if isinstance(inputs, torch.Tensor) else dict(inputs)
        unknown = sorted(set(given) - {"input_ids", "attention_mask", "token_type_ids"})
        if unknown or "input_ids" not in given:
            raise ValueError(
                f"pipeline_layers ({self.family.name}): the first stage takes input_ids [b, s] or "
                "a dict of input_ids, attention_mask and token_type_ids; got keys "
                f"{sorted(given)}"
            )
        if tokens_split:
            assert context is not None
            return self._sequence_chunk(given, context)
        local = (
            given
            if splitting is None
            else {k: rank_rows(k, v, splitting) for k, v in given.items()}
        )
        ids = local["input_ids"]  # [b', s]
        hidden = self._embed(ids, local.get("token_type_ids"))
        # A mask given travels on every microbatch (one payload structure), BERT's always.
        if "attention_mask" not in local and self.family.mask != "bidirectional":
            return hidden
        mask = local.get("attention_mask")  # [b', s]; under 3d None when nothing is padded
        return hidden, torch.ones_like(ids) if mask is None else mask

    def _embed_images(self, pixels: torch.Tensor) -> torch.Tensor:
        """``[b', C, H, W]`` -> ``[b', s, h']``: the family's code, or its ``embeddings``."""
        if self.family.embed_code is not None:
            return self.family.embed_code(self._inner[0], pixels)
        out: torch.Tensor = self.get_submodule("embeddings")(pixels)
        return out

    @staticmethod
    def _token_chunk(tokens: torch.Tensor, context: ParallelContext) -> Carried:
        """Tensor mode 'sequence', images: this rank's chunk of the embedded tokens.

        ``[b, s, h]`` (patches and class token) -> ``([b, (s + pad)/N, h], [b, s + pad])``,
        padded at the end to a multiple of the ranks; the keep-mask travels with every
        microbatch, so each block masks the padding as keys.
        """
        world = context.get_world_size(ParallelMode.SEQUENCE)
        chunk, keep = split_tokens(tokens, world, context.get_local_rank(ParallelMode.SEQUENCE))
        return chunk, keep.long().repeat(tokens.shape[0], 1)

    def _sequence_chunk(
        self, given: Mapping[str, torch.Tensor], context: ParallelContext
    ) -> Carried:
        """Tensor mode 'sequence': this rank's chunk of the tokens, at their global positions.

        The padding mask travels whole (``[b, s]``): every block's ring attention needs the
        mask of every key, and sending it costs less than gathering it in each block.
        """
        ids = given["input_ids"]  # [b, s]
        mask = given.get("attention_mask")
        if mask is not None and tuple(mask.shape) != tuple(ids.shape):
            raise ValueError(
                f"pipeline_layers ({self.family.name}) under tensor mode 'sequence': "
                f"attention_mask must be [b, s] = {list(ids.shape)} like input_ids (1: a token, "
                f"0: padding), got {list(mask.shape)}"
            )
        positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)  # [b, s]
        token_types = given.get("token_type_ids")
        hidden = self._embed(
            split_sequence_activation(ids, context),  # [b, s/N]
            None if token_types is None else split_sequence_activation(token_types, context),
            split_sequence_activation(positions, context),
        )  # [b, s/N, h]
        if mask is None and self.family.mask != "bidirectional":
            return hidden
        return hidden, torch.ones_like(ids) if mask is None else mask

    def _embed(
        self,
        ids: torch.Tensor,
        token_types: torch.Tensor | None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``[b', s']`` ids (at ``positions``, default ``0 .. s'-1``) -> ``[b', s', h']``."""
        modules = dict(self.named_children())
        if self.family.name == "GPT-2":
            if positions is None:
                positions = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)  # [1, s]
            hidden = modules["wte"](ids) + modules["wpe"](positions)
            if token_types is not None:
                hidden = hidden + modules["wte"](token_types)
            out: torch.Tensor = modules["drop"](hidden)
            return out
        if "word_embeddings" in modules:  # BLOOM (then a norm of the token rows), Falcon
            out = modules["word_embeddings"](ids)
            norm = modules.get("word_embeddings_layernorm")
            return out if norm is None else norm(out)
        if "embeddings" in modules:  # BERT
            out = modules["embeddings"](
                input_ids=ids, token_type_ids=token_types, position_ids=positions
            )
            return out
        out = modules["embed_tokens"](ids)
        if self.embedding_multiplier is not None:
            out = out * self.embedding_multiplier
        return out


def _mask_reads(inner: nn.Module) -> set[str]:
    """Which of ``layer_types`` and ``sliding_window`` the base model's forward reads.

    Both may sit in a config whose model ignores one of them: Mistral's, Mixtral's and
    Qwen3-MoE's configs carry ``layer_types``, but their forward slides every block whenever
    ``sliding_window`` is set. The forward's own source tells which one it builds masks from.

    Raises:
        ValueError: the source cannot be read while the config names a window.
    """
    config = getattr(inner, "config", None)
    windowed = getattr(config, "sliding_window", None) is not None or "sliding_attention" in (
        getattr(config, "layer_types", None) or ()
    )
    try:
        source = inspect.getsource(type(inner).forward)
    except (OSError, TypeError) as error:
        if not windowed:
            return set()
        raise ValueError(
            f"pipeline_layers: {type(inner).__name__}'s config names a sliding window, but the "
            "source of its forward, which says how its blocks use it, cannot be read"
        ) from error
    return {name for name in ("layer_types", "sliding_window") if name in source}


def _attends_in_window(config: object, index: int, family: StageLayout, reads: set[str]) -> bool:
    """Whether block ``index`` attends within a sliding window, as the base model decides.

    ``reads`` is what the base model's forward reads (:func:`_mask_reads`): ``layer_types``,
    one entry per block (Qwen2, Qwen3, Gemma 2, Cohere 2, Ministral), else
    ``sliding_window`` alone, every block (Mistral, Mixtral, Phi-3, Starcoder2), else neither
    (Llama: every block sees every earlier token).

    Raises:
        ValueError: a block of another kind (``"linear_attention"``, ...), or a window in a
            family whose stages build no causal mask.
    """
    types = getattr(config, "layer_types", None)
    if "layer_types" in reads and isinstance(types, list | tuple):
        kind = types[index]
        if kind not in ("full_attention", "sliding_attention"):
            raise ValueError(
                f"pipeline_layers ({family.name}): block {index} is of type {kind!r} "
                "(config.layer_types); its stages build the masks of 'full_attention' and "
                "'sliding_attention' blocks only"
            )
        sliding = bool(kind == "sliding_attention")
    else:
        sliding = "sliding_window" in reads and getattr(config, "sliding_window", None) is not None
    if sliding and family.mask != "causal":
        raise ValueError(
            f"pipeline_layers ({family.name}): block {index} attends within a sliding window, "
            "which its stages build for causal language models only"
        )
    return sliding


class BlockStage(nn.Module):
    """One repeated block: its positions, attention mask and rotary embedding from its input."""

    def __init__(
        self,
        family: StageLayout,
        layer: nn.Module,
        inner: nn.Module,
        sequence_split: int = 1,
        ring: ParallelContext | None = None,
        index: int = 0,
        reads: frozenset[str] = frozenset(),
    ) -> None:
        super().__init__()
        self.family = family
        self.layer = layer
        # 1D sequence parallelism: the input holds 1/sequence_split of the tokens (every block
        # after the first, which splits them); its attention sees them all, gathered
        self.sequence_split = sequence_split
        # tensor mode 'sequence': the input is this rank's chunk, attention goes round the ring
        self._ring = [ring]  # not a module attribute torch would traverse
        rotary = inner.get_submodule(family.rotary) if family.rotary else None
        self._rotary = [rotary]  # shared by every layer, holds no parameters
        # BLOOM: the base model's builder of the ALiBi bias of every head, and their count
        self._alibi: list[tuple[Callable[..., torch.Tensor], int]] = []
        if family.alibi == "built":
            self._alibi.append((inner.build_alibi_tensor, inner.num_heads))  # type: ignore[arg-type]
        self._config = getattr(inner, "config", None)
        self.sliding = _attends_in_window(self._config, index, family, set(reads))
        # Gemma 3 keeps one rotary embedding per kind of block (local and global frequencies)
        takes_kind = (
            rotary is not None and "layer_type" in inspect.signature(rotary.forward).parameters
        )
        types = getattr(self._config, "layer_types", None)
        self._rotary_kind = {"layer_type": types[index]} if takes_kind and types else {}

    def forward(self, carried: Carried) -> Carried:
        """``[b', s, h']`` (with its ``[b', s]`` padding mask) -> the same."""
        hidden, padding = carried if isinstance(carried, tuple) else (carried, None)
        ring = self._ring[0]
        kwargs = (
            self._whole_kwargs(hidden, padding)
            if ring is None
            else self._chunk_kwargs(hidden, padding, ring)
        )
        out = self.layer(hidden, **kwargs)
        result: torch.Tensor = out[0] if isinstance(out, tuple) else out
        return result if padding is None else (result, padding)

    def _chunk_kwargs(
        self, hidden: torch.Tensor, padding: torch.Tensor | None, ring: ParallelContext
    ) -> dict[str, Any]:
        """Under 'sequence': the chunk's global positions and the whole sequence's key mask.

        No causal mask is built: the ring attention masks the future by global position.
        """
        chunk, size = hidden.shape[1], ring.get_world_size(ParallelMode.SEQUENCE)
        start = chunk * ring.get_local_rank(ParallelMode.SEQUENCE)
        positions = torch.arange(start, start + chunk, device=hidden.device).unsqueeze(0)
        whole = padding if padding is not None else hidden.new_ones(hidden.shape[0], chunk * size)
        kwargs: dict[str, Any] = {"attention_mask": key_mask_for_attention(whole)}  # [b, s]
        if self.family.mask == "causal":
            kwargs["position_ids"] = positions  # [1, s/N]
        rotary = self._rotary[0]
        if rotary is not None:
            kwargs["position_embeddings"] = rotary(hidden, positions, **self._rotary_kind)
        return kwargs

    def _whole_kwargs(self, hidden: torch.Tensor, padding: torch.Tensor | None) -> dict[str, Any]:
        """Positions from 0, the family's mask and rotary embedding for the whole sequence."""
        kwargs: dict[str, Any] = {}
        length = hidden.shape[1] * self.sequence_split  # what attention sees
        positions = torch.arange(length, device=hidden.device).unsqueeze(0)  # [1, s]
        # The masks and the rotary embedding read only the batch, dtype and device of this
        # stand-in of the whole sequence's hidden states.
        split = self.sequence_split > 1
        whole = hidden.new_empty((hidden.shape[0], length, 0)) if split else hidden
        if self.family.mask is not None:
            kwargs["attention_mask"] = self._attention_mask(whole, padding, positions)
        if self.family.mask == "causal":
            kwargs["position_ids"] = positions
        rotary = self._rotary[0]
        if rotary is not None:
            kwargs["position_embeddings"] = rotary(whole, positions, **self._rotary_kind)
        if self.family.alibi == "none":
            kwargs["alibi"] = None  # a required argument of the block
        if self._alibi:  # every head's bias; each attention takes its heads' rows
            ((build, heads),) = self._alibi
            # integer positions: ones in bf16 would count past 256 inexactly
            ones = torch.ones(hidden.shape[0], length, dtype=torch.long, device=hidden.device)
            keys = padding if padding is not None else ones
            kwargs["alibi"] = build(keys, heads, hidden.dtype)
        return kwargs

    def _attention_mask(
        self, hidden: torch.Tensor, padding: torch.Tensor | None, positions: torch.Tensor
    ) -> Any:
        """The mask transformers' attention takes, built as the base model builds it."""
        from transformers.masking_utils import (
            create_bidirectional_mask,
            create_causal_mask,
            create_sliding_window_causal_mask,
        )

        if self.family.mask == "causal":
            build = create_sliding_window_causal_mask if self.sliding else create_causal_mask
            return build(
                config=self._config,
                inputs_embeds=hidden,
                attention_mask=padding,
                cache=None,
                position_ids=positions,
            )
        return create_bidirectional_mask(
            config=self._config, inputs_embeds=hidden, attention_mask=padding
        )


class HeadStage(nn.Module):
    """After the last block: ``[b', s, h']`` -> the logits the parallelized model returns.

    Language models: ``[b', s, V']`` (see ``causal_lm_loss`` and ``token_loss``); the ViT
    classifier: ``[b', C']`` from the class token.
    """

    def __init__(
        self,
        family: StageLayout,
        inner: nn.Module,
        head: nn.Module,
        ring: ParallelContext | None = None,
    ) -> None:
        super().__init__()
        self.family = family
        self._config = getattr(inner, "config", None)
        self._final = _adopt(self, inner, family.final)
        self.add_module(family.head, head)
        found = dict(inner.named_modules())
        _adopt(self, inner, tuple(name for name in family.head_modules if name in found))
        self._inner = [inner]  # the model's own code (head_code) reads it; not a child
        self._ring = [ring]  # not a module attribute torch would traverse

    def forward(self, carried: Carried) -> torch.Tensor:
        """See the class docstring."""
        hidden = carried[0] if isinstance(carried, tuple) else carried
        for module in self._final:
            hidden = module(hidden)
        ring = self._ring[0]
        if self.family.inputs == "images" and ring is not None:
            # the class token is rank 0's first: gather the chunks as the model's own forward
            # does (its backward reduce-scatters; every rank's loss is the whole batch's)
            group = ring.get_group(ParallelMode.SEQUENCE)
            hidden = gather_along_dim(hidden, 1, group, partial_grad=True)  # [b, s + pad, h]
        if self.family.head_code is not None:  # timm's pooling, fc_norm and head
            return self.family.head_code(self._inner[0], hidden)
        if self.family.inputs == "images":
            hidden = hidden[:, 0, :]  # [b', h']: the class token
        out: torch.Tensor = self.get_submodule(self.family.head)(hidden)
        return _logits_as_the_model_makes_them(out, self._config)


def _logits_as_the_model_makes_them(logits: torch.Tensor, config: object) -> torch.Tensor:
    """What a causal LM's forward does to its head's output: elementwise, so split logits too.

    Granite divides by ``logits_scaling``, Cohere multiplies by ``logit_scale``, Gemma 2 and 3
    cap them softly (``cap * tanh(logits / cap)``, ``final_logit_softcapping``).
    """
    scaling = getattr(config, "logits_scaling", None)
    if scaling is not None:
        logits = logits / scaling
    scale = getattr(config, "logit_scale", None)
    if isinstance(scale, int | float) and not isinstance(scale, bool):
        logits = logits * scale
    cap = getattr(config, "final_logit_softcapping", None)
    if cap is not None:
        logits = torch.tanh(logits / cap) * cap
    return logits


def pipeline_layers(model: nn.Module, *, context: ParallelContext | None = None) -> nn.Sequential:
    """``model`` (a transformers model, parallelized or not) as ``[embed, blocks..., head]``.

    Args:
        model: A Llama-style causal LM (Llama, Mistral, Qwen2), ``GPT2LMHeadModel``,
            ``BloomForCausalLM``, ``FalconForCausalLM``, ``BertForMaskedLM``,
            ``ViTForImageClassification`` or timm's ``VisionTransformer``;
            ``parallelize`` it first for tensor parallelism.
        context: The ParallelContext (default: the model's, from ``parallelize``, else none).

    Returns:
        An ``nn.Sequential`` of ``embed``, ``layer0`` ... ``layer{N-1}``, ``head``, holding the
        model's modules. Weights the head shares with the embedding are marked
        ``mark_pipeline_shared`` (key: the weight's name in ``model``), and each layer carries
        the model's names of its tensors (``set_original_names``), which engine checkpoints
        record and export under, and what ``save_pretrained`` / ``load_pretrained`` need of the
        model (its class, config and ties: ``mark_pretrained_source``), so a stage of them
        loads and saves a transformers checkpoint folder.

    Raises:
        TypeError: the model is none of the families above.
        ValueError: a tensor mode the stages cannot carry, 1D sequence parallelism over
            another span than the blocks, or a weight shared between other layers than the
            embedding and the head.
    """
    family = next((f for f in STAGE_FAMILIES if f.fits(model)), None)
    if family is None:
        known = ", ".join(f.name for f in STAGE_FAMILIES)
        raise TypeError(
            f"pipeline_layers knows these model families: {known}; {type(model).__name__} has "
            "the modules of none of them (e.g. model.embed_tokens, model.layers, model.norm, "
            "model.rotary_emb and lm_head for a Llama-style causal LM)"
        )
    ctx = context if context is not None else _context_of(model)
    _check_mode(ctx, family)
    inner = model.get_submodule(family.inner)
    blocks = family.blocks_of(inner)
    assert isinstance(blocks, nn.ModuleList | nn.Sequential)  # family.fits
    if getattr(blocks, PARALLELIZED_ATTR, None) is not None and blocks is not model:
        raise ValueError(
            f"pipeline_layers ({family.name}): {type(model).__name__} was converted part by "
            "part (parallelize found no plan for the whole of it: its embedding or pooling is "
            "not the family's), its blocks as one part, which splits and gathers at its own "
            "call; the stages call each block alone. Use it without a pipeline, or convert "
            "a model the family's plan takes"
        )
    split = _sequence_split(model, family, blocks, ctx)
    mode = None if ctx is None else ctx.config.mode
    ring = ctx if mode is not None and mode.splits_sequence else None
    reads = frozenset(_mask_reads(inner))
    layers: list[tuple[str, nn.Module]] = [("embed", EmbedStage(family, inner, ctx))]
    layers += [
        (f"layer{i}", BlockStage(family, layer, inner, split if i > 0 else 1, ring, i, reads))
        for i, layer in enumerate(blocks)
    ]
    layers.append(("head", HeadStage(family, inner, model.get_submodule(family.head), ring)))
    count = getattr(model, TOKEN_COUNT_ATTR, None)
    if isinstance(count, TokenCount):  # later stages cannot know a padding the first added
        count.staged = True
    # what the model computes on a probe batch, while its own forward may still be called
    probe = (
        None if any(p.is_meta for p in model.parameters()) else _probe_inputs(model, family, ctx)
    )
    want = None if probe is None else _quietly(model, lambda: _logits(model(probe)))
    token_span = getattr(model, TOKEN_SPAN_ATTRIBUTE, None)
    if isinstance(token_span, TokenSpan):  # the stages split a ViT's tokens from now on
        token_span.staged = True
    sequential = nn.Sequential(OrderedDict(layers))
    _check_every_parameter_held(sequential, model, family)
    _mark_tied(sequential, model)
    _mark_original_names(sequential, model)
    for layer in sequential:  # a stage saves the model's config.json, leaves out its ties
        mark_pretrained_source(layer, model)
    fork_each_layer(model, sequential)  # dropout on split activations: a mask per rank
    if probe is not None and want is not None:
        _check_like_the_model(sequential, model, family, ctx, probe, want)
    return sequential


#: The probe is longer than a sliding window up to this many tokens, so it sees it at work.
PROBE_WINDOWS_UP_TO = 256


def _probe_inputs(
    model: nn.Module, family: StageLayout, ctx: ParallelContext | None
) -> torch.Tensor:
    """A small whole batch every tensor mode splits: ``P`` rows of ``2P`` tokens, ``P`` images.

    ``P`` is the number of tensor ranks; the same values on every rank (a fixed seed). A
    sliding window of fewer than :data:`PROBE_WINDOWS_UP_TO` tokens makes the rows longer
    than it (a multiple of ``P``), within the model's positions.
    """
    ranks = 1 if ctx is None else ctx.get_world_size(ParallelMode.TENSOR)
    config = getattr(model, "config", None)
    g = torch.Generator().manual_seed(0)
    weight = next(model.parameters())
    if family.inputs == "images":
        size, channels = _image_size(model)
        pixels = torch.randn(ranks, channels, size, size, generator=g)
        return pixels.to(weight.device, weight.dtype)
    longest = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", 0)
    length = 2 * ranks
    window = getattr(config, "sliding_window", None)
    if isinstance(window, int) and window < PROBE_WINDOWS_UP_TO:  # a key falls out of view
        length = ranks * (window // ranks + 1)
    if longest and length > longest:
        length = ranks
    vocab = int(config.vocab_size)  # type: ignore[union-attr]
    return torch.randint(0, vocab, (ranks, length), generator=g).to(weight.device)


def _image_size(model: nn.Module) -> tuple[int, int]:
    """``(side, channels)`` of the images ``model`` takes: its config's, or timm's embedding's."""
    config = getattr(model, "config", None)
    if config is not None:
        return int(config.image_size), int(config.num_channels)
    embedding = model.get_submodule("patch_embed")
    channels = embedding.get_submodule("proj").get_parameter("weight").shape[1]
    return int(embedding.img_size[0]), int(channels)  # type: ignore[index]


def _logits(output: Any) -> torch.Tensor:
    """A model's logits: transformers' output's ``logits``, or the tensor timm returns."""
    logits: torch.Tensor = output if isinstance(output, torch.Tensor) else output.logits
    return logits


def _quietly(model: nn.Module, run: Callable[[], torch.Tensor]) -> torch.Tensor:
    """``run()`` with ``model`` in eval mode, no gradients, the random generators untouched.

    Every module's train / eval mode is restored afterwards.
    """
    training = {module: module.training for module in model.modules()}
    cuda = [p.device for p in model.parameters() if p.device.type == "cuda"][:1]
    try:
        with torch.random.fork_rng(devices=cuda), torch.no_grad():
            model.eval()
            return run()
    finally:
        for module, mode in training.items():
            module.training = mode


def _check_like_the_model(
    layers: nn.Sequential,
    model: nn.Module,
    family: StageLayout,
    ctx: ParallelContext | None,
    probe: torch.Tensor,
    want: torch.Tensor,
) -> None:
    """Refuse layers whose logits on ``probe`` differ from the model's (``want``).

    A model laid out as a family may compute more in its forward than in its modules (a
    multiplier, a cap of the logits, a mask of its own), which the stages would leave out
    silently. One forward of the layers in eval mode, without gradients (:func:`_quietly`), on
    the batch the model ran (:func:`_probe_inputs`). The largest difference is taken over the
    tensor ranks, so every rank decides alike. A model whose parameters have no values (the
    meta device) is not probed.

    Raises:
        ValueError: the layers' logits differ from the model's beyond rounding, or the
            layers fail where the model runs (a block wanting what its stage does not pass).
    """
    ranks = 1 if ctx is None else ctx.get_world_size(ParallelMode.TENSOR)
    failure: Exception | None = None
    gap = float("inf")
    try:
        got = _quietly(model, lambda: layers(probe))
        if got.shape == want.shape:
            largest = want.float().abs().max().clamp(min=1.0)
            gap = float((got.float() - want.float()).abs().max() / largest)
    except (TypeError, ValueError, RuntimeError) as error:
        failure = error
    # over the tensor ranks (a NaN counts as infinite), so that every rank raises alike and
    # none is left waiting in a collective
    seen = torch.tensor(
        [float(failure is not None), gap if gap == gap else float("inf")], device=want.device
    )
    if ctx is not None and ranks > 1:
        dist.all_reduce(seen, op=dist.ReduceOp.MAX, group=ctx.get_group(ParallelMode.TENSOR))
    failed, gap = bool(seen[0] > 0), float(seen[1])
    if failed:
        what = f"{type(failure).__name__}: {failure}" if failure else "it failed on another rank"
        raise ValueError(
            f"pipeline_layers ({family.name}): the layers of {type(model).__name__} cannot run "
            f"as its forward does ({what}); train it without a pipeline, or restate it as "
            "layers yourself"
        ) from failure
    bound = 1e-5 if want.dtype == torch.float32 else 1e-2
    if not float(gap) <= bound:
        raise ValueError(
            f"pipeline_layers ({family.name}): the layers of {type(model).__name__} compute "
            f"other logits than its forward on a probe batch of {list(probe.shape)} (largest "
            f"difference {float(gap):.2e} of the largest logit, over {ranks} tensor ranks); its "
            "forward does something its modules do not (a multiplier, a cap, a mask of its "
            "own), which the stages would leave out. Train it without a pipeline, or restate it "
            "as layers yourself"
        )


def _check_mode(ctx: ParallelContext | None, family: StageLayout) -> None:
    mode = None if ctx is None else ctx.config.tensor_mode
    if mode not in STAGE_MODES:
        raise ValueError(
            f"pipeline_layers: tensor mode {mode!r} is not one the pipeline stages can carry; "
            f"use one of {[m for m in STAGE_MODES if m is not None]}"
        )
    kind = None if ctx is None else ctx.config.mode
    if family.embed_code is not None and kind is not None and kind.splits_sequence:
        raise ValueError(
            f"pipeline_layers ({family.name}) under tensor mode {mode!r}: the stages would carry "
            "each rank's chunk of the tokens, padded where the ranks do not divide them, and "
            "its blocks take no mask of that padding; use another tensor mode for its pipeline"
        )


def _sequence_split(
    model: nn.Module,
    family: StageLayout,
    blocks: nn.ModuleList | nn.Sequential,
    ctx: ParallelContext | None,
) -> int:
    """How many ranks split the sequence between blocks (1D sequence parallelism), else 1.

    The model's span must start at its first block and end at its last block or final norm:
    then the stages carry the split tokens exactly as the model's own forward does.

    Raises:
        ValueError: the model was parallelized with sequence parallelism over another span
            (a user's plan whose span is a container of the blocks, which the stages never
            call as one module).
    """
    span = getattr(model, SEQUENCE_SPAN_ATTR, None)
    if ctx is None or span is None:
        return 1
    modules = dict(model.named_modules())
    inner = model.get_submodule(family.inner)
    listed = list(blocks)
    last = inner.get_submodule(family.final[-1]) if family.final else listed[-1]
    if modules.get(span[0]) is not listed[0] or modules.get(span[1]) is not last:
        raise ValueError(
            f"pipeline_layers: {type(model).__name__} splits the sequence from {span[0]!r} to "
            f"{span[1]!r} (1D sequence parallelism), which its stages cannot follow: they need "
            "the split to start at the first block and end after the last; use 1d without "
            "sequence_parallel for its pipeline"
        )
    return ctx.get_world_size(ParallelMode.PARALLEL_1D)


def _check_every_parameter_held(
    layers: nn.Sequential, model: nn.Module, family: StageLayout
) -> None:
    """Raise where a parameter of ``model`` is in no layer.

    A model laid out as a family may hold more than the family's modules (timm's distilled
    DeiT: a distillation token and a second head, which its own code reads from the model
    root). The layers' output may still equal the model's, but an optimizer, gradient sync or
    checkpoint built from the stages would never see such a parameter.

    Raises:
        ValueError: naming the parameters no layer holds.
    """
    held = {id(p) for p in layers.parameters()}
    missing = [name for name, p in model.named_parameters() if id(p) not in held]
    if missing:
        more = f" and {len(missing) - 4} more" if len(missing) > 4 else ""
        shown = ", ".join(missing[:4]) + more
        raise ValueError(
            f"pipeline_layers ({family.name}): {type(model).__name__} holds {shown}, which no "
            "layer holds (the family's stages know other modules): its stages would never "
            "train them; use it without a pipeline, or restate it as layers yourself"
        )


def _mark_tied(layers: nn.Sequential, model: nn.Module) -> None:
    """Mark each parameter the first and the last layer share (a tied head) for the engine.

    The key is the parameter's first name in ``model``, the same on both stages.
    """
    owners: dict[int, list[str]] = {}
    distinct: dict[int, nn.Parameter] = {}
    for layer_name, layer in layers.named_children():
        for p in layer.parameters():
            owners.setdefault(id(p), []).append(layer_name)
            distinct[id(p)] = p
    first_name = {id(p): n for n, p in model.named_parameters()}  # a tied weight: its first name
    order = [name for name, _ in layers.named_children()]
    first, last = order[0], order[-1]
    for key, p in distinct.items():
        held_by, name = owners[key], first_name.get(key, "a parameter")
        if len(held_by) < 2:
            continue
        if held_by != [first, last]:
            raise ValueError(
                f"pipeline_layers: {name} is shared by layers {held_by}; only the embedding "
                "and the head may share a weight across stages"
            )
        mark_pipeline_shared(p, name)


def _mark_original_names(layers: nn.Sequential, model: nn.Module) -> None:
    """Give each layer the model's names of its tensors (``tessera.context.set_original_names``).

    A stage holds some of the layers; the engine's checkpoints then record the model's names
    of what each stage saves, and export under them.
    """
    names = original_names(layers, model)
    for layer_name, layer in layers.named_children():
        prefix = f"{layer_name}."
        own = {n[len(prefix) :]: o for n, o in names.items() if n.startswith(prefix)}
        set_original_names(layer, own)


def _context_of(model: nn.Module) -> ParallelContext | None:
    """The context ``parallelize`` converted ``model`` for (``None``: not parallelized)."""
    ctx = getattr(model, CONTEXT_ATTR, None)
    return ctx if isinstance(ctx, ParallelContext) else None


def original_names(layers: nn.Module, model: nn.Module) -> dict[str, str]:
    """``{name in layers (or a stage of them): name in model}`` of every parameter and buffer.

    A tensor the model holds under several names (a head tied to the embedding) maps to the
    name whose trailing components agree most with the layers' name (``head.lm_head.weight``
    -> ``lm_head.weight``, ``embed.wte.weight`` -> ``transformer.wte.weight``).
    """
    by_id: dict[int, list[str]] = {}
    for name, tensor in [
        *model.named_parameters(remove_duplicate=False),
        *model.named_buffers(remove_duplicate=False),
    ]:
        by_id.setdefault(id(tensor), []).append(name)
    state = layers.state_dict(keep_vars=True)
    names: dict[str, str] = {}
    for name, tensor in state.items():
        if id(tensor) in by_id:
            candidates = by_id[id(tensor)]
            names[name] = max(candidates, key=lambda candidate: _common_tail(candidate, name))
    return names


def _common_tail(a: str, b: str) -> int:
    """How many trailing dotted components ``a`` and ``b`` share."""
    count = 0
    for x, y in zip(reversed(a.split(".")), reversed(b.split(".")), strict=False):
        if x != y:
            break
        count += 1
    return count
