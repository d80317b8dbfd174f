"""Gradient sums a layer can leave to the training loop: the mark layers give, the engine takes.

Some tensor-parallel weights are replicated over ranks that each see another part of the batch:
2.5D's depth layers (Wang et al. 2021, "Tesseract") each hold the same weight blocks and compute
their gradient from their own share of the rows, so the parts must be summed before the
optimizer uses them. Inside autograd that is one all-reduce per layer and per backward, which
keeps ``.grad`` complete after every backward (what a hand-written loop needs). A training loop
that runs several backwards per optimizer step (gradient accumulation, pipeline microbatches)
and knows when the step comes can do better: sum each gradient once per step, all layers
together in a few bucketed all-reduces, as data parallelism's gradient handlers do.

A layer offers this by implementing :class:`DefersGradientSum`; :func:`defer_gradient_sums`
switches every such layer of a model to leave its sums out and returns the parameters whose
``.grad`` is, from then on, this rank's part until the caller sums it over the returned mode.
Sums are linear, so summing after the accumulation equals summing every backward. The mark
lives here, below tessera-layers and tessera-engine, so that neither needs the other.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol, runtime_checkable

from torch import nn

__all__ = ["DEFERRED_SUM_ATTR", "DefersGradientSum", "defer_gradient_sums", "deferred_sum_mode"]

#: The attribute :func:`defer_gradient_sums` sets on each parameter it returns: its mode.
DEFERRED_SUM_ATTR = "_tessera_deferred_sum"


@runtime_checkable
class DefersGradientSum(Protocol):
    """A module whose layer can leave the sum of some parameters' gradients to its caller."""

    def defer_gradient_sum(self) -> Mapping[str, Sequence[nn.Parameter]]:
        """Stop summing inside autograd; returns ``{mode: parameters}`` now left partial.

        Idempotent: a second call returns the same parameters and changes nothing.
        """
        ...


def defer_gradient_sums(modules: Iterable[nn.Module]) -> dict[str, list[nn.Parameter]]:
    """Switch every deferring layer in ``modules`` (and below) to leave its gradient sums out.

    Returns:
        ``{mode: parameters}``, each parameter once (a weight tied between two layers appears
        under one mode), in module order: from now on the caller must sum their gradients
        over ``mode``'s group before every optimizer step, or the model trains wrong. Each
        returned parameter is marked (:func:`deferred_sum_mode`).

    Raises:
        ValueError: a parameter would be left partial over two different modes.
    """
    found: dict[str, list[nn.Parameter]] = {}
    mode_of: dict[int, str] = {}
    for root in modules:
        for module in root.modules():
            if not isinstance(module, DefersGradientSum):
                continue
            for mode, params in module.defer_gradient_sum().items():
                for p in params:
                    seen = mode_of.get(id(p))
                    if seen is None:
                        mode_of[id(p)] = mode
                        found.setdefault(mode, []).append(p)
                        setattr(p, DEFERRED_SUM_ATTR, mode)
                    elif seen != mode:
                        raise ValueError(
                            f"defer_gradient_sums: a parameter {list(p.shape)} of "
                            f"{type(module).__name__} is partial over {seen!r} and {mode!r}"
                        )
    return found


def deferred_sum_mode(param: nn.Parameter) -> str | None:
    """The mode over which ``param``'s gradient was left partial, or ``None``.

    A model whose layers were switched once stays switched: whoever trains it must sum these
    gradients (tessera.engine checks that a ``DeferredSumGradientHandler`` does).
    """
    mode = getattr(param, DEFERRED_SUM_ATTR, None)
    return mode if isinstance(mode, str) else None
