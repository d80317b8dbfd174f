"""A parallelized model's state dict names each split tensor's block; loading another's raises.

A parallelized model's ``state_dict()`` holds this rank's blocks under the original names: the
form for a checkpoint of one's own, one file per rank. The plain-PyTorch habit goes wrong
with it silently: ``if rank == 0: torch.save(model.state_dict(), path)``, then every rank
``model.load_state_dict(torch.load(path))`` to resume. Each tensor rank then loads rank 0's
block in place of its own: the shapes agree, nothing raises, the model is another one.

So each split parameter's entry in the state dict carries its block (``global_shape``,
``offsets``, ``local_shape`` of its ``ShardInfo``) as a plain attribute, which ``torch.save``
keeps (``weights_only`` loading too), and ``load_state_dict`` refuses, before anything is
copied, an entry naming another block than the one this rank holds, saying what to do
(one file per rank, or the gathered state dict). Entries without it (a plain model's, a
safetensors file's, a full state dict's) are loaded as before: their shapes are checked by
torch.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tessera.context import get_shard_info

__all__ = ["BLOCK_ATTR", "install_block_tags"]

#: The attribute of a state-dict tensor naming its block: ``(global shape, offsets, shape)``.
BLOCK_ATTR = "_tessera_block"

_Block = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]


def _blocks(module: nn.Module, prefix: str) -> dict[str, _Block]:
    """The state-dict key of each split parameter of ``module`` under ``prefix``, its block."""
    blocks: dict[str, _Block] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        info = get_shard_info(param)
        if info is not None and info.is_sharded:
            shape = (tuple(info.global_shape), tuple(info.offsets), tuple(info.local_shape))
            blocks[prefix + name] = shape
    return blocks


def install_block_tags(model: nn.Module) -> None:
    """Tag ``model``'s state-dict entries with their blocks; refuse loading another's."""

    def tag(module: nn.Module, state: dict[str, Any], prefix: str, metadata: Any) -> None:
        for key, block in _blocks(module, prefix).items():
            value = state.get(key)
            if isinstance(value, torch.Tensor):
                setattr(value, BLOCK_ATTR, block)

    def check(
        module: nn.Module, state: dict[str, Any], prefix: str, *args: Any, **kwargs: Any
    ) -> None:
        for key, mine in _blocks(module, prefix).items():
            given = getattr(state.get(key), BLOCK_ATTR, None)
            if given is None or tuple(given) == mine:
                continue
            _, offsets, shape = given
            raise ValueError(
                f"load_state_dict: {key!r} holds the block of {list(shape)} at offsets "
                f"{list(offsets)} of the {list(mine[0])} parameter, saved by another rank; "
                f"this rank holds the one at {list(mine[1])}, and would load the other in its "
                "place without an error (a state dict saved by rank 0 alone, loaded on every "
                "rank). Save and load one file per rank (each rank's own state_dict()), or "
                "the whole model: gather_full_state_dict(model) to save, "
                "load_full_state_dict(model, state) to load"
            )

    model.register_state_dict_post_hook(tag)  # type: ignore[no-untyped-call]
    model.register_load_state_dict_pre_hook(check)  # type: ignore[no-untyped-call]
