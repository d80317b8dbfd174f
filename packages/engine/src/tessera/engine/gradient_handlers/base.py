"""``BaseGradientHandler``: the plug point for what happens to gradients before the step.

A handler turns the gradients each rank computed into the gradients the optimizer must see:
averaged over data-parallel replicas, summed over ranks that each saw part of a sequence,
summed over the copies of a weight tied across pipeline stages. The Engine calls every
handler's ``handle_gradient()`` once per optimizer step, in the configured order. A user's
handler subclasses this, registers in tessera.engine's ``GRADIENT_HANDLERS`` and is chosen in
the config as ``gradient_handlers=[dict(type="MyHandler", ...)]``; ``initialize`` builds it with the
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

    def before_backward(self, final: bool) -> None:
        """The next backward is the last before an optimizer step (``final``), or not.

        The engine says so before each forward of a step that runs one backward on one
        module (not for pipeline chunks, nor under DDP, whose own hooks change ``.grad``
        during the backward). A handler that overlaps its communication with the backward
        arms its autograd hooks here; by default nothing happens.
        """
        del final  # nothing to arm

    def after_backward(self) -> None:
        """Finish what :meth:`before_backward` started (by default nothing).

        The engine calls every handler's before any handler's :meth:`handle_gradient`, so
        each of those sees complete gradients.
        """
        return None

    @abstractmethod
    def handle_gradient(self) -> None:
        """Transform the gradients in place (every rank of the groups involved calls it)."""

    def duplicate_parameters(self) -> list[torch.Tensor]:
        """Parameters on this rank that are extra copies of one counted elsewhere.

        (for the
        global gradient norm); none by default.
        """
        return []


class DenseGrads:
    """The gradients of ``params`` for a coalesced reduction, and which ones were missing.

    A parameter unused on this rank gets zeros: skipping it would change the bucket layout on
    this rank only, and the coalesced collectives would no longer match. A usage vector (1 where
    this rank had a gradient) is reduced in the same buckets, at no extra collective; after the
    reduction :meth:`drop_unused` gives back ``None`` to the parameters no rank used, as DDP
    leaves them, so the optimizer skips them (no momentum, no weight decay) like plain PyTorch.
    DTensor parameters (FSDP2) are left out: FSDP reduces them itself.
    """

    def __init__(self, params: Iterator[nn.Parameter]) -> None:
        self.params: list[nn.Parameter] = []
        self.grads: list[torch.Tensor] = []
        used: list[bool] = []
        for p in params:
            if not p.requires_grad or hasattr(p, "device_mesh"):
                continue
            used.append(p.grad is not None)
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            self.params.append(p)
            self.grads.append(p.grad)
        device = self.grads[0].device if self.grads else torch.device("cpu")
        self.usage = torch.tensor(used, dtype=torch.float32, device=device)  # [n params]

    @property
    def tensors(self) -> list[torch.Tensor]:
        """What to reduce: the gradients, then the usage vector."""
        return [*self.grads, self.usage] if self.grads else []

    def drop_unused(self) -> None:
        """After the reduction: ``grad = None`` where no rank had a gradient."""
        if not self.grads or bool(self.usage.all()):
            return
        for p, used in zip(self.params, self.usage.tolist(), strict=True):
            if used == 0:
                p.grad = None
