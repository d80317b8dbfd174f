"""Data loading for data parallelism: each DATA rank reads its own shard of the dataset.

Only the data-parallel coordinate decides the shard: the tensor and pipeline ranks of one
model replica must see the same batches (the tensor ranks split each sample's computation,
the pipeline stages pass it along), so the sampler uses the DATA group's size and local rank,
never the global ones. The sampler is torch's ``DistributedSampler``; the Trainer calls its
``set_epoch`` so each epoch shuffles differently yet identically on every rank.
"""

from __future__ import annotations

import random
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from tessera.context import ParallelContext, ParallelMode

from .context_lookup import resolve_context

__all__ = ["get_dataloader"]


def _seed_worker(worker_id: int) -> None:
    """Seed python's ``random`` in each loader worker from torch's per-worker seed."""
    random.seed(torch.initial_seed() % 2**32)


def get_dataloader(
    dataset: Dataset[Any],
    shuffle: bool = False,
    seed: int = 1024,
    batch_size: int = 1,
    drop_last: bool = False,
    context: ParallelContext | None = None,
    **kwargs: Any,
) -> DataLoader[Any]:
    """A DataLoader over this DATA rank's shard of ``dataset``.

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
    sampler: DistributedSampler[Any] = DistributedSampler(
        dataset, num_replicas=replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last
    )
    generator = torch.Generator()
    generator.manual_seed(seed)
    kwargs.setdefault("worker_init_fn", _seed_worker)
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        drop_last=drop_last,
        generator=generator,
        **kwargs,
    )
