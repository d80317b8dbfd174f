"""``build(cfg)``: turn a ``{"type": ..., **kwargs}`` mapping into an object.

A config names *what* to build (``type``: a registered name, or a class/callable) and *how*
(every other key is a keyword argument). Nested mappings that carry a ``type`` are built first,
depth first, so one config describes a whole object graph::

    build({"type": "Adam", "lr": 1e-3}, OPTIMIZERS, params=model.parameters())
    build({"type": Trainer, "optimizer": {"type": "SGD", "lr": 0.1}}, ...)

A nested config is looked up in the registry its key maps to (``DEFAULT_KEY_REGISTRIES``, e.g.
``optimizer`` -> ``OPTIMIZERS``), otherwise in its parent's registry. Every failure is reported as
a ``ConfigError`` naming the key path (``optimizer.lr``) before anything is constructed with bad
arguments: the keywords are bound against ``inspect.signature`` first, so a ``TypeError`` raised
*inside* a constructor is never mistaken for a bad key.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

from tessera.registry.builtin import LAYERS, LOSSES, LR_SCHEDULERS, MODELS, OPTIMIZERS
from tessera.registry.errors import ConfigError
from tessera.registry.registry import Registry

__all__ = ["DEFAULT_KEY_REGISTRIES", "build"]

#: Which registry a nested config is looked up in, by the key it sits under. A key not listed
#: keeps the registry of the enclosing config. Lists are followed: every typed mapping in
#: ``layers: [...]`` is looked up in ``LAYERS``.
DEFAULT_KEY_REGISTRIES: Mapping[str, Registry[Any]] = MappingProxyType(
    {
        "model": MODELS,
        "layer": LAYERS,
        "layers": LAYERS,
        "optimizer": OPTIMIZERS,
        "lr_scheduler": LR_SCHEDULERS,
        "loss": LOSSES,
        "criterion": LOSSES,
    }
)


def build(
    cfg: Mapping[str, Any],
    registry: Registry[Any] | None = None,
    *,
    registries: Mapping[str, Registry[Any]] | None = None,
    **overrides: Any,
) -> Any:
    """Build the object ``cfg`` describes.

    Args:
        cfg: Mapping with a ``type`` (a name in ``registry`` or a class/callable) and the keyword
            arguments. Values that are mappings with a ``type`` are built recursively, also
            inside lists and tuples; mappings without one are passed as plain dicts (their typed
            values built). ``cfg`` itself is not modified.
        registry: Where a string ``type`` is looked up; ``None`` means the type must be a
            class/callable (nested configs may still use their key's registry).
        registries: Key -> registry mapping for nested configs; defaults to
            ``DEFAULT_KEY_REGISTRIES``. Pass ``{**DEFAULT_KEY_REGISTRIES, "net": MODELS}`` to
            extend it.
        **overrides: Extra keyword arguments, added to (and replacing) the top-level keys and
            passed as given, never built (e.g. ``params=model.parameters()``). The names
            ``cfg``, ``registry`` and ``registries`` are taken by ``build`` itself; put such
            keys in ``cfg`` instead.

    Returns:
        Whatever the type returns when called with the keywords.

    Raises:
        ConfigError: ``type`` is missing, unknown or not callable, or a keyword is not accepted
            (the message lists the accepted ones) or a required one is missing. The message
            starts with the dotted key path of the offending entry.
    """
    if not isinstance(cfg, Mapping):
        raise ConfigError(f"build() needs a mapping with a 'type' key, got {type(cfg).__name__}")
    key_registries = DEFAULT_KEY_REGISTRIES if registries is None else registries
    merged = {**cfg, **overrides}
    built_overrides = set(overrides)
    return _build_mapping(merged, registry, key_registries, "", built_overrides)


def _join(path: str, key: object) -> str:
    return f"{path}.{key}" if path else str(key)


def _where(path: str) -> str:
    return path if path else "<root>"


def _build_mapping(
    cfg: Mapping[str, Any],
    registry: Registry[Any] | None,
    key_registries: Mapping[str, Registry[Any]],
    path: str,
    passthrough: set[str],
) -> Any:
    """Build one typed mapping; ``passthrough`` names keys whose values are used unbuilt."""
    if "type" not in cfg:
        keys = ", ".join(repr(k) for k in cfg) or "none"
        raise ConfigError(f"{_where(path)}: missing 'type' (keys present: {keys})")
    target = _resolve_type(cfg["type"], registry, _join(path, "type"))
    kwargs: dict[str, Any] = {}
    for key, value in cfg.items():
        if key == "type":
            continue
        if not isinstance(key, str):
            raise ConfigError(
                f"{_join(path, key)}: keyword names must be strings, got "
                f"{type(key).__name__} {key!r}"
            )
        if key in passthrough:
            kwargs[key] = value
            continue
        child_registry = key_registries.get(key, registry) if isinstance(key, str) else registry
        kwargs[key] = _build_value(value, child_registry, key_registries, _join(path, key))
    _check_keywords(target, kwargs, path)
    return target(**kwargs)


def _build_value(
    value: Any,
    registry: Registry[Any] | None,
    key_registries: Mapping[str, Registry[Any]],
    path: str,
) -> Any:
    if isinstance(value, Mapping):
        if "type" in value:
            return _build_mapping(value, registry, key_registries, path, set())
        return {
            k: _build_value(
                v,
                key_registries.get(k, registry) if isinstance(k, str) else registry,
                key_registries,
                _join(path, k),
            )
            for k, v in value.items()
        }
    if isinstance(value, list):
        return [
            _build_value(v, registry, key_registries, f"{path}[{i}]") for i, v in enumerate(value)
        ]
    if type(value) is tuple:  # exact tuples only: a namedtuple is a value, not a container
        return tuple(
            _build_value(v, registry, key_registries, f"{path}[{i}]") for i, v in enumerate(value)
        )
    return value


def _resolve_type(spec: object, registry: Registry[Any] | None, path: str) -> Callable[..., Any]:
    if isinstance(spec, str):
        if registry is None:
            raise ConfigError(
                f"{path}: '{spec}' is a name but no registry applies here; pass registry=... "
                "to build() or give the class itself"
            )
        try:
            found = registry.get(spec)
        except KeyError as exc:
            raise ConfigError(f"{path}: {exc.args[0]}") from None
        if not callable(found):
            raise ConfigError(
                f"{path}: '{spec}' in registry '{registry.name}' is {found!r}, not callable"
            )
        return found  # type: ignore[no-any-return]
    if callable(spec):
        return spec
    raise ConfigError(
        f"{path}: must be a registered name or a class/callable, got {type(spec).__name__} {spec!r}"
    )


def _check_keywords(target: Callable[..., Any], kwargs: dict[str, Any], path: str) -> None:
    """Bind ``kwargs`` to ``target``'s signature and report a mismatch as a ``ConfigError``."""
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):
        return  # no introspectable signature (some builtins): let the call itself decide
    try:
        signature.bind(**kwargs)
    except TypeError as exc:
        params = signature.parameters.values()
        accepted = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        takes_any = any(p.kind is p.VAR_KEYWORD for p in params)
        name = getattr(target, "__qualname__", None) or repr(target)
        unknown = [] if takes_any else [k for k in kwargs if k not in accepted]
        if unknown:
            listed = ", ".join(repr(k) for k in unknown)
            raise ConfigError(
                f"{_join(path, unknown[0])}: {name} accepts no keyword {listed}; accepted "
                f"keywords: {', '.join(accepted) or 'none'}"
            ) from None
        missing = [
            p.name
            for p in params
            if p.default is p.empty
            and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
            and p.name not in kwargs
        ]
        if missing:
            raise ConfigError(
                f"{_where(path)}: {name} is missing required keyword(s) "
                f"{', '.join(repr(m) for m in missing)}; accepted keywords: "
                f"{', '.join(accepted) or 'none'}"
            ) from None
        raise ConfigError(f"{_where(path)}: cannot call {name}{signature}: {exc}") from None
