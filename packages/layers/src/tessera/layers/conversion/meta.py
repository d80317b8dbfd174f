"""Models larger than one rank: build the parameters on the meta device, materialize shards.

``parallelize`` cuts each shard from a module's weights. A model too large for one rank is
built with :func:`meta_parameters`: its parameters on the meta device (no memory), its buffers
real (rotary frequencies, position ids: computed in ``__init__`` and often left out of the
state dict, so they could not be recovered later). ``parallelize`` then allocates only this
rank's shard of each converted parameter, on the context's device, drawn by the layer's
initializer (which draws one full parameter at a time, so the peak is the largest single
parameter), and allocates and initializes the few modules it keeps whole
(``reset_parameters``, or the transformers model's ``_init_weights``, seeded alike on every
rank). Without a tensor mode ``parallelize`` allocates nothing: :func:`~tessera.layers.
load_pretrained` allocates what the rank holds (the whole model, a pipeline stage, or ZeRO-3's
rows) and reads it. Load real weights next with ``load_pretrained`` (each rank reads its
slices) or ``load_full_state_dict`` (each rank reads the full tensors and keeps its blocks).
"""

from __future__ import annotations

from collections.abc import Collection, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from ..state.materialize import initialize_meta_modules

__all__ = ["check_meta_buffers", "materialize_whole_modules", "meta_parameters"]


@contextmanager
def meta_parameters() -> Iterator[None]:
    """Inside this block, every parameter a module registers is moved to the meta device.

    Each parameter is still created by its module's own code (one at a time, freed at once),
    and buffers stay where that code puts them. Not thread-safe: it swaps
    ``nn.Module.register_parameter`` for the duration of the block.
    """
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            param = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
        original(module, name, param)

    nn.Module.register_parameter = register  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def check_meta_buffers(model: nn.Module) -> None:
    """Buffers on the meta device cannot be recovered: refuse them before converting anything.

    Raises:
        ValueError: naming the meta buffers and how to build the model instead.
    """
    meta = [name for name, buffer in model.named_buffers() if buffer.is_meta]
    if meta:
        raise ValueError(
            f"parallelize: the buffers {meta[:4]}{' ...' if len(meta) > 4 else ''} are on the "
            "meta device, and their values (computed when the model was built) cannot be "
            "recovered. Build the model inside tessera.layers.meta_parameters() instead of "
            "torch.device('meta'): parameters on meta, buffers real"
        )


def materialize_whole_modules(
    model: nn.Module,
    device: torch.device,
    names: Collection[str] | None = None,
    *,
    seed: int = 0,
) -> None:
    """Allocate and initialize the parameters ``parallelize`` left whole and on meta.

    Each module draws from a generator seeded by ``seed`` and its name
    (:func:`~tessera.layers.state.materialize.initialize_meta_modules`): the tensor ranks,
    which all hold it whole, draw the same values whatever their own generators hold.

    Args:
        model: The model.
        device: Where to allocate them.
        names: Only these modules (default: every module). A module that ``parallelize``
            keeps whole but wraps (a router under sequence parallelism) is materialized
            before it is wrapped: the model's ``_init_weights`` knows the plain module's class.
        seed: The seed every rank shares (the context's ``base_seed``).

    Raises:
        ValueError: a module has neither ``reset_parameters`` nor an ``_init_weights`` on the
            model that covers it.
    """
    chosen = [(n, m) for n, m in model.named_modules() if names is None or n in names]
    initialize_meta_modules(
        chosen, device, seed, init_weights=getattr(model, "_init_weights", None)
    )
