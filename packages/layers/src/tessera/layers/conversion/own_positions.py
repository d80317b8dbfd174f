"""Learned positions read at ids a position module computes in a forward of its own.

BART's ``BartLearnedPositionalEmbedding`` is an ``nn.Embedding`` whose forward counts the
positions itself (``arange(s)`` past the cache, or the decoder's ``position_ids``) and reads its
table two rows further on (Lewis et al. 2020 keep fairseq's offset of the padding index). Its
rows are the same for every sample of the batch. Under 2D, 2.5D and 3D its table becomes the
mode's (its rows split over the features as the activations they are added to), and that table
must be read at the ids the module's own forward would read: so the forward still runs, on a
shell of the module holding no table, and its one lookup (``F.embedding``) is caught before it
reads anything (:class:`CaughtLookup`); the ids it asked for go to the mode's table.

A module is taken only when a probe shows its forward returns exactly its table's rows at the
ids it looked up (:func:`reads_own_ids`): a forward that scaled or added to them would be lost.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

__all__ = ["CaughtLookup", "OwnPositionIds", "reads_own_ids"]


class CaughtLookup(TorchFunctionMode):
    """Catches the ids of the first ``F.embedding`` called while it is active.

    With ``weight`` given the lookup is done on it; without, the ids themselves are returned
    (nothing is read: the shell's table is empty).
    """

    def __init__(self, weight: torch.Tensor | None = None) -> None:
        super().__init__()
        self.weight = weight
        self.ids: list[torch.Tensor] = []

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        """Every function as it is, but ``F.embedding``, whose ids are kept."""
        kwargs = kwargs or {}
        if func is F.embedding:
            ids = args[0] if args else kwargs["input"]
            self.ids.append(ids)
            if self.weight is None:
                return ids
            return F.embedding(ids, self.weight)
        return func(*args, **kwargs)


def _shell(module: nn.Embedding, device: torch.device) -> nn.Module:
    """``module`` without its table: its attributes and forward, its weight an empty tensor."""
    shell = copy.copy(module)
    shell._parameters = {}
    shell._buffers = dict(module._buffers)
    shell._forward_hooks = type(module._forward_hooks)()
    shell._forward_pre_hooks = type(module._forward_pre_hooks)()
    object.__setattr__(shell, "weight", torch.empty(0, device=device))
    return shell


def reads_own_ids(module: nn.Embedding) -> bool:
    """Whether ``module``'s forward returns its table's rows at the ids it looks up, no more.

    Probed on ids ``[2, 5]`` and a random table (on the CPU for a meta module); a forward
    taking other arguments, looking up twice or changing the rows is not one.
    """
    device = torch.device("cpu") if module.weight.is_meta else module.weight.device
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(module.num_embeddings, module.embedding_dim, generator=g).to(device)
    ids = torch.randint(0, module.num_embeddings // 2, (2, 5), generator=g).to(device)
    shell = _shell(module, device)
    object.__setattr__(shell, "weight", weight)
    caught = CaughtLookup(weight)
    try:
        with caught, torch.no_grad():
            got = shell(ids)
    except Exception:  # any failure means "not a lookup at ids of its own"
        return False
    if len(caught.ids) != 1 or not isinstance(got, torch.Tensor):
        return False
    want = F.embedding(caught.ids[0], weight)
    return got.shape == want.shape and torch.equal(got, want)


class OwnPositionIds:
    """A forward pre-hook giving the mode's table the ids the plain module's forward reads.

    Args:
        plain: The plain position module (kept as a shell without its table, see the module
            docstring).
        device: Where the ids are counted (the converted table's device).
    """

    def __init__(self, plain: nn.Embedding, device: torch.device) -> None:
        self.shell = _shell(plain, device)

    def __call__(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """``(ids,)``: what the plain forward looks up, given the model's arguments."""
        caught = CaughtLookup()
        with caught:
            self.shell(*args, **kwargs)
        return (caught.ids[0],), {}

    def __repr__(self) -> str:
        return f"OwnPositionIds({type(self.shell).__name__})"
