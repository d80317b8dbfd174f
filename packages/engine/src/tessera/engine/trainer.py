"""``Trainer``: the epoch loop around an Engine, extended by hooks.

The Trainer only orders things: per step it calls ``engine.zero_grad()``,
``engine.execute_schedule(...)`` and ``engine.step()`` (so any schedule and any parallelism
work unchanged), and around them the hooks' callbacks. It owns three pieces of shared state
the hooks read and write: ``train_metrics`` / ``test_metrics`` (named running metrics, reduced
over the DATA group when read), ``step_metrics`` (the latest per-step numbers shown on the
progress bar) and ``states`` (anything else, e.g. ``"epoch_metrics"``).

What the user sees comes from one rank only, the *display rank*: data rank 0 of the last
pipeline stage, tensor rank 0 (the rank that holds the loss). It shows a tqdm progress bar
with the loss (mean over data ranks) and the throughput, and writes an optional JSON-lines
metrics log, one object per line, that a user can plot::

    {"phase": "train_step", "epoch": 0, "step": 3, "loss": 0.71, "throughput": 5120.0}
    {"phase": "train_epoch", "epoch": 0, "step": 10, "loss": 0.69}
    {"phase": "test", "epoch": 0, "step": 10, "loss": 0.66, "accuracy": 0.81}
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from tessera.context import ParallelMode

from .context_lookup import group_if_parallel
from .data_agreement import agree_on_data, agree_on_length
from .dist_logger import DistributedLogger, get_dist_logger
from .engine import Engine
from .hooks.base import BaseHook
from .timer import MultiTimer

__all__ = ["Metric", "Trainer"]


class Metric(Protocol):
    """What the Trainer's metric tables hold (``AverageMetric``, ``ThroughputMetric``)."""

    name: str
    last: float

    def reset(self) -> None:
        """Forget every update."""
        ...

    def value(self, group: dist.ProcessGroup | None = None) -> float:
        """The value over every rank of ``group`` (collective)."""
        ...


def _sorted_hooks(hooks: Iterable[BaseHook]) -> list[BaseHook]:
    return sorted(hooks, key=lambda h: h.priority)


def _batch_size(label: Any) -> int | None:
    if isinstance(label, torch.Tensor) and label.dim() > 0:
        return int(label.shape[0])
    return None


class Trainer:
    """Runs epochs of training and evaluation with an Engine.

    Args:
        engine: The Engine.
        timer: Times ``"train-step"``, ``"train-epoch"`` and ``"test-step"`` (default: a new
            MultiTimer that does not synchronize CUDA).
        logger: Rank-aware logger (default: ``get_dist_logger()``).
        metrics_log: Path of the JSON-lines metrics log, written by the display rank.
    """

    def __init__(
        self,
        engine: Engine,
        timer: MultiTimer | None = None,
        logger: DistributedLogger | None = None,
        *,
        metrics_log: str | os.PathLike[str] | None = None,
    ) -> None:
        self.engine = engine
        self.timer = timer if timer is not None else MultiTimer(synchronize=False)
        self.logger = logger if logger is not None else get_dist_logger()
        self.metrics_log = Path(metrics_log) if metrics_log is not None else None
        self.train_metrics: dict[str, Metric] = {}
        self.test_metrics: dict[str, Metric] = {}
        self.step_metrics: dict[str, float] = {}
        self.states: dict[str, Any] = {}
        self.epoch = 0
        self.global_step = 0
        self.steps_per_epoch: int | None = None
        # Where fit() starts: set by a hook in before_train when resuming a checkpoint.
        self.start_epoch = 0
        self.start_step_in_epoch = 0
        ctx = engine.context
        self._data_group = group_if_parallel(ctx, ParallelMode.DATA)
        self.is_display_rank = self._display_rank()

    # ------------------------------------------------------------------ who shows what

    def _display_rank(self) -> bool:
        ctx = self.engine.context
        if ctx is None:
            return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
        first_data = ctx.is_first_rank(ParallelMode.DATA)
        last_stage = ctx.is_last_rank(ParallelMode.PIPELINE)
        first_tensor = (
            ctx.is_first_rank(ParallelMode.TENSOR)
            if ctx.is_initialized(ParallelMode.TENSOR)
            else True
        )
        return first_data and last_stage and first_tensor

    def _reduced(self, metrics: dict[str, Metric]) -> dict[str, float]:
        """Every metric's value over the data ranks (every rank calls it: collective)."""
        return {name: m.value(self._data_group) for name, m in metrics.items()}

    def _reduce_step_loss(self, loss: torch.Tensor | None) -> float:
        """The step loss averaged over data ranks (NaN on stages that hold no loss)."""
        if self._data_group is None:
            return float(loss.item()) if loss is not None else math.nan
        pair = torch.tensor(
            [float(loss.item()) if loss is not None else 0.0, 1.0 if loss is not None else 0.0],
            dtype=torch.float64,
        )
        if dist.get_backend(self._data_group) == "nccl":
            pair = pair.cuda()
        dist.all_reduce(pair, group=self._data_group)
        total, count = pair.tolist()
        return total / count if count else math.nan

    def log_metrics(self, phase: str, metrics: dict[str, float]) -> None:
        """Append one line to the JSON-lines log (display rank only)."""
        if self.metrics_log is None or not self.is_display_rank:
            return
        record: dict[str, Any] = {"phase": phase, "epoch": self.epoch, "step": self.global_step}
        record.update({k: (None if math.isnan(v) else v) for k, v in metrics.items()})
        self.metrics_log.parent.mkdir(parents=True, exist_ok=True)
        with self.metrics_log.open("a") as f:
            f.write(json.dumps(record) + "\n")

    def _call(self, hooks: Sequence[BaseHook], name: str, *args: Any) -> None:
        for hook in hooks:
            getattr(hook, name)(self, *args)

    def _progress(self, total: int | None, desc: str, show: bool) -> Any:
        if not (show and self.is_display_rank):
            return None
        from tqdm import tqdm

        return tqdm(total=total, desc=desc, dynamic_ncols=True, leave=True)

    # ------------------------------------------------------------------ training

    def fit(
        self,
        train_dataloader: Iterable[Any],
        epochs: int,
        max_steps: int | None = None,
        test_dataloader: Iterable[Any] | None = None,
        test_interval: int = 1,
        hooks: Iterable[BaseHook] = (),
        display_progress: bool = True,
    ) -> None:
        """Train for ``epochs`` epochs (or until ``max_steps`` steps in all).

        Every rank must call it with loaders of the same length: the lengths are compared
        first (a ``ValueError`` on every rank names the ranks and their lengths), and where a
        loader has no ``len()`` (an ``IterableDataset``) every step's data read agrees on who
        has a batch (``tessera.engine.data_agreement``). With a pipeline schedule one step
        takes one batch from the loader and splits it into micro-batches.

        Args:
            train_dataloader: Yields ``(inputs, labels)`` batches.
            epochs: Number of epochs.
            max_steps: Stop after this many steps in all (``None``: no limit).
            test_dataloader: Evaluated every ``test_interval`` epochs.
            test_interval: Epochs between evaluations.
            hooks: The hooks, called in ascending priority.
            display_progress: Show a tqdm bar (on the display rank).
        """
        if epochs < 0 or test_interval < 1:
            raise ValueError(
                f"need epochs >= 0 and test_interval >= 1, got {epochs}, {test_interval}"
            )
        ordered = _sorted_hooks(hooks)
        for hook in ordered:
            hook.after_hook_is_attached(self)
        self.states["hooks"] = ordered
        self.states["train_dataloader"] = train_dataloader
        self._call(ordered, "before_train")
        try:
            length = len(train_dataloader)  # type: ignore[arg-type]
        except TypeError:
            length = None
        self.steps_per_epoch = length
        if not agree_on_length(length, self.engine.context, "train"):
            length = None  # some rank's has no len(): every rank agrees per step instead
        stop = False
        first = self.start_epoch
        for epoch in range(first, epochs):
            self.epoch = epoch
            sampler = getattr(train_dataloader, "sampler", None)
            if sampler is not None and hasattr(sampler, "set_epoch"):
                sampler.set_epoch(epoch)
            start = self.start_step_in_epoch if epoch == first else 0
            stop = self._train_epoch(
                train_dataloader, length, max_steps, ordered, display_progress, start
            )
            if test_dataloader is not None and ((epoch + 1) % test_interval == 0 or stop):
                self.evaluate(
                    test_dataloader,
                    hooks=ordered,
                    display_progress=display_progress,
                    _attached=True,
                )
            if stop:
                break
        self._call(ordered, "after_train")

    def _train_epoch(
        self,
        loader: Iterable[Any],
        length: int | None,
        max_steps: int | None,
        hooks: Sequence[BaseHook],
        display_progress: bool,
        start_step: int = 0,
    ) -> bool:
        engine = self.engine
        engine.train()
        self._call(hooks, "before_train_epoch")
        bar = self._progress(length, f"epoch {self.epoch}", display_progress)
        if bar is not None and start_step:
            bar.update(start_step)
        # A resumed epoch whose batches were all consumed creates no iterator: creating one
        # draws from the loader's generator, which the uninterrupted run did not do here.
        done = length is not None and start_step >= length
        data_iter: Iterator[Any] = iter(()) if done else iter(loader)
        if length is None:
            data_iter = agree_on_data(data_iter, engine.context)
        stopped = False
        self.timer.start("train-epoch")
        step_in_epoch = start_step
        while length is None or step_in_epoch < length:
            if max_steps is not None and self.global_step >= max_steps:
                stopped = True
                break
            self._call(hooks, "before_train_iter")
            start = time.perf_counter()
            with self.timer.time("train-step"):
                engine.zero_grad()
                try:
                    output, label, loss = engine.execute_schedule(data_iter)
                except StopIteration:
                    break
                engine.step()
            seconds = time.perf_counter() - start
            self.global_step += 1
            step_in_epoch += 1
            self.step_metrics["loss"] = self._reduce_step_loss(loss)
            samples = _batch_size(label)
            if samples is not None:
                data = dist.get_world_size(self._data_group) if self._data_group is not None else 1
                self.step_metrics["throughput"] = samples * data / max(seconds, 1e-12)
            self._call(hooks, "after_train_iter", output, label, loss)
            self.log_metrics("train_step", self.step_metrics)
            if bar is not None:
                bar.set_postfix(
                    {k: f"{v:.4g}" for k, v in self.step_metrics.items()}, refresh=False
                )
                bar.update(1)
        self.timer.stop("train-epoch")
        if bar is not None:
            bar.close()
        self.states["epoch_metrics"] = self._reduced(self.train_metrics)
        self.log_metrics("train_epoch", self.states["epoch_metrics"])
        self._call(hooks, "after_train_epoch")
        return stopped or (max_steps is not None and self.global_step >= max_steps)

    # ------------------------------------------------------------------ evaluation

    def evaluate(
        self,
        test_dataloader: Iterable[Any],
        hooks: Iterable[BaseHook] = (),
        display_progress: bool = True,
        *,
        _attached: bool = False,
    ) -> dict[str, float]:
        """Run the model forward-only over ``test_dataloader``.

        Returns:
            The test metrics the hooks registered, reduced over the data ranks (the same on
            every rank of a data group; on pipeline stages without a loss, NaN).
        """
        ordered = _sorted_hooks(hooks)
        if not _attached:
            for hook in ordered:
                hook.after_hook_is_attached(self)
        engine = self.engine
        engine.eval()
        self._call(ordered, "before_test")
        try:
            length: int | None = len(test_dataloader)  # type: ignore[arg-type]
        except TypeError:
            length = None
        if not agree_on_length(length, engine.context, "test"):
            length = None
        bar = self._progress(length, f"test {self.epoch}", display_progress)
        data_iter: Iterator[Any] = iter(test_dataloader)
        if length is None:
            data_iter = agree_on_data(data_iter, engine.context)
        done = 0
        while length is None or done < length:
            self._call(ordered, "before_test_iter")
            with self.timer.time("test-step"):
                try:
                    output, label, loss = engine.execute_schedule(data_iter, forward_only=True)
                except StopIteration:
                    break
            done += 1
            self._call(ordered, "after_test_iter", output, label, loss)
            if bar is not None:
                bar.update(1)
        if bar is not None:
            bar.close()
        results = self._reduced(self.test_metrics)
        self.states["test_results"] = results
        self.log_metrics("test", results)
        self._call(ordered, "after_test")
        engine.train()
        return results
