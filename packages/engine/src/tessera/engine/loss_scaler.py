"""Dynamic loss scaling for float16 training, with one skip decision for the whole job.

float16 has 5 exponent bits: small gradients underflow to zero. Multiplying the loss by a large
scale S lifts them into range; the gradients are divided by S before the optimizer step
(Micikevicius et al. 2018, "Mixed Precision Training"). S is chosen dynamically: halved when a
gradient overflowed (that step is skipped), doubled after ``growth_interval`` clean steps.

Why not ``torch.amp.GradScaler`` itself: its overflow flag is per process. Under tensor,
pipeline or ZeRO parallelism each rank holds different gradients, so one rank may overflow
while another does not; if only that rank skipped, the replicas would diverge forever. Here the
found-inf flag is all-reduced (MAX) over every rank that holds parameters before anyone
decides, so all ranks skip or step together and the scale stays identical everywhere.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["DynamicLossScaler"]


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (FSDP2 gradients), or the tensor itself."""
    to_local = getattr(t, "to_local", None)
    if callable(to_local):
        local = to_local()
        assert isinstance(local, torch.Tensor)
        return local
    return t


class DynamicLossScaler:
    """The loss scale of fp16 training and its update rule.

    Args:
        init_scale: First scale.
        growth_factor: Multiplier after ``growth_interval`` steps without overflow.
        backoff_factor: Multiplier after an overflow.
        growth_interval: Clean steps between two growths.
        min_scale: The scale never drops below this.
        max_scale: The scale never grows above this.
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 1000,
        min_scale: float = 1.0,
        max_scale: float = 2.0**24,
    ) -> None:
        if init_scale <= 0 or growth_factor <= 1 or not 0 < backoff_factor < 1:
            raise ValueError(
                f"DynamicLossScaler needs init_scale > 0, growth_factor > 1 and 0 < "
                f"backoff_factor < 1; got {init_scale}, {growth_factor}, {backoff_factor}"
            )
        if growth_interval < 1:
            raise ValueError(f"growth_interval must be >= 1, got {growth_interval}")
        self._scale = float(init_scale)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self.min_scale = float(min_scale)
        self.max_scale = float(max_scale)
        self._clean_steps = 0
        self.skipped_steps = 0

    @property
    def scale(self) -> float:
        """The current loss scale."""
        return self._scale

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * scale``: what backward runs on."""
        return loss * self._scale

    def unscale_(
        self, grads: Iterable[torch.Tensor], group: dist.ProcessGroup | None = None
    ) -> bool:
        """Divide ``grads`` by the scale in place; return whether any rank saw inf or NaN.

        Args:
            grads: The local gradients (DTensors are unscaled through their local shard).
            group: The ranks that must agree on the decision (all ranks that hold
                parameters); ``None`` for a single process. Every rank of it must call this.
        """
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for g in grads:
            local = local_tensor(g)
            by_device.setdefault(local.device, []).append(local)
        found = torch.zeros(1, dtype=torch.float32)  # [1]
        for device, tensors in by_device.items():
            flag = torch.zeros(1, dtype=torch.float32, device=device)
            inv = torch.full((1,), 1.0 / self._scale, dtype=torch.float32, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(tensors, flag, inv)
            found = torch.maximum(found, flag.cpu())
        if group is not None:
            reduce_on = torch.device("cpu")
            if dist.get_backend(group) == "nccl":
                reduce_on = torch.device("cuda", torch.cuda.current_device())
            flag = found.to(reduce_on)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
            found = flag.cpu()
        return bool(found.item() > 0)

    def update(self, found_inf: bool) -> None:
        """Back off after an overflow, grow after ``growth_interval`` clean steps."""
        if found_inf:
            self._scale = max(self._scale * self.backoff_factor, self.min_scale)
            self._clean_steps = 0
            self.skipped_steps += 1
            return
        self._clean_steps += 1
        if self._clean_steps >= self.growth_interval:
            self._scale = min(self._scale * self.growth_factor, self.max_scale)
            self._clean_steps = 0

    def state_dict(self) -> dict[str, Any]:
        """Plain numbers only (safe for ``weights_only`` loading)."""
        return {
            "scale": self._scale,
            "clean_steps": self._clean_steps,
            "skipped_steps": self.skipped_steps,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what ``state_dict`` returned."""
        self._scale = float(state["scale"])
        self._clean_steps = int(state["clean_steps"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
