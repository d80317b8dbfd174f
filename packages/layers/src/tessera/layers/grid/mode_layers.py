"""The ``ModeLayers`` the grid modes share: 2D and 2.5D (the mesh) and 3D (the cube).

On every grid an activation between blocks is cut into row blocks over the grid's batch axis
and feature blocks over its hidden axis, the logits into row blocks with every class whole:
the loss, the logits gather and the placements of activations follow from the grid alone.
What differs is how the grid is found and how an activation is cut (``Mesh`` and ``Cube``
lay out their blocks alike but check them their own way), passed in here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tessera.context import ParallelContext

from ..shared.mode_layers import ActivationMap, Cuts, ModeLayers, RoleBuilders
from .base import Grid
from .loss import gather_grid_logits, grid_token_loss

__all__ = ["grid_mode_layers"]


def _check_alike(logits: torch.Tensor, batch: Any, mode: str) -> None:
    """Raise on every rank of the batch group where ``logits`` differ between its ranks.

    Logits as many rows as the targets are whole only if every rank holds the same ones;
    otherwise they are this rank's rows given with this rank's targets, whose mean would be
    this rank's alone (one all-gather of a checksum, on this path only).
    """
    probe = logits.detach().double().sum().reshape(1)
    every = [torch.empty_like(probe) for _ in range(batch.world_size)]
    dist.all_gather(every, probe, group=batch.group)
    if any(not torch.equal(theirs, every[0]) for theirs in every):
        raise ValueError(
            f"token loss under tensor mode {mode!r}: logits {list(logits.shape)} have the "
            "targets' rows but differ between the ranks that split the batch, so they are "
            "this rank's rows: pass the whole batch's targets"
        )


G = TypeVar("G", bound=Grid)


def grid_mode_layers(
    name: str,
    grid_of: Callable[[ParallelContext], G],
    cut: tuple[Callable[[torch.Tensor, G], torch.Tensor], ...],
    *,
    classes: Mapping[str, type[nn.Module]],
    roles: RoleBuilders,
    attention_rows: ActivationMap | None = None,
    rows_to_attention: ActivationMap | None = None,
    two_layouts: bool = False,
    column_cuts: Cuts | None = None,
) -> ModeLayers:
    """A grid mode's ``ModeLayers``.

    Args:
        name: The tensor mode's name.
        grid_of: The context's grid (``mesh_of``, ``cube_of``).
        cut: ``(split, gather, split_batch)`` of an activation on that grid.
        classes: The mode's classes (``TokenEmbedding`` and ``Head`` default to its
            ``Embedding`` and ``Classifier``).
        roles: How ``parallelize`` builds the mode's roles.
        attention_rows: The rows a mask takes where attention runs (default: the batch's).
        rows_to_attention: The rows between blocks to the rows attention runs on, where they
            differ (3D).
        two_layouts: Activations alternate between two layouts (3D).
        column_cuts: The layout of a column layer's output where it is not the one between
            blocks (3D's ``"z"``); ``None``: the same.
    """
    split, gather, split_batch = cut

    def on_grid(fn: Callable[[torch.Tensor, G], torch.Tensor]) -> ActivationMap:
        return lambda x, context: fn(x, grid_of(context))

    def activation_cuts(context: ParallelContext, ndim: int) -> dict[int, tuple[str, ...]]:
        grid = grid_of(context)  # rows over the batch axis, features over the hidden axis
        return {0: (grid.batch_axis.mode,), ndim - 1: (grid.hidden_axis.mode,)}

    def logits_cuts(context: ParallelContext, ndim: int) -> dict[int, tuple[str, ...]]:
        return {0: (grid_of(context).batch_axis.mode,)}  # [b/B, s, V]: every class whole

    def token_loss(
        logits: torch.Tensor,
        targets: torch.Tensor,
        ignore_index: int,
        reduction: str,
        context: ParallelContext,
        vocab_size: int | None,
    ) -> torch.Tensor:
        grid = grid_of(context)  # logits [b/B, s, V]: rows split, every class whole
        if grid.batch_axis.world_size > 1 and logits.shape[:-1] == targets.shape:
            # the whole batch's logits, alike on every rank (a head no plan converted: a
            # part's model, gather_logits'): one process's loss, computed on every rank
            _check_alike(logits, grid.batch_axis, name)
            return F.cross_entropy(
                logits.reshape(-1, logits.shape[-1]),
                targets.reshape(-1),
                ignore_index=ignore_index,
                reduction=reduction,
            )
        rows = split_batch(targets, grid)
        return grid_token_loss(
            logits, rows, grid, name, ignore_index=ignore_index, reduction=reduction
        )

    def gather_logits(logits: torch.Tensor, context: ParallelContext) -> torch.Tensor:
        return gather_grid_logits(logits, grid_of(context))

    named: dict[str, Any] = {"TokenEmbedding": classes["Embedding"], "Head": classes["Classifier"]}
    return ModeLayers(
        name=name,
        split=on_grid(split),
        gather=on_grid(gather),
        split_batch=on_grid(split_batch),
        classes={**named, **classes},
        two_layouts=two_layouts,
        attention_rows=attention_rows if attention_rows is not None else on_grid(split_batch),
        rows_to_attention=rows_to_attention,
        token_loss=token_loss,
        gather_logits=gather_logits,
        roles=roles,
        activation_cuts=activation_cuts,
        column_cuts=column_cuts,
        logits_cuts=logits_cuts,
    )
