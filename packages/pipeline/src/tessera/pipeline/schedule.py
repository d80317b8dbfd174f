"""The schedule interface: a schedule is a plan, the order of compute actions on each rank.

A schedule decides only the ORDER of F, B (and W) on each pipeline rank
(:meth:`Schedule.compute_actions`). Everything else follows from that order by rules every
schedule shares, and the result is an immutable :class:`tessera.pipeline.ActionTable`
(:meth:`Schedule.table`). A schedule runs nothing: :class:`tessera.pipeline.PipelineRunner`
runs its table on the ranks, :func:`tessera.pipeline.simulate` on a model of time.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import ClassVar

from tessera.pipeline.actions import Action
from tessera.pipeline.table import ActionTable, add_communication, check_actions

__all__ = ["Schedule", "add_communication", "check_actions"]


def _check_positive(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


class Schedule(abc.ABC):
    """A pipeline schedule: for each pipeline rank, the order of its compute actions.

    Subclasses implement :meth:`compute_actions` (the order of F, B and W on one rank) and set
    ``splits_backward``; everything else, including the communication actions, is shared. A user's
    own schedule plugs in the same way (and through the ``tessera.schedules`` entry points).

    A schedule is immutable: its numbers are read-only and its tables frozen, so one schedule
    can serve any number of runners and simulations.

    Attributes:
        splits_backward: True when the backward is split into B (input gradient) and W (weight
            gradient); False when ``B`` is the full backward and no ``W`` appears.
    """

    splits_backward: ClassVar[bool] = False

    def __init__(
        self,
        num_microbatches: int,
        *,
        num_chunks: int = 1,
        tensor_shape: Sequence[int] | None = None,
    ) -> None:
        _check_positive("num_microbatches", num_microbatches)
        _check_positive("num_chunks", num_chunks)
        self._num_microbatches = num_microbatches
        self._num_chunks = num_chunks
        self._tensor_shape = (
            None if tensor_shape is None else tuple(int(size) for size in tensor_shape)
        )
        # A memo of the pure function table(p, forward_only): built once, not on every step.
        self._tables: dict[tuple[int, bool], ActionTable] = {}

    #: What a schedule once held and its runner holds now (see the CHANGELOG).
    _RUNNER_SETTINGS = ("fuse_weight_grad", "tensor_dtype", "last_run")

    def __setattr__(self, name: str, value: object) -> None:
        """Refuse what is now the runner's: set on a plan, it would be ignored, silently."""
        if name in self._RUNNER_SETTINGS:
            raise AttributeError(
                f"{name} is a setting of the runner, not of the schedule: pass "
                f"PipelineRunner(schedule, {name}=...) (or set it on the runner)"
                if name != "last_run"
                else "last_run is the runner's: read PipelineRunner(schedule).last_run"
            )
        super().__setattr__(name, value)

    @property
    def num_microbatches(self) -> int:
        """Microbatches per step (m)."""
        return self._num_microbatches

    @property
    def num_chunks(self) -> int:
        """Model chunks per rank (1 unless interleaved)."""
        return self._num_chunks

    @property
    def tensor_shape(self) -> tuple[int, ...] | None:
        """Shape of the one tensor passed between stages when known in advance, else None.

        Known, it lets the runner skip the shape exchange of the first step.
        """
        return self._tensor_shape

    @abc.abstractmethod
    def compute_actions(self, pipeline_rank: int, num_stages: int) -> list[Action]:
        """The ordered F, B (and W) actions of ``pipeline_rank``, without communication."""

    def check_stages(self, pipeline_rank: int, num_stages: int) -> None:
        """Validate ``(pipeline_rank, num_stages)``; subclasses add their own requirements.

        Raises:
            ValueError: the rank is outside ``[0, num_stages)`` or num_stages is not positive.
        """
        _check_positive("num_stages", num_stages)
        if not 0 <= pipeline_rank < num_stages:
            raise ValueError(f"pipeline_rank {pipeline_rank} is outside [0, {num_stages})")

    def table(self, num_stages: int, *, forward_only: bool = False) -> ActionTable:
        """This schedule on ``num_stages`` pipeline ranks, as an immutable table.

        Args:
            num_stages: the pipeline group's size.
            forward_only: the evaluation table: every microbatch's forward, in the schedule's
                forward order, and their transfers; no backward.

        Raises:
            ValueError: the schedule cannot run on this many stages (both numbers named).
        """
        self.check_stages(0, num_stages)
        key = (num_stages, forward_only)
        table = self._tables.get(key)
        if table is None:
            compute = []
            for rank in range(num_stages):
                self.check_stages(rank, num_stages)
                compute.append(self.compute_actions(rank, num_stages))
            table = ActionTable.from_compute(
                compute,
                num_microbatches=self.num_microbatches,
                num_chunks=self.num_chunks,
                splits_backward=self.splits_backward,
                forward_only=forward_only,
            )
            self._tables[key] = table
        return table

    def actions(
        self, pipeline_rank: int, num_stages: int, *, forward_only: bool = False
    ) -> list[Action]:
        """The full ordered action list of ``pipeline_rank``: compute plus communication.

        A copy of ``table(num_stages, forward_only=forward_only).row(pipeline_rank)``.
        """
        self.check_stages(pipeline_rank, num_stages)
        return list(self.table(num_stages, forward_only=forward_only).row(pipeline_rank))

    def action_table(self, num_stages: int, *, forward_only: bool = False) -> list[list[Action]]:
        """Every rank's action list as lists, ``table[rank]`` (copies of :meth:`table`'s rows)."""
        return [list(row) for row in self.table(num_stages, forward_only=forward_only).rows]

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(num_microbatches={self.num_microbatches}, "
            f"num_chunks={self.num_chunks})"
        )
