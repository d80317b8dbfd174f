"""Data loading for data parallelism: each DATA rank reads its own shard of the dataset.

Only the data-parallel coordinate decides the shard: the tensor and pipeline ranks of one
model replica must see the same batches (the tensor ranks split each sample's computation,
the pipeline stages pass it along), so the sampler uses the DATA group's size and local rank,
never the global ones. The sampler is torch's ``DistributedSampler``; the Trainer calls its
``set_epoch`` so each epoch shuffles differently yet identically on every rank.

Resuming in the middle of an epoch: the loader counts the batches it has handed to the training
loop (not the ones its workers prefetched), and ``state_dict()`` records the epoch, that count
and the state the loader's generator had when the epoch's iteration began. After
``load_state_dict`` the next iteration draws the same worker seeds and starts at the next
unread batch: the sampler skips the consumed samples, no data is read for them.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from tessera.context import ParallelContext, ParallelMode

from .context_lookup import resolve_context

__all__ = ["ResumableDataLoader", "ResumableDistributedSampler", "get_dataloader"]

_LOG = logging.getLogger(__name__)


def _seed_worker(worker_id: int) -> None:
    """Seed python's ``random`` in each loader worker from torch's per-worker seed."""
    random.seed(torch.initial_seed() % 2**32)


class ResumableDistributedSampler(DistributedSampler[Any]):
    """``DistributedSampler`` that can start an epoch after a number of samples.

    ``skip_next(n)`` makes the next ``__iter__`` of the current epoch drop the first ``n``
    indices of this rank's shard (after shuffling and padding exactly as
    ``DistributedSampler`` does), once. ``len()`` stays the full shard length, so
    ``len(loader)`` is the epoch length.
    """

    _skip = 0
    _skip_epoch = -1

    def skip_next(self, samples: int) -> None:
        """Drop the first ``samples`` indices of the next iteration of the current epoch."""
        if samples < 0:
            raise ValueError(f"cannot skip {samples} samples")
        self._skip = int(samples)
        self._skip_epoch = self.epoch

    def __iter__(self) -> Iterator[Any]:
        indices = list(super().__iter__())
        skip = self._skip if self._skip_epoch == self.epoch else 0
        self._skip, self._skip_epoch = 0, -1
        return iter(indices[skip:])


class _CountingIterator:
    """Wraps a DataLoader iterator and counts the batches handed out."""

    def __init__(self, loader: ResumableDataLoader, inner: Iterator[Any]) -> None:
        self._loader = loader
        self._inner = inner

    def __iter__(self) -> _CountingIterator:
        return self

    def __next__(self) -> Any:
        batch = next(self._inner)
        self._loader._consumed += 1
        return batch


class ResumableDataLoader(DataLoader[Any]):
    """A DataLoader whose position (epoch, batches consumed) is saved and restored.

    Built by ``get_dataloader``; its sampler is a ``ResumableDistributedSampler``.
    """

    _consumed = 0
    _resume: tuple[int, int] | None = None  # (epoch, batches) the next iteration starts at
    _epoch_start_generator: torch.Tensor | None = None

    def _epoch(self) -> int:
        return int(getattr(self.sampler, "epoch", 0))

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        if self.generator is not None:
            self._epoch_start_generator = self.generator.get_state()
        resume, self._resume = self._resume, None
        self._consumed = resume[1] if resume is not None and resume[0] == self._epoch() else 0
        return _CountingIterator(self, super().__iter__())

    @property
    def batches_consumed(self) -> int:
        """Batches of the current epoch handed to the loop (skipped ones included)."""
        return self._consumed

    def _replicas(self) -> int:
        return int(getattr(self.sampler, "num_replicas", 1))

    def state_dict(self) -> dict[str, Any]:
        """The position: plain ints and a generator-state tensor (``weights_only``-safe).

        Mid-epoch, the generator state is the one the epoch's iteration started from (it is
        drawn again when the iteration is recreated); after a whole epoch, the current one.
        """
        complete = self._consumed >= len(self)
        if not complete and self._epoch_start_generator is not None:
            generator = self._epoch_start_generator
        elif self.generator is not None:
            generator = self.generator.get_state()
        else:
            generator = torch.empty(0, dtype=torch.uint8)
        return {
            "epoch": self._epoch(),
            "batches": self._consumed,
            "batch_size": int(self.batch_size or 1),
            "data_size": self._replicas(),
            "generator": generator.clone(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Make the next iteration of the saved epoch resume where ``state`` was taken.

        Under another data-parallel size or batch size the position is converted through the
        number of samples consumed by all data ranks together (exact when it divides).
        """
        samples = int(state["batches"]) * int(state["batch_size"]) * int(state["data_size"])
        per_step = int(self.batch_size or 1) * self._replicas()
        batches, rest = divmod(samples, per_step)
        if rest:
            _LOG.warning(
                "resumed data position: %d samples consumed is not a multiple of batch size "
                "%d x %d data ranks; resuming after %d batches",
                samples,
                self.batch_size,
                self._replicas(),
                batches,
            )
        epoch = int(state["epoch"])
        set_epoch = getattr(self.sampler, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)
        complete = batches >= len(self)
        if not complete and batches:
            skip_next = getattr(self.sampler, "skip_next", None)
            if not callable(skip_next):
                raise TypeError(
                    f"the sampler {type(self.sampler).__name__} cannot skip samples; "
                    "build the loader with get_dataloader"
                )
            skip_next(batches * int(self.batch_size or 1))
        self._resume = None if complete else (epoch, batches)
        self._consumed = batches
        generator = state.get("generator")
        if self.generator is not None and isinstance(generator, torch.Tensor) and generator.numel():
            self.generator.set_state(generator)
        self._epoch_start_generator = None


def get_dataloader(
    dataset: Dataset[Any],
    shuffle: bool = False,
    seed: int = 1024,
    batch_size: int = 1,
    drop_last: bool = False,
    context: ParallelContext | None = None,
    **kwargs: Any,
) -> ResumableDataLoader:
    """A DataLoader over this DATA rank's shard of ``dataset``, resumable mid-epoch.

    Args:
        dataset: A map-style dataset.
        shuffle: Shuffle (the same permutation on every rank, then sharded).
        seed: Seed of the shuffle; also seeds the loader's generator.
        batch_size: Per data rank.
        drop_last: Drop the tail that does not divide evenly (else the sampler pads by
            repeating samples so every rank gets the same number, as DistributedSampler does),
            and drop an incomplete last batch.
        context: The ParallelContext (default: the current one; none: the whole dataset).
        **kwargs: Passed to ``DataLoader`` (``num_workers``, ``collate_fn``, ...).

    Raises:
        ValueError: ``kwargs`` holds ``sampler`` or ``shuffle`` twice.
    """
    if "sampler" in kwargs or "batch_sampler" in kwargs:
        raise ValueError("get_dataloader builds the sampler itself; do not pass sampler=")
    ctx = resolve_context(context)
    if ctx is not None and ctx.is_initialized(ParallelMode.DATA):
        replicas = ctx.get_world_size(ParallelMode.DATA)
        rank = ctx.get_local_rank(ParallelMode.DATA)
    else:
        replicas, rank = 1, 0
    sampler = ResumableDistributedSampler(
        dataset, num_replicas=replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last
    )
    generator = torch.Generator()
    generator.manual_seed(seed)
    kwargs.setdefault("worker_init_fn", _seed_worker)
    return ResumableDataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        drop_last=drop_last,
        generator=generator,
        **kwargs,
    )
