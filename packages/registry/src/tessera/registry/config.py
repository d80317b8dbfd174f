"""``Config``: a nested dict with attribute access, loaded from Python, TOML, JSON or YAML.

Why a dict subclass: configs are handed to code that expects plain dicts (``**cfg``,
``json.dumps``, ``ParallelConfig.from_dict``), so a ``Config`` *is* one. Nested mappings are
converted to ``Config`` when stored (also inside lists and tuples), so every way of reading a value
(``cfg.a``, ``cfg["a"]``, ``cfg.get("a")``, ``cfg.items()``) sees the same ``Config`` and
``cfg.parallel.tensor.mode`` works at any depth.

Keys that collide with dict methods (``items``, ``keys``, ``copy``, ``update``, ...) or with
``Config``'s own methods (``merge``, ``to_dict``, ...) are only reachable by subscription
(``cfg["items"]``).
"""

from __future__ import annotations

import ast
import difflib
import importlib
import inspect
import json
import os
import runpy
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

from tessera.registry.errors import ConfigError

__all__ = ["Config"]

_SUFFIXES = (".py", ".toml", ".json", ".yaml", ".yml")


def _convert(value: Any) -> Any:
    """Store-time conversion: mappings become ``Config``, containers are walked."""
    if isinstance(value, Config):
        return value
    if isinstance(value, Mapping):
        return Config(value)
    if isinstance(value, list):
        return [_convert(v) for v in value]
    if type(value) is tuple:  # exact tuples: a namedtuple is a leaf value
        return tuple(_convert(v) for v in value)
    return value


def _plain(value: Any) -> Any:
    """Inverse of ``_convert``: ``Config`` -> ``dict``, lists copied, leaves shared."""
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if type(value) is tuple:
        return tuple(_plain(v) for v in value)
    return value


class Config(dict[str, Any]):
    """A configuration tree: a ``dict`` whose nested mappings are ``Config`` too.

    Read with ``cfg.parallel.tensor.mode`` or ``cfg["parallel"]["tensor"]["mode"]``; a missing
    attribute raises ``AttributeError`` naming the key and the closest existing keys. Setting an
    attribute sets the key. ``merge`` and ``apply_overrides`` return a new ``Config`` and leave
    the original untouched.

    Example:
        >>> cfg = Config({"parallel": {"tensor": {"size": 4, "mode": "2d"}}})
        >>> cfg.parallel.tensor.mode
        '2d'
        >>> cfg.apply_overrides(["parallel.tensor.size=1"]).parallel.tensor.size
        1
    """

    __slots__ = ()

    def __init__(
        self, data: Mapping[str, Any] | Iterable[tuple[str, Any]] = (), **kwargs: Any
    ) -> None:
        super().__init__()
        self.update(data, **kwargs)

    # ------------------------------------------------------------------ dict protocol

    def __setitem__(self, key: str, value: Any) -> None:
        super().__setitem__(key, _convert(value))

    def update(  # type: ignore[override]
        self, data: Mapping[str, Any] | Iterable[tuple[str, Any]] = (), **kwargs: Any
    ) -> None:
        """Like ``dict.update``, converting nested mappings to ``Config``."""
        items = data.items() if isinstance(data, Mapping) else data
        for key, value in items:
            self[key] = value
        for key, value in kwargs.items():
            self[key] = value

    def setdefault(self, key: str, default: Any = None) -> Any:
        """Like ``dict.setdefault``, converting a stored mapping to ``Config``."""
        if key not in self:
            self[key] = default
        return self[key]

    def copy(self) -> Config:
        """A shallow copy that is still a ``Config``."""
        return Config(self)

    def __or__(self, other: Any) -> Config:  # type: ignore[override]
        if not isinstance(other, Mapping):
            return NotImplemented
        result = self.copy()
        result.update(other)
        return result

    def __ror__(self, other: Any) -> Config:  # type: ignore[override]
        if not isinstance(other, Mapping):
            return NotImplemented
        result = Config(other)
        result.update(self)
        return result

    def __ior__(self, other: Any) -> Config:  # type: ignore[override]
        self.update(other)
        return self

    def __repr__(self) -> str:
        return f"Config({dict.__repr__(self)})"

    # ------------------------------------------------------------------ attribute access

    def __getattr__(self, name: str) -> Any:
        # Only called when normal lookup fails, so dict methods keep precedence.
        try:
            return self[name]
        except KeyError:
            pass
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)  # protocol probes (copy, pickle) must see a plain miss
        keys = [k for k in self if isinstance(k, str)]
        close = difflib.get_close_matches(name, keys, n=3)
        hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
        listed = ", ".join(repr(k) for k in keys) if keys else "none"
        raise AttributeError(f"config has no key '{name}'{hint} (keys: {listed})")

    def __setattr__(self, name: str, value: Any) -> None:
        self[name] = value

    def __delattr__(self, name: str) -> None:
        try:
            del self[name]
        except KeyError:
            raise AttributeError(f"config has no key '{name}'") from None

    def __dir__(self) -> Iterable[str]:
        return [*super().__dir__(), *(k for k in self if isinstance(k, str))]

    # ------------------------------------------------------------------ transformations

    def to_dict(self) -> dict[str, Any]:
        """A plain nested copy: ``Config`` -> ``dict``, lists copied, leaf values shared."""
        result: dict[str, Any] = _plain(self)
        return result

    def merge(self, other: Mapping[str, Any]) -> Config:
        """Return a new ``Config``: ``self`` recursively updated by ``other`` (``other`` wins).

        Two mappings under the same key are merged key by key; any other pair (including a list
        against a list) is replaced by ``other``'s value.
        """
        return Config(_merge(self.to_dict(), _plain(other)))

    def apply_overrides(self, overrides: Iterable[str]) -> Config:
        """Return a new ``Config`` with command-line style ``key.path=value`` strings applied.

        Values are parsed as Python literals (``4``, ``1e-3``, ``'x'``, ``[1, 2]``, ``None``,
        ``True``) with ``ast.literal_eval``; anything that is not a literal is kept as the raw
        string (``mode=2d`` gives ``'2d'``). Missing intermediate keys are created as mappings.

        Raises:
            ConfigError: an item has no ``=``, an empty key segment, or a path that runs
                through a value that is not a mapping.
        """
        if isinstance(overrides, str):
            raise ConfigError(
                f"apply_overrides() takes a list of 'key=value' strings, got the string "
                f"{overrides!r}; wrap it in a list"
            )
        result = Config(self.to_dict())
        for item in overrides:
            key, sep, raw = item.partition("=")
            key = key.strip()
            if not sep or not key:
                raise ConfigError(f"override {item!r} is not of the form 'key.path=value'")
            parts = key.split(".")
            if any(not p for p in parts):
                raise ConfigError(f"override {item!r}: key path '{key}' has an empty segment")
            node: Config = result
            for depth, part in enumerate(parts[:-1]):
                child = node.get(part)
                if child is None:
                    child = Config()
                    node[part] = child
                elif not isinstance(child, Config):
                    where = ".".join(parts[: depth + 1])
                    raise ConfigError(
                        f"override {item!r}: '{where}' is a {type(child).__name__} "
                        f"({child!r}), not a mapping, so it has no key '{parts[depth + 1]}'"
                    )
                node = child
            node[parts[-1]] = _parse_value(raw.strip())
        return result

    # ------------------------------------------------------------------ loading

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> Config:
        """Load a config file, choosing the reader by suffix.

        - ``.py``: **executes the file** (only load trusted files) and keeps its top-level
          public variables: names not starting with ``_``, leaving out modules and the
          functions/classes it imported (ones it defines itself are kept).
        - ``.toml``: ``tomllib`` (Python >= 3.11) or the ``tomli`` package.
        - ``.json``: the top level must be an object.
        - ``.yaml`` / ``.yml``: ``yaml.safe_load``; needs PyYAML.

        The data formats execute nothing.

        Raises:
            ConfigError: unknown suffix, a missing optional reader, a parse error (naming the
                file), text that is not UTF-8, a Python config that raises (chained), or a
                top level that is not a mapping.
            FileNotFoundError: the file does not exist.
        """
        file = Path(path)
        suffix = file.suffix.lower()
        if suffix not in _SUFFIXES:
            raise ConfigError(
                f"{file}: unknown config suffix '{file.suffix}'; supported: {', '.join(_SUFFIXES)}"
            )
        if not file.is_file():
            raise FileNotFoundError(f"config file not found: {file}")
        if suffix == ".py":
            data: object = _read_python(file)
        elif suffix == ".toml":
            data = _read_toml(file)
        elif suffix == ".json":
            data = _read_json(file)
        else:
            data = _read_yaml(file)
        if data is None:  # an empty YAML document
            data = {}
        if not isinstance(data, Mapping):
            raise ConfigError(f"{file}: the top level must be a mapping, got {type(data).__name__}")
        return cls(data)


def _merge(base: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in other.items():
        current = merged.get(key)
        if isinstance(current, dict) and isinstance(value, dict):
            merged[key] = _merge(current, value)
        else:
            merged[key] = value
    return merged


def _parse_value(raw: str) -> Any:
    try:
        return ast.literal_eval(raw)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return raw


def _read_text(file: Path, kind: str) -> str:
    try:
        return file.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{file}: invalid {kind}: not UTF-8 text ({exc})") from exc


def _read_python(file: Path) -> dict[str, Any]:
    run_name = f"tessera_config_{file.stem}"
    try:
        namespace = runpy.run_path(str(file), run_name=run_name)
    except SyntaxError as exc:  # also IndentationError, and a file that is not UTF-8
        where = f" line {exc.lineno}" if exc.lineno is not None else ""
        raise ConfigError(f"{file}:{where} invalid Python: {exc.msg}") from exc
    except Exception as exc:
        # The config file is a program; its own error, named after the file it came from.
        raise ConfigError(
            f"{file}: running the config file raised {type(exc).__name__}: {exc}"
        ) from exc
    return {
        name: value
        for name, value in namespace.items()
        if not name.startswith("_")
        and not isinstance(value, ModuleType)
        and not _imported_definition(value, run_name)
    }


def _imported_definition(value: object, run_name: str) -> bool:
    """True for a function or class that the config file imported rather than defined."""
    if inspect.isclass(value) or inspect.isroutine(value):
        return getattr(value, "__module__", None) != run_name
    return False


def _read_toml(file: Path) -> dict[str, Any]:
    loads: Callable[[str], dict[str, Any]]
    try:
        loads = importlib.import_module("tomllib").loads
    except ImportError:
        try:
            loads = importlib.import_module("tomli").loads
        except ImportError:
            raise ConfigError(
                f"{file}: reading TOML needs Python >= 3.11 or the 'tomli' package "
                "(pip install tomli)"
            ) from None
    try:
        return loads(_read_text(file, "TOML"))
    except ConfigError:
        raise
    except ValueError as exc:  # tomllib.TOMLDecodeError subclasses ValueError
        raise ConfigError(f"{file}: invalid TOML: {exc}") from exc


def _read_json(file: Path) -> object:
    try:
        result: object = json.loads(_read_text(file, "JSON"))
    except (json.JSONDecodeError, RecursionError) as exc:
        raise ConfigError(f"{file}: invalid JSON: {exc}") from exc
    return result


def _read_yaml(file: Path) -> object:
    try:
        yaml = importlib.import_module("yaml")
    except ImportError:
        raise ConfigError(
            f"{file}: reading YAML needs PyYAML, which is not installed (pip install pyyaml)"
        ) from None
    try:
        result: object = yaml.safe_load(_read_text(file, "YAML"))
    except yaml.YAMLError as exc:
        raise ConfigError(f"{file}: invalid YAML: {exc}") from exc
    return result
