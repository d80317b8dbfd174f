"""Global positions under tensor mode ``'sequence'`` for a model that counts them itself.

Under ``'sequence'`` rank ``r`` holds tokens ``[r c, (r + 1) c)`` of every sequence. A
transformers model takes ``position_ids``, and the boundary passes this rank's chunk of the
global ones. A model a researcher wrote often takes only the token ids and counts positions
itself (``torch.arange(ids.shape[1])``), which on each rank restarts at 0: every rank's
tokens would be embedded as the first ``c`` of the sequence, without an error.

So such a model's learned position tables (role ``position_embedding``) get their ids moved
to this rank's chunk, ``r c`` on, checked to be ``0 .. c-1`` first (ids counted otherwise,
from a padding mask, say, cannot be told apart from global ones); a model that takes no
``position_ids`` and has no such table (rotary or sinusoidal positions computed in its
forward) is refused by name, since nothing it computes can be reached.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from tessera.context import ParallelContext, ParallelMode

__all__ = ["forward_takes_positions", "install_chunk_positions"]


def forward_takes_positions(model: nn.Module) -> bool:
    """Whether ``model``'s forward takes ``position_ids`` (by name, or through ``**kwargs``)."""
    try:
        parameters = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):  # no signature to read: assume a transformers-like one
        return True
    return any(p.name == "position_ids" or p.kind is p.VAR_KEYWORD for p in parameters)


def install_chunk_positions(
    model: nn.Module, tables: Iterable[str], context: ParallelContext
) -> None:
    """Move the ids of ``tables`` to this rank's chunk of the sequence (see the module doc).

    Raises:
        ValueError: the model counts positions itself and has no position table to move.
    """
    names = list(tables)
    if not names:
        raise ValueError(
            f"parallelize under tensor mode 'sequence': {type(model).__name__}.forward takes no "
            "position_ids and no module has role 'position_embedding', so positions it "
            "computes in its forward (rotary, sinusoidal) would count this rank's chunk from "
            "0; add a position_ids argument to its forward (tessera passes each rank its "
            "chunk of the global positions) or use tensor mode '1d' with sequence_parallel=True"
        )
    rank = context.get_local_rank(ParallelMode.SEQUENCE)

    def to_chunk(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        positions = args[0]
        chunk = positions.shape[-1]
        counted = torch.arange(chunk, device=positions.device)
        if not bool((positions == counted).all()):
            raise ValueError(
                f"{type(module).__name__} under tensor mode 'sequence' got positions other than "
                f"0 .. {chunk - 1}, which tessera cannot place in the whole sequence; let the "
                "model take position_ids (tessera passes each rank its chunk of them)"
            )
        return (positions + rank * chunk, *args[1:])  # [.., c]: r c .. (r + 1) c - 1

    for name in names:
        model.get_submodule(name).register_forward_pre_hook(to_chunk)
