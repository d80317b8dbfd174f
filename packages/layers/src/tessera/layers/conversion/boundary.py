"""The boundary of a parallelized model: what goes in split, what comes out, and its loss.

A model someone else wrote takes full inputs. ``parallelize`` installs hooks so it still does:

* ``"tokens"`` models (transformers' language models) take the whole batch of token ids on
  every tensor rank; where the mode splits the batch (2D, 2.5D) the root's pre-hook keeps this
  rank's rows of ``input_ids``, ``attention_mask``, ``token_type_ids`` and per-row
  ``position_ids``; the embedding then makes the mode's layout itself.
* ``"features"`` models take a full activation ``[b, ..., h]``: the pre-hook splits it into the
  mode's layout (:func:`split_activation`) and the forward hook gathers the output back.
* Under 1D sequence parallelism (Korthikanti et al. 2022) the input of the plan's first block
  is split along the sequence and the output of its last module gathered, so the norms and
  residual adds in between run on ``[b, s/p, h]``.
* ``"images"`` models (a ViT) take the whole batch of images; under ``'sequence'`` each rank
  embeds them whole, its blocks run on its chunk of the tokens, and the final norm's output
  is gathered so the head reads the class token (:func:`_install_token_span`).

Language-model logits stay split (by vocabulary in 1D, by batch on the mesh) and
:func:`causal_lm_loss` computes the loss from them without gathering.
"""

from __future__ import annotations

from typing import Any, Literal, overload

import torch
import torch.nn.functional as F
from torch import nn

from tessera.context import ParallelContext, ParallelMode, TensorMode

from ..comm.ops import gather_along_dim, split_along_dim
from ..cube.embedding import Embedding3D
from ..cube.layout import LAYOUT_ATTR, mark_layout
from ..dispatch.activations import gather_activation, split_activation, split_batch
from ..sequence.replicated import TOKENS_BEFORE_PADDING, split_sequence_activation
from ..shared.context_access import current_or_none, tensor_mode
from ..shared.errors import ModeNotImplementedError
from ..shared.mode_layers import MODE_LAYERS, check_targets, find_mode_layers
from .left_out import LAYOUT_MARK
from .mask_rows import MaskGiven
from .model_loss import MODEL_LOSS_ATTR
from .output_fields import install_whole_output_fields
from .plan import Plan
from .sequence import KEY_PADDING_ATTRIBUTE, KeyPadding
from .sequence_positions import forward_takes_positions
from .split_logits import local_logits, token_split_logits
from .token_padding import TOKEN_COUNT_ATTR, TokenCount, pad_rows_inside, pad_tokens, strip_tokens

__all__ = ["causal_lm_loss", "gather_logits", "install_boundary", "token_loss"]

#: Keyword inputs of transformers' models that hold one row per sample (an encoder-decoder's
#: decoder stream too: encoder_decoder.py).
BATCH_KWARGS = (
    "input_ids",
    "attention_mask",
    "token_type_ids",
    "decoder_input_ids",
    "decoder_attention_mask",
)
#: Masks attention reads (under 3d they take layout "z"'s rows).
ATTENTION_MASKS = ("attention_mask", "decoder_attention_mask")


def rank_rows(name: str, value: Any, context: ParallelContext, *, hidden_rows: bool = False) -> Any:
    """This rank's rows of the model input ``name`` under a mode that splits the batch.

    Non-tensors pass unchanged, as does one row of ``position_ids`` (broadcast over the
    batch). Under 3d an ``attention_mask`` takes layout ``"z"``'s rows and is ``None`` when
    nothing is padded, and per-sample ``position_ids`` take layout ``"z"``'s rows too, marked
    so: transformers builds masks (packed sequences) and rotary embeddings from them for
    attention, which runs on layout ``"z"``, and the 3D position embedding swaps them back
    to layout ``"y"``'s rows (``ids_in_layout_y``). With ``hidden_rows`` (a model of one's
    own, mask_rows.py) a mask takes the rows of the hidden states, as it is.
    """
    if not isinstance(value, torch.Tensor):
        return value
    if name == "position_ids" and value.shape[0] == 1:
        return value  # one row of positions, broadcast over the batch
    if hidden_rows and name in ATTENTION_MASKS:
        return split_batch(value, context)  # attention moves it to its rows (mask_rows.py)
    layers = find_mode_layers(context.config.tensor_mode)
    two_layouts = layers is not None and layers.two_layouts and layers.attention_rows is not None
    if two_layouts and name in (*ATTENTION_MASKS, "position_ids"):
        # 3D: attention runs on a column layer's output, in layout "z", whose rows are not
        # the rows of layout "y" that split_batch keeps: both take layout "z"'s rows.
        assert layers is not None and layers.attention_rows is not None
        if name in ATTENTION_MASKS and bool(value.all()):
            return None  # nothing masked: the causal mask alone
        mine = layers.attention_rows(value, context)
        return mark_layout(mine, "z") if name == "position_ids" else mine
    return split_batch(value, context)


def _image_inputs(
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    context: ParallelContext,
    kind: TensorMode,
    owner: str,
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Images: this rank's rows where the mode splits the batch, else the whole batch.

    Under ``'sequence'`` every rank embeds the whole images; the tokens are split after the
    embedding (:func:`_install_token_span`).
    """
    if not kind.splits_activations:  # 1D and 'sequence' embed the whole batch of images
        return args, kwargs
    if args:
        args = (split_batch(args[0], context), *args[1:])
    elif isinstance(kwargs.get("pixel_values"), torch.Tensor):
        kwargs["pixel_values"] = split_batch(kwargs["pixel_values"], context)
    return args, kwargs


def _padded_tokens(
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    mask: torch.Tensor,
    extra: int,
    takes_positions: bool,
) -> tuple[tuple[Any, ...], dict[str, Any], torch.Tensor]:
    """The token inputs with ``extra`` padding tokens at the end of each row.

    Ids and token types are padded with 0, the mask with 0 (the padding is no key), positions
    with each row's last (within any position table); the targets are padded by the loss
    (``token_loss``), the logits stripped by ``gather_logits``. Causal attention never reads
    a later position, and bidirectional attention masks the padding, so the real tokens
    compute as one process's.
    """

    def pad(x: Any) -> Any:
        if not isinstance(x, torch.Tensor) or x.dim() != 2:
            return x
        return torch.cat([x, x.new_zeros(x.shape[0], extra)], 1)  # [b, s + extra]

    embeds = kwargs.get("inputs_embeds")
    if isinstance(embeds, torch.Tensor):  # [b, s, h] -> [b, s + extra, h], zeros masked
        kwargs["inputs_embeds"] = torch.cat(
            [embeds, embeds.new_zeros(embeds.shape[0], extra, *embeds.shape[2:])], 1
        )

    positions = kwargs.get("position_ids")
    if not isinstance(positions, torch.Tensor) and takes_positions:  # the whole sequence's
        positions = torch.arange(mask.shape[1], device=mask.device).unsqueeze(0)
    if isinstance(positions, torch.Tensor):
        kwargs["position_ids"] = torch.cat([positions, positions[:, -1:].expand(-1, extra)], 1)
    for key in BATCH_KWARGS:
        if key != "attention_mask":
            kwargs[key] = pad(kwargs.get(key)) if key in kwargs else None
            if kwargs[key] is None:
                del kwargs[key]
    return tuple(pad(a) if i == 0 else a for i, a in enumerate(args)), kwargs, pad(mask)


def _sequence_inputs(
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    context: ParallelContext,
    owner: str,
    padding: KeyPadding | None,
    count: TokenCount,
    takes_positions: bool = True,
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Tensor mode 'sequence': this rank's chunk of every token, with global positions.

    A padding mask goes to the attention layers through ``padding`` (conversion/sequence.py), not
    through transformers. A model whose forward takes no ``position_ids`` gets none; its
    position tables move their ids to this rank's chunk instead (sequence_positions.py). A
    sequence the ranks do not divide is padded at its end (:func:`_padded_tokens`); ``count``
    records its length.
    """
    ids = args[0] if args else kwargs.get("input_ids")
    if not isinstance(ids, torch.Tensor):  # embeddings of one's own: a soft prompt, images
        ids = kwargs.get("inputs_embeds")
    if not isinstance(ids, torch.Tensor) or ids.dim() < 2:
        raise ValueError(
            f"{owner} under tensor mode 'sequence' takes input_ids [b, s] or inputs_embeds "
            f"[b, s, h], got {type(ids).__name__}"
        )
    mask = kwargs.pop("attention_mask", None)
    extra = -ids.shape[1] % context.get_world_size(ParallelMode.SEQUENCE)
    count.tokens, count.padded = ids.shape[1], ids.shape[1] + extra
    if extra:  # padded at the end, the padding masked as keys
        if padding is None:
            raise ValueError(
                f"{owner} under tensor mode 'sequence': {ids.shape[1]} tokens do not divide "
                f"into {context.get_world_size(ParallelMode.SEQUENCE)} chunks, and no "
                "attention converted by parallelize could mask a padding; pad input_ids to a "
                "multiple of the ranks, with attention_mask 0 there"
            )
        if not isinstance(mask, torch.Tensor):
            mask = torch.ones(ids.shape[:2], dtype=torch.long, device=ids.device)
        args, kwargs, mask = _padded_tokens(args, kwargs, mask, extra, takes_positions)
        ids = mask  # [b, s + extra]: the tokens' shape
    if isinstance(mask, torch.Tensor) and not bool(mask.all()):
        if padding is None:
            raise ValueError(
                f"{owner} under tensor mode 'sequence' has no attention converted by "
                "parallelize, so nothing can apply its padding mask (attention_mask has zeros)"
            )
        if mask.dim() != 2 or tuple(mask.shape) != tuple(ids.shape[:2]):
            raise ValueError(
                f"{owner} under tensor mode 'sequence': attention_mask must be [b, s] = "
                f"{list(ids.shape[:2])} like input_ids (1: a token, 0: padding), got "
                f"{list(mask.shape)}"
            )
        padding.set(split_sequence_activation(mask, context))
    elif padding is not None:
        padding.set(None)
    if takes_positions and kwargs.get("position_ids") is None:  # the whole sequence's, split
        kwargs["position_ids"] = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)
    for key in (*BATCH_KWARGS, "position_ids"):
        if isinstance(kwargs.get(key), torch.Tensor):
            kwargs[key] = split_sequence_activation(kwargs[key], context)
    embeds = kwargs.get("inputs_embeds")
    if isinstance(embeds, torch.Tensor):  # a plain slice: its gradient is this chunk's share
        rank, world = (
            f(ParallelMode.SEQUENCE) for f in (context.get_local_rank, context.get_world_size)
        )
        kwargs["inputs_embeds"] = embeds.chunk(world, 1)[rank]  # [b, s/N, h]
    args = tuple(
        split_sequence_activation(a, context) if i == 0 and isinstance(a, torch.Tensor) else a
        for i, a in enumerate(args)
    )
    return args, kwargs


def _split_embeddings(
    name: str, value: Any, context: ParallelContext, module: nn.Module
) -> torch.Tensor:
    """Whole embeddings given in place of ids, in the layout the embedding would have made.

    ``inputs_embeds`` ``[b, s, h]``: a soft prompt, image features merged into the text's.
    The embedding's output is an activation between blocks, so :func:`split_activation`'s
    block; its backward gathers the gradient whole, so embeddings of one's own train as on
    one process.
    """
    if not isinstance(value, torch.Tensor) or value.dim() != 3:
        shape = list(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(
            f"{type(module).__name__}: {name} must be whole embeddings [b, s, h], got {shape}"
        )
    split = split_activation(value, context)
    setattr(split, LAYOUT_MARK, "activation")  # for a module left out taking it
    return split


def _wants_router_logits(model: nn.Module, kwargs: dict[str, Any]) -> bool:
    """Whether a mixture-of-experts model's forward will collect its routers' logits."""
    asked = kwargs.get("output_router_logits")
    if asked is None:
        asked = getattr(getattr(model, "config", None), "output_router_logits", False)
    return bool(asked)


def install_boundary(
    model: nn.Module,
    plan: Plan,
    context: ParallelContext,
    mode: str,
    sequence_parallel: bool,
    attention: tuple[str, ...] = (),
    mask_given: MaskGiven | None = None,
) -> None:
    """Register the boundary hooks of ``plan`` on ``model`` (see the module docstring).

    ``attention``: under 1D sequence parallelism these modules get their input gathered
    whole (see :func:`_install_sequence_span`). ``mask_given``: the model takes its mask in
    its hidden states' rows (mask_rows.py); each forward records whether it was given one.
    """
    kind = context.config.mode
    assert kind is not None  # parallelize converts under a registered mode only
    splits_batch = not kind.replicated_activations
    position_tables = [
        m for m in model.modules() if isinstance(m, Embedding3D) and m.reads_positions
    ]

    splits_tokens = sequence_parallel or kind.splits_sequence
    takes_positions = forward_takes_positions(model)
    # the sequence's length before the padding a span (1D) or the boundary ('sequence') adds
    count = TokenCount() if splits_tokens else None

    def before(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if splits_tokens and _wants_router_logits(module, kwargs):
            raise ValueError(
                f"{type(module).__name__} under tensor mode {mode!r}"
                f"{' with sequence_parallel' if sequence_parallel else ''} was asked for its "
                "router logits (output_router_logits): its load-balancing loss averages the "
                "routing of every token of the sequence, but here each rank routes only its "
                "share of the tokens, so the loss would differ from one process's; use tensor "
                "mode '1d' without sequence_parallel (every rank routes every token)"
            )
        own_loss = getattr(module, MODEL_LOSS_ATTR, False)
        if plan.causal_lm and kwargs.get("labels") is not None and not own_loss:
            raise ValueError(
                f"{type(module).__name__} parallelized under tensor mode {mode!r}: its own loss "
                f"(labels=...) is of a kind tessera does not compute on split logits "
                f"(loss_type {getattr(module, 'loss_type', None)!r}) and assumes whole logits; "
                "call it without labels and use "
                "tessera.layers.causal_lm_loss(output.logits, input_ids) (token_loss(logits, "
                "labels) for a masked LM)"
            )
        if plan.boundary == "features":
            if not args or not isinstance(args[0], torch.Tensor):
                raise ValueError(
                    f"{type(module).__name__}: a 'features' plan takes the activation as the "
                    "first positional argument"
                )
            if kind.splits_sequence:
                return None  # the model is its own token span (below)
            x = args[0]
            if count is not None:  # 1D sequence parallelism: padded to equal chunks
                x = pad_tokens(x, context.get_world_size(ParallelMode.PARALLEL_1D), count)
            split = split_activation(x, context)
            setattr(split, LAYOUT_MARK, "activation")  # for a module left out taking it
            return (split, *args[1:]), kwargs
        if plan.boundary == "images":
            token_span = getattr(module, TOKEN_SPAN_ATTRIBUTE, None)
            if isinstance(token_span, TokenSpan) and token_span.staged:
                raise ValueError(
                    f"{type(module).__name__} under tensor mode 'sequence' was cut into "
                    "pipeline layers (pipeline_layers), whose stages now split its tokens; "
                    "call the layers, not the model"
                )
            return _image_inputs(args, kwargs, context, kind, type(module).__name__)
        if kind.splits_sequence:
            padding = getattr(module, KEY_PADDING_ATTRIBUTE, None)
            assert count is not None
            return _sequence_inputs(
                args, kwargs, context, type(module).__name__, padding, count, takes_positions
            )
        if not splits_batch:
            return None
        for embeds in ("inputs_embeds", "decoder_inputs_embeds"):
            if kwargs.get(embeds) is not None:
                kwargs[embeds] = _split_embeddings(embeds, kwargs[embeds], context, module)
        args = tuple(
            rank_rows("input_ids", a, context) if i == 0 else a for i, a in enumerate(args)
        )
        own = mask_given is not None
        for key in (*BATCH_KWARGS, "position_ids"):
            if key in kwargs:
                kwargs[key] = rank_rows(key, kwargs[key], context, hidden_rows=own)
        if mask_given is not None:
            mask_given.value = any(kwargs.get(key) is not None for key in ATTENTION_MASKS)
        marked = getattr(kwargs.get("position_ids"), LAYOUT_ATTR, None) == "z"
        for table in position_tables:  # they must arrive still marked
            table.expects_marked_ids = marked
        return args, kwargs

    model.register_forward_pre_hook(before, with_kwargs=True)
    if plan.boundary == "images" and kind.splits_sequence:
        if plan.sequence_span is None:
            raise ValueError(
                f"parallelize: the {plan.name} names no sequence_span (the blocks whose tokens "
                "tensor mode 'sequence' splits), so its images cannot run under 'sequence'"
            )
        _install_token_span(model, plan.sequence_span, context)
    if plan.boundary == "features" and kind.splits_sequence:
        # the gradients of an image model's span: every rank computes with the whole output
        _install_token_span(model, ("", ""), context)
    elif plan.boundary == "features":
        split = sequence_parallel or not kind.replicated_activations

        def after(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
            if isinstance(output, torch.Tensor):
                whole = gather_activation(output, context)
                return whole if count is None else strip_tokens(whole, count)
            if split:  # its blocks would reach the caller as if they were whole
                raise ValueError(
                    f"{type(module).__name__} parallelized with a features plan under tensor "
                    f"mode {mode!r} returned {type(output).__name__}: a features plan's model "
                    "returns its activation as one tensor, which the boundary gathers whole"
                )
            return output

        model.register_forward_hook(after)
    if sequence_parallel and count is not None:
        _install_sequence_span(model, plan.sequence_span, attention, context, count)
        setattr(model, TOKEN_COUNT_ATTR, count)  # pipeline stages mark it (stages.py)
    if kind.splits_sequence and plan.boundary == "tokens" and count is not None:
        _mark_padded_logits(model, count, context)
    # A bare model (BertModel, ViTModel); under 'sequence' an image model's span gathers already
    images = plan.boundary == "images" and not kind.splits_sequence
    whole_already = kind.replicated_activations  # 1D (its span gathers the sequence)
    if (plan.boundary == "tokens" or images) and not plan.causal_lm and not whole_already:
        _install_whole_hidden_states(model, plan, context, kind, count)
    if plan.boundary in ("tokens", "images"):
        install_whole_output_fields(model, context, mode, sequence_parallel, count)


def _mark_padded_logits(model: nn.Module, count: TokenCount, context: ParallelContext) -> None:
    """Mark the logits of a sequence the boundary padded with its length before the padding.

    ``gather_logits`` strips the padding by it; ``token_loss`` pads the targets to match.
    Logits of this rank's chunk (``[b, (s + pad)/N, V]``) are handed out as
    :class:`~.split_logits.SplitLogits`, so code of one's own reading the tokens whole
    (``logits[:, -1]``, a mean, a loss of its own) raises instead of computing on a chunk.
    """
    ranks = context.get_world_size(ParallelMode.SEQUENCE)

    def mark(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        first = isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor)
        # return_dict=False, without labels: the logits first
        logits = output[0] if first else getattr(output, "logits", output)
        if not isinstance(logits, torch.Tensor) or count.tokens is None or count.padded is None:
            return None
        chunk = count.padded // ranks
        if logits.dim() == 3 and logits.shape[1] == chunk != count.tokens:
            logits = token_split_logits(logits, ranks)
        setattr(logits, TOKENS_BEFORE_PADDING, count.tokens)
        if first:
            return (logits, *output[1:])
        if isinstance(output, torch.Tensor):
            return logits
        output.logits = logits
        return output

    model.register_forward_hook(mark)


#: The outputs of a bare model (an encoder or a decoder without its head) gathered whole.
HIDDEN_OUTPUTS = ("last_hidden_state", "pooler_output")


def _install_whole_hidden_states(
    model: nn.Module,
    plan: Plan,
    context: ParallelContext,
    kind: TensorMode,
    count: TokenCount | None = None,
) -> None:
    """A bare model (BertModel, GPT2Model, ...) returns its hidden states whole, every mode.

    Its output feeds the user's own head or pooling (a sentence embedding, a classifier),
    which reads whole ``[b, s, h]`` hidden states. Under 2D, 2.5D and 3D they are gathered
    from the mesh's blocks at the model's output. Under ``'sequence'`` the tokens are gathered
    at the end of the plan's span, so what follows inside the model (BERT's pooler reads the
    first token) sees the whole sequence; the gather's backward reduce-scatters, the
    convention of the sequence gradient handler (every rank computes the same loss from the
    whole output, so each chunk's gradient is ``N`` times its share). 1D keeps them whole
    already (with sequence parallelism its span gathers them).
    """

    def gathered(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        if isinstance(output, torch.Tensor):
            return gather_activation(output, context)
        for name in HIDDEN_OUTPUTS:
            value = getattr(output, name, None)
            if isinstance(value, torch.Tensor):
                setattr(output, name, gather_activation(value, context))
        return output

    if not kind.splits_sequence:
        model.register_forward_hook(gathered)
        return
    group = context.get_group(ParallelMode.SEQUENCE)
    padded = count if count is not None and plan.boundary == "tokens" else TokenCount()

    def whole_tokens(x: torch.Tensor) -> torch.Tensor:  # [b, s, h], the padding stripped
        return strip_tokens(gather_along_dim(x, 1, group, partial_grad=True), padded)

    def whole_sequence(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        if isinstance(output, torch.Tensor):
            return whole_tokens(output)
        if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
            return (whole_tokens(output[0]), *output[1:])
        value = getattr(output, "last_hidden_state", None)
        if isinstance(value, torch.Tensor):
            output.last_hidden_state = whole_tokens(value)
        return output

    end = model if plan.sequence_span is None else model.get_submodule(plan.sequence_span[1])
    if plan.sequence_span is not None and not _read_after(model, plan.sequence_span[1]):
        # nothing reads the tokens after the span: gathered at the model's output, after its
        # own code (GPT2Model views its output as [-1, s, h] with the chunk's s: gathered
        # before that view, the whole sequence would fold into the batch dim)
        end = model
    end.register_forward_hook(whole_sequence)


def _read_after(model: nn.Module, end: str) -> bool:
    """Whether a module holding parameters follows the span's ``end`` (BERT's pooler).

    Such a module reads the whole sequence (the pooler, the first token), so the tokens are
    gathered at the span's end. Modules are taken in the order the model registered them.
    """
    names = [name for name, _ in model.named_modules()]
    after = names[names.index(end) + 1 :]
    return any(
        not name.startswith(f"{end}.") and any(True for _ in model.get_submodule(name).parameters())
        for name in after
    )


def _hidden_states(
    args: tuple[Any, ...], kwargs: dict[str, Any], owner: str
) -> tuple[torch.Tensor, Any]:
    """The ``[batch, seq, hidden]`` input of a block, and how to put a new one in its place."""
    key = "hidden_states"
    x = args[0] if args else kwargs.get(key)
    if not isinstance(x, torch.Tensor) or x.dim() < 3:
        raise ValueError(
            f"sequence parallelism: {owner!r} must take [batch, seq, hidden] as its first "
            f"argument, got {type(x).__name__}"
        )

    def replace(new: torch.Tensor) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if args:
            return (new, *args[1:]), kwargs
        return args, {**kwargs, key: new}

    return x, replace


def _install_sequence_span(
    model: nn.Module,
    span: tuple[str, str] | None,
    attention: tuple[str, ...],
    context: ParallelContext,
    count: TokenCount,
) -> None:
    """Split the sequence at the input of ``span[0]``, gather it at the output of ``span[1]``.

    A features plan has no span (the boundary splits the input itself). A sequence the ranks
    do not divide is padded at the split and stripped at the gather and inside attention
    (:mod:`.token_padding`); ``count`` holds its length.

    An attention module inside the span gets its input gathered whole: transformers' attention
    reshapes q, k and v by its *input's* length (Llama's ``hidden_states.shape[:-1]``), so it
    must see the whole sequence, not only the column layers inside it. The gather's backward
    keeps this rank's chunk of the gradient, which the column layers' ``copy_to_group``
    already summed (Korthikanti et al. 2022 do the same gather inside the column layer).
    """
    group = context.get_group(ParallelMode.PARALLEL_1D)
    world = context.get_world_size(ParallelMode.PARALLEL_1D)

    def whole(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        x, replace = _hidden_states(args, kwargs, type(module).__name__)
        return replace(strip_tokens(gather_along_dim(x, 1, group), count))  # [b, s, h]

    pad_rows_inside(model, world)  # attention's output projection scatters the sequence again
    for name in attention:
        module = model.get_submodule(name)
        if getattr(module, "_tessera_gathers_own_sequence", False):  # multihead.py's: q, k, v
            setattr(module, TOKEN_COUNT_ATTR, count)
            continue
        module.register_forward_pre_hook(whole, with_kwargs=True)
    if span is None:
        return
    first, last = (model.get_submodule(name) for name in span)

    def enter(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        x, replace = _hidden_states(args, kwargs, span[0])
        chunk = split_along_dim(pad_tokens(x, world, count), 1, group)  # [b, ceil(s/p), h]
        setattr(chunk, LAYOUT_MARK, "activation")  # the span's layout, for modules left out
        return replace(chunk)

    def gathered(x: torch.Tensor) -> torch.Tensor:
        return strip_tokens(gather_along_dim(x, 1, group), count)  # [b, s, h]

    def leave(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        if isinstance(output, torch.Tensor):
            return gathered(output)
        if isinstance(getattr(output, "last_hidden_state", None), torch.Tensor):
            output.last_hidden_state = gathered(output.last_hidden_state)
            return output
        if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
            return (gathered(output[0]), *output[1:])
        raise ValueError(
            f"sequence parallelism: {span[1]!r} returned {type(output).__name__}; the end of a "
            "sequence_span must return the hidden states (or a tuple or model output holding "
            "them first)"
        )

    first.register_forward_pre_hook(enter, with_kwargs=True)
    last.register_forward_hook(leave)


#: The attribute of a model whose tokens a :class:`TokenSpan` splits under 'sequence'.
TOKEN_SPAN_ATTRIBUTE = "_tessera_token_span"


class TokenSpan:
    """Whether a ViT's own forward still splits its tokens under 'sequence'.

    ``pipeline_layers`` sets ``staged``: from then on its stages split the tokens (each
    microbatch carrying its own padding mask) and the model's hooks let everything pass;
    calling the model itself is then refused (its blocks would see the whole sequence as
    this rank's chunk).
    """

    def __init__(self) -> None:
        self.staged = False


def split_tokens(x: torch.Tensor, world: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[b, s, h]`` -> this rank's chunk ``[b, (s + pad)/N, h]`` and the keep-mask ``[s + pad]``.

    Tokens that do not divide by the ``world`` ranks are padded at the end with zeros; the mask
    is True on the ``s`` real tokens (every attention masks the others as keys). The split is
    a plain slice: its backward pads this rank's chunk gradient with zeros.
    """
    length = x.shape[1]
    pad = -length % world
    keep = torch.arange(length + pad, device=x.device) < length  # [s + pad]
    x = F.pad(x, (0, 0, 0, pad)) if pad else x  # [b, s + pad, h]
    return x.chunk(world, 1)[rank], keep


def _install_token_span(model: nn.Module, span: tuple[str, str], context: ParallelContext) -> None:
    """Tensor mode 'sequence' for a model that makes its tokens itself (a ViT), or is given them.

    Every rank embeds the whole image (patches, class token, positions); the input of
    ``span[0]`` keeps this rank's chunk of the tokens and the output of ``span[1]`` is
    gathered whole, so the head reads the class token wherever it lives. A features plan's
    model is a span of itself (``("", "")``): its whole input is this rank's chunk inside it,
    and code around it (a part's: :mod:`.parts`) computes on whole tensors on every rank.
    Tokens that do not divide by the ranks (a ViT's N_p + 1) are padded at the end with zeros
    that every attention masks as keys (the model's :class:`KeyPadding`) and that the gather
    drops.

    The gradients follow the convention of the sequence handler (each rank's gradient is N
    times its share; the handler sums over SEQUENCE and divides by N): the split is a plain
    slice (its backward pads this rank's chunk with zeros: the embedding's gradient is this
    rank's tokens' share), and the gather's backward reduce-scatters (every rank's head
    computed the same loss, so each chunk gets N times its gradient).
    """
    group = context.get_group(ParallelMode.SEQUENCE)
    world = context.get_world_size(ParallelMode.SEQUENCE)
    rank = context.get_local_rank(ParallelMode.SEQUENCE)
    first, last = (model.get_submodule(name) for name in span)
    padding = getattr(model, KEY_PADDING_ATTRIBUTE, None)
    tokens = [0]  # the batch in flight's own length, before padding
    state = TokenSpan()
    setattr(model, TOKEN_SPAN_ATTRIBUTE, state)

    def enter(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if state.staged:
            return None  # pipeline stages pass this rank's chunk already
        x, replace = _hidden_states(args, kwargs, span[0])
        batch, length = x.shape[0], x.shape[1]
        if length % world and padding is None:
            raise ValueError(
                f"tensor mode 'sequence': the {length} tokens of {list(x.shape)} do not "
                f"divide by {world} ranks, and no attention converted by parallelize can mask "
                "padding"
            )
        tokens[0] = length
        chunk, keep = split_tokens(x, world, rank)  # [b, (s + pad)/N, h], [s + pad]
        if padding is not None:  # zero tokens at the end, masked as keys, dropped at the end
            padded = keep.shape[0] > length
            padding.set(keep.expand(batch, -1).chunk(world, 1)[rank] if padded else None)
        setattr(chunk, LAYOUT_MARK, "activation")  # the span's layout, for modules left out
        return replace(chunk)

    def leave(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        if state.staged:
            return None
        if not isinstance(output, torch.Tensor):
            raise ValueError(
                f"tensor mode 'sequence': {span[1] or type(model).__name__!r} returned "
                f"{type(output).__name__}; the end of a sequence_span of an image model (or a "
                "features plan's model) must return the hidden states"
            )
        whole = gather_along_dim(output, 1, group, partial_grad=True)  # [b, s + pad, h]
        return whole[:, : tokens[0]]  # [b, s, h]

    first.register_forward_pre_hook(enter, with_kwargs=True)
    last.register_forward_hook(leave)


#: ``"mean"``: the mean over the batch's tokens; ``"sum_and_count"``: the pair
#: ``(loss_sum, num_tokens)`` an engine with ``per_token_loss=True`` weighs globally.
Reduction = Literal["mean", "sum_and_count"]


@overload
def causal_lm_loss(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    *,
    ignore_index: int = -100,
    reduction: Literal["mean"] = "mean",
    vocab_size: int | None = None,
    context: ParallelContext | None = None,
) -> torch.Tensor: ...


@overload
def causal_lm_loss(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    *,
    ignore_index: int = -100,
    reduction: Literal["sum_and_count"],
    vocab_size: int | None = None,
    context: ParallelContext | None = None,
) -> tuple[torch.Tensor, torch.Tensor]: ...


def causal_lm_loss(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    *,
    ignore_index: int = -100,
    reduction: Reduction = "mean",
    vocab_size: int | None = None,
    context: ParallelContext | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Next-token cross-entropy of a parallelized language model, from its split logits.

    The targets are ``input_ids`` shifted by one (as transformers' causal LM loss), shifted
    *before* any split, so the last token of a block predicts the first of the next; the last
    position predicts nothing. See :func:`token_loss`.

    Args:
        logits: The model's logits (see :func:`token_loss`).
        input_ids: The whole batch of token ids ``[b, s]``, as given to the model.
        ignore_index: Targets that count for nothing.
        reduction: ``"mean"``, or ``"sum_and_count"`` (see :func:`token_loss`).
        vocab_size: The whole vocabulary's size (see :func:`token_loss`).
        context: The ParallelContext (default the current one).
    """
    pad = torch.full_like(input_ids[:, :1], ignore_index)
    targets = torch.cat([input_ids[:, 1:], pad], 1)  # [b, s]: position i predicts token i+1
    if reduction == "sum_and_count":
        return token_loss(
            logits,
            targets,
            ignore_index=ignore_index,
            reduction=reduction,
            vocab_size=vocab_size,
            context=context,
        )
    return token_loss(
        logits, targets, ignore_index=ignore_index, vocab_size=vocab_size, context=context
    )


@overload
def token_loss(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    ignore_index: int = -100,
    reduction: Literal["mean"] = "mean",
    vocab_size: int | None = None,
    context: ParallelContext | None = None,
) -> torch.Tensor: ...


@overload
def token_loss(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    ignore_index: int = -100,
    reduction: Literal["sum_and_count"],
    vocab_size: int | None = None,
    context: ParallelContext | None = None,
) -> tuple[torch.Tensor, torch.Tensor]: ...


def token_loss(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    ignore_index: int = -100,
    reduction: Reduction = "mean",
    vocab_size: int | None = None,
    context: ParallelContext | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Mean cross-entropy over every non-ignored target of the whole batch, from split logits.

    For a masked language model (BERT's labels: ``ignore_index`` where nothing is predicted),
    an image classifier (one target per image: logits ``[b, C]``) and, through
    :func:`causal_lm_loss`, a causal language model. The targets are split here as the mode
    split the logits; the value is the same on every tensor rank.

    Args:
        logits: ``[b, s, V]`` without tensor parallelism, ``[b, s, V/p]`` (split by
            vocabulary) in 1D, ``[b/(depth q), s, V]`` in 2D/2.5D, ``[b/q^2, s, V]`` in 3D,
            ``[b, s/N, V]`` under ``'sequence'`` (an image classifier's ``[b, C]`` whole
            there: it read the gathered class token).
        targets: The whole batch's target ids, aligned with the logits' leading dims
            (``[b, s]``, or ``[b]`` for one class per sample).
        ignore_index: Targets that count for nothing.
        reduction: ``"mean"``: the mean over the batch's non-ignored targets.
            ``"sum_and_count"``: ``(loss_sum, num_tokens)`` of the whole batch, the same on
            every tensor rank, for an engine with ``per_token_loss=True``, which weighs every
            token of the global step alike however data ranks, microbatches and accumulation
            steps cut it (``tessera.engine``'s ``token_weighting.py``). Not under
            ``'sequence'``, whose mean already spans its ranks' tokens.
        vocab_size: The whole vocabulary's size. Under 1D it tells whole logits ``[b, s, V]``
            (a model whose head was not converted, or :func:`gather_logits`'s), which then get
            the plain cross-entropy, from a slice; without it, logits that lost the head's
            mark (scaled or capped after the head) are checked on the loss's own all-reduce
            and whole ones are an error (see ``vocab_parallel_cross_entropy``).
        context: The ParallelContext (default the current one).

    Raises:
        ValueError: ``logits`` and the rank's targets disagree in batch or sequence length,
            or ``reduction`` is unknown or ``"sum_and_count"`` under ``'sequence'``.
        ModeNotImplementedError: the mode has no parallelized language models.
    """
    ctx = current_or_none(context)
    mode = tensor_mode(ctx)
    if reduction not in ("mean", "sum_and_count"):
        raise ValueError(
            f"token_loss: reduction must be 'mean' or 'sum_and_count', got {reduction!r}"
        )
    if reduction == "sum_and_count":
        kind = None if ctx is None else ctx.config.mode
        if kind is not None and kind.token_loss_spans_ranks:
            raise ValueError(
                "token_loss: reduction='sum_and_count' is not supported under tensor mode "
                f"{mode!r} (its mean already spans every token of the sequence ranks)"
            )
        count = (targets != ignore_index).sum()  # the whole batch's: alike on every tensor rank
        total = _cross_entropy(logits, targets, ignore_index, "sum", ctx, mode, vocab_size)
        return total, count
    return _cross_entropy(logits, targets, ignore_index, "mean", ctx, mode, vocab_size)


def _cross_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int,
    reduction: str,
    ctx: ParallelContext | None,
    mode: str | None,
    vocab_size: int | None = None,
) -> torch.Tensor:
    """The whole batch's ``"mean"`` or ``"sum"`` cross-entropy, from this rank's logits."""
    logits = local_logits(logits)  # read as laid out: tessera's own loss
    if ctx is None or mode is None:
        check_targets(logits, targets, mode)
        return F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]),
            targets.reshape(-1),
            ignore_index=ignore_index,
            reduction=reduction,
        )
    layers = find_mode_layers(mode)
    if layers is None or layers.token_loss is None:
        raise ModeNotImplementedError("token_loss", mode, _modes_with("token_loss"))
    return layers.token_loss(logits, targets, ignore_index, reduction, ctx, vocab_size)


def _modes_with(facet: str) -> list[str]:
    """The modes whose ``ModeLayers`` have ``facet`` (for a message)."""
    return [name for name, layers in MODE_LAYERS.items() if getattr(layers, facet) is not None]


def gather_logits(logits: torch.Tensor, *, context: ParallelContext | None = None) -> torch.Tensor:
    """The whole batch's logits ``[b, ..., V]`` on every rank, from a parallelized model's.

    For evaluation, sampling or inspection; the losses (:func:`causal_lm_loss`,
    :func:`token_loss`) never need it. No gradient flows back through it.

    Args:
        logits: As the model returns them (see :func:`token_loss`): split by vocabulary in 1D,
            by batch rows in 2D/2.5D/3D, by tokens under ``'sequence'``.
        context: The ParallelContext (default the current one).
    """
    ctx = current_or_none(context)
    mode = tensor_mode(ctx)
    with torch.no_grad():
        if ctx is None or mode is None:
            return logits.detach()
        layers = find_mode_layers(mode)
        if layers is None or layers.gather_logits is None:
            raise ModeNotImplementedError("gather_logits", mode, _modes_with("gather_logits"))
        detached = local_logits(logits).detach()
        tokens = getattr(logits, TOKENS_BEFORE_PADDING, None)  # 'sequence' padded them
        if tokens is not None:
            setattr(detached, TOKENS_BEFORE_PADDING, tokens)
        return layers.gather_logits(detached, ctx)
