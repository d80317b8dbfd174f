"""Dropout in a model someone else wrote: each mask from the random numbers its activation needs.

A plain model draws every dropout mask from torch's global generator, which the context seeds
alike on every tensor rank. That is right for an activation every tensor rank holds whole
(replicated: the masks must agree, or the replicas drift apart) and wrong for one split across
the ranks: each shard would get the same mask pattern, so the shards' masks are correlated and
the model trains with a dropout no single process would draw (Megatron-LM, Shoeybi et al.
2019, section 3, keeps a separate generator for split activations).

So ``parallelize`` forks the generator over each region of the forward whose activations are
split: on entering, one number is drawn from the global generator (the same on every tensor
rank) and the generator is reseeded from it and the tensor rank; on leaving, the global state
is put back. Every random draw in the region (``nn.Dropout`` modules, the dropout inside an
attention function, anything else) then differs across tensor ranks, and the model's own code
and modules stay as they are. Because the fork is seeded from the global generator, activation
checkpointing that replays the global state (torch's, transformers') replays the masks too.

The split regions:

* ``2d``, ``2.5d``, ``3d``, ``sequence``: the whole forward (every rank holds another block
  or another chunk of tokens);
* ``1d`` with ``sequence_parallel``: the sequence span;
* ``1d``: from a column layer's output to the next row layer's input (attention
  probabilities, an MLP's hidden activation); everything else is replicated and keeps the
  global generator, also inside an attention module after its output layer (GPT-2's
  ``resid_dropout``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from tessera.context import ParallelContext, ParallelMode, derive_seed, find_tensor_mode

from ..comm.inflight import tracing
from ..shared.rank_draws import RankDraws
from .plan import COLUMN_ROLES

__all__ = ["RANK_FORK_ATTR", "RankFork", "fork_each_layer", "install_dropout_streams"]

#: The attribute of a parallelized model holding its :class:`RankFork`. Where the fork spans
#: the whole forward (the mesh, cube and sequence modes: ``fork.whole_forward``) pipeline
#: stages fork per layer.
RANK_FORK_ATTR = "_tessera_rank_fork"


def _all_split(mode: str) -> bool:
    """Whether every activation is split across the tensor ranks (features, or tokens).

    Not 1D's, whole between its column-to-row pairs.
    """
    kind = find_tensor_mode(mode)
    return kind is not None and (kind.splits_activations or kind.splits_sequence)


class RankFork:
    """Forks torch's generators into a tensor-rank-distinct, replayable state, and back.

    A generator's state cannot be traced, so under ``torch.compile`` the region does not fork:
    it enters :class:`~tessera.layers.shared.rank_draws.RankDraws`, which answers its draws
    from the rank's counter stream inside the graph. It costs the compiled graph nothing, and
    is entered whatever the model (a draw in the model's own code, a drop path, would
    otherwise be alike on every rank while traced, and each rank's own eagerly).

    Args:
        context: Gives the tensor rank and the device whose generator dropout uses.
    """

    def __init__(self, context: ParallelContext) -> None:
        self._rank = context.get_local_rank(ParallelMode.TENSOR)
        self._cuda = context.device if context.device.type == "cuda" else None
        self._saved: tuple[torch.Tensor, torch.Tensor | None] | None = None
        #: Made once: Dynamo traces entering a mode, not building one.
        self._draws = RankDraws(self._rank)
        self._drawing = False
        #: Answer the draws from the counter streams in eager runs too (compiled and eager
        #: steps then draw the same masks: a check of a compiled step against eager). Not
        #: with activation checkpointing: its recompute runs outside the region.
        self.streams_in_eager = False
        #: Whether the region is the model's whole forward (set by install_dropout_streams).
        self.whole_forward = False

    @property
    def active(self) -> bool:
        """Whether the generators are forked now (or the draws answered from the streams)."""
        return self._saved is not None or self._drawing

    def enter(self, *_: Any) -> None:
        """Fork (no-op when forked already): same draw on every rank, then a rank's seed."""
        if self._saved is not None or self._drawing:
            return
        if tracing() or self.streams_in_eager:
            self._drawing = True
            self._draws.enter_region()
            return
        draw = int(torch.randint(0, 2**62, (1,)))  # the global generator: alike on every rank
        cuda_state = torch.cuda.get_rng_state(self._cuda) if self._cuda is not None else None
        self._saved = (torch.default_generator.get_state(), cuda_state)
        seed = derive_seed(draw, "tensor_dropout", 0, self._rank)
        # The CPU generator alone: torch.manual_seed would also queue a lazy seed of every
        # CUDA / XPU / MTIA device, formatting a stack trace for each (~0.7 ms a call).
        torch.default_generator.manual_seed(seed)
        if self._cuda is not None:
            with torch.cuda.device(self._cuda):
                torch.cuda.manual_seed(seed)

    def leave(self, *_: Any) -> None:
        """Put the global generators back where the fork left them (no-op when not forked)."""
        if self._drawing:
            self._drawing = False
            self._draws.leave_region()
            return
        if self._saved is None:
            return
        cpu_state, cuda_state = self._saved
        self._saved = None
        torch.default_generator.set_state(cpu_state)
        if self._cuda is not None and cuda_state is not None:
            torch.cuda.set_rng_state(cuda_state, self._cuda)


def install_dropout_streams(
    model: nn.Module,
    context: ParallelContext,
    mode: str,
    roles: Mapping[str, str],
    sequence_parallel: bool = False,
    span: tuple[str, str] | None = None,
) -> RankFork:
    """Fork the generators over the split regions of ``model`` (see the module docstring).

    Args:
        model: The model being parallelized (its modules converted already).
        context: Its context.
        mode: The tensor mode.
        roles: The plan's roles by module name (``"col"``, ``"qkv"``, ``"row"``, ...).
        sequence_parallel: 1D sequence parallelism is on.
        span: Its first and last module of the sequence span (``None``: the whole model, as
            for a plan of a block that takes and returns activations).

    Returns:
        The fork, for tests and for a caller that needs to know whether it is active.
    """
    fork = RankFork(context)
    # A forward that raised inside a region must not leave the next one forked.
    model.register_forward_pre_hook(fork.leave)
    if _all_split(mode) or (sequence_parallel and span is None):
        model.register_forward_pre_hook(fork.enter)
        model.register_forward_hook(fork.leave, always_call=True)
        fork.whole_forward = True
    elif sequence_parallel and span is not None:
        model.get_submodule(span[0]).register_forward_pre_hook(fork.enter)
        model.get_submodule(span[1]).register_forward_hook(fork.leave, always_call=True)
    else:
        for name, role in roles.items():
            layer = model.get_submodule(name)
            if role in COLUMN_ROLES:
                layer.register_forward_hook(fork.enter)
            elif role == "row":
                layer.register_forward_pre_hook(fork.leave)
        model.register_forward_hook(fork.leave, always_call=True)
    setattr(model, RANK_FORK_ATTR, fork)
    return fork


def fork_each_layer(model: nn.Module, layers: nn.Module) -> None:
    """Fork around each of ``layers`` (pipeline stages' layers cut from ``model``).

    A model whose fork spans its whole forward is run layer by layer by a pipeline, without
    that forward; each layer then forks on its own (a fresh draw from the global generator
    each, so checkpointing still replays them).
    """
    fork = getattr(model, RANK_FORK_ATTR, None)
    if not isinstance(fork, RankFork) or not fork.whole_forward:
        return  # 1D: the column and row layers' own hooks fork, whoever calls them
    for layer in layers.children():
        layer.register_forward_pre_hook(fork.enter)
        layer.register_forward_hook(fork.leave, always_call=True)
