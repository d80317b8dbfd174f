"""Interleaved 1F1B.

Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM", section 2.2.

Each rank holds v model chunks (virtual stages r, r+p, ..., r+(v-1)p), so a microbatch crosses
every rank v times with 1/v of the work each time. The pipeline fills v times faster and the
bubble shrinks to (p-1)/(v*m+p-1), paid for with v times more point-to-point messages.
"""

from __future__ import annotations

from collections.abc import Sequence

from tessera.pipeline.actions import Action, ActionKind
from tessera.pipeline.schedule import Schedule

__all__ = ["InterleavedPipelineSchedule"]


class InterleavedPipelineSchedule(Schedule):
    """Megatron-LM's interleaved 1F1B over ``num_model_chunks`` chunks per rank.

    Work is counted in (microbatch, chunk) units, ``m * v`` of each direction per rank. Forwards
    go in groups of p microbatches through chunk 0, then the same group through chunk 1, ...,
    then the next group; the k-th forward is microbatch ``(k // (p*v)) * p + k % p`` of chunk
    ``(k % (p*v)) // p``. Backwards take the same order with the chunks reversed (v-1 first).
    Rank r warms up with ``min((p - r - 1) * 2 + (v - 1) * p, m * v)`` forwards, then alternates
    one forward and one backward, then drains the remaining backwards.

    Example, p=2, v=2, m=4, written ``F<microbatch>:<chunk>`` (chunk 0 unwritten):
    rank 0 ``F0 F1 F0:1 F1:1 F2 B0:1 F3 B1:1 F2:1 B0 F3:1 B1 B2:1 B3:1 B2 B3``.

    Args:
        num_microbatches: microbatches per step (m); must be a multiple of the number of stages,
            checked when the stage count is known (:meth:`actions`).
        num_model_chunks: model chunks per rank (v).
        tensor_shape: see :class:`Schedule`.
    """

    def __init__(
        self,
        num_microbatches: int,
        num_model_chunks: int,
        *,
        tensor_shape: Sequence[int] | None = None,
    ) -> None:
        super().__init__(num_microbatches, num_chunks=num_model_chunks, tensor_shape=tensor_shape)

    @property
    def num_model_chunks(self) -> int:
        """Model chunks per rank (v); the same as ``num_chunks``."""
        return self.num_chunks

    def check_stages(self, pipeline_rank: int, num_stages: int) -> None:
        """Also require ``num_microbatches % num_stages == 0`` (microbatches go in groups of p).

        Raises:
            ValueError: naming both numbers when m is not a multiple of p.
        """
        super().check_stages(pipeline_rank, num_stages)
        if self.num_microbatches % num_stages:
            raise ValueError(
                f"interleaved 1F1B needs num_microbatches to be a multiple of the number of "
                f"pipeline stages: {self.num_microbatches} % {num_stages} = "
                f"{self.num_microbatches % num_stages}, expected 0"
            )

    def _unit(self, k: int, num_stages: int, forward: bool) -> tuple[int, int]:
        p, v = num_stages, self.num_chunks
        in_group = k % (p * v)
        chunk = in_group // p
        if not forward:
            chunk = v - 1 - chunk
        return (k // (p * v)) * p + k % p, chunk

    def compute_actions(self, pipeline_rank: int, num_stages: int) -> list[Action]:
        """See :class:`InterleavedPipelineSchedule`."""
        self.check_stages(pipeline_rank, num_stages)
        p, v = num_stages, self.num_chunks
        total = self.num_microbatches * v
        warmup = min((p - pipeline_rank - 1) * 2 + (v - 1) * p, total)

        def fwd(k: int) -> Action:
            return Action(ActionKind.F, *self._unit(k, p, forward=True))

        def bwd(k: int) -> Action:
            return Action(ActionKind.B, *self._unit(k, p, forward=False))

        order = [fwd(k) for k in range(warmup)]
        for k in range(total - warmup):
            order += [fwd(warmup + k), bwd(k)]
        order += [bwd(k) for k in range(total - warmup, total)]
        return order
