"""Encoder-decoders (T5, BART): two token streams, a bias on the logits, an encoder on its own.

An encoder-decoder takes two streams of token ids: ``input_ids`` for the encoder and
``decoder_input_ids`` (or ``labels``, shifted right by the model) for the decoder, whose
cross-attention reads the encoder's output, a sequence of its own length. Under 1D both
streams are whole on every rank; on the mesh and the cube the boundary keeps this rank's rows
of both (``decoder_input_ids`` and ``decoder_attention_mask`` beside ``input_ids`` and
``attention_mask``, :data:`~.boundary.BATCH_KWARGS`), so the encoder's output holds the rows
the decoder's queries do, in the layout any activation has there.

Two things happen outside the model's forward, installed here:

* ``generate()`` runs the encoder once on its own (``model.get_encoder()``), then feeds its
  output back through ``encoder_outputs`` at each step. Where the mode splits the batch the
  encoder's ids and mask are split when it is called on its own (:func:`install_encoder_rows`);
  its output stays in the mode's layout, which is what the decoder reads.
* BART adds ``final_logits_bias`` ``[1, V]`` to its logits. Under 1D they are this rank's
  slice of the vocabulary, so the buffer becomes its slice too (marked with its
  ``ShardInfo``, so the whole buffer is gathered and loaded as any split tensor); on the mesh
  and the cube every rank's logits hold the whole vocabulary for its rows, and the buffer
  stays whole (:func:`split_logits_bias`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tessera.context import ParallelContext, ParallelMode, set_shard_info

from ..comm.collectives import check_divisible
from ..shared.shards import shard_info
from .plan import Plan

__all__ = ["ENCODER_CALLED_ATTR", "install_encoder_rows", "split_logits_bias"]

#: Set on the encoder while the model's own forward runs (its input is split already).
ENCODER_CALLED_ATTR = "_tessera_inside_model"


def split_logits_bias(model: nn.Module, plan: Plan, context: ParallelContext) -> None:
    """Under 1D: each buffer of ``plan.logits_bias`` becomes this rank's vocabulary slice.

    Raises:
        ValueError: a buffer is not ``[1, V]``, or ``V`` does not divide by the ranks.
    """
    world = context.get_world_size(ParallelMode.PARALLEL_1D)
    rank = context.get_local_rank(ParallelMode.PARALLEL_1D)
    for name in plan.logits_bias:
        owner_name, _, attr = name.rpartition(".")
        owner = model.get_submodule(owner_name) if owner_name else model
        whole = owner._buffers.get(attr)
        if not isinstance(whole, torch.Tensor) or whole.dim() != 2 or whole.shape[0] != 1:
            shape = list(whole.shape) if isinstance(whole, torch.Tensor) else None
            raise ValueError(
                f"parallelize: the {plan.name} names {name!r} a bias [1, V] added to the logits, "
                f"but {type(model).__name__} holds {shape} there"
            )
        vocab = whole.shape[1]
        check_divisible(vocab, world, f"parallelize: {name} [1, {vocab}] (vocabulary)")
        mine = whole.chunk(world, 1)[rank].clone()  # [1, V/p], the head's rows of the vocabulary
        info = shard_info(
            context, (1, vocab), splits={1: (ParallelMode.PARALLEL_1D.value,)}, owner=name
        )
        set_shard_info(mine, info)
        owner._buffers[attr] = mine


def install_encoder_rows(model: nn.Module, plan: Plan, context: ParallelContext) -> None:
    """Where the mode splits the batch: the encoder called on its own gets this rank's rows.

    The model's forward keeps this rank's rows of its inputs before its encoder runs; called on
    its own (``generate()`` does, once per call) the encoder gets the whole batch, and its ids
    and mask are split here as the boundary would have. While the model's own forward runs, a
    flag on the encoder says its input is split already.
    """
    from .boundary import rank_rows

    assert plan.encoder is not None

    def inside(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        setattr(module.get_submodule(plan.encoder or ""), ENCODER_CALLED_ATTR, True)

    def outside(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        setattr(module.get_submodule(plan.encoder or ""), ENCODER_CALLED_ATTR, False)

    def rows(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if getattr(module, ENCODER_CALLED_ATTR, False):
            return None
        if kwargs.get("inputs_embeds") is not None:
            raise ValueError(
                f"{type(module).__name__} called on its own takes input_ids, not inputs_embeds "
                "(the embedding makes the mode's layout)"
            )
        args = tuple(
            rank_rows("input_ids", a, context) if i == 0 else a for i, a in enumerate(args)
        )
        for key in ("input_ids", "attention_mask"):
            if key in kwargs:
                kwargs[key] = rank_rows(key, kwargs[key], context)
        return args, kwargs

    model.register_forward_pre_hook(inside, with_kwargs=True)
    model.register_forward_hook(outside, always_call=True)
    model.get_submodule(plan.encoder).register_forward_pre_hook(rows, with_kwargs=True)
    model.register_forward_hook(_whole_encoder_output(context))


def _whole_encoder_output(context: ParallelContext) -> Any:
    """A hook giving the model's output its ``encoder_last_hidden_state`` whole.

    The encoder's output is in the mode's blocks (``[b/B, s, h/q]``) for the decoder's
    cross-attention; what the model returns is for its caller (a pooled sentence embedding,
    an auxiliary loss), who reads ``[b, s, h]`` as on one process. Not while ``generate()``
    runs: it reads none of it, and each step would gather it again.
    """
    from ..dispatch.activations import gather_activation
    from .generation import GENERATING_ATTR

    def whole(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        value = getattr(output, "encoder_last_hidden_state", None)
        if isinstance(value, torch.Tensor) and not getattr(module, GENERATING_ATTR, False):
            output.encoder_last_hidden_state = gather_activation(value, context)  # [b, s, h]
        return output

    return whole
