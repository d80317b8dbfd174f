"""ParallelConfig.from_dict: every accepted form and every ConfigError, with its message."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from tessera.context import ConfigError, ExtraInitializer, ParallelConfig, load_config
from tessera.registry import Config


def test_config_error_is_a_value_error() -> None:
    assert issubclass(ConfigError, ValueError)


@pytest.mark.parametrize("parallel", [None, {}])
def test_absent_or_empty_is_pure_data_parallel(parallel: Any) -> None:
    c = ParallelConfig.from_dict(parallel, 6)
    assert (c.data_size, c.pipeline_size, c.tensor_size) == (6, 1, 1)
    assert (c.tensor_mode, c.tensor_depth, dict(c.tensor_args), c.extra) == (None, 1, {}, ())
    assert c.world_size == 6


@pytest.mark.parametrize("pipeline", [2, {"size": 2}])
def test_pipeline_int_or_dict(pipeline: Any) -> None:
    c = ParallelConfig.from_dict({"pipeline": pipeline}, 8)
    assert (c.data_size, c.pipeline_size, c.tensor_size) == (4, 2, 1)


def test_tensor_one_means_no_tensor_parallelism() -> None:
    c = ParallelConfig.from_dict({"tensor": 1}, 4)
    assert (c.data_size, c.tensor_size, c.tensor_mode) == (4, 1, None)


@pytest.mark.parametrize(
    ("tensor", "world", "expected"),
    [
        ({"size": 2, "mode": "1d"}, 8, (4, 2, "1d", 1, 2)),
        ({"size": 4, "mode": "2d"}, 8, (2, 4, "2d", 1, 2)),
        ({"size": 9, "mode": "2d"}, 9, (1, 9, "2d", 1, 3)),
        ({"size": 8, "mode": "2.5d", "depth": 2}, 8, (1, 8, "2.5d", 2, 2)),
        ({"size": 4, "mode": "2.5d", "depth": 4}, 8, (2, 4, "2.5d", 4, 1)),
        ({"size": 8, "mode": "3d"}, 16, (2, 8, "3d", 1, 2)),
        ({"size": 27, "mode": "3d"}, 27, (1, 27, "3d", 1, 3)),
        ({"size": 4, "mode": "sequence"}, 4, (1, 4, "sequence", 1, 4)),
        ({"size": 1, "mode": None}, 3, (3, 1, None, 1, 1)),
    ],
)
def test_tensor_modes(tensor: dict[str, Any], world: int, expected: tuple[Any, ...]) -> None:
    c = ParallelConfig.from_dict({"tensor": tensor}, world)
    assert (c.data_size, c.tensor_size, c.tensor_mode, c.tensor_depth, c.tensor_dim) == expected


def test_extra_tensor_keys_are_kept_as_mode_arguments() -> None:
    tensor = {"size": 2, "mode": "1d", "sequence_parallel": True, "overlap": 3}
    c = ParallelConfig.from_dict({"tensor": tensor}, 2)
    assert dict(c.tensor_args) == {"sequence_parallel": True, "overlap": 3}
    tensor["overlap"] = 4  # the config keeps its own copy
    assert c.tensor_args["overlap"] == 3


def test_explicit_data_is_accepted_when_consistent() -> None:
    c = ParallelConfig.from_dict({"data": 2, "pipeline": 2, "tensor": {"size": 2, "mode": "1d"}}, 8)
    assert (c.data_size, c.pipeline_size, c.tensor_size) == (2, 2, 2)
    c = ParallelConfig.from_dict({"data": {"size": 4}}, 4)
    assert c.data_size == 4


def test_extra_initializers_are_read() -> None:
    class Mine:
        pass

    c = ParallelConfig.from_dict({"extra": [{"type": "MyInitializer", "k": 1}, {"type": Mine}]}, 2)
    assert c.extra == (ExtraInitializer("MyInitializer", {"k": 1}), ExtraInitializer(Mine, {}))


def test_configs_compare_equal_and_hash() -> None:
    a = ParallelConfig.from_dict({"tensor": {"size": 2, "mode": "1d", "x": 1}}, 4)
    b = ParallelConfig.from_dict({"tensor": {"size": 2, "mode": "1d", "x": 1}}, 4)
    assert a == b
    assert hash(a) == hash(b)


# --------------------------------------------------------------------------- every ConfigError

ERRORS: list[tuple[str, Any, int, list[str]]] = [
    # world size != data * pipeline * tensor: all four numbers are shown
    (
        "explicit data",
        {"data": 2, "pipeline": 2, "tensor": {"size": 4, "mode": "2d"}},
        8,
        ["world size 8", "data 2", "pipeline 2", "tensor 4", "= 16"],
    ),
    (
        "not divisible",
        {"pipeline": 3, "tensor": {"size": 2, "mode": "1d"}},
        8,
        ["world size 8", "pipeline 3", "tensor 2", "= 6", "data"],
    ),
    # tensor size > 1 without a mode
    ("int tensor > 1", {"tensor": 4}, 4, ["parallel.tensor=4", "mode", "'1d'"]),
    ("dict without mode", {"tensor": {"size": 4}}, 4, ["tensor size 4 > 1 needs a mode", "'2d'"]),
    # 2d not a perfect square, listing valid sizes
    (
        "2d not square",
        {"tensor": {"size": 8, "mode": "2d"}},
        8,
        ["parallel.tensor.size", "8 is not a perfect square", "1, 4, 9, 16"],
    ),
    # 2.5d not q*q*depth, or depth missing, or depth elsewhere
    (
        "2.5d bad size",
        {"tensor": {"size": 8, "mode": "2.5d", "depth": 3}},
        8,
        ["not q*q*depth", "depth 3", "3, 12, 27"],
    ),
    (
        "2.5d not square layers",
        {"tensor": {"size": 12, "mode": "2.5d", "depth": 4}},
        12,
        ["12 / 4 = 3 is not a perfect square"],
    ),
    (
        "2.5d depth missing",
        {"tensor": {"size": 8, "mode": "2.5d"}},
        8,
        ["parallel.tensor.depth is missing", "q * q * depth"],
    ),
    (
        "depth without 2.5d",
        {"tensor": {"size": 4, "mode": "2d", "depth": 1}},
        4,
        ["parallel.tensor.depth is read only by mode(s) ['2.5d'], but mode is '2d'"],
    ),
    # 3d not a perfect cube
    (
        "3d not cube",
        {"tensor": {"size": 4, "mode": "3d"}},
        4,
        ["4 is not a perfect cube", "1, 8, 27, 64"],
    ),
    # unknown mode, listing the known ones
    (
        "unknown mode",
        {"tensor": {"size": 2, "mode": "4d"}},
        2,
        ["unknown mode '4d'", "'1d', '2d', '2.5d', '3d', 'sequence'"],
    ),
    ("mode not a str", {"tensor": {"size": 2, "mode": 1}}, 2, ["unknown mode 1"]),
    # sizes that are not positive ints
    (
        "pipeline str",
        {"pipeline": "2"},
        2,
        ["parallel.pipeline must be a positive int", "'2' (str)"],
    ),
    ("pipeline zero", {"pipeline": 0}, 2, ["parallel.pipeline must be a positive int", "0 (int)"]),
    ("pipeline negative", {"pipeline": {"size": -1}}, 2, ["parallel.pipeline.size", "-1"]),
    ("pipeline bool", {"pipeline": True}, 2, ["parallel.pipeline", "True (bool)"]),
    ("pipeline float", {"pipeline": 2.0}, 2, ["parallel.pipeline", "2.0 (float)"]),
    (
        "tensor size str",
        {"tensor": {"size": "4", "mode": "2d"}},
        4,
        ["parallel.tensor.size", "'4'"],
    ),
    (
        "depth zero",
        {"tensor": {"size": 4, "mode": "2.5d", "depth": 0}},
        4,
        ["parallel.tensor.depth"],
    ),
    ("data zero", {"data": 0}, 2, ["parallel.data must be a positive int"]),
    ("tensor zero", {"tensor": 0}, 2, ["parallel.tensor must be a positive int"]),
    ("world size zero", {}, 0, ["world_size must be a positive int"]),
    ("world size absurd", {}, 2**65, ["world_size 36893488147419103232 exceeds", "2**20"]),
    # unknown keys, with the closest suggestion
    (
        "pipline",
        {"pipline": 2},
        2,
        ["unknown key 'parallel.pipline'", "did you mean 'parallel.pipeline'"],
    ),
    ("tensr", {"tensr": 2}, 2, ["'parallel.tensr'", "did you mean 'parallel.tensor'"]),
    (
        "mode argument misspelt",
        {"tensor": {"size": 2, "mode": "1d", "sequence_paralel": True}},
        2,
        ["'parallel.tensor.sequence_paralel'", "did you mean 'parallel.tensor.sequence_parallel'"],
    ),
    (
        "mode argument of another mode",
        {"tensor": {"size": 4, "mode": "2d", "sequence_parallel": True}},
        4,
        ["parallel.tensor.sequence_parallel is read only by mode(s) ['1d'], but mode is '2d'"],
    ),
    (
        "far key",
        {"zzz": 2},
        2,
        ["unknown key 'parallel.zzz'", "known keys: data, pipeline, tensor, extra"],
    ),
    (
        "pipeline sub key",
        {"pipeline": {"sise": 2}},
        2,
        ["'parallel.pipeline.sise'", "did you mean 'parallel.pipeline.size'"],
    ),
    (
        "tensor typo",
        {"tensor": {"size": 8, "mode": "2.5d", "dept": 2}},
        8,
        ["'parallel.tensor.dept'", "did you mean 'parallel.tensor.depth'"],
    ),
    ("tensor size missing", {"tensor": {"mode": "1d"}}, 2, ["parallel.tensor.size is missing"]),
    ("pipeline size missing", {"pipeline": {}}, 2, ["parallel.pipeline.size is missing"]),
    # wrong shapes
    ("parallel not a dict", [1], 2, ["parallel must be a dict"]),
    ("extra not a list", {"extra": {"type": "X"}}, 2, ["parallel.extra must be a list"]),
    ("extra entry not a dict", {"extra": ["X"]}, 2, ["parallel.extra[0] must be a dict"]),
    ("extra without type", {"extra": [{"k": 1}]}, 2, ["parallel.extra[0].type is missing"]),
    ("extra type bad", {"extra": [{"type": 3}]}, 2, ["parallel.extra[0].type must be"]),
]


@pytest.mark.parametrize(
    ("parallel", "world", "fragments"),
    [pytest.param(p, w, f, id=name) for name, p, w, f in ERRORS],
)
def test_config_errors(parallel: Any, world: int, fragments: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        ParallelConfig.from_dict(parallel, world)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"


def test_constructor_checks_the_same_invariants() -> None:
    with pytest.raises(ConfigError, match="not a perfect square"):
        ParallelConfig(tensor_size=8, tensor_mode="2d")
    with pytest.raises(ConfigError, match="needs a mode"):
        ParallelConfig(tensor_size=2)
    with pytest.raises(ConfigError, match="positive int"):
        ParallelConfig(data_size=0)


# --------------------------------------------------------------------------- config files

PY_CONFIG = """
parallel = dict(pipeline=2, tensor=dict(size=4, mode="1d", sequence_parallel=True))
model = dict(type="GPT")
"""

TOML_CONFIG = """
[parallel]
pipeline = 2
[parallel.tensor]
size = 4
mode = "1d"
sequence_parallel = true
[model]
type = "GPT"
"""

JSON_CONFIG = (
    '{"parallel": {"pipeline": 2, "tensor": {"size": 4, "mode": "1d", '
    '"sequence_parallel": true}}, "model": {"type": "GPT"}}'
)


@pytest.mark.parametrize(
    ("suffix", "text"), [(".py", PY_CONFIG), (".toml", TOML_CONFIG), (".json", JSON_CONFIG)]
)
def test_config_file_behaves_like_the_dict(tmp_path: Path, suffix: str, text: str) -> None:
    path = tmp_path / f"cfg{suffix}"
    path.write_text(text)
    from_file = ParallelConfig.from_dict(Config.from_file(path)["parallel"], 16)
    from_dict = ParallelConfig.from_dict(
        {"pipeline": 2, "tensor": {"size": 4, "mode": "1d", "sequence_parallel": True}}, 16
    )
    assert from_file == from_dict
    assert load_config(path)["model"]["type"] == "GPT"
    assert load_config(str(path)) == load_config(path)


def test_config_file_errors_match_the_dict(tmp_path: Path) -> None:
    path = tmp_path / "bad.py"
    path.write_text("parallel = dict(pipline=2)\n")
    with pytest.raises(ConfigError) as from_file:
        ParallelConfig.from_dict(load_config(path)["parallel"], 2)
    with pytest.raises(ConfigError) as from_dict:
        ParallelConfig.from_dict({"pipline": 2}, 2)
    assert str(from_file.value) == str(from_dict.value)


def test_load_config_accepts_dicts_and_configs() -> None:
    cfg = Config({"parallel": {"pipeline": 2}})
    assert load_config(cfg) is cfg
    assert load_config({"x": 1}) == {"x": 1}
    with pytest.raises(ConfigError, match="must be a dict"):
        load_config(3)  # type: ignore[arg-type]


def test_parallel_keys_at_the_top_level_are_reported() -> None:
    with pytest.raises(ConfigError, match=re.escape("found ['tensor'] at the top level")):
        load_config({"tensor": {"size": 2, "mode": "1d"}})
