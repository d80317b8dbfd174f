"""GPipe: every forward, then every backward.

Huang et al. 2019, "GPipe: Efficient Training of Giant Neural Networks using Pipeline Parallelism".

Simplest schedule and the reference for the others: its bubble is (p-1)/(m+p-1) of the step, and
rank 0 holds the activations of all m microbatches at once, which is what 1F1B fixes.
"""

from __future__ import annotations

from collections.abc import Sequence

from tessera.pipeline.actions import Action, ActionKind
from tessera.pipeline.schedule import Schedule

__all__ = ["GPipeSchedule"]


class GPipeSchedule(Schedule):
    """All forwards, then all backwards, in microbatch order, on every rank.

    Rank r (any rank): ``F0 F1 ... F(m-1) B0 B1 ... B(m-1)`` (plus the transfers).

    Args:
        num_microbatches: microbatches per step (m).
        tensor_shape: see :class:`Schedule`.
    """

    def __init__(self, num_microbatches: int, *, tensor_shape: Sequence[int] | None = None) -> None:
        super().__init__(num_microbatches, tensor_shape=tensor_shape)

    def compute_actions(self, pipeline_rank: int, num_stages: int) -> list[Action]:
        """See :class:`GPipeSchedule`."""
        self.check_stages(pipeline_rank, num_stages)
        m = self.num_microbatches
        return [Action(ActionKind.F, i) for i in range(m)] + [
            Action(ActionKind.B, i) for i in range(m)
        ]
