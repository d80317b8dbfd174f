"""A parallelized transformers language model as a sequence of layers, for pipeline stages.

A pipeline (``tessera.pipeline.build_pipeline_model``) cuts a model given as a sequence of
layers, each taking and returning one tensor. transformers' models are one ``forward`` that
also computes positions, masks and rotary embeddings, so :func:`pipeline_layers` re-states a
Llama as ``[embed, layer 0, ..., layer N-1, head]``: the embedding takes the token ids (and
applies the model's boundary: this rank's rows where the mode splits the batch), each decoder
layer recomputes what it needs from its input's length (positions from 0, the causal mask, the
rotary embedding), and the head is the final norm and the vocabulary projection. The layers
hold the model's own modules, so the parameters are the same tensors; :func:`original_names`
maps the sequence's names back to the model's for full state dicts.

Tensor modes: 1D without sequence parallelism, 2D, 2.5D and 3D (the activations between
stages are the mode's blocks, the same shape on every stage).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tessera.context import ParallelContext

from ..activations import split_batch
from .api import CONTEXT_ATTR
from .dropout import fork_each_layer

__all__ = ["original_names", "pipeline_layers"]

#: The modes whose activations between stages keep the same layout and length everywhere.
STAGE_MODES = (None, "1d", "2d", "2.5d", "3d")


class EmbedStage(nn.Module):
    """Token ids ``[b, s]`` (the whole batch) -> the first layer's input, in the mode's layout."""

    def __init__(self, embed_tokens: nn.Module, context: ParallelContext | None) -> None:
        super().__init__()
        self.embed_tokens = embed_tokens
        self._context = [context]  # not a module attribute torch would traverse

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[b, s]`` -> ``[b', s, h']``."""
        context = self._context[0]
        if context is not None and context.config.tensor_mode not in (None, "1d"):
            input_ids = split_batch(input_ids, context)  # this rank's rows
        out: torch.Tensor = self.embed_tokens(input_ids)
        return out


class DecoderStage(nn.Module):
    """One decoder layer: its positions, causal mask and rotary embedding from its input."""

    def __init__(self, layer: nn.Module, rotary: nn.Module, config: Any) -> None:
        super().__init__()
        self.layer = layer
        self._rotary = [rotary]  # shared by every layer, holds no parameters
        self._config = config

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[b', s, h']`` -> ``[b', s, h']``."""
        from transformers.masking_utils import create_causal_mask

        positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)  # [1, s]
        mask = create_causal_mask(
            config=self._config,
            inputs_embeds=hidden,
            attention_mask=None,
            cache=None,
            position_ids=positions,
        )
        rotary = self._rotary[0](hidden, position_ids=positions)
        out = self.layer(
            hidden, attention_mask=mask, position_ids=positions, position_embeddings=rotary
        )
        result: torch.Tensor = out[0] if isinstance(out, tuple) else out
        return result


class HeadStage(nn.Module):
    """The final norm and the vocabulary projection: ``[b', s, h']`` -> logits."""

    def __init__(self, norm: nn.Module, lm_head: nn.Module) -> None:
        super().__init__()
        self.norm = norm
        self.lm_head = lm_head

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits as the parallelized model returns them (see ``causal_lm_loss``)."""
        out: torch.Tensor = self.lm_head(self.norm(hidden))
        return out


def pipeline_layers(model: nn.Module, *, context: ParallelContext | None = None) -> nn.Sequential:
    """``model`` (a transformers ``LlamaForCausalLM``, parallelized or not) as layers.

    Args:
        model: The model; ``parallelize`` it first for tensor parallelism.
        context: The ParallelContext (default: the model's, from ``parallelize``, else none).

    Raises:
        TypeError: the model is not a Llama-style causal LM (``model.embed_tokens``,
            ``model.layers``, ``model.norm``, ``model.rotary_emb``, ``lm_head``).
        ValueError: its head is tied to its embedding (stages would each hold a copy), or the
            tensor mode's activations change length inside the model (1D sequence
            parallelism, 'sequence').
    """
    inner = getattr(model, "model", None)
    lm_head = getattr(model, "lm_head", None)
    needed = ("embed_tokens", "layers", "norm", "rotary_emb")
    if (
        not isinstance(inner, nn.Module)
        or not isinstance(lm_head, nn.Module)
        or not all(hasattr(inner, a) for a in needed)
    ):
        raise TypeError(
            f"pipeline_layers takes a Llama-style causal language model (model.embed_tokens, "
            f"model.layers, model.norm, model.rotary_emb, lm_head); got {type(model).__name__}"
        )
    if getattr(lm_head, "weight", None) is getattr(inner.embed_tokens, "weight", 0):
        raise ValueError(
            "pipeline_layers: the head is tied to the token embedding, and the first and last "
            "stages would each hold a copy; build the model with tie_word_embeddings=False"
        )
    ctx = context if context is not None else _context_of(model)
    mode = None if ctx is None else ctx.config.tensor_mode
    sequence_parallel = ctx is not None and bool(ctx.config.tensor_args.get("sequence_parallel"))
    if mode not in STAGE_MODES or sequence_parallel:
        what = "1d with sequence_parallel" if sequence_parallel else repr(mode)
        raise ValueError(
            f"pipeline_layers: under tensor mode {what} the activations between layers are "
            "split along the sequence, which the pipeline stages cannot carry yet; use 1d "
            "(without sequence_parallel), 2d, 2.5d or 3d"
        )
    embed, blocks, norm, rotary = (inner.get_submodule(a) for a in needed)
    assert isinstance(blocks, nn.ModuleList), "model.layers must be an nn.ModuleList"
    layers: list[tuple[str, nn.Module]] = [("embed", EmbedStage(embed, ctx))]
    layers += [
        (f"layer{i}", DecoderStage(layer, rotary, getattr(inner, "config", None)))
        for i, layer in enumerate(blocks)
    ]
    layers.append(("head", HeadStage(norm, lm_head)))
    from collections import OrderedDict

    sequential = nn.Sequential(OrderedDict(layers))
    fork_each_layer(model, sequential)  # dropout on split activations: a mask per rank
    return sequential


def _context_of(model: nn.Module) -> ParallelContext | None:
    """The context ``parallelize`` converted ``model`` for (``None``: not parallelized)."""
    ctx = getattr(model, CONTEXT_ATTR, None)
    return ctx if isinstance(ctx, ParallelContext) else None


def original_names(layers: nn.Module, model: nn.Module) -> dict[str, str]:
    """``{name in layers (or a stage of them): name in model}`` of every parameter and buffer."""
    by_id: dict[int, str] = {}
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        by_id.setdefault(id(tensor), name)
    state = layers.state_dict(keep_vars=True)
    return {name: by_id[id(t)] for name, t in state.items() if id(t) in by_id}
