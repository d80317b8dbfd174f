"""State dicts name each split tensor's block; loading another rank's block raises.

A state dict of tensor-parallel layers holds this rank's blocks under the original names: the
form for a checkpoint of one's own, one file per rank. The plain-PyTorch habit goes wrong
with it silently: ``if rank == 0: torch.save(model.state_dict(), path)``, then every rank
``model.load_state_dict(torch.load(path))`` to resume. Each tensor rank then loads rank 0's
block in place of its own: the shapes agree, nothing raises, the model is another one.

So each split parameter's entry carries its block (``global_shape``, ``offsets``,
``local_shape`` of its ``ShardInfo``) as a plain attribute, which ``torch.save`` keeps
(``weights_only`` loading too), and ``load_state_dict`` refuses an entry naming another
block than the one this rank holds, saying what to do (one file per rank, or the gathered
state dict). Entries without it (a plain model's, a safetensors file's, a full state dict's)
are loaded as before: their shapes are checked by torch.

The hooks sit on each module that owns split parameters (every tessera layer registers them
when it is built; ``parallelize`` on the modules it splits), so the state dict of any module
holding them is tagged: a whole model of one's own, a submodule (``model.transformer``), a
layer. A parallelized model's root checks every entry as well, so a refusal there comes
before anything is copied; elsewhere before the owning module's tensors are.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tessera.context import get_shard_info

__all__ = ["BLOCK_ATTR", "install_block_tags", "tag_own_blocks"]

#: The attribute of a state-dict tensor naming its block: ``(global shape, offsets, shape)``.
BLOCK_ATTR = "_tessera_block"

#: Set on a module whose own parameters are tagged, so its hooks are registered once.
_TAGGED_ATTR = "_tessera_blocks_tagged"

_Block = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]


def _blocks(module: nn.Module, prefix: str, *, recurse: bool) -> dict[str, _Block]:
    """The state-dict key of each split parameter of ``module`` under ``prefix``, its block."""
    blocks: dict[str, _Block] = {}
    for name, param in module.named_parameters(remove_duplicate=False, recurse=recurse):
        info = get_shard_info(param)
        if info is not None and info.is_sharded:
            shape = (tuple(info.global_shape), tuple(info.offsets), tuple(info.local_shape))
            blocks[prefix + name] = shape
    return blocks


def _tag(module: nn.Module, state: dict[str, Any], prefix: str, metadata: Any) -> None:
    for key, block in _blocks(module, prefix, recurse=False).items():
        value = state.get(key)
        if isinstance(value, torch.Tensor):
            setattr(value, BLOCK_ATTR, block)


def _refuse_other_blocks(
    module: nn.Module, state: dict[str, Any], prefix: str, *, recurse: bool
) -> None:
    for key, mine in _blocks(module, prefix, recurse=recurse).items():
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


def _check_own(module: nn.Module, state: dict[str, Any], prefix: str, *args: Any) -> None:
    _refuse_other_blocks(module, state, prefix, recurse=False)


def _check_all(module: nn.Module, state: dict[str, Any], prefix: str, *args: Any) -> None:
    _refuse_other_blocks(module, state, prefix, recurse=True)


def tag_own_blocks(module: nn.Module) -> None:
    """Tag the state-dict entries of ``module``'s own split parameters; refuse another's.

    Looked up when the state dict is made or loaded, so parameters registered (or given
    their ``ShardInfo``) after this call are covered. Idempotent.
    """
    if module.__dict__.get(_TAGGED_ATTR, False):
        return
    module.__dict__[_TAGGED_ATTR] = True
    module.register_state_dict_post_hook(_tag)  # type: ignore[no-untyped-call]
    module.register_load_state_dict_pre_hook(_check_own)  # type: ignore[no-untyped-call]


def install_block_tags(model: nn.Module) -> None:
    """Tag every split parameter's entry of ``model`` and of each of its submodules.

    ``model`` checks all its entries before anything is loaded; each owning module checks its
    own (for a submodule's state dict loaded into that submodule).
    """
    for module in model.modules():
        if _blocks(module, "", recurse=False):
            tag_own_blocks(module)
    model.register_load_state_dict_pre_hook(_check_all)  # type: ignore[no-untyped-call]
