"""1D dropout that draws from the RNG stream matching how its input is distributed.

Megatron-LM (Shoeybi et al. 2019, section 3): dropout on a replicated activation must draw
the same mask on every tensor rank (the default stream, equal across tensor ranks), or the
replicas diverge; dropout on a sharded activation (attention probabilities of a rank's heads,
or any activation under sequence parallelism) must draw independent masks per shard (the
TENSOR stream, different per tensor rank).
"""

from __future__ import annotations

from tessera.context import ParallelContext

from ..shared.base import Module1D
from ..shared.dropout import ParallelDropout

__all__ = ["Dropout1D"]


class Dropout1D(ParallelDropout, Module1D):
    """``torch.nn.Dropout`` with tensor-parallel RNG.

    Args:
        p: Drop probability.
        inplace: As torch's Dropout.
        parallel_input: The input is sharded across the tensor ranks (e.g. after a
            Linear1DCol): draw from ``ctx.seed(ParallelMode.TENSOR)``.
        sequence_parallel: The input is split along the sequence: also the TENSOR stream.
        context: The ParallelContext (default the current one).
    """

    def __init__(
        self,
        p: float = 0.5,
        inplace: bool = False,
        *,
        parallel_input: bool = False,
        sequence_parallel: bool = False,
        context: ParallelContext | None = None,
    ) -> None:
        super().__init__(sequence_parallel=sequence_parallel, context=context)
        self.init_dropout(p, inplace)
        self.parallel_input = parallel_input

    @property
    def sharded_input(self) -> bool:
        """Whether masks differ across tensor ranks."""
        return self.parallel_input or self.sequence_parallel

    def dropout_repr(self) -> str:
        """``p`` and ``parallel_input``, before the 1D summary in ``print(module)``."""
        return f"p={self.p}, parallel_input={self.parallel_input}"
