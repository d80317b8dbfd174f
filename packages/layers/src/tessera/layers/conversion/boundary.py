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

Language-model logits stay split (by vocabulary in 1D, by batch on the mesh) and
:func:`causal_lm_loss` computes the loss from them without gathering.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tessera.context import ParallelContext, ParallelMode

from ..activations import gather_activation, split_activation, split_batch
from ..collectives import check_divisible
from ..comm import gather_along_dim, split_along_dim
from ..context_access import current_or_none, tensor_mode
from ..cross_entropy import vocab_parallel_cross_entropy
from ..errors import ModeNotImplementedError
from ..loss_2d import CrossEntropyLoss2D, CrossEntropyLoss2p5D
from ..loss_3d import CrossEntropyLoss3D
from .plan import Plan

__all__ = ["causal_lm_loss", "install_boundary"]

#: Keyword inputs of transformers' models that hold one row per sample.
BATCH_KWARGS = ("input_ids", "attention_mask", "token_type_ids")


def _split_rows(name: str, value: Any, context: ParallelContext) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    if name == "position_ids" and value.shape[0] == 1:
        return value  # one row of positions, broadcast over the batch
    return split_batch(value, context)


def install_boundary(
    model: nn.Module, plan: Plan, context: ParallelContext, mode: str, sequence_parallel: bool
) -> None:
    """Register the boundary hooks of ``plan`` on ``model`` (see the module docstring)."""
    splits_batch = mode != "1d"

    def before(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if plan.causal_lm and kwargs.get("labels") is not None:
            raise ValueError(
                f"{type(module).__name__} parallelized under tensor mode {mode!r}: its own loss "
                "(labels=...) assumes whole logits; call it without labels and use "
                "tessera.layers.causal_lm_loss(output.logits, input_ids)"
            )
        if plan.boundary == "features":
            if not args or not isinstance(args[0], torch.Tensor):
                raise ValueError(
                    f"{type(module).__name__}: a 'features' plan takes the activation as the "
                    "first positional argument"
                )
            return (split_activation(args[0], context), *args[1:]), kwargs
        if not splits_batch:
            return None
        if kwargs.get("inputs_embeds") is not None:
            raise ValueError(
                f"{type(module).__name__} under tensor mode {mode!r} takes input_ids, not "
                "inputs_embeds (the embedding makes the mode's layout)"
            )
        args = tuple(
            _split_rows("input_ids", a, context) if i == 0 else a for i, a in enumerate(args)
        )
        for key in (*BATCH_KWARGS, "position_ids"):
            if key in kwargs:
                kwargs[key] = _split_rows(key, kwargs[key], context)
        return args, kwargs

    model.register_forward_pre_hook(before, with_kwargs=True)
    if plan.boundary == "features":

        def after(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
            return (
                gather_activation(output, context) if isinstance(output, torch.Tensor) else output
            )

        model.register_forward_hook(after)
    if sequence_parallel and plan.sequence_span is not None:
        _install_sequence_span(model, plan.sequence_span, context)


def _install_sequence_span(
    model: nn.Module, span: tuple[str, str], context: ParallelContext
) -> None:
    """Split the sequence at the input of ``span[0]``, gather it at the output of ``span[1]``."""
    group = context.get_group(ParallelMode.PARALLEL_1D)
    world = context.get_world_size(ParallelMode.PARALLEL_1D)
    first, last = (model.get_submodule(name) for name in span)

    def enter(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        key = "hidden_states"
        x = args[0] if args else kwargs.get(key)
        if not isinstance(x, torch.Tensor) or x.dim() < 3:
            raise ValueError(
                f"sequence parallelism: {span[0]!r} must take [batch, seq, hidden] as its first "
                f"argument, got {type(x).__name__}"
            )
        check_divisible(
            x.shape[1], world, f"sequence parallelism: dim 1 (sequence) of {list(x.shape)}"
        )
        local = split_along_dim(x, 1, group)  # [b, s/p, h]
        if args:
            return (local, *args[1:]), kwargs
        kwargs[key] = local
        return args, kwargs

    def leave(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        return gather_along_dim(output, 1, group)  # [b, s, h]

    first.register_forward_pre_hook(enter, with_kwargs=True)
    last.register_forward_hook(leave)


def causal_lm_loss(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    *,
    ignore_index: int = -100,
    context: ParallelContext | None = None,
) -> torch.Tensor:
    """Next-token cross-entropy of a parallelized language model, from its split logits.

    The targets are ``input_ids`` shifted by one (as transformers' causal LM loss), shifted
    *before* any split so no target crosses a block boundary; the loss is the mean over every
    predicted token of the whole batch, the same on every tensor rank.

    Args:
        logits: The model's logits: ``[b, s, V]`` without tensor parallelism, ``[b, s, V/p]``
            (split by vocabulary) in 1D, ``[b/(depth q), s, V]`` in 2D/2.5D, ``[b/q^2, s, V]``
            in 3D.
        input_ids: The whole batch of token ids ``[b, s]``, as given to the model.
        ignore_index: Targets that count for nothing.
        context: The ParallelContext (default the current one).

    Raises:
        ValueError: ``logits`` and ``input_ids`` disagree in batch or sequence length.
        ModeNotImplementedError: the mode has no parallelized language models yet.
    """
    ctx = current_or_none(context)
    mode = tensor_mode(ctx)
    targets = input_ids
    if ctx is not None and mode in ("2d", "2.5d", "3d"):
        targets = split_batch(input_ids, ctx)
    if tuple(logits.shape[:2]) != tuple(targets.shape):
        raise ValueError(
            f"causal_lm_loss under tensor mode {mode!r}: logits {list(logits.shape)} do not "
            f"match the ids {list(targets.shape)} of this rank (pass the whole batch of ids)"
        )
    shifted, targets = logits[:, :-1], targets[:, 1:]  # [b', s-1, V'], [b', s-1]
    if ctx is None or mode is None:
        return F.cross_entropy(
            shifted.reshape(-1, shifted.shape[-1]), targets.reshape(-1), ignore_index=ignore_index
        )
    if mode == "1d":
        return vocab_parallel_cross_entropy(
            shifted,
            targets,
            ctx.get_group(ParallelMode.PARALLEL_1D),
            ignore_index=ignore_index,
            reduction="mean",
        )
    losses = {"2d": CrossEntropyLoss2D, "2.5d": CrossEntropyLoss2p5D, "3d": CrossEntropyLoss3D}
    if mode in losses:
        loss: torch.Tensor = losses[mode](ignore_index=ignore_index, context=ctx)(shifted, targets)
        return loss
    raise ModeNotImplementedError("causal_lm_loss", mode, ("1d", *losses))
