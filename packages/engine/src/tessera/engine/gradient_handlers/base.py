"""``BaseGradientHandler``: the plug point for what happens to gradients before the step.

A handler turns the gradients each rank computed into the gradients the optimizer must see:
averaged over data-parallel replicas, summed over ranks that each saw part of a sequence,
summed over the copies of a weight tied across pipeline stages. The Engine calls every
handler's ``handle_gradient()`` once per optimizer step, in the configured order. A user's
handler subclasses this, registers in ``GRADIENT_HANDLERS`` and is chosen in the config as
``gradient_handlers=[dict(type="MyHandler", ...)]``; ``initialize`` builds it with the
keywords ``model``, ``optimizer`` and ``context``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from tessera.context import ParallelContext

from ..context_lookup import resolve_context

__all__ = ["BaseGradientHandler", "ModelLike"]

#: One module, or a pipeline rank's model chunks.
ModelLike = nn.Module | Sequence[nn.Module]


class BaseGradientHandler(ABC):
    """Base class of gradient handlers.

    Args:
        model: The module (or this pipeline rank's chunks) whose gradients are handled.
        optimizer: The optimizer (unused by the built-in handlers; kept for user handlers).
        context: The ParallelContext (default: the current one).
    """

    def __init__(
        self,
        model: ModelLike,
        optimizer: torch.optim.Optimizer | None = None,
        context: ParallelContext | None = None,
    ) -> None:
        self._model = model
        self._optimizer = optimizer
        self._context = resolve_context(context)

    @property
    def context(self) -> ParallelContext | None:
        """The ParallelContext the handler's groups come from."""
        return self._context

    def parameters(self) -> Iterator[nn.Parameter]:
        """Every parameter of the handled model."""
        modules = [self._model] if isinstance(self._model, nn.Module) else list(self._model)
        for m in modules:
            yield from m.parameters()

    @abstractmethod
    def handle_gradient(self) -> None:
        """Transform the gradients in place (every rank of the groups involved calls it)."""

    def duplicate_parameters(self) -> list[torch.Tensor]:
        """Parameters on this rank that are extra copies of one counted elsewhere.

        (for the
        global gradient norm); none by default.
        """
        return []


def dense_grads(params: Iterator[nn.Parameter]) -> list[torch.Tensor]:
    """The gradients of ``params`` that require grad, a missing one filled with zeros.

    Zeros instead of skipping keep the bucket layout identical on every rank even when a
    parameter was unused on one of them, so the coalesced collectives match up.
    DTensor parameters (FSDP2) are left out: FSDP reduces them itself.
    """
    grads: list[torch.Tensor] = []
    for p in params:
        if not p.requires_grad or hasattr(p, "device_mesh"):
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grads.append(p.grad)
    return grads
