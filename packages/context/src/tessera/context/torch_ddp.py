"""``DistributedDataParallel`` over ranks that hold other blocks of tessera's split parameters.

A data-parallel script wraps its model in ``DistributedDataParallel(model)``, whose group is the
whole world by default. Around a model tessera split, the world holds the other tensor ranks
too, whose parameters are other blocks of the same weights (equal shapes, so DDP's own check
passes): DDP would broadcast one rank's blocks over all of them at construction and average
the gradients of different blocks at every step. The model would be destroyed without an
error.

So the first split parameter tessera describes (:func:`~.shard.set_shard_info`) wraps DDP's
constructor: given a module holding a parameter whose ``ShardInfo`` splits it, and a group
(the ``process_group`` argument, else the ``device_mesh``'s, else the world) holding more than
one rank of this rank's tensor group under the current context (else the context its layers
were built under), it raises, saying to pass the data replicas' group. Without a context
nothing is checked.
"""

from __future__ import annotations

import functools
import inspect
import sys
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from .context import ParallelContext

__all__ = ["guard_torch_ddp"]

#: Set on the wrapper: DDP's constructor is wrapped already.
_WRAPPED = "_tessera_checks_groups"


def _holds_split_parameter(module: torch.nn.Module) -> bool:
    from .torch_clipping import is_split

    return any(is_split(p) for p in module.parameters())


def _context_of(module: torch.nn.Module) -> ParallelContext | None:
    """The context a module's parts were built under, if any.

    tessera's layers hold it as ``context``; ``parallelize`` sets ``_tessera_context`` on the
    model.
    """
    from .context import ParallelContext

    for part in module.modules():
        for name in ("_tessera_context", "context"):
            found = vars(part).get(name)
            if isinstance(found, ParallelContext):
                return found
    return None


def _check_group(module: torch.nn.Module, group: Any) -> None:
    """Raise where ``group`` holds more than one rank of this rank's tensor group."""
    from .grad_norm import resolve_context
    from .modes import ParallelMode

    context = resolve_context(None) or _context_of(module)
    if context is None or not dist.is_initialized() or not _holds_split_parameter(module):
        return
    if not context.is_initialized(ParallelMode.TENSOR):
        return
    tensor = set(dist.get_process_group_ranks(context.get_group(ParallelMode.TENSOR)))
    given = dist.group.WORLD if group is None else group
    shared = sorted(tensor & set(dist.get_process_group_ranks(given)))
    if len(shared) > 1:
        raise ValueError(
            f"DistributedDataParallel over a process group holding ranks {shared} of this "
            "rank's tensor-parallel group: they hold other blocks of the parameters tessera "
            "split, so DDP would broadcast one rank's blocks over the others and average the "
            "gradients of different blocks. Pass process_group=ctx.get_group(ParallelMode.DATA) "
            "(the data replicas), or let tessera.engine.initialize wrap the model"
            + (_TRAINER if _called_from("accelerate", "transformers") else "")
        )


#: Said where accelerate (transformers' ``Trainer``) builds the DDP.
_TRAINER = (
    ". transformers' Trainer (through accelerate) wraps the model in DDP over every rank and "
    "gives each rank other batches, where tensor ranks need the same ones: it cannot train "
    "a tensor-parallel model. Train it with tessera.engine, or a loop of your own "
    "(docs/your-own-loop.md), where model(**batch, labels=...).loss works as with the Trainer"
)


def _called_from(*packages: str) -> bool:
    """Whether a frame of any of ``packages`` is on the stack (the caller of DDP)."""
    frame = sys._getframe(1)
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if module.split(".")[0] in packages:
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


def guard_torch_ddp() -> None:
    """Wrap ``DistributedDataParallel.__init__`` as the module docstring says (once)."""
    from torch.nn.parallel import DistributedDataParallel

    original = DistributedDataParallel.__init__
    if getattr(original, _WRAPPED, False):
        return
    signature = inspect.signature(original)

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        try:
            bound = signature.bind(self, *args, **kwargs)
        except TypeError:
            bound = None  # torch's constructor reports it
        if bound is not None:
            group = bound.arguments.get("process_group")
            mesh = bound.arguments.get("device_mesh")
            if group is None and mesh is not None:  # DDP's own reading of a mesh
                group = mesh.get_group(mesh_dim=0)
            _check_group(bound.arguments["module"], group)
        original(self, *args, **kwargs)

    setattr(__init__, _WRAPPED, True)
    wrapped: Any = __init__
    DistributedDataParallel.__init__ = wrapped  # type: ignore[method-assign]
