"""``generate()`` of a parallelized language model: every step reads whole logits.

transformers' generation loop reads ``outputs.logits[:, -1, :]`` and takes its argmax (or
samples from its softmax) as the next token of every sample. A parallelized model's logits
are split, by vocabulary under 1D (the argmax of this rank's slice, read as a token id, is
another token, and the ranks would disagree on it) and by batch rows on the mesh and cube.
So while ``generate`` runs, the model's forward gathers its logits whole
(:func:`~tessera.layers.conversion.boundary.gather_logits`): every tensor rank then picks the
same token for every sample, as one process does. Sampling draws from torch's global
generator, which the context seeds alike on every tensor rank (``parallelize`` forks it only
inside the forward), so sampled tokens agree too.

The gather costs one collective of the step's logits, ``[b, 1, V]`` per new token once the
cache holds the prompt; training keeps its logits split (the losses read them that way).
"""

from __future__ import annotations

import types
from typing import Any

from torch import nn

from tessera.context import ParallelContext, find_tensor_mode, tensor_mode_names

__all__ = ["GENERATING_ATTR", "install_generation"]

#: The attribute of a parallelized model set while its ``generate`` runs.
GENERATING_ATTR = "_tessera_generating"


def _generating_modes() -> list[str]:
    """The modes whose generation equals one process's: those that keep whole sequences.

    ``'sequence'`` cannot split the one new token of a cached step over its ranks.
    """
    found = (find_tensor_mode(name) for name in tensor_mode_names())
    return [m.name for m in found if m is not None and not m.splits_sequence]


def _generate(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The class's ``generate``, with whole logits at every step (see the module docstring)."""
    setattr(self, GENERATING_ATTR, True)
    try:
        return type(self).generate(self, *args, **kwargs)  # type: ignore[attr-defined]
    finally:
        setattr(self, GENERATING_ATTR, False)


def _refuse_generate(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """``generate`` where it cannot equal one process: refused by name."""
    layout = getattr(self, _LAYOUT_ATTR, "this layout")
    raise ValueError(
        f"{type(self).__name__}.generate under {layout}: each step after the prompt feeds one "
        "new token, which cannot be split over the ranks that split the sequence; generate "
        f"with the model under tensor mode {' or '.join(repr(m) for m in _generating_modes())} "
        "without sequence_parallel, or on one process from its gathered state dict"
    )


#: The attribute naming the layout whose ``generate`` is refused, for the message.
_LAYOUT_ATTR = "_tessera_generation_refused"


def install_generation(
    model: nn.Module, context: ParallelContext, mode: str, sequence_parallel: bool
) -> None:
    """Make ``model.generate`` (transformers' ``GenerationMixin``) read whole logits.

    A bound method on the instance, so a deep copy of the model binds it to the copy.
    Models without ``generate`` are left alone; under ``'sequence'`` and 1D sequence
    parallelism it is refused by name.
    """
    from .boundary import gather_logits

    generate = getattr(type(model), "generate", None)
    if not callable(generate):
        return
    kind = context.config.mode
    if kind is None or kind.splits_sequence or sequence_parallel:
        layout = f"tensor mode {mode!r}" + (" with sequence_parallel" if sequence_parallel else "")
        setattr(model, _LAYOUT_ATTR, layout)
        setattr(model, "generate", types.MethodType(_refuse_generate, model))  # noqa: B010
        return
    setattr(model, "generate", types.MethodType(_generate, model))  # noqa: B010
    setattr(model, GENERATING_ATTR, False)

    def whole_logits(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        if not getattr(module, GENERATING_ATTR, False):
            return None
        logits = getattr(output, "logits", None)
        if logits is None:
            raise ValueError(
                f"{type(module).__name__}.generate under tensor mode {mode!r}: its forward "
                f"returned {type(output).__name__} without logits to gather"
            )
        output.logits = gather_logits(logits, context=context)  # [b, s, V] on every rank
        return output

    model.register_forward_hook(whole_logits)
