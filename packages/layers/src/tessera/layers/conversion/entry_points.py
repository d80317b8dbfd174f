"""A model's entry points besides ``forward``, which the boundary's hooks do not see.

``parallelize`` puts its boundary on the model's ``forward``: the inputs are split for the mode
on the way in and the outputs gathered (or left split for the loss) on the way out. timm's
models have other entry points that run the same modules without it: ``forward_features``
(the final norm's output ``[b, N, h]``), ``forward_head`` (the head on such features) and
``forward_intermediates`` (the blocks' outputs, reshaped as images). Called on a parallelized
model, they would hand the mode's layers whole inputs, or return this rank's blocks of the
blocks' outputs reshaped as if they were whole: ``forward_intermediates`` under 2D returned
features of the wrong width, without an error.

Each runs as it is where its numbers are one process's, and is refused by name elsewhere:

* under ``1d`` (activations whole between blocks) all three;
* ``forward_features`` and ``forward_head`` also where the tokens are split inside the plan's
  span, which gathers them at the final norm (``sequence``, ``1d`` with sequence
  parallelism);
* ``forward_intermediates`` nowhere else: the blocks' outputs are split there.
"""

from __future__ import annotations

import types
from typing import Any

from torch import nn

from tessera.context import ParallelContext

__all__ = ["install_entry_points"]

#: timm's entry points besides ``forward``.
_ENTRY_POINTS = ("forward_features", "forward_head", "forward_intermediates")


#: On a model whose entry points are guarded: how many of its own calls are in flight.
_OWN_CALLS_ATTR = "_tessera_own_calls"


def _enter(module: nn.Module, args: Any) -> None:
    setattr(module, _OWN_CALLS_ATTR, getattr(module, _OWN_CALLS_ATTR, 0) + 1)


def _leave(module: nn.Module, args: Any, output: Any) -> None:
    setattr(module, _OWN_CALLS_ATTR, getattr(module, _OWN_CALLS_ATTR, 1) - 1)


def _guard(name: str, why: str, mode: str) -> Any:
    """The entry point ``name``, run from the model's own call only (else refused)."""

    def guarded(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if getattr(self, _OWN_CALLS_ATTR, 0):  # timm's forward: forward_head(forward_features)
            return getattr(type(self), name)(self, *args, **kwargs)
        raise ValueError(
            f"{type(self).__name__}.{name} of a model parallelized under tensor mode {mode!r}: "
            f"{why}, which only the model's own call splits and gathers; call the model "
            f"itself (its output is the head's), or use tensor mode '1d' for {name}"
        )

    return guarded


def install_entry_points(
    model: nn.Module, context: ParallelContext, mode: str, sequence_parallel: bool
) -> None:
    """Refuse the entry points of ``model`` besides ``forward`` where they would be wrong.

    Only calls from outside: the model's own ``forward`` calls them (timm's ``forward`` is
    ``forward_head(forward_features(x))``), between its boundary's hooks.
    """
    kind = context.config.mode
    assert kind is not None
    whole = kind.replicated_activations and not sequence_parallel
    gathered_at_norm = kind.splits_sequence or sequence_parallel
    guarded = 0
    for name in _ENTRY_POINTS:
        if whole or not callable(getattr(type(model), name, None)):
            continue
        if name != "forward_intermediates" and gathered_at_norm:
            continue
        why = (
            "the blocks' outputs it returns are this rank's blocks of them"
            if name == "forward_intermediates"
            else "its input and output are split over the tensor ranks by the model's boundary"
        )
        # a bound method on the instance: a deep copy of the model binds it to the copy
        object.__setattr__(model, name, types.MethodType(_guard(name, why, mode), model))
        guarded += 1
    if guarded:
        model.register_forward_pre_hook(_enter)
        model.register_forward_hook(_leave, always_call=True)
