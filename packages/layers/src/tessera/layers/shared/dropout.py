"""What every tensor-parallel dropout shares: the probability, the forward and its RNG rule.

Megatron-LM (Shoeybi et al. 2019, section 3): a mask over an activation that every tensor rank
holds the same must be the same on every rank (the default stream, equal across tensor
ranks), or the replicas diverge; a mask over an activation whose ranks hold different blocks
must be drawn independently per block (the TENSOR stream, ``ctx.seed(ParallelMode.TENSOR)``,
different per tensor rank). The 1D, 2D, 2.5D, 3D and sequence dropouts differ only in which
holds for their input (:attr:`ParallelDropout.sharded_input`); the rest is written once here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tessera.context import ParallelMode

from ..comm.inflight import tracing
from .base import ParallelModule
from .rank_draws import rank_dropout

__all__ = ["ParallelDropout"]


class ParallelDropout(ParallelModule):
    """Mixin of the parallel dropouts (listed before their mode's base class).

    Attributes (set by :meth:`init_dropout`): ``p`` and ``inplace``, as torch's Dropout.
    """

    p: float
    inplace: bool

    def init_dropout(self, p: float, inplace: bool) -> None:
        """Check ``p`` (torch's message) and keep ``p`` and ``inplace``."""
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
        self.p, self.inplace = p, inplace

    @property
    def sharded_input(self) -> bool:
        """Whether masks differ across tensor ranks (default: every rank holds its own block)."""
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Any shape; the mask is drawn from the TENSOR stream if :attr:`sharded_input`.

        Traced by ``torch.compile``, from the rank's counter stream instead (``rank_draws``).
        """
        if not self.training or self.p == 0.0:
            return x
        if self.sharded_input and tracing():  # a generator's state cannot be traced
            rank = self.context.get_local_rank(ParallelMode.TENSOR)
            return rank_dropout(x, self.p, True, self.inplace, rank=rank)
        if self.sharded_input:
            with self.context.seed(ParallelMode.TENSOR):
                return F.dropout(x, self.p, True, self.inplace)
        return F.dropout(x, self.p, True, self.inplace)

    def dropout_repr(self) -> str:
        """The dropout's own part of ``print(module)``: ``p=..`` (a mode may add its flags)."""
        return f"p={self.p}"

    def extra_repr(self) -> str:
        """:meth:`dropout_repr`, then the mode base's summary where it has one."""
        return ", ".join(part for part in (self.dropout_repr(), super().extra_repr()) if part)
