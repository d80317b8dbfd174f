"""``ParallelModule``: the base of every tensor-parallel layer, whatever its mode.

It holds the context the layer was built for (``context=`` or the current one; construction
never changes global state) and makes parameters that carry their ``ShardInfo``. Mode
families subclass it (``Module1D`` here; 2D, 2.5D and 3D add theirs) and keep their groups.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import ClassVar

import torch
from torch import nn

from tessera.context import ModeLike, ParallelContext, ParallelMode

from ..comm.ops import copy_to_group
from .block_tags import tag_own_blocks
from .context_access import GroupInfo, group_info, resolve_context
from .initializers import Initializer
from .input_checks import check_input
from .shards import new_parameter, shard_info

__all__ = ["Module1D", "ParallelModule"]


def _check_input_hook(module: nn.Module, args: tuple[object, ...]) -> None:
    check_input(module, args)


class ParallelModule(nn.Module):
    """A layer whose parameters and activations are split over some modes of a context.

    Args:
        context: The ParallelContext; default the current one.
        device: Where parameters live; default the context's device.

    Attributes:
        takes_indices: Whether the input holds integer indices (embeddings); the input check
            then requires an integer dtype instead of the parameters' dtype.
    """

    takes_indices: bool = False

    def __init__(
        self,
        context: ParallelContext | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.context = resolve_context(context)
        self.device = torch.device(device) if device is not None else self.context.device
        # Wrong dtype or device: a named ValueError before any matmul or collective.
        self.register_forward_pre_hook(_check_input_hook)
        # Rank 0's state dict loaded on every rank: an error, not its blocks in all of them.
        tag_own_blocks(self)

    def make_parameter(
        self,
        name: str,
        global_shape: Sequence[int],
        initializer: Initializer,
        *,
        fan_in: int,
        fan_out: int,
        splits: Mapping[int, Sequence[ModeLike]] | None = None,
        replicated: Sequence[ModeLike] = (),
        partial_grad: Sequence[ModeLike] = (),
        dtype: torch.dtype | None = None,
    ) -> nn.Parameter:
        """Create parameter ``name`` (full shape ``global_shape``), register it, return it."""
        info = shard_info(
            self.context,
            global_shape,
            splits,
            replicated,
            partial_grad,
            owner=f"{type(self).__name__}.{name}",
        )
        param = new_parameter(
            info, initializer, fan_in=fan_in, fan_out=fan_out, dtype=dtype, device=self.device
        )
        self.register_parameter(name, param)
        return param


class Module1D(ParallelModule):
    """Base of the 1D (Megatron-LM) layers: keeps the 1D group and the sequence-parallel flag.

    Args:
        sequence_parallel: Activations between blocks are split along the sequence dim
            (dim 1 of ``[batch, seq, hidden]``), Korthikanti et al. 2022.
        context: The ParallelContext; default the current one.
        device: Where parameters live; default the context's device.
    """

    #: The dim of ``[batch, seq, hidden]`` that 1D sequence parallelism splits.
    SEQUENCE_DIM = 1
    #: Parameters used on this rank's tokens only under sequence parallelism (a LayerNorm's,
    #: a row layer's bias): their gradient is this rank's part, summed over the 1D group.
    SEQUENCE_SUMMED: ClassVar[tuple[str, ...]] = ()
    #: Set by :meth:`defer_gradient_sum`: that sum is the training loop's.
    sequence_sum_deferred = False

    def __init__(
        self,
        *,
        sequence_parallel: bool = False,
        context: ParallelContext | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__(context, device)
        self.tp: GroupInfo = group_info(self.context, ParallelMode.PARALLEL_1D)
        self.sequence_parallel = sequence_parallel

    def token_dim(self, x: torch.Tensor) -> int:
        """The dim of ``x`` that sequence parallelism splits.

        The sequence of ``[b, s, h]``; the tokens of ``[n, h]``, where a block flattened its
        batch and sequence (a mixture of experts' shared expert): a rank's ``b * s/p`` tokens,
        gathered with the other ranks' and scattered back alike.
        """
        return self.SEQUENCE_DIM if x.dim() > 2 else 0

    @property
    def split_mode(self) -> str:
        """The mode 1D splits parameters over."""
        return ParallelMode.PARALLEL_1D.value

    def summed_over_group(self, param: torch.Tensor) -> torch.Tensor:
        """``param`` routed so that its gradient is summed over the 1D group.

        Through f (``copy_to_group``), whose backward sums it; unchanged once that sum was
        deferred to the training loop.
        """
        return param if self.sequence_sum_deferred else copy_to_group(param, self.tp.group)

    def defer_gradient_sum(self) -> dict[str, list[nn.Parameter]]:
        """Under sequence parallelism, leave the sum of :attr:`SEQUENCE_SUMMED` to the loop.

        Korthikanti et al. 2022 all-reduce these gradients once per optimizer step; in
        autograd it is one all-reduce per layer and backward. Afterwards their ``.grad`` holds
        this rank's tokens' part until the caller sums it over the returned mode (see
        :class:`tessera.context.DefersGradientSum`). Without sequence parallelism nothing is
        partial and nothing is deferred.
        """
        params = [
            p
            for name in self.SEQUENCE_SUMMED
            if isinstance(p := getattr(self, name, None), nn.Parameter)
        ]
        if not self.sequence_parallel or self.tp.world_size == 1 or not params:
            return {}
        self.sequence_sum_deferred = True
        return {self.tp.mode: params}

    def extra_repr(self) -> str:
        """The summary shown by ``print(module)``."""
        sp = ", sequence_parallel=True" if self.sequence_parallel else ""
        return f"tp={self.tp.world_size}{sp}"
