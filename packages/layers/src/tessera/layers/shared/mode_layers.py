"""``ModeLayers``: what tessera-layers needs of one tensor mode, owned by the mode's folder.

A tensor mode (``tessera.context.TensorMode``) says how the ranks are arranged; its
``ModeLayers`` says how tensors live on them: the maps between a whole activation or batch
and this rank's block (``split_activation``, ``gather_activation``, ``split_batch``) and the
classes its layers are made of. tessera's five modes register theirs from their folders
(``parallel_1d/``, ``mesh/`` for 2D and 2.5D, ``cube/``, ``sequence/``) through
:func:`register_mode_layers`, the call a user's mode makes too (with
``register_implementation`` for the builder of each dispatching layer); the dispatching code
looks the context's mode up here and never compares its name.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Protocol

import torch
from torch import nn

from tessera.context import ParallelContext

__all__ = [
    "MODE_LAYERS",
    "ActivationMap",
    "Cuts",
    "ModeLayers",
    "RoleBuilders",
    "TokenLoss",
    "check_targets",
    "find_mode_layers",
    "register_mode_layers",
]

#: A whole tensor to this rank's block, or back: ``map(x, context)``.
ActivationMap = Callable[[torch.Tensor, ParallelContext], torch.Tensor]
#: ``loss(logits, targets, ignore_index, reduction, context, vocab_size)``: the whole batch's
#: ``"mean"`` or ``"sum"`` cross-entropy from this rank's logits and the whole batch's targets.
TokenLoss = Callable[
    [torch.Tensor, torch.Tensor, int, str, ParallelContext, "int | None"], torch.Tensor
]


#: ``cuts(context, ndim)``: the groups cutting each dim of an ``ndim``-dim tensor (dims not
#: named are whole), as ``tessera.context.cut_placements`` reads them.
Cuts = Callable[[ParallelContext, int], Mapping[int, tuple[str, ...]]]

#: ``(in_features, out_features, bias)`` of a linear layer.
Dims = tuple[int, int, bool]


class RoleBuilders(Protocol):
    """How ``parallelize`` builds the roles whose layer differs by more than its class.

    conversion/converters.py reads a plain module's sizes, builds what this returns and moves
    the plain weights into it; the mode decides the layer. ``made`` holds the keywords every
    converted layer takes (``dtype``, ``device``, ``context``, the initializers).
    """

    def linear(
        self, dims: Dims, *, row: bool, fused: int, sequence_parallel: bool, **made: Any
    ) -> nn.Module:
        """A column layer (``row=False``: ``col``, ``qkv``, ``gate_up``) or a row layer.

        ``fused``: parts side by side in a column layer's output (q, k, v: 3).
        ``sequence_parallel``: the layer takes or returns sequence-split activations.
        """
        ...

    def dense(self, dims: Dims, **made: Any) -> nn.Module | None:
        """A linear layer that keeps the layout between blocks; ``None``: keep it whole."""
        ...

    def norm(
        self,
        cls: type[nn.Module],
        args: tuple[Any, ...],
        *,
        inner: bool,
        sequence_parallel: bool,
        **where: Any,
    ) -> nn.Module | None:
        """A norm of the mode's class ``cls``; ``None``: keep the plain one.

        ``inner``: it takes a column layer's output. ``sequence_parallel``: inside the span.
        """
        ...

    def head_block(self, context: ParallelContext) -> int:
        """This rank's block of a column layer's output features, and so of the heads."""
        ...


@dataclass(frozen=True)
class ModeLayers:
    """One tensor mode's layers and activation maps.

    Attributes:
        name: The tensor mode's name (``TensorMode.name``).
        split: A whole activation ``[batch, ..., hidden]`` to this rank's block.
        gather: This rank's block back to the whole activation, on every rank.
        split_batch: A whole batch ``[b, ...]`` (token ids, targets, images) to this rank's
            rows.
        classes: Class key (``"Linear"``, ``"VocabParallelEmbedding"``, ...) -> the mode's
            class, for builders shared by several modes (the grid modes' ``dispatch/grid.py``).
        two_layouts: Activations alternate between two layouts from one linear to the next
            (3D's ``"y"`` and ``"z"``), so a norm is told which it takes.
        attention_rows: A whole batch's tensor that attention reads (a mask ``[b, ...]``)
            to the rows attention runs on here; ``None``: the batch is whole there.
        rows_to_attention: This rank's rows of a per-sample tensor between blocks (a mask the
            model's own code made from ``split_batch``'s rows) to the rows attention runs on,
            where the two differ (3D: ``"y"``'s rows to ``"z"``'s); ``None``: they are the same.
        token_loss: The cross-entropy of the logits a converted model returns under the
            mode (``tessera.layers.token_loss``), or ``None`` where it has none.
        gather_logits: Those logits to the whole batch's ``[b, ..., V]`` on every rank
            (``tessera.layers.gather_logits``), or ``None``.
        activation_cuts: ``cuts(context, ndim)``: which groups cut each dim of an activation
            between blocks (``{0: batch groups, ndim - 1: hidden groups}`` on a grid), the
            layout ``split_activation`` makes, as DTensor placements read it
            (``tessera.context.cut_placements``); ``None``: not stated.
        column_cuts: The same for a column layer's output (features split: 1D's
            ``[b, s, F/p]``, 3D's layout ``"z"``); ``None``: as ``activation_cuts``.
        logits_cuts: The same for the logits a head returns (1D's split by vocabulary, the
            grids' by rows with every class whole); ``None``: as ``activation_cuts``.
        roles: How ``parallelize`` builds its roles under the mode, or ``None`` where it
            converts nothing (sequence parallelism keeps every layer whole). With it,
            ``classes`` name ``"TokenEmbedding"``, ``"Head"``, ``"PatchEmbedding"``,
            ``"LayerNorm"`` and ``"RMSNorm"``.
    """

    name: str
    split: ActivationMap
    gather: ActivationMap
    split_batch: ActivationMap
    classes: Mapping[str, type[nn.Module]] = field(default_factory=dict)
    two_layouts: bool = False
    attention_rows: ActivationMap | None = None
    rows_to_attention: ActivationMap | None = None
    token_loss: TokenLoss | None = None
    gather_logits: ActivationMap | None = None
    roles: RoleBuilders | None = None
    activation_cuts: Cuts | None = None
    column_cuts: Cuts | None = None
    logits_cuts: Cuts | None = None


def check_targets(logits: torch.Tensor, targets: torch.Tensor, mode: str | None) -> None:
    """Raise where this rank's ``targets`` do not match the leading dims of its ``logits``."""
    if tuple(logits.shape[:-1]) != tuple(targets.shape):
        raise ValueError(
            f"token loss under tensor mode {mode!r}: logits {list(logits.shape)} do not match "
            f"this rank's targets {list(targets.shape)} (pass the whole batch's targets)"
        )


_REGISTERED: dict[str, ModeLayers] = {}

#: Tensor mode name -> its ``ModeLayers``, read-only (a live view).
MODE_LAYERS: Mapping[str, ModeLayers] = MappingProxyType(_REGISTERED)


def register_mode_layers(layers: ModeLayers, *, replace: bool = False) -> None:
    """Make ``layers`` what the activation maps and shared builders use under its mode.

    Raises:
        ValueError: the mode has ``ModeLayers`` already and ``replace`` is false.
    """
    if layers.name in _REGISTERED and not replace and _REGISTERED[layers.name] is not layers:
        raise ValueError(
            f"register_mode_layers: tensor mode {layers.name!r} has its layers already; pass "
            "replace=True to replace them"
        )
    _REGISTERED[layers.name] = layers


def find_mode_layers(mode: str | None) -> ModeLayers | None:
    """The ``ModeLayers`` registered for ``mode``, or ``None``."""
    return None if mode is None else _REGISTERED.get(mode)
