"""``ProcessGroups``: this rank's process groups of one job, by parallel mode.

One of the three parts a :class:`tessera.context.ParallelContext` is composed of (with the RNG
streams of :mod:`tessera.context.seeds` and the failure monitor of
:mod:`tessera.context.failures`). It answers every per-mode question (which group, which local
rank, who is next) and owns exactly the groups it created, so ``destroy()`` releases those and
nothing else. :func:`build_groups` creates them collectively from a layout.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from .layouts import Group
from .modes import ModeLike, mode_key

__all__ = ["Membership", "ProcessGroups", "build_groups", "new_group_in_order"]


@dataclass(frozen=True)
class Membership:
    """This rank's group of one mode.

    Attributes:
        ranks: the group's global ranks, ordered by local rank.
        local_rank: this rank's index in ``ranks``.
        group: the process group (the context's backend).
        cpu_group: a gloo group over the same ranks, for metadata and objects (the same group
            under gloo).
    """

    ranks: Group
    local_rank: int
    group: dist.ProcessGroup
    cpu_group: dist.ProcessGroup

    @property
    def size(self) -> int:
        """The number of ranks in the group."""
        return len(self.ranks)

    def neighbour(self, step: int) -> int:
        """The global rank ``step`` local ranks away (wrapping around)."""
        return self.ranks[(self.local_rank + step) % len(self.ranks)]


class ProcessGroups:
    """This rank's groups of every mode of one job.

    Args:
        memberships: this rank's group of each mode it belongs to, by mode key.
        absent: for each mode with groups but none holding this rank, those groups (named in
            the error of a query).
        created: every process group built for these memberships, in creation order (the
            ones ``destroy`` releases).
        global_rank: this rank (named in errors).
    """

    def __init__(
        self,
        memberships: Mapping[str, Membership],
        absent: Mapping[str, list[Group]],
        created: list[dist.ProcessGroup],
        global_rank: int,
    ) -> None:
        self._members = dict(memberships)
        self._absent = dict(absent)
        self._created = created
        self._global_rank = global_rank
        self._destroyed = False

    @property
    def modes(self) -> list[str]:
        """The modes this rank has a group of."""
        return list(self._members)

    @property
    def created(self) -> list[dist.ProcessGroup]:
        """The process groups these memberships own (empty once destroyed)."""
        return self._created

    @property
    def is_destroyed(self) -> bool:
        """Whether :meth:`destroy` ran."""
        return self._destroyed

    def is_initialized(self, mode: ModeLike) -> bool:
        """Whether this rank has a group of ``mode``."""
        return not self._destroyed and mode_key(mode) in self._members

    def of(self, mode: ModeLike) -> Membership:
        """This rank's group of ``mode``.

        Raises:
            RuntimeError: the groups were destroyed.
            ValueError: the mode is not initialized, or no group of it holds this rank (its
                groups are named).
        """
        if self._destroyed:
            raise RuntimeError("the context was destroyed; its groups can no longer be used")
        key = mode_key(mode)
        found = self._members.get(key)
        if found is not None:
            return found
        if key in self._absent:
            raise ValueError(
                f"global rank {self._global_rank} is in no group of mode {key!r} (its groups: "
                f"{self._absent[key]}); check is_initialized({key!r}) first"
            )
        listed = ", ".join(repr(m) for m in self._members)
        raise ValueError(
            f"parallel mode {key!r} is not initialized in this context; initialized modes: {listed}"
        )

    def destroy(self) -> None:
        """Destroy the groups created for these memberships, last first; idempotent."""
        if self._destroyed:
            return
        self._destroyed = True
        if dist.is_initialized():
            for group in reversed(self._created):
                dist.destroy_process_group(group)
        self._created = []
        self._members.clear()


def new_group_in_order(ranks: Group, timeout: timedelta, backend: str | None) -> dist.ProcessGroup:
    """``dist.new_group`` whose local ranks follow ``ranks``' order (collective).

    A mode's coordinates are local ranks, so a group listed out of increasing order must keep
    that order. torch's ``new_group`` sorts the ranks unless it is given ``sort_ranks=False``,
    which older releases (2.11 among them) do not have; there every built-in layout still
    works (its groups are listed in increasing order), and a plug-in layout that lists a group
    out of order is refused on every rank alike, before the group is created.

    Raises:
        RuntimeError: ``ranks`` is out of increasing order and this torch would sort it.
    """
    group: dist.ProcessGroup
    if "sort_ranks" in inspect.signature(dist.new_group).parameters:
        group = dist.new_group(list(ranks), timeout=timeout, backend=backend, sort_ranks=False)
        return group
    if list(ranks) != sorted(ranks):
        raise RuntimeError(
            f"process group {list(ranks)} lists its ranks out of increasing order, and "
            f"torch {torch.__version__}'s new_group has no sort_ranks=False to keep that order "
            "(its local ranks would be those of the sorted list); list the group's ranks in "
            "increasing order, or use a torch whose new_group takes sort_ranks"
        )
    group = dist.new_group(list(ranks), timeout=timeout, backend=backend)
    return group


def build_groups(
    layout: Mapping[str, list[Group]],
    rank: int,
    *,
    timeout: timedelta,
    cpu_groups: bool,
) -> ProcessGroups:
    """Create every group of ``layout`` (collective: every rank, same layout, same order).

    Identical rank tuples (e.g. TENSOR and PARALLEL_1D) share one process group. On an error
    the groups made so far are destroyed before it propagates.

    Args:
        layout: the groups of each mode (``rank_groups(config)``).
        rank: this global rank.
        timeout: of every collective on the new groups.
        cpu_groups: also create a gloo group per group (the backend is not gloo).
    """
    created: list[dist.ProcessGroup] = []
    cache: dict[tuple[str, Group], dist.ProcessGroup | None] = {}

    def group_of(ranks: Group, kind: str) -> dist.ProcessGroup | None:
        key = (kind, ranks)
        if key not in cache:
            pg = new_group_in_order(ranks, timeout, None if kind == "main" else "gloo")
            member = rank in ranks
            cache[key] = pg if member else None
            if member:
                created.append(pg)
        return cache[key]

    memberships: dict[str, Membership] = {}
    absent: dict[str, list[Group]] = {}
    try:
        for mode, groups in layout.items():
            for ranks in groups:
                pg = group_of(ranks, "main")
                cpu_pg = group_of(ranks, "cpu") if cpu_groups else pg
                if pg is not None and cpu_pg is not None:
                    local = ranks.index(rank)
                    if dist.get_rank(pg) != local:
                        raise RuntimeError(
                            f"process group for mode {mode!r} ranks {ranks} gives rank {rank} "
                            f"local rank {dist.get_rank(pg)}, expected {local}"
                        )
                    memberships[mode_key(mode)] = Membership(ranks, local, pg, cpu_pg)
            if mode_key(mode) not in memberships:
                absent[mode_key(mode)] = groups
    except BaseException:
        for pg in reversed(created):
            dist.destroy_process_group(pg)
        raise
    return ProcessGroups(memberships, absent, created, rank)
