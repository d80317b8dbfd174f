"""Non-finite losses and gradients: found on any rank, decided by every rank together.

An inf or NaN that reaches the optimizer is copied into every replica by the next gradient
all-reduce and never leaves: the job goes on returning ``step() == True`` while its weights are
NaN. So before the optimizer steps, each rank reduces what it holds to two flags (a loss it
backpropagated since the last step was non-finite; one of its gradients is) and the flags of
all ranks are gathered, so every rank takes the same decision (raise, or skip the step) and
can say where the trouble started: a loss that went bad on one rank spreads to every rank's
gradients, so the rank whose *loss* is non-finite is the origin, and a gradient that is
non-finite under finite losses went bad in a backward.

The gather is one tiny collective per optimizer step; the gradient flag costs one fused norm
over this rank's gradients (``torch._foreach_norm``), no host synchronization until the gather.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .loss_scaler import local_tensor as _local

__all__ = ["NonFiniteError", "NonFiniteReport", "find_nonfinite"]


@dataclass(frozen=True)
class NonFiniteReport:
    """Which ranks saw a non-finite loss and which a non-finite gradient, at which step.

    Attributes:
        step: The optimizer step that was about to run (``global_step + 1``).
        loss_ranks: Global ranks whose loss was inf or NaN.
        grad_ranks: Global ranks holding an inf or NaN gradient.
    """

    step: int
    loss_ranks: tuple[int, ...]
    grad_ranks: tuple[int, ...]

    def describe(self) -> str:
        """One sentence: where it started first, then how far it spread."""
        if self.loss_ranks:
            first = f"the loss went non-finite first, on rank(s) {list(self.loss_ranks)}"
        else:
            first = (
                "a gradient went non-finite first (every loss was finite), on rank(s) "
                f"{list(self.grad_ranks)}"
            )
        spread = (
            f"; non-finite gradients on rank(s) {list(self.grad_ranks)}"
            if (self.loss_ranks and self.grad_ranks)
            else ""
        )
        return f"optimizer step {self.step}: {first}{spread}"


class NonFiniteError(FloatingPointError):
    """Raised on every rank when a step's loss or gradients hold inf or NaN (``nonfinite``).

    Attributes:
        report: The ranks and the step.
    """

    def __init__(self, report: NonFiniteReport) -> None:
        self.report = report
        super().__init__(
            f"{report.describe()}. No parameter was updated. Lower the learning rate, clip "
            "gradients (clip_grad_norm=...), check the data of those ranks, or set "
            "nonfinite='skip' to skip such steps"
        )

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.report,))


def _all_finite(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """A CPU bool scalar: whether every element of ``tensors`` is finite."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        local = _local(t)
        if local.numel():
            by_device.setdefault(local.device, []).append(local)
    finite = torch.ones((), dtype=torch.bool)
    for group in by_device.values():
        norms = torch._foreach_norm(group)  # inf or NaN in a tensor makes its norm so
        finite &= torch.isfinite(torch.stack(norms).sum()).cpu()
    return finite


def find_nonfinite(
    losses: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    step: int,
    group: dist.ProcessGroup | None,
) -> NonFiniteReport | None:
    """Gather every rank's flags; return the report, or ``None`` when all is finite.

    Args:
        losses: The losses this rank backpropagated since the last optimizer step.
        grads: This rank's gradients.
        step: The optimizer step about to run, for the message.
        group: Every rank that takes part in the step (``None``: one process). Every rank of
            it must call this.
    """
    flags = torch.stack(
        [
            ~_all_finite([loss.detach().float().reshape(-1) for loss in losses]),
            ~_all_finite(grads),
        ]
    ).to(torch.int32)  # [2]: loss bad, gradient bad
    if group is None:
        table = [flags]
        ranks = [dist.get_rank() if dist.is_available() and dist.is_initialized() else 0]
    else:
        on = torch.device("cpu")
        if dist.get_backend(group) == "nccl":
            on = torch.device("cuda", torch.cuda.current_device())
        table = [torch.empty(2, dtype=torch.int32, device=on) for _ in range(group.size())]
        dist.all_gather(table, flags.to(on), group=group)
        table = [t.cpu() for t in table]
        ranks = dist.get_process_group_ranks(group)
    loss_ranks = tuple(r for r, f in zip(ranks, table, strict=True) if f[0])
    grad_ranks = tuple(r for r, f in zip(ranks, table, strict=True) if f[1])
    if not loss_ranks and not grad_ranks:
        return None
    return NonFiniteReport(step, loss_ranks, grad_ranks)
