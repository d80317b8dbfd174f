"""``model(input_ids, labels=...)`` of a parallelized transformers model: its own loss, right.

transformers' language models compute their loss inside the forward, through the model's
``loss_function`` (``ForCausalLMLoss``, ``ForMaskedLMLoss``), which flattens the logits to
``[-1, vocab_size]``: on split logits that is an error or a wrong number. ``parallelize`` sets
the model's ``loss_function`` to tessera's (:func:`~.boundary.causal_lm_loss`,
:func:`~.boundary.token_loss`), which reads the logits as the mode split them and the labels
whole, so ``model(ids, labels=ids).loss`` is the single-process loss on every tensor rank, and
so is everything built on it (transformers' ``Trainer``, whose gradient accumulation passes
``num_items_in_batch``: the loss is then the sum over the batch's labels divided by it).

Some classes compute their loss where no attribute reaches it: ``BertForMaskedLM`` and the
sequence classifiers build ``nn.CrossEntropyLoss()`` inline, and an image classifier's
``loss_function`` (``ForImageClassification``) reads ``[b, C]`` logits whole. For those the
loss moves to the model's boundary (:class:`BoundaryLoss`): ``labels`` are taken out of the
call before the forward sees them, and the loss of the split logits is put into the output's
``loss`` as transformers would have, first. A classifier's loss is tessera's only for one
label per sample (``single_label_classification``); regression and multi-label targets are
refused by name. Models whose loss is of another kind (question answering) keep refusing
``labels``.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import torch
from torch import nn

from tessera.context import ParallelContext

__all__ = [
    "BOUNDARY_LOSS_KINDS",
    "LOSS_KINDS",
    "MODEL_LOSS_ATTR",
    "BoundaryLoss",
    "install_model_loss",
]

#: The attribute of a model whose ``loss_function`` is tessera's.
MODEL_LOSS_ATTR = "_tessera_model_loss"
#: transformers' ``loss_type`` values tessera computes on split logits.
LOSS_KINDS = ("ForCausalLM", "ForMaskedLM")
#: An encoder-decoder's (T5's, BART's): its labels are the decoder's targets as they are (the
#: decoder's input is them shifted right), its criterion built inline.
SEQ2SEQ_KIND = "ForConditionalGeneration"
#: Kinds computed at the boundary when the model's own loss cannot be replaced: the language
#: models' (a forward building its criterion inline) and one label per sample's.
BOUNDARY_LOSS_KINDS = (
    *LOSS_KINDS,
    "ForSequenceClassification",
    "ForImageClassification",
    SEQ2SEQ_KIND,
)


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
    attribute reaches: their loss moves to the boundary (:class:`BoundaryLoss`). Read from the
    forward's source; a class whose source cannot be read is taken not to.
    """
    try:
        source = inspect.getsource(type(model).forward)
    except (OSError, TypeError):
        return False
    return "self.loss_function(" in source


#: transformers' classification losses tessera computes: one integer label per sample.
_SINGLE_LABEL = "single_label_classification"


class BoundaryLoss:
    """A model's loss computed at its boundary, from the logits as the mode split them.

    For a class whose loss no attribute replaces (a criterion built inline, or a loss kind
    whose ``loss_function`` reads whole logits): its forward pre-hook takes ``labels`` out of
    the call, so the forward runs as without them, and its forward hook puts the loss of the
    split logits into the output as transformers would: ``output.loss``, first in the output
    (or first in the tuple of ``return_dict=False``).

    ``num_items_in_batch`` (transformers' ``Trainer`` under gradient accumulation) counts only
    where the forward would have handed it to its ``loss_function``: an inline criterion takes
    the mean whatever it is given, and so does this loss then.

    Args:
        kind: One of :data:`BOUNDARY_LOSS_KINDS`.
        context: The model's ParallelContext.
        takes_item_count: Whether ``num_items_in_batch`` divides the summed loss.
    """

    def __init__(self, kind: str, context: ParallelContext, takes_item_count: bool) -> None:
        self.kind, self.context, self.takes_item_count = kind, context, takes_item_count
        # The call in flight: (labels, num_items_in_batch). The root model is not called again
        # inside its own forward, so one slot suffices.
        self.pending: tuple[torch.Tensor, Any] | None = None

    def take_labels(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        """Forward pre-hook: keep ``labels`` for the output, run the forward without them."""
        labels = kwargs.pop("labels", None)
        if labels is None:
            self.pending = None
            return None
        items = kwargs.get("num_items_in_batch") if self.takes_item_count else None
        self.pending = (labels, items)
        if self.kind == SEQ2SEQ_KIND:  # what the forward does with labels, before any split
            given = ("decoder_input_ids", "decoder_inputs_embeds")
            if all(kwargs.get(key) is None for key in given):
                shift = getattr(module, "prepare_decoder_input_ids_from_labels")  # noqa: B009
                kwargs["decoder_input_ids"] = shift(labels)  # labels shifted right
            kwargs["use_cache"] = False
        return args, kwargs

    def put_loss(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        """Forward hook: the loss of this call's labels, first in the model's output."""
        if self.pending is None:
            return None
        (labels, items), self.pending = self.pending, None
        if isinstance(output, tuple):  # return_dict=False: (logits, ...) -> (loss, logits, ...)
            return (self.loss(module, output[0], labels, items), *output)
        logits = getattr(output, "logits", None)
        if not isinstance(logits, torch.Tensor) or not dataclasses.is_dataclass(output):
            raise ValueError(
                f"{type(module).__name__} was called with labels, but its forward returned "
                f"{type(output).__name__} without logits to compute the loss from"
            )
        loss = self.loss(module, logits, labels, items)
        # a new output, so that the loss comes first in its keys and tuple, as transformers'
        return dataclasses.replace(output, loss=loss)  # type: ignore[type-var]

    def loss(
        self, module: nn.Module, logits: torch.Tensor, labels: torch.Tensor, items: Any
    ) -> torch.Tensor:
        """The single-process loss of ``labels`` (the whole batch's) from split ``logits``."""
        config = getattr(module, "config", None)
        if self.kind == SEQ2SEQ_KIND:  # each decoder position's target, not shifted again
            return SplitLogitsLoss("ForMaskedLM", self.context)(
                logits, labels, num_items_in_batch=items
            )
        if self.kind in LOSS_KINDS:
            vocab = getattr(config, "vocab_size", None)
            return SplitLogitsLoss(self.kind, self.context)(
                logits, labels, vocab_size=vocab, num_items_in_batch=items
            )
        # transformers' ForSequenceClassificationLoss: the problem type from the config, else
        # from the labels, recorded on the config as transformers records it
        num_labels = getattr(config, "num_labels", None)
        problem = getattr(config, "problem_type", None)
        if problem is None:
            if num_labels == 1:
                problem = "regression"
            elif labels.dtype in (torch.long, torch.int):
                problem = _SINGLE_LABEL
            else:
                problem = "multi_label_classification"
            if config is not None:
                config.problem_type = problem
        if problem != _SINGLE_LABEL:
            base = getattr(module, "base_model_prefix", "") or "<encoder>"
            raise ValueError(
                f"{type(module).__name__} parallelized: tessera computes a classifier's loss "
                f"from split logits for one class per sample only ({_SINGLE_LABEL!r}: integer "
                f"labels, num_labels > 1), and this is {problem!r}; call it without labels, or "
                f"parallelize only its base model (parallelize(model.{base}) on a fresh model), "
                "whose outputs come back whole, so its head and its own loss run whole"
            )
        # [b] targets for [b, C] logits (one label per sample), the whole batch's
        return SplitLogitsLoss("ForMaskedLM", self.context)(
            logits, labels.reshape(-1), num_items_in_batch=items
        )


def install_model_loss(model: nn.Module, context: ParallelContext) -> bool:
    """Make ``model(..., labels=...)`` return the single-process loss, where tessera can.

    ``model.loss_function`` becomes tessera's where transformers lets it be set and the
    forward calls it for a language model's loss; otherwise a loss of
    :data:`BOUNDARY_LOSS_KINDS` is computed at the boundary (:class:`BoundaryLoss`).

    Returns:
        Whether ``labels`` are handled: a model of another loss kind keeps refusing them at
        the boundary.
    """
    # transformers falls back to the causal LM loss where a class name says no kind
    # (GPT2LMHeadModel)
    kind = getattr(model, "loss_type", None) or "ForCausalLM"
    prop = getattr(type(model), "loss_function", None)
    calls_it = _forward_calls_loss_function(model)
    settable = isinstance(prop, property) and prop.fset is not None
    if kind in LOSS_KINDS and settable and calls_it:
        setattr(model, "loss_function", SplitLogitsLoss(kind, context))  # noqa: B010
    elif kind in BOUNDARY_LOSS_KINDS and not (kind == SEQ2SEQ_KIND and calls_it):
        # an inline criterion, or a classifier's loss (a conditional generator calling its
        # loss_function, transformers' causal LM loss, is of another kind)
        hooks = BoundaryLoss(kind, context, takes_item_count=calls_it)

        # plain functions: a deep copy of the model shares them (and the context) as it is
        def take_labels(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            return hooks.take_labels(module, args, kwargs)

        def put_loss(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
            return hooks.put_loss(module, args, output)

        # first: an encoder-decoder's decoder input comes from the labels before any split
        first = kind == SEQ2SEQ_KIND
        model.register_forward_pre_hook(take_labels, with_kwargs=True, prepend=first)
        model.register_forward_hook(put_loss)
    else:
        return False
    setattr(model, MODEL_LOSS_ATTR, True)
    return True
