"""The engine's registries: the handlers, schedules and hooks a config can name.

Each belongs to this package and fills from its own entry-point group: a distribution
declares ``[project.entry-points."tessera.gradient_handlers"]`` (tessera-engine declares its
handlers there, tessera-pipeline its schedules under ``tessera.schedules``), and a user's
class joins with ``@GRADIENT_HANDLERS.register``. Typed: ``GRADIENT_HANDLERS.get(name)`` is a
handler class, ``HOOKS.get(name)`` a hook class.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tessera.registry import Registry

if TYPE_CHECKING:
    from .gradient_handlers.base import BaseGradientHandler
    from .hooks.base import BaseHook

__all__ = ["GRADIENT_HANDLERS", "HOOKS", "SCHEDULES"]

#: Gradient handlers by name (``gradient_handlers=[dict(type=...)]``).
GRADIENT_HANDLERS: Registry[type[BaseGradientHandler]] = Registry(
    "gradient_handlers", group="tessera.gradient_handlers"
)
#: Step schedules by name (``schedule=dict(type=...)``): classes or factories of schedules.
SCHEDULES: Registry[Callable[..., Any]] = Registry("schedules", group="tessera.schedules")
#: Trainer hooks by name.
HOOKS: Registry[type[BaseHook]] = Registry("hooks", group="tessera.hooks")
