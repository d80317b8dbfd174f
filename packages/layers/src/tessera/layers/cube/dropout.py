"""Dropout for modes in which every tensor rank holds a different block of an activation.

Under 3D no two ranks hold the same elements of an activation (batch and hidden both split);
under sequence parallelism each rank holds its own sub-sequence. Either way every mask is
drawn from the TENSOR stream (``ctx.seed(ParallelMode.TENSOR)``), which differs per tensor
rank (Megatron-LM's rule for sharded activations).
"""

from __future__ import annotations

from tessera.context import ParallelContext

from ..shared.dropout import ParallelDropout

__all__ = ["Dropout3D", "SequenceDropout", "ShardedDropout"]


class ShardedDropout(ParallelDropout):
    """``torch.nn.Dropout`` drawing from ``ctx.seed(ParallelMode.TENSOR)``.

    Args:
        p: Drop probability.
        inplace: As torch's Dropout.
        context: The ParallelContext (default the current one).
    """

    #: The tensor mode the layer belongs to (checked at construction).
    MODE = "3d"

    def __init__(
        self, p: float = 0.5, inplace: bool = False, *, context: ParallelContext | None = None
    ) -> None:
        super().__init__(context)
        self.init_dropout(p, inplace)
        if self.context.config.tensor_mode != self.MODE:
            raise ValueError(
                f"{type(self).__name__} needs a context with tensor mode {self.MODE!r}, but "
                f"its tensor mode is {self.context.config.tensor_mode!r}"
            )


class Dropout3D(ShardedDropout):
    """3D dropout; see :class:`ShardedDropout`."""

    MODE = "3d"


class SequenceDropout(ShardedDropout):
    """Dropout under sequence parallelism; see :class:`ShardedDropout`."""

    MODE = "sequence"
