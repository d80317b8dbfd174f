"""A model's optional outputs, every layer's hidden states and attention weights: whole or refused.

``output_hidden_states=True`` returns the hidden states between every two blocks, and
``output_attentions=True`` every attention's weights ``[b, heads, q, k]``. The boundary gathers
what a model returns as its result (logits, ``last_hidden_state``), but these come from inside
the blocks, in the layout the mode keeps there: mesh blocks ``[b/q, s, h/q]`` under 2D, 2.5D
and 3D, chunks of the tokens ``[b, s/N, h]`` under ``'sequence'`` and 1D sequence parallelism,
a rank's heads ``[b, heads/p, q, k]`` under 1D. Handed on as they are, a probe, a
distillation loss or a pooled embedding of a middle layer reads a block as the whole tensor
(a cosine similarity of two blocks is a number, the wrong one) without an error.

So a forward hook on the model gathers each hidden state whole (the mode's activation gather;
a token chunk's padding stripped), and under 1D each attention's weights by heads, their
backward the gathers' own. Attention weights are refused where they are not a rank's heads of
whole rows: the grids split them by rows and heads, and ``'sequence'``'s ring or all-to-all
never forms them (transformers would return an empty tuple). A model returning a plain tuple
(``return_dict=False``) is refused where its hidden states would be split: its fields cannot
be told apart by position.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from tessera.context import ParallelContext, ParallelMode, TensorMode

from ..comm.ops import gather_along_dim
from ..dispatch.activations import gather_activation
from .token_padding import TokenCount, strip_tokens

__all__ = ["install_whole_output_fields"]

#: The fields of transformers' outputs holding one hidden state per layer.
HIDDEN_FIELDS = ("hidden_states", "encoder_hidden_states", "decoder_hidden_states")
#: The fields holding one attention's weights ``[b, heads, q, k]`` per layer.
ATTENTION_FIELDS = ("attentions", "encoder_attentions", "decoder_attentions", "cross_attentions")


def install_whole_output_fields(
    model: nn.Module,
    context: ParallelContext,
    mode: str,
    sequence_parallel: bool,
    count: TokenCount | None,
) -> None:
    """Gather ``model``'s per-layer hidden states and attention weights whole (module doc).

    Args:
        model: The converted model.
        context: The ParallelContext.
        mode: Its tensor mode's name (for messages).
        sequence_parallel: 1D sequence parallelism splits the tokens inside the span.
        count: The length of the sequence before the padding the tokens' split adds (``None``
            where no tokens are split).
    """
    kind = context.config.mode
    assert kind is not None
    hidden = _hidden_gather(kind, context, sequence_parallel, count)
    heads = _heads_gather(kind, context)
    layout = f"tensor mode {mode!r}" + (" with sequence_parallel" if sequence_parallel else "")

    split = {"output_hidden_states": hidden is not None, "output_attentions": True}

    def refuse_tuples(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        asked = [key for key, splits in split.items() if splits and kwargs.get(key)]
        if asked and kwargs.get("return_dict") is False:
            raise ValueError(
                f"{type(module).__name__} under {layout}: {asked[0]}=True with "
                "return_dict=False; its per-layer outputs are split here and are gathered "
                "from the fields of its output: call it with return_dict=True"
            )

    def whole(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        for field in HIDDEN_FIELDS:
            states = getattr(output, field, None)
            if isinstance(states, tuple) and hidden is not None:
                setattr(output, field, tuple(_each(hidden, states)))
        for field in ATTENTION_FIELDS:
            weights = getattr(output, field, None)
            if weights is None:
                continue
            if heads is None:
                raise ValueError(
                    f"{type(module).__name__} under {layout} was asked for its attention "
                    f"weights ({field}): here attention splits them by rows and heads, or "
                    "never forms them (the ring, all-to-all attention), so they cannot come "
                    "back as one process's; ask for them under tensor mode '1d' (gathered by "
                    "heads), or from the model on one process"
                )
            setattr(output, field, tuple(_each(heads, weights)))
        return output

    model.register_forward_pre_hook(refuse_tuples, with_kwargs=True)
    model.register_forward_hook(whole)


def _each(gather: Callable[[torch.Tensor], torch.Tensor], values: tuple[Any, ...]) -> list[Any]:
    return [gather(v) if isinstance(v, torch.Tensor) else v for v in values]


def _hidden_gather(
    kind: TensorMode,
    context: ParallelContext,
    sequence_parallel: bool,
    count: TokenCount | None,
) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The gather of one hidden state ``[b, s, h]`` from the layout between blocks.

    ``None``: whole already (1D's).
    """
    if kind.splits_sequence or sequence_parallel:  # [b, s/N, h], padded to equal chunks
        axis = ParallelMode.SEQUENCE if kind.splits_sequence else ParallelMode.PARALLEL_1D
        group = context.get_group(axis)
        # 'sequence': every rank computes with the whole tensor, so a chunk's gradient is N
        # times its share, the sequence handler's convention (as the boundary's gather)
        partial = kind.splits_sequence
        padding = count if count is not None else TokenCount()

        def tokens(x: torch.Tensor) -> torch.Tensor:
            if padding.tokens is None:  # an image model's span: its length is not recorded
                raise ValueError(
                    "output_hidden_states under tensor mode 'sequence': the hidden states of "
                    "an image model's span are chunks of its tokens whose whole length the "
                    "boundary does not record, so they cannot be gathered; read the model's "
                    "last_hidden_state, or ask for them under another mode"
                )
            if x.dim() < 3 or x.shape[1] == padding.tokens:
                return x  # gathered already (after a span's end) or not a token tensor
            return strip_tokens(gather_along_dim(x, 1, group, partial_grad=partial), padding)

        return tokens
    if kind.replicated_activations:
        return None

    def blocks(x: torch.Tensor) -> torch.Tensor:
        return gather_activation(x, context)  # [b, s, h] from [b/q, s, h/q]

    return blocks


def _heads_gather(
    kind: TensorMode, context: ParallelContext
) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The gather of one attention's weights ``[b, heads/p, q, k]`` by heads.

    Where attention holds a rank's heads of whole rows (1D, with or without sequence
    parallelism); ``None`` elsewhere.
    """
    if not kind.replicated_activations or kind.splits_sequence:
        return None
    group = context.get_group(ParallelMode.PARALLEL_1D)

    def heads(x: torch.Tensor) -> torch.Tensor:
        return gather_along_dim(x, 1, group)  # [b, heads, q, k]

    return heads
