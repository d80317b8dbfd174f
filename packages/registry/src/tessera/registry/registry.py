"""``Registry[T]``: a name -> component table that fills itself from packaging entry points.

Why entry points: the registry must never import an implementation (it is the bottom of the
dependency graph and stays standard-library only), yet ``LAYERS.get("Linear2D")`` has to work as
soon as tessera-layers is *installed*, without the user importing it. Each installed
distribution announces its components in its metadata (``[project.entry-points."tessera.layers"]``
``Linear2D = "tessera.layers:Linear2D"``); the registry reads that metadata on its first lookup,
which is cheap because it imports nothing, and imports a component's module only when that one
name is requested.

Lookup order for a name: explicit registrations (``register``), then entry points, then the
optional fallback table (torch's own optimizers, schedulers and losses, see ``builtin.py``).
"""

from __future__ import annotations

import difflib
import threading
from collections.abc import Callable, Iterator, Mapping
from importlib import metadata
from typing import Any, Generic, TypeVar, cast, overload

__all__ = ["Registry"]

T = TypeVar("T")
_O = TypeVar("_O")

#: How many close names a "not found" message suggests.
_MAX_SUGGESTIONS = 5
#: Up to this many names, a "not found" message without close matches lists them all.
_MAX_LISTED = 30


def _describe_entry_point(ep: metadata.EntryPoint) -> str:
    """Render ``name = value`` plus the distribution that declared it, for error messages."""
    dist = getattr(ep, "dist", None)
    origin = ""
    if dist is not None:
        origin = f" (distribution {dist.metadata['Name']} {dist.version})"
    return f"'{ep.name} = {ep.value}' in group '{ep.group}'{origin}"


def _describe_object(obj: object) -> str:
    """Render ``module.qualname`` of a registered object, for error messages."""
    module = getattr(obj, "__module__", None)
    qualname = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None)
    if module and qualname:
        return f"{module}.{qualname}"
    return repr(obj)


class Registry(Generic[T]):
    """A named table of components, looked up by name.

    ``T`` is what ``get`` returns (for tessera's own registries, a class or factory). Names come
    from three sources, in this order of precedence:

    1. ``register`` (as ``@REG.register``, ``@REG.register(name="X")``, ``REG.register(obj)``);
    2. the entry-point group ``group`` of every installed distribution, read on the first lookup;
    3. ``fallback``, a function returning extra names (called at most once, on the first lookup
       that needs it; tessera uses it to expose torch's own classes without importing torch at
       import time).

    A lookup is ``get``, ``in``, ``names()``, iteration (over the names, sorted) or ``len``.
    Registration never triggers a lookup, so decorators that run while a module is imported stay
    cheap and cannot recurse into the entry-point scan.

    Args:
        name: Human-readable name used in error messages (e.g. ``"layers"``).
        group: Entry-point group to fill from (e.g. ``"tessera.layers"``); ``None`` for a registry
            filled only by ``register``.
        fallback: Zero-argument callable returning a mapping of last-resort names.
    """

    def __init__(
        self,
        name: str,
        *,
        group: str | None = None,
        fallback: Callable[[], Mapping[str, T]] | None = None,
    ) -> None:
        self._name = name
        self._group = group
        self._fallback_factory = fallback
        self._objects: dict[str, T] = {}
        # Names registered with override=True before the entry points were read: an entry point
        # of the same name found later is dropped instead of being checked against them.
        self._overridden: set[str] = set()
        self._pending: dict[str, list[metadata.EntryPoint]] | None = None
        self._fallback: dict[str, T] | None = None
        # Re-entrant so a fallback factory may import code that registers into this registry.
        self._lock = threading.RLock()

    @property
    def name(self) -> str:
        """The registry's name, as used in error messages."""
        return self._name

    @property
    def group(self) -> str | None:
        """The entry-point group this registry fills from, if any."""
        return self._group

    def __repr__(self) -> str:
        return f"Registry({self._name!r}, group={self._group!r})"

    # ------------------------------------------------------------------ registration

    @overload
    def register(
        self, obj: None = None, *, name: str | None = None, override: bool = False
    ) -> Callable[[_O], _O]: ...

    @overload
    def register(self, obj: _O, *, name: str | None = None, override: bool = False) -> _O: ...

    def register(
        self, obj: object = None, *, name: str | None = None, override: bool = False
    ) -> object:
        """Register ``obj`` under ``name`` (default: ``obj.__name__``).

        Usable as a bare decorator, as a decorator factory (``@REG.register(name="X")``) or as a
        plain call; returns ``obj`` unchanged so the decorated class keeps its identity.

        Registering the *same* object twice under one name is a no-op (a module may be imported
        through an entry point and directly); a *different* object under a taken name raises
        unless ``override=True``. A registration also shadows an entry point or fallback of the
        same name: with ``override=True`` silently, otherwise the entry point is loaded on the
        first lookup of that name and must resolve to the same object.

        Raises:
            ValueError: ``name`` is already registered to a different object.
            TypeError: ``name`` was not given and ``obj`` has no ``__name__``.
        """
        if obj is None:

            def decorator(target: _O) -> _O:
                self._add(target, name, override)
                return target

            return decorator
        self._add(obj, name, override)
        return obj

    def _add(self, obj: object, name: str | None, override: bool) -> None:
        if name is None:
            name = getattr(obj, "__name__", None)
            if not isinstance(name, str):
                raise TypeError(
                    f"registry '{self._name}': cannot infer a name for {obj!r} (it has no "
                    "__name__); pass name='...'"
                )
        with self._lock:
            existing = self._objects.get(name, _MISSING)
            if existing is not _MISSING and existing is not obj and not override:
                raise ValueError(
                    f"registry '{self._name}': name '{name}' is already registered to "
                    f"{_describe_object(existing)}; cannot register {_describe_object(obj)} "
                    "under it (pass override=True to replace it)"
                )
            self._objects[name] = cast(T, obj)
            if override:
                self._overridden.add(name)
                if self._pending is not None:
                    self._pending.pop(name, None)

    # ------------------------------------------------------------------ lookup

    def get(self, name: str) -> T:
        """Return the component registered as ``name``.

        Raises:
            KeyError: no source knows ``name``; the message lists the closest known names.
            ImportError: ``name`` comes from an entry point that failed to load; the message
                names the entry point and its distribution (other names keep working).
            ValueError: ``name`` is declared by conflicting sources (two entry points with
                different targets, or an entry point and a different registered object).
        """
        with self._lock:
            pending = self._entry_points()
            ep = self._single_entry_point(name, pending[name]) if name in pending else None
        if ep is not None:
            # Imported without holding the lock: the import may run register() decorators of
            # this registry from another thread too, and must not deadlock against them.
            loaded = self._load_entry_point(ep)
            with self._lock:
                self._record_entry_point(ep, loaded)
        with self._lock:
            found = self._objects.get(name, _MISSING)
            if found is not _MISSING:
                return cast(T, found)
            fallback = self._fallback_table()
            if name in fallback:
                return fallback[name]
            raise KeyError(self._not_found_message(name))

    def __contains__(self, name: object) -> bool:
        if not isinstance(name, str):
            return False
        with self._lock:
            if name in self._objects or name in self._entry_points():
                return True
            return name in self._fallback_table()

    def names(self) -> list[str]:
        """All known names (registered, declared by entry points, fallback), sorted.

        Entry points are listed without being loaded.
        """
        with self._lock:
            known = set(self._objects) | set(self._entry_points()) | set(self._fallback_table())
        return sorted(known)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self.names())

    # ------------------------------------------------------------------ lazy sources

    def _entry_points(self) -> dict[str, list[metadata.EntryPoint]]:
        """Read (once) the entry points of ``group`` without loading any of them."""
        if self._pending is None:
            pending: dict[str, list[metadata.EntryPoint]] = {}
            if self._group is not None:
                for ep in metadata.entry_points(group=self._group):
                    if ep.name in self._overridden:
                        continue
                    same_name = pending.setdefault(ep.name, [])
                    # A distribution visible twice on sys.path declares the same value twice.
                    if all(other.value != ep.value for other in same_name):
                        same_name.append(ep)
            self._pending = pending
        return self._pending

    def _single_entry_point(
        self, name: str, candidates: list[metadata.EntryPoint]
    ) -> metadata.EntryPoint:
        """The one entry point declaring ``name``; several different targets are ambiguous."""
        if len(candidates) > 1:
            listed = "; ".join(_describe_entry_point(ep) for ep in candidates)
            raise ValueError(
                f"registry '{self._name}': name '{name}' is declared by {len(candidates)} entry "
                f"points with different targets: {listed}; uninstall one of the distributions"
            )
        return candidates[0]

    def _load_entry_point(self, ep: metadata.EntryPoint) -> object:
        """Import an entry point's target, naming the entry point if that fails."""
        try:
            loaded: object = ep.load()
        except Exception as exc:
            raise ImportError(
                f"registry '{self._name}': entry point {_describe_entry_point(ep)} failed to "
                f"load: {type(exc).__name__}: {exc}"
            ) from exc
        return loaded

    def _record_entry_point(self, ep: metadata.EntryPoint, loaded: object) -> None:
        """Move a loaded entry point into the table, checking it against a registration."""
        name = ep.name
        if name in self._overridden:
            return  # replaced with override=True while the entry point was loading
        existing = self._objects.get(name, _MISSING)
        if existing is not _MISSING and existing is not loaded:
            raise ValueError(
                f"registry '{self._name}': name '{name}' is registered to "
                f"{_describe_object(existing)} but entry point {_describe_entry_point(ep)} "
                f"resolves to {_describe_object(loaded)}; register with override=True to "
                "replace the entry point"
            )
        self._objects[name] = cast(T, loaded)
        if self._pending is not None:
            self._pending.pop(name, None)

    def _fallback_table(self) -> dict[str, T]:
        if self._fallback is None:
            factory = self._fallback_factory
            self._fallback = dict(factory()) if factory is not None else {}
        return self._fallback

    def _not_found_message(self, name: str) -> str:
        known = sorted(set(self._objects) | set(self._entry_points()) | set(self._fallback_table()))
        message = f"registry '{self._name}' has no name '{name}'"
        if not known:
            where = f" in entry-point group '{self._group}'" if self._group else ""
            return (
                f"{message}: it is empty (nothing registered and nothing declared{where}; "
                "is the package that provides it installed?)"
            )
        close = difflib.get_close_matches(name, known, n=_MAX_SUGGESTIONS, cutoff=0.6)
        if not close:
            lowered = {k.lower(): k for k in known}
            close = [
                lowered[m]
                for m in difflib.get_close_matches(name.lower(), lowered, n=_MAX_SUGGESTIONS)
            ]
        if close:
            return f"{message}; did you mean {', '.join(repr(c) for c in close)}?"
        if len(known) <= _MAX_LISTED:
            return f"{message}; known names: {', '.join(known)}"
        return f"{message}; it knows {len(known)} names, see .names()"


class _Missing:
    """Sentinel type: distinguishes "absent" from a registered ``None``."""

    def __repr__(self) -> str:
        return "<missing>"


_MISSING: Any = _Missing()
