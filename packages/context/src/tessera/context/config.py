"""``ParallelConfig``: the validated ``parallel = dict(...)`` block of a configuration.

Reading the block is pure (no process group, no torch): every mistake is reported as a
``ConfigError`` naming the key and showing the arithmetic, before any process could block in a
collective that the others never reach.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tessera.registry import ConfigError

from .tensor_modes import (
    TENSOR_MODES,
    TensorMode,
    find_tensor_mode,
    tensor_mode_names,
)

__all__ = ["TENSOR_MODES", "ExtraInitializer", "ParallelConfig"]

_PARALLEL_KEYS = ("data", "pipeline", "tensor", "extra")
_SIZE_KEYS = ("size",)
_TENSOR_KEYS = ("size", "mode")


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
        tensor_args: The mode's own keys of ``parallel.tensor`` (``sequence_parallel=True``,
            ``depth=2``), each checked by the mode and kept for its layers.
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
        # A private copy, so mutating the caller's dict later cannot change this config.
        args = dict(self.tensor_args)
        # ``depth`` is a mode's argument like any other; ``tensor_depth`` is its reading.
        if self.tensor_depth != 1:
            given = args.setdefault("depth", self.tensor_depth)
            if given != self.tensor_depth:
                raise ConfigError(
                    f"ParallelConfig.tensor_depth={self.tensor_depth} disagrees with "
                    f"tensor_args['depth']={given!r}; give one of them"
                )
        _check_mode(self.tensor_mode, self.tensor_size, args)
        object.__setattr__(self, "tensor_args", args)
        object.__setattr__(self, "tensor_depth", args.get("depth", 1))
        object.__setattr__(self, "extra", tuple(self.extra))

    @property
    def mode(self) -> TensorMode | None:
        """The :class:`TensorMode` named by ``tensor_mode`` (``None`` without tensor parallelism).

        What the rest of tessera asks about the mode (its mesh, its groups, its replicas),
        instead of comparing its name.
        """
        return find_tensor_mode(self.tensor_mode)

    @property
    def world_size(self) -> int:
        """``data_size * pipeline_size * tensor_size``."""
        return self.data_size * self.pipeline_size * self.tensor_size

    @property
    def tensor_dim(self) -> int:
        """The side ``q`` of the tensor mode's mesh: 2D ``q*q``, 2.5D ``q*q*depth``, 3D ``q**3``.

        For 1d, sequence and no mode it is the tensor size itself.
        """
        mode = self.mode
        return self.tensor_size if mode is None else mode.side(self.tensor_size, self.tensor_args)

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
        tensor_size, mode, args = _read_tensor(parallel.get("tensor", 1))
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
            tensor_args=args,
            extra=extra,
        )


# ---------------------------------------------------------------------------------- readers


def _show(value: object) -> str:
    return f"{value!r} ({type(value).__name__})"


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


def _read_tensor(value: object) -> tuple[int, str | None, dict[str, Any]]:
    """Read ``tensor=1`` or ``tensor=dict(size, mode, **args)``; the mode checks the rest."""
    if not isinstance(value, Mapping):
        size = _check_size("parallel.tensor", value)
        if size != 1:
            raise ConfigError(
                f"parallel.tensor={size} has no mode; tensor size {size} > 1 needs one of "
                f"{_known_modes()}: write tensor=dict(size={size}, mode='{TENSOR_MODES[0]}')"
            )
        return 1, None, {}
    mode = value.get("mode")
    if mode is not None:
        _find_mode(mode, "parallel.tensor")
    args = {k: v for k, v in value.items() if k not in _TENSOR_KEYS}
    _check_mode_arguments(mode, args)
    if "size" not in value:
        raise ConfigError(
            "parallel.tensor.size is missing (write tensor=dict(size=N, mode=...) or tensor=1)"
        )
    return _check_size("parallel.tensor.size", value["size"]), mode, args


def _find_mode(mode: object, where: str) -> TensorMode:
    found = find_tensor_mode(mode)
    if found is None:
        raise ConfigError(
            f"{where}.mode: unknown mode {mode!r}; known modes: {_known_modes()} (a "
            "mode of your own: register a TensorMode in tessera.context.TENSOR_MODE_PLUGINS)"
        )
    return found


def _readers() -> dict[str, tuple[str, ...]]:
    """The arguments of every registered mode that loads (a broken plug-in is skipped here)."""
    readers: dict[str, tuple[str, ...]] = {}
    for name in tensor_mode_names():
        try:
            mode = find_tensor_mode(name)
        except (ImportError, TypeError):
            continue
        if mode is not None:
            readers[name] = mode.arguments
    return readers


def _check_mode_arguments(mode: str | None, args: Mapping[str, Any]) -> None:
    """Check the extra keys of ``parallel.tensor``: the mode reads exactly its ``arguments``.

    A near miss of a real key, or an argument the chosen mode does not read, would be ignored
    silently, so both are errors.
    """
    if not args:
        return
    readers = _readers()
    own = readers.get(mode, ()) if mode is not None else ()
    found = find_tensor_mode(mode)
    kept = found is not None and found.open_arguments
    every_argument = sorted({a for arguments in readers.values() for a in arguments})
    for key in args:
        if key in own:
            continue
        reading = [m for m, arguments in readers.items() if key in arguments]
        if reading:
            raise ConfigError(
                f"parallel.tensor.{key} is read only by mode(s) {reading}, but mode is "
                f"{mode!r}: it would be ignored; remove it or change the mode"
            )
        known = (*_TENSOR_KEYS, *every_argument)
        close = difflib.get_close_matches(str(key), list(known), n=1, cutoff=0.75)
        if close:
            raise ConfigError(_unknown_key_message("parallel.tensor", key, known))
        if kept:
            continue
        raise ConfigError(
            f"parallel.tensor.{key} is not read by tensor mode {mode!r} (its keys: "
            f"{list(own)}): it would be ignored; remove it"
        )


def _known_modes() -> str:
    return "None, " + ", ".join(repr(m) for m in tensor_mode_names())


def _check_mode(mode: str | None, size: int, args: Mapping[str, Any]) -> None:
    """Check that ``size`` and ``args`` fit ``mode``; the mode says which sizes would."""
    if mode is None:
        if size != 1:
            raise ConfigError(
                f"parallel.tensor: tensor size {size} > 1 needs a mode, one of {_known_modes()}"
            )
        _check_mode_arguments(None, args)
        return
    found = _find_mode(mode, "parallel.tensor")
    _check_mode_arguments(mode, args)
    found.check(size, args)


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
