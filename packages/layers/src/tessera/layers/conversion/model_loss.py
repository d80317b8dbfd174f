"""``model(input_ids, labels=...)`` of a parallelized transformers model: its own loss, right.

transformers' language models compute their loss inside the forward, through the model's
``loss_function`` (``ForCausalLMLoss``, ``ForMaskedLMLoss``), which flattens the logits to
``[-1, vocab_size]``: on split logits that is an error or a wrong number. ``parallelize`` sets
the model's ``loss_function`` to tessera's (:func:`~.boundary.causal_lm_loss`,
:func:`~.boundary.token_loss`), which reads the logits as the mode split them and the labels
whole, so ``model(ids, labels=ids).loss`` is the single-process loss on every tensor rank, and
so is everything built on it (transformers' ``Trainer``, whose gradient accumulation passes
``num_items_in_batch``: the loss is then the sum over the batch's labels divided by it).
Models whose loss is of another kind (a classifier's) keep refusing ``labels``.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from tessera.context import ParallelContext

__all__ = ["LOSS_KINDS", "MODEL_LOSS_ATTR", "install_model_loss"]

#: The attribute of a model whose ``loss_function`` is tessera's.
MODEL_LOSS_ATTR = "_tessera_model_loss"
#: transformers' ``loss_type`` values tessera computes on split logits.
LOSS_KINDS = ("ForCausalLM", "ForMaskedLM")


class SplitLogitsLoss:
    """The model's ``loss_function``, computed from the mode's split logits (picklable).

    Args:
        kind: ``"ForCausalLM"`` (labels shifted by one, as transformers') or ``"ForMaskedLM"``.
        context: The model's ParallelContext.
    """

    def __init__(self, kind: str, context: ParallelContext) -> None:
        self.kind, self.context = kind, context

    def __call__(
        self,
        logits: torch.Tensor,
        labels: torch.Tensor,
        vocab_size: int | None = None,
        num_items_in_batch: torch.Tensor | int | None = None,
        ignore_index: int = -100,
        shift_labels: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        """Transformers' loss signature; ``logits`` as the model returns them, labels whole."""
        from .boundary import token_loss

        targets = labels
        if self.kind == "ForCausalLM":
            if shift_labels is not None:
                targets = shift_labels
            else:
                pad = torch.full_like(labels[:, :1], ignore_index)
                targets = torch.cat([labels[:, 1:], pad], 1)  # [b, s]: i predicts i + 1
        loss = token_loss(
            logits, targets, ignore_index=ignore_index, vocab_size=vocab_size, context=self.context
        )
        if num_items_in_batch is None:
            return loss
        count = (targets != ignore_index).sum()  # the whole batch's, on every tensor rank
        return loss * count / num_items_in_batch  # the sum over the batch / num_items_in_batch


def _forward_calls_loss_function(model: nn.Module) -> bool:
    """Whether the class's forward computes its loss through ``self.loss_function``.

    Some classes still build ``nn.CrossEntropyLoss()`` inline (``BertForMaskedLM``), which no
    attribute reaches: they keep refusing ``labels``. Read from the forward's source; a class
    whose source cannot be read is taken not to.
    """
    try:
        source = inspect.getsource(type(model).forward)
    except (OSError, TypeError):
        return False
    return "self.loss_function(" in source


def install_model_loss(model: nn.Module, context: ParallelContext) -> bool:
    """Set ``model.loss_function`` to tessera's where transformers lets it be set.

    Returns:
        Whether it was set: a model of another loss kind, or a transformers release without a
        settable ``loss_function``, keeps refusing ``labels`` at the boundary.
    """
    # transformers falls back to the causal LM loss where a class name says no kind
    # (GPT2LMHeadModel)
    kind = getattr(model, "loss_type", None) or "ForCausalLM"
    prop = getattr(type(model), "loss_function", None)
    if kind not in LOSS_KINDS or not isinstance(prop, property) or prop.fset is None:
        return False
    if not _forward_calls_loss_function(model):  # BERT's masked LM builds its own criterion
        return False
    setattr(model, "loss_function", SplitLogitsLoss(kind, context))  # noqa: B010
    setattr(model, MODEL_LOSS_ATTR, True)
    return True
