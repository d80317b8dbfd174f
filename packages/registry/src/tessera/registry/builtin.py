"""The registries shared across packages and a user's config, and torch's classes as fallbacks.

``LAYERS`` is the one tessera registry two packages use (tessera-layers fills it, the pipeline
builds layers from it); the others name what a user's config builds: ``MODELS`` (the user's
own, registered by the user) and the three that also know torch's classes. Registries for
anything else a config builds (datasets, samplers, ...) are the user's to declare, a
``Registry("datasets")`` passed to ``build`` through ``registries=``.
A package's own plug points have their own registries in that package: process-group
initializers in tessera.context, gradient handlers, schedules and hooks in tessera.engine.

Each registry fills from the entry-point group ``tessera.<name in lower case>``: a package
declares ``[project.entry-points."tessera.layers"] Linear2D = "tessera.layers:Linear2D"`` and the
name resolves once the package is installed.

``OPTIMIZERS``, ``LR_SCHEDULERS`` and ``LOSSES`` also know torch's own classes (``"Adam"``,
``"CosineAnnealingLR"``, ``"CrossEntropyLoss"``) so a config can name them like any other
component. torch is imported by ``importlib`` inside the fallback functions, i.e. on the first
lookup that misses the registered and entry-point names, never at ``import tessera.registry``:
this package stays standard-library only and importable without torch.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from types import ModuleType
from typing import Any

from tessera.registry.registry import Registry

__all__ = [
    "Component",
    "LAYERS",
    "MODELS",
    "OPTIMIZERS",
    "LR_SCHEDULERS",
    "LOSSES",
]

#: What tessera's registries hold: a class or factory that ``build`` calls with keywords.
Component = Callable[..., Any]


def _import_or_none(module: str) -> ModuleType | None:
    """Import ``module`` if it is installed; a missing torch just means "no fallbacks"."""
    try:
        return importlib.import_module(module)
    except ImportError:
        return None


def _torch_optimizers() -> dict[str, Component]:
    """Every public ``torch.optim.Optimizer`` subclass in ``torch.optim`` (Adam, SGD, ...)."""
    optim = _import_or_none("torch.optim")
    if optim is None:
        return {}
    base = optim.Optimizer
    table: dict[str, Component] = {}
    for name in dir(optim):
        obj = getattr(optim, name)
        if (
            not name.startswith("_")
            and isinstance(obj, type)
            and issubclass(obj, base)
            and obj is not base
        ):
            table[name] = obj
    return table


def _torch_lr_schedulers() -> dict[str, Component]:
    """The schedulers ``torch.optim.lr_scheduler`` exports (its ``__all__``), minus the base."""
    module = _import_or_none("torch.optim.lr_scheduler")
    if module is None:
        return {}
    base = getattr(module, "LRScheduler", None)
    exported = getattr(module, "__all__", None) or [n for n in dir(module) if n[:1] != "_"]
    table: dict[str, Component] = {}
    for name in exported:
        obj = getattr(module, name, None)
        if isinstance(obj, type) and obj is not base and obj.__module__ == module.__name__:
            table[name] = obj
    return table


def _torch_losses() -> dict[str, Component]:
    """The public ``torch.nn`` modules whose name ends in ``Loss`` (CrossEntropyLoss, ...)."""
    nn = _import_or_none("torch.nn")
    if nn is None:
        return {}
    table: dict[str, Component] = {}
    for name in dir(nn):
        obj = getattr(nn, name)
        if name.endswith("Loss") and isinstance(obj, type) and issubclass(obj, nn.Module):
            table[name] = obj
    return table


def _registry(
    name: str, fallback: Callable[[], dict[str, Component]] | None = None
) -> Registry[Component]:
    return Registry(name, group=f"tessera.{name}", fallback=fallback)


LAYERS = _registry("layers")
MODELS = _registry("models")
OPTIMIZERS = _registry("optimizers", _torch_optimizers)
LR_SCHEDULERS = _registry("lr_schedulers", _torch_lr_schedulers)
LOSSES = _registry("losses", _torch_losses)
