"""Uneven data, diagnosed: every rank must run the same number of steps.

A data rank whose loader holds one batch fewer leaves its peers in a collective it never
joins: gloo aborts in C++ ("Received data size doesn't match expected size", no Python
traceback), NCCL hangs. Two checks turn that into a ``ValueError`` on every rank, raised
before any mismatched collective, naming the ranks and their lengths:

- :func:`agree_on_length`, once per loop (the Trainer's ``fit`` and ``evaluate``): every
  rank's ``len()`` of its loader, gathered over the global CPU group. Equal lengths cost
  nothing more; different ones are the error.
- :func:`agree_on_data`, per step, where a loader has no ``len()`` (an ``IterableDataset``):
  the iterator ``execute_schedule`` reads becomes :class:`AgreedBatches`, whose every ``next``
  (the step's data read) is followed by one small all-reduce saying which ranks have a batch.
  All: the step runs. None: the epoch ends for every rank together (``StopIteration``). Some:
  the error.

Every pipeline and tensor rank reads the same batch as its data replica (the runner calls
``next(data_iter)`` on every stage), so the ranks compared are all of the job's.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from tessera.context import ParallelContext, ParallelMode

__all__ = ["AgreedBatches", "agree_on_data", "agree_on_length"]

_HINT = (
    "every rank must run the same number of steps, or the ranks with more batches wait in a "
    "collective the others never join; give the data ranks equal shards (get_dataloader, or "
    "a DistributedSampler with drop_last=True) or cut every rank's stream to the same count"
)


def _by_value(values: Sequence[Any], ranks: Sequence[int]) -> dict[Any, list[int]]:
    grouped: dict[Any, list[int]] = {}
    for rank, value in zip(ranks, values, strict=True):
        grouped.setdefault(value, []).append(rank)
    return grouped


def agree_on_length(length: int | None, ctx: ParallelContext | None, what: str) -> bool:
    """Compare every rank's loader length; whether all ranks know theirs (all are then equal).

    Collective over the global CPU group (one ``all_gather_object`` of an int). Returns True
    when there is nothing to compare (no context, one rank).

    Args:
        length: ``len()`` of this rank's loader, or None where it has none.
        ctx: The job's context.
        what: The loader's role in messages (``"train"``, ``"test"``).

    Returns:
        False when some rank's loader has no ``len()``: the caller then agrees per step
        (:func:`agree_on_data`) on every rank alike, since every rank got the same answer.

    Raises:
        ValueError: on every rank, when the known lengths differ; names each length's ranks.
    """
    if ctx is None or ctx.world_size < 2:
        return True
    lengths: list[int | None] = [None] * ctx.world_size
    dist.all_gather_object(lengths, length, group=ctx.get_cpu_group(ParallelMode.GLOBAL))
    known = {n for n in lengths if n is not None}
    if len(known) > 1:
        grouped = _by_value(lengths, ctx.get_ranks_in_group(ParallelMode.GLOBAL))
        parts = [
            f"ranks {ranks}: {'no len()' if n is None else f'{n} batches'}"
            for n, ranks in sorted(grouped.items(), key=lambda kv: kv[1][0])
        ]
        raise ValueError(
            f"uneven data: the ranks' {what} loaders differ in length ({'; '.join(parts)}); "
            + _HINT
        )
    return None not in lengths


class AgreedBatches:
    """An iterator over this rank's batches that agrees with every rank at each ``next``.

    Each ``next`` reads this rank's batch, then one all-reduce of a one-hot "have data" vector
    over the global CPU group (``world_size`` ints) says which ranks have one. All: the batch
    is returned. None: ``StopIteration`` on every rank together (the end of the epoch). Some:
    ``ValueError`` on every rank naming both sides, before any collective of the step, which
    the ranks would otherwise enter out of step. Schedules call ``next`` once per step on
    every rank (the pipeline runner on every stage), so the all-reduce is always matched.

    Args:
        data_iter: This rank's batches.
        ctx: The job's context.
    """

    def __init__(self, data_iter: Iterator[Any], ctx: ParallelContext) -> None:
        self._inner = data_iter
        self._ctx = ctx
        self._ranks = ctx.get_ranks_in_group(ParallelMode.GLOBAL)
        self.read = 0  # batches every rank has read through this iterator

    def __iter__(self) -> AgreedBatches:
        return self

    def __next__(self) -> Any:
        try:
            batch: list[Any] = [next(self._inner)]
        except StopIteration:
            batch = []
        # past the read, before the collective: a rank still blocked in its read is behind
        # this one, so the context's progress detection names it (the engine's own read mark
        # comes only after this all-reduce, which waits for that rank)
        self._ctx.mark_progress()
        have = torch.zeros(len(self._ranks), dtype=torch.int32)  # [world]: one-hot, summed
        have[self._ranks.index(self._ctx.global_rank)] = 1 if batch else 0
        dist.all_reduce(have, group=self._ctx.get_cpu_group(ParallelMode.GLOBAL))
        flags = have.tolist()
        if all(flags):
            self.read += 1
            return batch[0]
        if not any(flags):
            raise StopIteration
        done = [r for r, f in zip(self._ranks, flags, strict=True) if not f]
        more = [r for r, f in zip(self._ranks, flags, strict=True) if f]
        raise ValueError(
            f"uneven data: after {self.read} batches ranks {done} have no batch left, while "
            f"ranks {more} read one more (their loaders hold more); " + _HINT
        )


def agree_on_data(data_iter: Iterator[Any], ctx: ParallelContext | None) -> Iterator[Any]:
    """``data_iter`` as :class:`AgreedBatches`, or unchanged without peers to agree with."""
    if ctx is None or ctx.world_size < 2:
        return data_iter
    return AgreedBatches(data_iter, ctx)
