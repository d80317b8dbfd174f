"""Parameters left on the meta device, given storage in place and, where nothing reads them, values.

A model built inside :func:`~tessera.layers.meta_parameters` holds no memory until some step
allocates it: ``parallelize`` under a tensor mode (this rank's shards), else
:func:`~tessera.layers.load_pretrained` (whatever this rank holds: the whole model under data
parallelism, its stage under a pipeline, its rows under ZeRO-3 once ``initialize`` has
sharded the model on meta). Both allocate through :func:`allocate`, which keeps the
parameter's identity (``torch.utils.swap_tensors``): a weight tied to another stays tied, an
optimizer built on the meta parameters steps the real ones, and FSDP2 finds its sharded
parameter where it left it.

What no checkpoint fills (the modules ``parallelize`` keeps whole, a head the checkpoint
lacks) is initialized by :func:`initialize_meta_modules`: the module's ``reset_parameters``
or the transformers model's ``_init_weights``, drawn from a generator seeded by the context's
seed and the module's name. Every rank therefore draws the same values without
communicating, whatever its own generator holds (each rank's generator may differ: the
replicas of a tensor left whole would otherwise start apart, and nothing but the engine's
check would notice). Buffers are never on meta (``meta_parameters`` leaves them real:
computed in ``__init__``, alike on every rank), so none needs values here.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from tessera.context import derive_seed

__all__ = ["allocate", "initialize_meta_modules"]


@contextmanager
def _seeded(device: torch.device, seed: int) -> Iterator[None]:
    """The CPU generator (and ``device``'s on CUDA) seeded with ``seed``, restored after."""
    cuda = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda):
        # not torch.manual_seed: it would also seed every other CUDA device, unrestored
        torch.default_generator.manual_seed(seed)
        if cuda:
            with torch.cuda.device(device):
                torch.cuda.manual_seed(seed)
        yield


def allocate(param: torch.Tensor, device: torch.device) -> None:
    """Give the meta ``param`` uninitialized storage on ``device``, in place.

    The Python object stays the same (its holders, ties and optimizers keep it) and so do its
    attributes (ShardInfo, FullForm). A DTensor (FSDP2's sharded parameter) gets storage for
    its local part only.
    """
    if not param.is_meta:
        return
    fresh = torch.empty_like(param, device=device)
    if isinstance(param, nn.Parameter):
        fresh = nn.Parameter(fresh, requires_grad=param.requires_grad)
    marks = dict(vars(param))
    # swaps the attributes too: put them back
    torch.utils.swap_tensors(param, fresh)  # type: ignore[no-untyped-call]
    vars(param).update(marks)


def initialize_meta_modules(
    modules: Iterable[tuple[str, nn.Module]],
    device: torch.device,
    seed: int,
    *,
    init_weights: object = None,
    skip: Collection[int] = (),
    caller: str = "parallelize",
) -> list[str]:
    """Allocate and initialize each module holding parameters on meta; returns their names.

    Args:
        modules: ``(name, module)`` pairs (``model.named_modules()``).
        device: Where to allocate.
        seed: The seed every rank shares (the context's ``base_seed``); each module draws
            from ``derive_seed(seed, name)``, so the values do not depend on the rank, on its
            generator, or on which other modules are initialized.
        init_weights: The transformers model's ``_init_weights``, for modules without
            ``reset_parameters``.
        skip: ``id()`` of meta parameters that will be read whole from elsewhere: a module
            all of whose meta parameters are in it is left for its reader to allocate.
        caller: The function named in errors.

    Raises:
        ValueError: a module has neither ``reset_parameters`` nor an ``init_weights``
            (the message starts with ``caller``).
    """
    done = []
    for name, module in modules:
        meta = [p for p in module.parameters(recurse=False) if p.is_meta]
        if not meta or all(id(p) in skip for p in meta):
            continue
        for p in meta:
            allocate(p, device)
        reset = getattr(module, "reset_parameters", None)
        if not callable(reset):
            reset = (lambda m=module: init_weights(m)) if callable(init_weights) else None
        if reset is None:
            raise ValueError(
                f"{caller}: {name or 'the model'} ({type(module).__name__}) was built on "
                "the meta device and has no reset_parameters to initialize it; give it one, "
                "or build the model with real parameters"
            )
        with _seeded(device, derive_seed(seed, "meta-init", name)), torch.no_grad():
            reset()
        done.append(name)
    return done
