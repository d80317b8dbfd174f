"""Running metrics that are reduced across data-parallel ranks before anyone shows them.

Each data-parallel rank sees its own slice of the data, so a loss or an accuracy measured on
one rank describes a fraction of the batch. A metric here keeps a sum and a count (plain
numbers, no per-step synchronization) and all-reduces both over the DATA group only when its
value is read, so the value shown is the one of the whole global batch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["AverageMetric", "ThroughputMetric"]


def _number(value: torch.Tensor | float | int) -> float:
    if isinstance(value, torch.Tensor):
        return float(value.detach().float().sum().item())
    return float(value)


class AverageMetric:
    """``sum / count`` over every update since the last reset, over all data ranks.

    Args:
        name: Shown in logs and on the progress bar.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.sum = 0.0
        self.count = 0.0
        self.last = float("nan")

    def reset(self) -> None:
        """Forget every update."""
        self.sum, self.count, self.last = 0.0, 0.0, float("nan")

    def update(self, total: torch.Tensor | float | int, count: float = 1.0) -> None:
        """Add ``total`` (a sum over ``count`` items, e.g. the number of correct labels)."""
        value = _number(total)
        self.sum += value
        self.count += count
        self.last = value / count if count else float("nan")

    def local_value(self) -> float:
        """This rank's own ``sum / count`` (NaN before any update)."""
        return self.sum / self.count if self.count else float("nan")

    def value(self, group: dist.ProcessGroup | None = None) -> float:
        """``sum / count`` over every rank of ``group``; every rank of it must call this."""
        if group is None:
            return self.local_value()
        both = torch.tensor([self.sum, self.count], dtype=torch.float64)
        if dist.get_backend(group) == "nccl":
            both = both.cuda()
        dist.all_reduce(both, group=group)
        s, c = both.tolist()
        return s / c if c else float("nan")


class ThroughputMetric:
    """Samples per second of the whole job: samples summed over data ranks, time averaged."""

    def __init__(self, name: str = "throughput") -> None:
        self.name = name
        self.samples = 0.0
        self.seconds = 0.0
        self.last = float("nan")

    def reset(self) -> None:
        """Forget every update."""
        self.samples, self.seconds, self.last = 0.0, 0.0, float("nan")

    def update(self, samples: float, seconds: float) -> None:
        """Add one step of ``samples`` that took ``seconds``."""
        self.samples += samples
        self.seconds += seconds
        self.last = samples / seconds if seconds > 0 else float("nan")

    def local_value(self) -> float:
        """This rank's samples per second."""
        return self.samples / self.seconds if self.seconds > 0 else float("nan")

    def value(self, group: dist.ProcessGroup | None = None) -> float:
        """Global samples per second; every rank of ``group`` must call this."""
        if group is None:
            return self.local_value()
        both = torch.tensor([self.samples, self.seconds], dtype=torch.float64)
        if dist.get_backend(group) == "nccl":
            both = both.cuda()
        dist.all_reduce(both, group=group)
        samples, seconds = both.tolist()
        seconds /= dist.get_world_size(group)
        return samples / seconds if seconds > 0 else float("nan")
