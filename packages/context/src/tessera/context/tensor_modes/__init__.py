"""Tensor modes as objects: ``tensor=dict(size=x, mode=...)`` names one of them.

Colossal-AI's tutorial "Add your own parallel mode" ends with
``parallel = dict(tensor=dict(size=x, mode='new_mode'))``. A :class:`TensorMode` is what makes
that name mean something: it owns the config keys the mode reads (``tensor=dict(size=4,
mode='new_mode', my_key=...)``) and their checks, the side of its mesh, and the
process-group initializer that builds its groups among each block of tensor ranks.

tessera's own five modes are objects of the same kind, one module each in this folder
(``one_d``, ``two_d``, ``two_p5_d``, ``three_d``, ``sequence``), and they reach
:data:`TENSOR_MODE_PLUGINS` the way a user's does: through the entry-point group
``tessera.tensor_modes`` of tessera-context's package metadata. Register yours there from
your own package, or with ``@TENSOR_MODE_PLUGINS.register(name=...)``; then the context
creates its groups, the dispatching layers build what ``register_implementation(layer, mode,
builder)`` registered for it, and the engine trains with the gradient handlers the config
names. No tessera source is edited.
"""

from __future__ import annotations

from tessera.registry import Registry

from .base import TensorMode

__all__ = [
    "TENSOR_MODES",
    "TENSOR_MODE_PLUGINS",
    "TensorMode",
    "builtin_tensor_modes",
    "find_tensor_mode",
    "tensor_mode_names",
]

#: The names of tessera's own tensor modes, in the order the docs list them.
TENSOR_MODES: tuple[str, ...] = ("1d", "2d", "2.5d", "3d", "sequence")


def builtin_tensor_modes() -> dict[str, type[TensorMode]]:
    """Tessera's own modes by name, as its entry points announce them.

    The registry's last resort: a source tree run without installing tessera-context (no
    entry points in its metadata) still knows them.
    """
    from .one_d import Mode1D
    from .sequence import ModeSequence
    from .three_d import Mode3D
    from .two_d import Mode2D
    from .two_p5_d import Mode2p5D

    return {cls.name: cls for cls in (Mode1D, Mode2D, Mode2p5D, Mode3D, ModeSequence)}


#: Every tensor mode by name: tessera's five and a user's own (entry-point group
#: ``tessera.tensor_modes``, or ``@TENSOR_MODE_PLUGINS.register(name=...)``).
TENSOR_MODE_PLUGINS: Registry[type[TensorMode]] = Registry(
    "tensor_modes", group="tessera.tensor_modes", fallback=builtin_tensor_modes
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


def tensor_mode_names() -> list[str]:
    """Every registered mode's name: tessera's own first, in their order, then the others."""
    others = [n for n in TENSOR_MODE_PLUGINS.names() if n not in TENSOR_MODES]
    return [*TENSOR_MODES, *others]
