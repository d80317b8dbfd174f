"""``ParallelConfig``: the validated ``parallel = dict(...)`` block of a configuration.

Reading the block is pure (no process group, no torch): every mistake is reported as a
``ConfigError`` naming the key and showing the arithmetic, before any process could block in a
collective that the others never reach.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tessera.registry import ConfigError

__all__ = ["TENSOR_MODES", "ExtraInitializer", "ParallelConfig"]

#: The tensor modes a ``parallel.tensor.mode`` may name (``None`` means no tensor parallelism).
TENSOR_MODES: tuple[str, ...] = ("1d", "2d", "2.5d", "3d", "sequence")

_PARALLEL_KEYS = ("data", "pipeline", "tensor", "extra")
_SIZE_KEYS = ("size",)
_TENSOR_KEYS = ("size", "mode", "depth")

#: Arguments a built-in tensor mode reads from the extra keys of ``parallel.tensor``.
MODE_ARGUMENTS: dict[str, tuple[str, ...]] = {"1d": ("sequence_parallel",)}


#: The largest world size a config may describe (about a million ranks).
MAX_WORLD_SIZE = 1 << 20


@dataclass(frozen=True)
class ExtraInitializer:
    """One entry of ``parallel.extra``: a user's process-group initializer and its arguments.

    Attributes:
        type: The name of a class registered in ``PROCESS_GROUP_INITIALIZERS``, or the class.
        args: The other keys of the entry, passed to the class's constructor as keywords.
    """

    type: str | type
    args: Mapping[str, Any] = field(default_factory=dict, hash=False)


@dataclass(frozen=True)
class ParallelConfig:
    """How the ranks of a job are split: data x pipeline x tensor, and the tensor mode.

    Build it with ``ParallelConfig.from_dict(parallel, world_size)``; the constructor checks the
    same invariants, so a hand-made instance is valid too.

    Attributes:
        data_size: Number of model replicas (data-parallel ranks).
        pipeline_size: Number of pipeline stages.
        tensor_size: Number of ranks splitting each stage's tensors.
        tensor_mode: ``None``, ``'1d'``, ``'2d'``, ``'2.5d'``, ``'3d'``, ``'sequence'`` or the
            name of a registered ``TensorMode`` (tensor_modes.py).
        tensor_depth: The depth of 2.5D (``tensor_size == q * q * depth``); 1 otherwise.
        tensor_args: Extra keys of ``parallel.tensor`` (e.g. ``sequence_parallel=True``),
            kept for the layers of that mode.
        extra: User initializers named in ``parallel.extra``.
    """

    data_size: int = 1
    pipeline_size: int = 1
    tensor_size: int = 1
    tensor_mode: str | None = None
    tensor_depth: int = 1
    tensor_args: Mapping[str, Any] = field(default_factory=dict, hash=False)
    extra: tuple[ExtraInitializer, ...] = ()

    def __post_init__(self) -> None:
        for key in ("data_size", "pipeline_size", "tensor_size", "tensor_depth"):
            _check_size(f"ParallelConfig.{key}", getattr(self, key))
        _check_mode(self.tensor_mode, self.tensor_size, self.tensor_depth, "ParallelConfig")
        # A private copy, so mutating the caller's dict later cannot change this config.
        object.__setattr__(self, "tensor_args", dict(self.tensor_args))
        object.__setattr__(self, "extra", tuple(self.extra))

    @property
    def world_size(self) -> int:
        """``data_size * pipeline_size * tensor_size``."""
        return self.data_size * self.pipeline_size * self.tensor_size

    @property
    def tensor_dim(self) -> int:
        """The side ``q`` of the tensor mode's mesh: 2D ``q*q``, 2.5D ``q*q*depth``, 3D ``q**3``.

        For 1d, sequence and no mode it is the tensor size itself.
        """
        if self.tensor_mode == "2d":
            return math.isqrt(self.tensor_size)
        if self.tensor_mode == "2.5d":
            return math.isqrt(self.tensor_size // self.tensor_depth)
        if self.tensor_mode == "3d":
            return _icbrt(self.tensor_size)
        return self.tensor_size

    @classmethod
    def from_dict(cls, parallel: Mapping[str, Any] | None, world_size: int) -> ParallelConfig:
        """Read a ``parallel = dict(...)`` block for a job of ``world_size`` ranks.

        Accepted forms::

            {} or None                                   # pure data parallelism
            dict(pipeline=2)  /  dict(pipeline=dict(size=2))
            dict(tensor=1)                               # no tensor parallelism
            dict(tensor=dict(size=4, mode="2d"))
            dict(tensor=dict(size=8, mode="2.5d", depth=2))
            dict(tensor=dict(size=4, mode="1d", sequence_parallel=True))  # extra keys kept
            dict(data=2, ...)                            # optional; checked against the rest
            dict(extra=[dict(type="MyInitializer", arg=1)])

        The data size, when absent, is ``world_size // (pipeline * tensor)``.

        Raises:
            ConfigError: any violation; the message names the key and shows the arithmetic.
        """
        _check_size("world_size", world_size)
        if world_size > MAX_WORLD_SIZE:
            # Layouts are computed as explicit rank tuples: an absurd world size (a typo, an
            # overflowed variable) must fail here, not as a MemoryError in rank_groups.
            raise ConfigError(
                f"world_size {world_size} exceeds the largest supported job of "
                f"{MAX_WORLD_SIZE} ranks (2**20)"
            )
        if parallel is None:
            parallel = {}
        if not isinstance(parallel, Mapping):
            raise ConfigError(
                f"parallel must be a dict like dict(tensor=dict(size=2, mode='1d')), "
                f"got {_show(parallel)}"
            )
        _check_keys("parallel", parallel, _PARALLEL_KEYS)

        pipeline = _read_size("parallel.pipeline", parallel.get("pipeline", 1))
        tensor_size, mode, depth, args = _read_tensor(parallel.get("tensor", 1))
        extra = _read_extra(parallel.get("extra", ()))

        model = pipeline * tensor_size
        if "data" in parallel:
            data = _read_size("parallel.data", parallel["data"])
            if data * model != world_size:
                raise ConfigError(
                    f"world size {world_size} != data {data} * pipeline {pipeline} * tensor "
                    f"{tensor_size} = {data * model} (parallel.data, parallel.pipeline, "
                    "parallel.tensor.size)"
                )
        else:
            if world_size % model != 0:
                raise ConfigError(
                    f"world size {world_size} is not divisible by pipeline {pipeline} * tensor "
                    f"{tensor_size} = {model}, so no data size satisfies world size = data * "
                    f"pipeline * tensor ({world_size} = data * {pipeline} * {tensor_size}); "
                    "check parallel.pipeline and parallel.tensor.size"
                )
            data = world_size // model
        return cls(
            data_size=data,
            pipeline_size=pipeline,
            tensor_size=tensor_size,
            tensor_mode=mode,
            tensor_depth=depth,
            tensor_args=args,
            extra=extra,
        )


# ---------------------------------------------------------------------------------- readers


def _show(value: object) -> str:
    return f"{value!r} ({type(value).__name__})"


def _icbrt(n: int) -> int:
    """Integer cube root, rounded down."""
    root = round(math.pow(n, 1 / 3))
    while root**3 > n:
        root -= 1
    while (root + 1) ** 3 <= n:
        root += 1
    return root


def _check_size(key: str, value: object) -> int:
    # bool is an int subclass; ``pipeline=True`` is a typo, not a size.
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{key} must be a positive int, got {_show(value)}")
    return value


def _check_keys(where: str, block: Mapping[str, Any], known: Sequence[str]) -> None:
    for key in block:
        if key not in known:
            raise ConfigError(_unknown_key_message(where, key, known))


def _unknown_key_message(where: str, key: object, known: Sequence[str]) -> str:
    close = difflib.get_close_matches(str(key), list(known), n=1, cutoff=0.6)
    hint = f"; did you mean '{where}.{close[0]}'?" if close else ""
    listed = ", ".join(known)
    return f"unknown key '{where}.{key}' (known keys: {listed}){hint}"


def _read_size(key: str, value: object) -> int:
    """Read ``key=int`` or ``key=dict(size=int)``."""
    if isinstance(value, Mapping):
        _check_keys(key, value, _SIZE_KEYS)
        if "size" not in value:
            raise ConfigError(f"{key}.size is missing (write {key}=dict(size=N) or {key}=N)")
        return _check_size(f"{key}.size", value["size"])
    return _check_size(key, value)


def _read_tensor(value: object) -> tuple[int, str | None, int, dict[str, Any]]:
    """Read ``tensor=1`` or ``tensor=dict(size, mode, depth, **args)``."""
    if not isinstance(value, Mapping):
        size = _check_size("parallel.tensor", value)
        if size != 1:
            raise ConfigError(
                f"parallel.tensor={size} has no mode; tensor size {size} > 1 needs one of "
                f"{_known_modes()}: write tensor=dict(size={size}, mode='1d')"
            )
        return 1, None, 1, {}
    _check_mode_arguments(value)
    if "size" not in value:
        raise ConfigError(
            "parallel.tensor.size is missing (write tensor=dict(size=N, mode=...) or tensor=1)"
        )
    size = _check_size("parallel.tensor.size", value["size"])
    mode = value.get("mode")
    plugin = _plugin(mode)
    if (
        mode is not None
        and plugin is None
        and (not isinstance(mode, str) or mode not in TENSOR_MODES)
    ):
        raise ConfigError(
            f"parallel.tensor.mode: unknown mode {mode!r}; known modes: {_known_modes()} (a "
            "mode of your own: register a TensorMode in tessera.context.TENSOR_MODE_PLUGINS)"
        )
    if plugin is not None:
        args = {k: v for k, v in value.items() if k not in _TENSOR_KEYS}
        plugin.check(size, args)
        return size, plugin.name, 1, args
    if "depth" in value:
        if mode != "2.5d":
            raise ConfigError(
                f"parallel.tensor.depth is only for mode '2.5d', but mode is {mode!r}; remove depth"
            )
        depth = _check_size("parallel.tensor.depth", value["depth"])
    elif mode == "2.5d":
        raise ConfigError(
            f"parallel.tensor.depth is missing; mode '2.5d' splits tensor size {size} into "
            "q * q * depth ranks, e.g. tensor=dict(size=8, mode='2.5d', depth=2)"
        )
    else:
        depth = 1
    _check_mode(mode, size, depth, "parallel.tensor")
    args = {k: v for k, v in value.items() if k not in _TENSOR_KEYS}
    return size, mode, depth, args


def _check_mode_arguments(tensor: Mapping[str, Any]) -> None:
    """Check the extra keys of ``parallel.tensor``, which are the mode's arguments.

    A near miss of a real key, or an argument the chosen mode does not read, would be ignored
    silently, so both are errors.
    """
    mode = tensor.get("mode")
    plugin = _plugin(mode)
    if plugin is not None:  # a mode of your own reads exactly its declared keys
        for key in tensor:
            if key not in _TENSOR_KEYS and key not in plugin.arguments:
                raise ConfigError(
                    f"parallel.tensor.{key} is not read by tensor mode {mode!r} (its keys: "
                    f"{list(plugin.arguments)}): it would be ignored; remove it"
                )
        if "depth" in tensor:
            raise ConfigError(f"parallel.tensor.depth is only for mode '2.5d', not {mode!r}")
        return
    every_argument = sorted({a for args in MODE_ARGUMENTS.values() for a in args})
    for key in tensor:
        if key in _TENSOR_KEYS:
            continue
        if key in every_argument:
            readers = [m for m, args in MODE_ARGUMENTS.items() if key in args]
            if mode not in readers:
                raise ConfigError(
                    f"parallel.tensor.{key} is read only by mode(s) {readers}, but mode is "
                    f"{mode!r}: it would be ignored; remove it or change the mode"
                )
            continue
        known = (*_TENSOR_KEYS, *every_argument)
        close = difflib.get_close_matches(str(key), list(known), n=1, cutoff=0.75)
        if close:
            raise ConfigError(_unknown_key_message("parallel.tensor", key, known))


def _known_modes() -> str:
    from .tensor_modes import TENSOR_MODE_PLUGINS as PLUGINS

    return "None, " + ", ".join(repr(m) for m in (*TENSOR_MODES, *PLUGINS.names()))


def _plugin(mode: object) -> Any:
    """The registered ``TensorMode`` called ``mode`` (tensor_modes.py), or ``None``."""
    if mode in TENSOR_MODES:
        return None
    from .tensor_modes import find_tensor_mode

    return find_tensor_mode(mode)


def _check_mode(mode: str | None, size: int, depth: int, where: str) -> None:
    """Check that ``size`` fits the shape of ``mode`` and say which sizes would."""
    if mode is None:
        if size != 1:
            raise ConfigError(
                f"{where}: tensor size {size} > 1 needs a mode, one of {_known_modes()}"
            )
        return
    if _plugin(mode) is not None:
        return
    if mode not in TENSOR_MODES:
        raise ConfigError(f"{where}.mode: unknown mode {mode!r}; known modes: {_known_modes()}")
    if mode != "2.5d" and depth != 1:
        raise ConfigError(f"{where}.depth={depth} is only for mode '2.5d', not {mode!r}")
    if mode == "2d":
        q = math.isqrt(size)
        if q * q != size:
            valid = ", ".join(str(i * i) for i in range(1, 6))
            raise ConfigError(
                f"{where}.size: tensor size {size} is not a perfect square; 2d needs q*q ranks "
                f"({valid}, ...); {q}*{q} = {q * q} and {q + 1}*{q + 1} = {(q + 1) ** 2}"
            )
    elif mode == "2.5d":
        if size % depth != 0 or math.isqrt(size // depth) ** 2 != size // depth:
            valid = ", ".join(str(i * i * depth) for i in range(1, 5))
            raise ConfigError(
                f"{where}.size: tensor size {size} is not q*q*depth with depth {depth} "
                f"({size} / {depth} = {size / depth:g} is not a perfect square); "
                f"2.5d with depth {depth} needs {valid}, ... ranks"
            )
    elif mode == "3d":
        q = _icbrt(size)
        if q**3 != size:
            valid = ", ".join(str(i**3) for i in range(1, 5))
            raise ConfigError(
                f"{where}.size: tensor size {size} is not a perfect cube; 3d needs q*q*q ranks "
                f"({valid}, ...); {q}^3 = {q**3} and {q + 1}^3 = {(q + 1) ** 3}"
            )


def _read_extra(value: object) -> tuple[ExtraInitializer, ...]:
    """Read ``extra=[dict(type=..., **args), ...]``."""
    if isinstance(value, (Mapping, str)) or not isinstance(value, Sequence):
        raise ConfigError(
            f"parallel.extra must be a list of dicts like [dict(type='MyInitializer')], "
            f"got {_show(value)}"
        )
    entries = []
    for i, entry in enumerate(value):
        key = f"parallel.extra[{i}]"
        if not isinstance(entry, Mapping):
            raise ConfigError(f"{key} must be a dict with a 'type' key, got {_show(entry)}")
        if "type" not in entry:
            raise ConfigError(
                f"{key}.type is missing: name a class registered in PROCESS_GROUP_INITIALIZERS "
                "or pass a ProcessGroupInitializer subclass"
            )
        kind = entry["type"]
        if not isinstance(kind, (str, type)):
            raise ConfigError(f"{key}.type must be a registered name or a class, got {_show(kind)}")
        args = {k: v for k, v in entry.items() if k != "type"}
        entries.append(ExtraInitializer(type=kind, args=args))
    return tuple(entries)
