"""A tensor mode of your own, named in the config like tessera's: ``tensor=dict(mode=...)``.

Colossal-AI's tutorial "Add your own parallel mode" ends with
``parallel = dict(tensor=dict(size=x, mode='new_mode'))``. A :class:`TensorMode` is what makes
that name mean something: it owns the config keys the mode reads (``tensor=dict(size=4,
mode='new_mode', my_key=...)``) and their checks, and the process-group initializer that
builds its groups among each block of tensor ranks. Register it in
:data:`TENSOR_MODE_PLUGINS` (``@TENSOR_MODE_PLUGINS.register(name=...)``), or announce it
from your own package through the entry-point group ``tessera.tensor_modes``; then the
context creates its groups, the dispatching layers build what ``register_implementation(layer,
mode, builder)`` registered for it, and the engine trains with the gradient handlers the
config names. No tessera source is edited.

tessera's own five modes (``'1d'``, ``'2d'``, ``'2.5d'``, ``'3d'``, ``'sequence'``) are not yet
objects of this kind (their checks live in config.py, their groups in layouts.py); their
names cannot be taken.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

from tessera.registry import Registry

if TYPE_CHECKING:
    from .initializers import ProcessGroupInitializer

__all__ = ["TENSOR_MODE_PLUGINS", "TensorMode", "find_tensor_mode"]


class TensorMode:
    """A tensor mode: its name, the config keys it reads and checks, and its groups.

    Subclass it, set the class attributes and override :meth:`check` where a size does not
    fit (2D's perfect square, say).

    Attributes:
        name: The name the config gives in ``parallel.tensor.mode``.
        arguments: The keys of ``parallel.tensor`` it reads besides ``size`` and ``mode``
            (they reach ``ParallelConfig.tensor_args``); any other key is an error.
        initializer: Builds its groups (a ``ProcessGroupInitializer`` declaring their names),
            or ``None`` for a mode that uses only the TENSOR group.
    """

    name: ClassVar[str]
    arguments: ClassVar[tuple[str, ...]] = ()
    initializer: ClassVar[type[ProcessGroupInitializer] | None] = None

    def check(self, size: int, args: Mapping[str, Any]) -> None:
        """Raise ``ConfigError`` where ``size`` tensor ranks or ``args`` do not fit the mode.

        Args:
            size: ``parallel.tensor.size``.
            args: The mode's keys of ``parallel.tensor`` (see ``arguments``).
        """


#: Tensor modes of your own, by name (entry-point group ``tessera.tensor_modes``).
TENSOR_MODE_PLUGINS: Registry[type[TensorMode]] = Registry(
    "tensor_modes", group="tessera.tensor_modes"
)


def find_tensor_mode(name: object) -> TensorMode | None:
    """The registered tensor mode called ``name``, or ``None`` where none is.

    Raises:
        TypeError: what is registered under ``name`` is not a ``TensorMode`` subclass, or
            names itself otherwise.
    """
    if not isinstance(name, str) or name not in TENSOR_MODE_PLUGINS:
        return None
    cls = TENSOR_MODE_PLUGINS.get(name)
    if not (isinstance(cls, type) and issubclass(cls, TensorMode)):
        raise TypeError(f"TENSOR_MODE_PLUGINS[{name!r}] is {cls!r}, not a TensorMode subclass")
    if getattr(cls, "name", None) != name:
        raise TypeError(
            f"TENSOR_MODE_PLUGINS[{name!r}] is {cls.__name__}, whose name is "
            f"{getattr(cls, 'name', None)!r}: register it under its own name"
        )
    return cls()
