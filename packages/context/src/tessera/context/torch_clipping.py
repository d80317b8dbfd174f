"""``torch.nn.utils.clip_grad_norm_`` on parameters tessera split: the global norm, every rank.

A loop of one's own clips with torch's function. Given parameters that tessera split across
ranks (a ``ShardInfo`` naming the groups a dim is cut over), torch's function computes the norm
of this rank's blocks only, a different number on every rank: each rank would scale its
gradients by another coefficient, and the model would train differently from one process
without an error. (torch's own tensor parallelism holds DTensors, whose norm torch gathers;
tessera's parameters are plain tensors.)

So the first split parameter tessera describes (:func:`~.shard.set_shard_info`) wraps torch's
function: given a parameter whose ShardInfo splits it, it clips by the global norm of
:mod:`.grad_norm` under the current context (every rank of the job calls it, as every rank
calls torch's in a data-parallel loop; a weight tied across pipeline stages counted on the
first stage, as the engine counts it); given none, it is torch's function, untouched. A name
bound to torch's function before (``from torch.nn.utils import clip_grad_norm_`` ahead of the
first split parameter) keeps torch's: call it as ``torch.nn.utils.clip_grad_norm_``, or call
``tessera.context.clip_grad_norm``.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .context import ParallelContext

__all__ = ["guard_torch_clipping", "is_split"]

#: Set on the wrapper: torch's function is wrapped already.
_WRAPPED = "_tessera_global_norm"


def is_split(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` carries a ShardInfo that splits it over some group."""
    from .shard import get_shard_info

    info = get_shard_info(tensor)
    return info is not None and bool(info.sharded_modes)


def _later_copies(params: list[torch.Tensor], context: ParallelContext) -> list[torch.Tensor]:
    """The copies of weights tied across pipeline stages that a later stage holds.

    The first stage's copy is counted in the norm, as the engine counts it.
    """
    from .modes import ParallelMode
    from .tied import pipeline_shared_key

    if context.pipeline_size == 1 or context.get_local_rank(ParallelMode.PIPELINE) == 0:
        return []
    return [p for p in params if pipeline_shared_key(p) is not None]


def guard_torch_clipping() -> None:
    """Wrap ``torch.nn.utils.clip_grad_norm_`` as the module docstring says (once)."""
    from torch.nn.utils import clip_grad

    original = clip_grad.clip_grad_norm_
    if getattr(original, _WRAPPED, False):
        return

    @functools.wraps(original)
    def clip_grad_norm_(
        parameters: torch.Tensor | Iterable[torch.Tensor],
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
        foreach: bool | None = None,
    ) -> torch.Tensor:
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        if not any(is_split(p) for p in params):
            return original(
                params,
                max_norm,
                norm_type=norm_type,
                error_if_nonfinite=error_if_nonfinite,
                foreach=foreach,
            )
        from .grad_norm import global_grad_norm, resolve_context, scale_to_norm

        context = resolve_context(None)
        if context is None:
            raise RuntimeError(
                "torch.nn.utils.clip_grad_norm_ was given parameters tessera split across ranks "
                "(their ShardInfo), but no ParallelContext is current to sum their norm over; "
                "call tessera.context.clip_grad_norm(parameters, max_norm, context=ctx)"
            )
        total = global_grad_norm(params, float(norm_type), context, _later_copies(params, context))
        if error_if_nonfinite and not bool(torch.isfinite(total)):
            raise RuntimeError(
                f"The total norm of order {float(norm_type)} for gradients from `parameters` "
                "is non-finite, so it cannot be clipped. To disable this error and scale the "
                "gradients by the non-finite norm anyway, set `error_if_nonfinite=False`"
            )
        scale_to_norm(params, float(max_norm), total)
        return total

    setattr(clip_grad_norm_, _WRAPPED, True)
    wrapped: Any = clip_grad_norm_
    clip_grad.clip_grad_norm_ = wrapped
    torch.nn.utils.clip_grad_norm_ = wrapped
