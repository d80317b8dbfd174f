"""Non-interleaved 1F1B.

PipeDream-Flush (Narayanan et al. 2021, "Memory-Efficient Pipeline-Parallel DNN Training"), as
in Megatron-LM.

Same bubble as GPipe, (p-1)/(m+p-1), but rank r holds at most p - r microbatches' activations
instead of m: after a short warm-up of forwards each rank alternates one forward and one backward,
so a microbatch's activations are freed soon after they are made.
"""

from __future__ import annotations

from collections.abc import Sequence

from tessera.pipeline.actions import Action, ActionKind
from tessera.pipeline.schedule import Schedule

__all__ = ["PipelineSchedule", "one_f_one_b_order"]


def one_f_one_b_order(num_microbatches: int, num_warmup: int) -> list[tuple[ActionKind, int]]:
    """The 1F1B order of one rank as (kind, microbatch) pairs.

    Warm-up: forwards 0..w-1; steady state: F(w+i) then B(i) for i in 0..m-w-1; cool-down: the
    remaining w backwards. ``num_warmup`` is capped at ``num_microbatches``.
    """
    m = num_microbatches
    w = min(num_warmup, m)
    order = [(ActionKind.F, i) for i in range(w)]
    for i in range(m - w):
        order += [(ActionKind.F, w + i), (ActionKind.B, i)]
    order += [(ActionKind.B, i) for i in range(m - w, m)]
    return order


class PipelineSchedule(Schedule):
    """1F1B: warm-up of ``num_stages - rank - 1`` forwards (at most m), then one F / one B.

    Example, p=2, m=4: rank 0 ``F0 F1 B0 F2 B1 F3 B2 B3``; rank 1 ``F0 B0 F1 B1 F2 B2 F3 B3``.

    Args:
        num_microbatches: microbatches per step (m).
        tensor_shape: shape of the tensor passed between stages, when known in advance.
    """

    def __init__(self, num_microbatches: int, tensor_shape: Sequence[int] | None = None) -> None:
        super().__init__(num_microbatches, tensor_shape=tensor_shape)

    def compute_actions(self, pipeline_rank: int, num_stages: int) -> list[Action]:
        """See :class:`PipelineSchedule`."""
        self.check_stages(pipeline_rank, num_stages)
        warmup = num_stages - pipeline_rank - 1
        return [Action(k, i) for k, i in one_f_one_b_order(self.num_microbatches, warmup)]
