"""The ranks a checkpoint is written and read by, and the few collectives it needs.

Every rank of the job takes part in a save and a load. Before any rank enters a collective
that could wait for a rank that gave up, all ranks exchange their local verdicts (``agree``),
so an error found on one rank (a missing key, a bad shape, a corrupt file) is raised on every
rank instead of leaving the others blocked until the timeout. What cannot be agreed on (a rank
that stops in the middle) is left to the context's failure board: saves and loads run inside
``guard``, so the ranks left waiting name the rank that stopped.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, TypeVar

import torch.distributed as dist

from tessera.context import ParallelContext, ParallelMode

from ..context_lookup import resolve_context
from .errors import CheckpointError

__all__ = ["Comm"]

T = TypeVar("T")


class Comm:
    """The group of a checkpoint: the context's GLOBAL group, torch's WORLD, or one process.

    Args:
        context: The ParallelContext (default: the current one; none: torch's default group
            if one is initialized, else a single process).
    """

    def __init__(self, context: ParallelContext | None = None) -> None:
        ctx = resolve_context(context)
        self.context = ctx
        self.group: dist.ProcessGroup | None = None
        self.rank = 0
        self.world_size = 1
        if ctx is not None and ctx.world_size > 1:
            self.group = ctx.get_group(ParallelMode.GLOBAL)
            self.rank = ctx.global_rank
            self.world_size = ctx.world_size
        elif (
            ctx is None
            and dist.is_available()
            and dist.is_initialized()
            and dist.get_world_size() > 1
        ):
            self.group = dist.group.WORLD
            self.rank = dist.get_rank()
            self.world_size = dist.get_world_size()

    @classmethod
    def local(cls) -> Comm:
        """This process alone (no collectives), e.g. to export a checkpoint."""
        comm = cls.__new__(cls)
        comm.context = None
        comm.group = None
        comm.rank = 0
        comm.world_size = 1
        return comm

    @property
    def distributed(self) -> bool:
        """Whether more than one process takes part."""
        return self.group is not None

    @property
    def is_coordinator(self) -> bool:
        """Rank 0 writes the shared files and publishes the checkpoint."""
        return self.rank == 0

    def all_gather(self, obj: T) -> list[T]:
        """Every rank's ``obj`` (in-memory exchange; nothing read from disk is unpickled)."""
        if self.group is None:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def broadcast(self, obj: T) -> T:
        """Rank 0's ``obj`` on every rank."""
        if self.group is None:
            return obj
        box: list[Any] = [obj]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, 0), group=self.group)
        return box[0]  # type: ignore[no-any-return]

    def agree(self, errors: list[str], what: str, error: type[CheckpointError]) -> None:
        """Raise ``error`` on every rank if any rank reported an error (a collective).

        Args:
            errors: This rank's problems (empty: none).
            what: What failed, the start of the message.
            error: The exception class raised.
        """
        everyone = self.all_gather(list(errors))
        lines = [
            (f"rank {rank}: {e}" if self.distributed else e)
            for rank, errs in enumerate(everyone)
            for e in errs
        ]
        if lines:
            shown = lines[:20]
            more = f"\n... and {len(lines) - 20} more" if len(lines) > 20 else ""
            raise error(f"{what}:\n  " + "\n  ".join(shown) + more)

    @contextlib.contextmanager
    def guard(self, where: str) -> Iterator[None]:
        """Run a save or load inside the context's failure guard, when there is a context.

        A rank that fails alone is posted on the failure board, so the ranks left waiting for
        it raise ``RankFailedError`` naming it and ``where``. A ``CheckpointError`` is only
        ever raised by every rank together (after ``agree``): it blames no rank, so it is not
        posted, and a caller that handles it (e.g. tries an older checkpoint) leaves no stale
        report to be blamed for a later failure.
        """
        guard = getattr(self.context, "guard", None)
        if guard is None:
            yield
            return
        agreed: CheckpointError | None = None
        with guard(where):
            try:
                yield
            except CheckpointError as exc:
                agreed = exc
        if agreed is not None:
            raise agreed

    def barrier(self) -> None:
        """Wait for every rank (through a gather, so it honours the group's timeout)."""
        self.all_gather(0)
