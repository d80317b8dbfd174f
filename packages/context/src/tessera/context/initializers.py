"""Process-group initializers: the plug point that decides which ranks form each group.

An initializer is pure: given a ``ParallelConfig`` it returns rank groups for the mode names it
declares. It never creates a process group; ``ParallelContext`` does that for every initializer
in the same order on every rank. This is how a user adds a mode without editing tessera: subclass
``ProcessGroupInitializer``, register it in ``PROCESS_GROUP_INITIALIZERS`` (or pass the class) and
name it in ``parallel.extra``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import ClassVar

from tessera.registry import ConfigError, Registry

from .config import ExtraInitializer, ParallelConfig
from .layouts import (
    Groups,
    global_groups,
    groups_1d,
    groups_2d,
    groups_2p5d,
    groups_3d,
    lift,
    sequence_groups,
)
from .modes import ParallelMode, mode_key

__all__ = [
    "PROCESS_GROUP_INITIALIZERS",
    "GlobalInitializer",
    "ProcessGroupInitializer",
    "SequenceInitializer",
    "Tensor1DInitializer",
    "Tensor2DInitializer",
    "Tensor2p5DInitializer",
    "Tensor3DInitializer",
    "rank_groups",
]


class ProcessGroupInitializer(ABC):
    """Computes the rank groups of the modes it declares.

    Subclasses set ``modes`` (the mode names, plain strings or ParallelMode members) and
    implement ``rank_groups``. Constructor keywords come from the ``parallel.extra`` entry
    (every key but ``type``).

    Example::

        @PROCESS_GROUP_INITIALIZERS.register
        class FirstLastStage(ProcessGroupInitializer):
            modes = ("embedding",)

            def rank_groups(self, config):
                ...  # one group per (data, tensor) position: its first and last stage
    """

    #: The names of the modes this initializer creates; the queries use the same strings.
    modes: ClassVar[tuple[str, ...]] = ()

    @abstractmethod
    def rank_groups(self, config: ParallelConfig) -> Mapping[str, Sequence[Sequence[int]]]:
        """Return, for each declared mode, its groups of global ranks.

        Each group lists global ranks ordered by local rank. The groups of one mode must be
        disjoint; a rank in none of them simply has no group of that mode.
        """


#: The process-group initializers a config can name in ``parallel.extra``, owned by this
#: package: filled from the entry-point group ``tessera.process_group_initializers`` (where
#: tessera-context declares its own) and by ``@PROCESS_GROUP_INITIALIZERS.register``.
PROCESS_GROUP_INITIALIZERS: Registry[type[ProcessGroupInitializer]] = Registry(
    "process_group_initializers", group="tessera.process_group_initializers"
)


class GlobalInitializer(ProcessGroupInitializer):
    """GLOBAL, DATA, PIPELINE, TENSOR and MODEL; always used."""

    modes = (
        ParallelMode.GLOBAL,
        ParallelMode.DATA,
        ParallelMode.PIPELINE,
        ParallelMode.TENSOR,
        ParallelMode.MODEL,
    )

    def rank_groups(self, config: ParallelConfig) -> dict[str, Groups]:
        """See ``layouts.global_groups``."""
        return global_groups(config)


class _TensorModeInitializer(ProcessGroupInitializer):
    """An initializer for one tensor mode; refuses a config of another mode."""

    tensor_mode: ClassVar[str]

    def rank_groups(self, config: ParallelConfig) -> dict[str, Groups]:
        """Lift the mode's tensor-rank layout into every tensor block."""
        self.require_mode(config)
        return lift(config, self.tensor_groups(config))

    def require_mode(self, config: ParallelConfig) -> None:
        """Refuse a config of another tensor mode than the one these groups are for."""
        if config.tensor_mode != self.tensor_mode:
            raise ConfigError(
                f"{type(self).__name__} builds the groups of tensor mode {self.tensor_mode!r}, "
                f"but parallel.tensor.mode is {config.tensor_mode!r}"
            )

    @abstractmethod
    def tensor_groups(self, config: ParallelConfig) -> dict[str, Groups]:
        """The groups among the tensor ranks ``0 .. tensor_size - 1`` of one block."""


class Tensor1DInitializer(_TensorModeInitializer):
    """PARALLEL_1D (see ``layouts.groups_1d``)."""

    tensor_mode = "1d"
    modes = (ParallelMode.PARALLEL_1D,)

    def tensor_groups(self, config: ParallelConfig) -> dict[str, Groups]:
        """One line of every tensor rank."""
        return groups_1d(config.tensor_size)


class Tensor2DInitializer(_TensorModeInitializer):
    """PARALLEL_2D_ROW and PARALLEL_2D_COL (see ``layouts.groups_2d``)."""

    tensor_mode = "2d"
    modes = (ParallelMode.PARALLEL_2D_ROW, ParallelMode.PARALLEL_2D_COL)

    def tensor_groups(self, config: ParallelConfig) -> dict[str, Groups]:
        """The rows and columns of the q x q mesh."""
        return groups_2d(config.tensor_dim)


class Tensor2p5DInitializer(_TensorModeInitializer):
    """PARALLEL_2P5D_ROW/COL/DEP/XZ (see ``layouts.groups_2p5d``)."""

    tensor_mode = "2.5d"
    modes = (
        ParallelMode.PARALLEL_2P5D_ROW,
        ParallelMode.PARALLEL_2P5D_COL,
        ParallelMode.PARALLEL_2P5D_DEP,
        ParallelMode.PARALLEL_2P5D_XZ,
    )

    def tensor_groups(self, config: ParallelConfig) -> dict[str, Groups]:
        """The rows, columns and depth lines of ``depth`` stacked q x q meshes."""
        return groups_2p5d(config.tensor_dim, config.tensor_depth)


class Tensor3DInitializer(_TensorModeInitializer):
    """PARALLEL_3D_INPUT/WEIGHT/OUTPUT and the two product groups (see ``layouts.groups_3d``)."""

    tensor_mode = "3d"
    modes = (
        ParallelMode.PARALLEL_3D_INPUT,
        ParallelMode.PARALLEL_3D_WEIGHT,
        ParallelMode.PARALLEL_3D_OUTPUT,
        ParallelMode.PARALLEL_3D_INPUT_X_WEIGHT,
        ParallelMode.PARALLEL_3D_OUTPUT_X_WEIGHT,
    )

    def tensor_groups(self, config: ParallelConfig) -> dict[str, Groups]:
        """The three axes and two planes of the q x q x q cube."""
        return groups_3d(config.tensor_dim)


class SequenceInitializer(_TensorModeInitializer):
    """SEQUENCE and SEQUENCE_DP (see ``layouts.sequence_groups``)."""

    tensor_mode = "sequence"
    modes = (ParallelMode.SEQUENCE, ParallelMode.SEQUENCE_DP)

    def rank_groups(self, config: ParallelConfig) -> dict[str, Groups]:
        """See ``layouts.sequence_groups``: SEQUENCE_DP spans the data replicas too."""
        self.require_mode(config)
        return sequence_groups(config)

    def tensor_groups(self, config: ParallelConfig) -> dict[str, Groups]:
        """The sequence ranks of one block (the TENSOR group)."""
        return {ParallelMode.SEQUENCE: [tuple(range(config.tensor_size))]}


def _resolve(entry: ExtraInitializer, where: str) -> ProcessGroupInitializer:
    """Find the class an ``extra`` entry names and construct it with the entry's arguments."""
    kind = entry.type
    if isinstance(kind, str):
        if kind not in PROCESS_GROUP_INITIALIZERS:
            known = ", ".join(PROCESS_GROUP_INITIALIZERS.names()) or "none"
            raise ConfigError(
                f"{where}.type: no process-group initializer named {kind!r} in "
                f"PROCESS_GROUP_INITIALIZERS (registered: {known}); register the class with "
                "@PROCESS_GROUP_INITIALIZERS.register or pass the class itself"
            )
        cls: object = PROCESS_GROUP_INITIALIZERS.get(kind)  # checked below: entry points vary
    else:
        cls = kind
    if not (isinstance(cls, type) and issubclass(cls, ProcessGroupInitializer)):
        raise ConfigError(f"{where}.type: {cls!r} is not a ProcessGroupInitializer subclass")
    try:
        return cls(**entry.args)
    except TypeError as exc:
        raise ConfigError(f"{where}: cannot construct {cls.__name__}: {exc}") from exc


def _check(
    name: str, declared: Sequence[str], groups: Mapping[str, Sequence[Sequence[int]]], world: int
) -> dict[str, Groups]:
    """Validate one initializer's output and normalize it to tuples keyed by mode name."""
    keys = {mode_key(m) for m in groups}
    if keys != set(declared):
        raise ConfigError(
            f"{name} declares modes {sorted(declared)} but returned groups for {sorted(keys)}"
        )
    out: dict[str, Groups] = {}
    for mode, mode_groups in groups.items():
        seen: dict[int, int] = {}
        normalized: Groups = []
        for i, group in enumerate(mode_groups):
            ranks = tuple(group)
            if not ranks:
                raise ConfigError(f"{name}: group {i} of mode {mode!r} is empty")
            for r in ranks:
                if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < world:
                    raise ConfigError(
                        f"{name}: group {i} of mode {mode!r} holds {r!r}, not a rank in "
                        f"0..{world - 1} (world size {world})"
                    )
                if r in seen:
                    raise ConfigError(
                        f"{name}: rank {r} is in group {seen[r]} and group {i} of mode "
                        f"{mode!r}; the groups of one mode must be disjoint"
                    )
                seen[r] = i
            normalized.append(ranks)
        out[mode if isinstance(mode, ParallelMode) else mode_key(mode)] = normalized
    return out


def rank_groups(config: ParallelConfig) -> dict[str, Groups]:
    """Every mode the config initializes, with its rank groups; no process group is touched.

    Order (the order in which a context creates the groups, identical on every rank): the
    global modes, then the tensor mode's, then each ``parallel.extra`` initializer's.

    Raises:
        ConfigError: an extra initializer is unknown, returns invalid groups, or reuses a
            mode name that is already taken.
    """
    initializers: list[tuple[str, ProcessGroupInitializer]] = [
        ("GlobalInitializer", GlobalInitializer())
    ]
    tensor_mode = config.mode
    if tensor_mode is not None and tensor_mode.initializer is not None:
        initializers.append((tensor_mode.initializer.__name__, tensor_mode.initializer()))
    for i, entry in enumerate(config.extra):
        where = f"parallel.extra[{i}]"
        initializers.append((where, _resolve(entry, where)))

    result: dict[str, Groups] = {}
    owner: dict[str, str] = {}
    for name, initializer in initializers:
        label = f"{name} ({type(initializer).__name__})" if name.startswith("parallel") else name
        declared = [mode_key(m) for m in type(initializer).modes]
        if not declared:
            raise ConfigError(f"{label} declares no modes; set the class attribute `modes`")
        for mode in declared:
            if mode in owner:
                raise ConfigError(
                    f"{label} declares mode {mode!r}, which {owner[mode]} already creates; "
                    "pick another name"
                )
            owner[mode] = label
        groups = _check(label, declared, initializer.rank_groups(config), config.world_size)
        result.update(groups)
    return result
