"""A tensor mode of the user's own, named in the config as tessera's are (tensor_modes.py)."""

from __future__ import annotations

from typing import Any

import pytest

from tessera.context import (
    TENSOR_MODE_PLUGINS,
    ConfigError,
    ParallelConfig,
    ProcessGroupInitializer,
    TensorMode,
    find_tensor_mode,
    global_rank,
    rank_groups,
)


class RowsInitializer(ProcessGroupInitializer):
    modes = ("rows",)

    def rank_groups(self, config: ParallelConfig) -> dict[str, list[tuple[int, ...]]]:
        blocks = [(d, p) for d in range(config.data_size) for p in range(config.pipeline_size)]
        return {
            "rows": [
                tuple(global_rank(config, d, p, t) for t in range(config.tensor_size))
                for d, p in blocks
            ]
        }


class Rows(TensorMode):
    name = "rows"
    arguments = ("average",)
    initializer = RowsInitializer

    def check(self, size: int, args: Any) -> None:
        if size % 2:
            raise ConfigError(f"parallel.tensor.size {size}: 'rows' needs an even count")


TENSOR_MODE_PLUGINS.register(Rows, name="rows")


def test_a_registered_mode_is_read_and_builds_its_groups() -> None:
    c = ParallelConfig.from_dict({"pipeline": 2, "tensor": {"size": 2, "mode": "rows"}}, 8)
    assert (c.data_size, c.tensor_size, c.tensor_mode) == (2, 2, "rows")
    c = ParallelConfig.from_dict({"tensor": {"size": 2, "mode": "rows", "average": False}}, 4)
    assert dict(c.tensor_args) == {"average": False}
    groups = rank_groups(c)
    assert [tuple(g) for g in groups["rows"]] == [(0, 1), (2, 3)]
    assert isinstance(find_tensor_mode("rows"), Rows) and find_tensor_mode("4d") is None


@pytest.mark.parametrize(
    ("tensor", "fragment"),
    [
        ({"size": 3, "mode": "rows"}, "'rows' needs an even count"),
        ({"size": 2, "mode": "rows", "avrage": 1}, "did you mean 'parallel.tensor.average'"),
        ({"size": 2, "mode": "rows", "zzz": 1}, r"parallel.tensor.zzz is not read by .*'rows'"),
        ({"size": 2, "mode": "rows", "depth": 2}, r"depth is read only by mode\(s\) \['2.5d'\]"),
        ({"size": 2, "mode": "row"}, r"unknown mode 'row'; known modes: .*'rows'"),
    ],
)
def test_a_registered_mode_checks_its_keys(tensor: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        ParallelConfig.from_dict({"tensor": tensor}, 6)


def test_a_mode_registered_under_another_name_is_refused() -> None:
    class Misnamed(TensorMode):
        name = "other"

    TENSOR_MODE_PLUGINS.register(Misnamed, name="misnamed")
    with pytest.raises(TypeError, match="register it under its own name"):
        ParallelConfig.from_dict({"tensor": {"size": 2, "mode": "misnamed"}}, 2)


def test_the_builtin_modes_come_from_the_entry_points_and_the_fallback_alike() -> None:
    """tessera-context announces its five modes as entry points (as a user's package would);
    the registry's fallback names the same classes for a source tree that is not installed."""
    from importlib import metadata

    from tessera.context import TENSOR_MODES
    from tessera.context.tensor_modes import builtin_tensor_modes

    announced = {ep.name: ep.load() for ep in metadata.entry_points(group="tessera.tensor_modes")}
    fallback = builtin_tensor_modes()
    assert sorted(fallback) == sorted(TENSOR_MODES)
    for name, cls in fallback.items():
        assert announced[name] is cls and TENSOR_MODE_PLUGINS.get(name) is cls
        mode = find_tensor_mode(name)
        assert mode is not None and mode.name == name
    # without entry points (no package metadata) the fallback alone names them
    from tessera.registry import Registry

    bare = Registry("tensor_modes", group=None, fallback=builtin_tensor_modes)
    assert sorted(bare.names()) == sorted(TENSOR_MODES) and bare.get("2.5d") is fallback["2.5d"]
