"""Zero bubble ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", section 3.1).

The backward of a stage has two halves: B, the gradient with respect to the stage's input, which
the previous stage waits for, and W, the gradient with respect to the weights, which nobody waits
for. ZB-H1 runs 1F1B on F and B and defers W to fill the bubbles, reducing the idle time per rank
from 1F1B's (p-1)(T_F + T_B + T_W) to (p-1)(T_F + T_B - T_W), i.e. to a third with equal costs.

Memory accounting (the paper's ZB-H1 constraint). A microbatch's activations are held from its F
until its LAST backward piece, W (W needs the stage inputs and the output gradients that B used),
so a microbatch is "in flight" on a rank from F until W. 1F1B holds p - r in flight on rank r, p on
rank 0. ZB-H1 lets rank r defer up to r weight gradients, so every rank holds at most
(p - r - 1) + 1 + r = p in flight: the pipeline's peak, rank 0's, is unchanged. (The paper counts
memory the same way: M_B after F, M_W of it still held after B until W.)
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from tessera.pipeline.actions import Action, ActionKind
from tessera.pipeline.one_f_one_b import one_f_one_b_order
from tessera.pipeline.schedule import Schedule

__all__ = ["ZeroBubbleSchedule"]


class ZeroBubbleSchedule(Schedule):
    """ZB-H1: 1F1B on F and B, with rank r keeping up to r weight gradients W deferred.

    Order on rank r: the 1F1B order of F and B (warm-up of ``p - r - 1`` forwards); after each B
    in the steady state, W's of the oldest pending microbatches run until at most r are pending;
    after each B of the cool-down, one pending W runs (filling the wait for the next gradient);
    the rest run at the end.

    Example, p=2, m=3: rank 0 ``F0 F1 B0 W0 F2 B1 W1 B2 W2``; rank 1
    ``F0 B0 F1 B1 W0 F2 B2 W1 W2``.

    Args:
        num_microbatches: microbatches per step (m).
        tensor_shape: see :class:`Schedule`.
    """

    splits_backward = True

    def __init__(self, num_microbatches: int, *, tensor_shape: Sequence[int] | None = None) -> None:
        super().__init__(num_microbatches, tensor_shape=tensor_shape)

    def compute_actions(self, pipeline_rank: int, num_stages: int) -> list[Action]:
        """See :class:`ZeroBubbleSchedule`."""
        self.check_stages(pipeline_rank, num_stages)
        m = self.num_microbatches
        warmup = min(num_stages - pipeline_rank - 1, m)
        steady_backwards = m - warmup
        pending: deque[int] = deque()
        order: list[Action] = []
        backwards_done = 0
        for kind, microbatch in one_f_one_b_order(m, warmup):
            order.append(Action(kind, microbatch))
            if kind is not ActionKind.B:
                continue
            backwards_done += 1
            pending.append(microbatch)
            if backwards_done <= steady_backwards:
                while len(pending) > pipeline_rank:
                    order.append(Action(ActionKind.W, pending.popleft()))
            else:
                order.append(Action(ActionKind.W, pending.popleft()))
        order += [Action(ActionKind.W, microbatch) for microbatch in pending]
        return order
