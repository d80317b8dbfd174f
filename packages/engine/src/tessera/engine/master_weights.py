"""Master-weight mixed precision: the model held in float16/bfloat16, fp32 copies optimized.

Autocast (``fp16=dict(mode="torch")``, ``bf16=True``) keeps every parameter in fp32 and casts
per operation, so parameters, gradients and the activations saved for backward keep their fp32
footprint where autocast leaves an op in fp32. Master-weight training (Micikevicius et al. 2018,
"Mixed Precision Training"; the ``naive`` AMP of Colossal-AI's seeds) holds the model itself in
the low-precision format: parameters, gradients and activations take half the memory, every op
runs in that format. The optimizer must not update those copies: an update ``lr * g`` smaller
than half the spacing of float16 near the weight (2**-11 relative) rounds away, and bfloat16
keeps only 8 significant bits. So each low-precision parameter has an fp32 *master*: the
optimizer (and its state) lives on the masters, and after every step the masters are rounded
into the model.

At a step: the model's gradients (reduced by DDP or the handlers in the model's format) are
copied into fp32 gradients of the masters and the model's are freed; the loss scaler unscales
and checks the masters' gradients (one decision over all ranks), clipping reads the masters'
ShardInfo (copied from the model's parameters, so the global norm of a tensor-parallel model is
counted right), the optimizer steps the masters, and the masters are copied back. ZeRO-1 shards
the optimizer built here, that is the masters and their state.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from tessera.context import ShardInfo, set_shard_info

from .zero import _constructor_kwargs, _group_settings

__all__ = ["LOW_PRECISION_DTYPES", "MasterWeights", "cast_floating"]

#: The formats a model can be held in under master weights.
LOW_PRECISION_DTYPES = (torch.float16, torch.bfloat16)


def cast_floating(obj: Any, dtype: torch.dtype, only: Sequence[torch.dtype] | None = None) -> Any:
    """``obj`` with every floating-point tensor in it cast to ``dtype``.

    Tuples, lists and dicts are walked (a model's inputs and outputs); anything else is kept.

    Args:
        obj: A tensor, or a container of them.
        dtype: The target format.
        only: Cast only tensors of these dtypes (``None``: every floating-point tensor).
    """
    if isinstance(obj, torch.Tensor):
        if not obj.is_floating_point() or obj.dtype == dtype:
            return obj
        if only is not None and obj.dtype not in only:
            return obj
        return obj.to(dtype)
    if isinstance(obj, tuple):
        items = [cast_floating(o, dtype, only) for o in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else tuple(items)
    if isinstance(obj, list):
        return [cast_floating(o, dtype, only) for o in obj]
    if isinstance(obj, dict):
        return {k: cast_floating(v, dtype, only) for k, v in obj.items()}
    return obj


def _marks(p: torch.Tensor) -> dict[str, object]:
    """The ``_tessera_*`` attributes a parameter carries (ShardInfo and other packages' marks)."""
    return {k: v for k, v in vars(p).items() if k.startswith("_tessera_")}


class MasterWeights:
    """The fp32 masters of a model's parameters, the model itself cast to ``dtype`` in place.

    Building it casts every floating-point parameter (``param.data``, so the ``nn.Parameter``
    objects and hence DDP, handlers and tied weights keep working) and every floating-point
    buffer to ``dtype``, after taking an fp32 copy of each parameter. A parameter shared by two
    modules (tied) has one master. The masters carry the parameters' ShardInfo and other
    ``_tessera_*`` marks, so clipping and checkpoints read the right placement.

    Args:
        modules: The model, or this pipeline rank's chunks (not yet wrapped in DDP; FSDP2's
            DTensor parameters are refused).
        dtype: ``torch.float16`` or ``torch.bfloat16``.

    Raises:
        ValueError: ``dtype`` is not a low-precision format, or a parameter is a DTensor.
    """

    def __init__(self, modules: nn.Module | Sequence[nn.Module], dtype: torch.dtype) -> None:
        if dtype not in LOW_PRECISION_DTYPES:
            raise ValueError(f"master weights need float16 or bfloat16 models, got {dtype}")
        self.dtype = dtype
        self._modules = [modules] if isinstance(modules, nn.Module) else list(modules)
        self._pairs: list[tuple[nn.Parameter, nn.Parameter]] = []  # (model's, master)
        self._master_of: dict[int, nn.Parameter] = {}
        for module in self._modules:
            for name, p in module.named_parameters():
                if id(p) in self._master_of or not p.is_floating_point():
                    continue
                if hasattr(p, "device_mesh"):
                    raise ValueError(
                        f"parameter {name} is a DTensor (FSDP2, zero.stage 2/3): master weights "
                        "work with plain parameters only (ZeRO stage 1)"
                    )
                master = nn.Parameter(
                    p.detach().clone().to(torch.float32), requires_grad=p.requires_grad
                )
                for key, value in _marks(p).items():
                    if isinstance(value, ShardInfo):
                        set_shard_info(master, value)
                    else:
                        setattr(master, key, value)
                p.data = p.data.to(dtype)
                self._pairs.append((p, master))
                self._master_of[id(p)] = master
            for sub in module.modules():
                for key, buf in sub._buffers.items():
                    if buf is not None and buf.is_floating_point():
                        sub._buffers[key] = buf.to(dtype)

    @property
    def masters(self) -> list[nn.Parameter]:
        """The fp32 masters, one per distinct low-precision parameter."""
        return [m for _, m in self._pairs]

    def pairs(self) -> Iterator[tuple[nn.Parameter, nn.Parameter]]:
        """``(model parameter, its master)`` for every master."""
        yield from self._pairs

    def master_of(self, param: torch.Tensor) -> nn.Parameter | None:
        """The master of a model parameter (``None`` for one without: an integer parameter)."""
        return self._master_of.get(id(param))

    def rebuild_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """A new optimizer like ``optimizer`` (class, param-group settings) over the masters.

        The optimizer state, if any, is not carried over (build the optimizer fresh, as for ZeRO).

        Raises:
            ValueError: the optimizer holds a tensor that is not a parameter of the model.
        """
        groups: list[dict[str, Any]] = []
        for g in optimizer.param_groups:
            params = []
            for p in g["params"]:
                master = self._master_of.get(id(p))
                if master is None:
                    raise ValueError(
                        f"the optimizer holds a tensor of shape {tuple(p.shape)} that is not a "
                        "floating-point parameter of the model; master weights need an "
                        "optimizer over model.parameters()"
                    )
                params.append(master)
            groups.append({"params": params, **_group_settings(g)})
        keywords, _ = _constructor_kwargs(type(optimizer), dict(optimizer.defaults))
        return type(optimizer)(groups, **keywords)

    def grads_to_masters(self) -> list[torch.Tensor]:
        """Move the model's gradients into fp32 gradients of the masters; return those.

        A parameter without a gradient leaves its master without one (the optimizer skips it,
        as it would have skipped the parameter). The model's gradients are freed.
        """
        grads: list[torch.Tensor] = []
        for p, master in self._pairs:
            if p.grad is None:
                master.grad = None
                continue
            master.grad = p.grad.detach().to(torch.float32)
            p.grad = None
            grads.append(master.grad)
        return grads

    def zero_model_grads(self) -> None:
        """Free the model's gradients (the optimizer clears only the masters')."""
        for p, _ in self._pairs:
            p.grad = None

    @torch.no_grad()
    def copy_to_model(self) -> None:
        """Round every master into its model parameter (after the optimizer step or a load)."""
        for p, master in self._pairs:
            p.copy_(master)

    def masters_of(self, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The masters of ``params`` (those with one), e.g. a handler's duplicate parameters."""
        return [m for p in params if (m := self._master_of.get(id(p))) is not None]
