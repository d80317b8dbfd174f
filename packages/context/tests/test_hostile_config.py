"""Hostile ``parallel`` blocks (hypothesis): a valid ParallelConfig or a ConfigError, nothing else.

Each example runs under hypothesis' deadline, so a parser that loops or explodes on a huge
size fails here as a slow example instead of hanging a job. Valid results are checked against
the invariants the rest of tessera relies on (the product of the sizes is the world size, the
layout covers every rank once per mode).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tessera.context import TENSOR_MODES, ConfigError, ParallelConfig, load_config, rank_groups
from tessera.registry import Config

SETTINGS = settings(
    max_examples=300,
    deadline=2000,  # ms per example: generous for two shared cores, finite for a hang
    suppress_health_check=[HealthCheck.too_slow],
)

# Values a careless or hostile config file may hold where a size or a mode is expected.
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-3, max_value=70),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=6),
    st.sampled_from(["2", "1d", "2d", "2.5d", "3d", "sequence", "4", "size"]),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.dictionaries(st.one_of(st.text(max_size=5), st.integers()), inner, max_size=3),
    ),
    max_leaves=6,
)
sizes = st.one_of(st.integers(min_value=1, max_value=8), values)
tensor_blocks = st.one_of(
    sizes,
    st.fixed_dictionaries(
        {},
        optional={
            "size": st.one_of(st.sampled_from([1, 2, 4, 8, 9, 16, 27, 64]), values),
            "mode": st.one_of(st.sampled_from([None, *TENSOR_MODES]), values),
            "depth": st.one_of(st.integers(min_value=0, max_value=4), values),
            "sequence_parallel": values,
        },
    ),
)
extra_blocks = st.one_of(
    values,
    st.lists(
        st.one_of(
            values,
            st.fixed_dictionaries({"type": st.one_of(st.text(max_size=8), values)}),
        ),
        max_size=2,
    ),
)
parallel_blocks = st.one_of(
    st.none(),
    values,
    st.fixed_dictionaries(
        {},
        optional={
            "data": st.one_of(sizes, st.fixed_dictionaries({"size": sizes})),
            "pipeline": st.one_of(sizes, st.fixed_dictionaries({"size": sizes})),
            "tensor": tensor_blocks,
            "extra": extra_blocks,
            "pipline": values,  # a typo
        },
    ),
)
world_sizes = st.one_of(
    st.integers(min_value=1, max_value=64),
    st.integers(min_value=-2, max_value=0),
    st.sampled_from([True, 2.0, "4", None]),
)


def _check_valid(config: ParallelConfig, world: Any) -> None:
    assert config.world_size == world
    assert config.data_size * config.pipeline_size * config.tensor_size == world
    assert config.tensor_mode in (None, *TENSOR_MODES)
    if config.tensor_size > 1:
        assert config.tensor_mode is not None
    if config.extra:
        return  # user initializers are looked up by name: their layouts are their own
    for mode, groups in rank_groups(config).items():
        members = [rank for group in groups for rank in group]
        assert len(members) == len(set(members)), mode  # disjoint
        assert set(members) <= set(range(world)), mode


@SETTINGS
@given(parallel=parallel_blocks, world=world_sizes)
def test_random_parallel_blocks_give_a_config_or_a_config_error(parallel: Any, world: Any) -> None:
    try:
        config = ParallelConfig.from_dict(parallel, world)
    except ConfigError as err:
        assert str(err)  # a message, never an empty error
        return
    _check_valid(config, world)


@SETTINGS
@given(
    data=st.integers(1, 4),
    pipeline=st.integers(1, 4),
    size=st.sampled_from([1, 2, 4, 8, 9, 16, 27]),
    mode=st.sampled_from([None, *TENSOR_MODES]),
    depth=st.integers(1, 4),
)
def test_well_formed_blocks_are_accepted_exactly_when_the_arithmetic_works(
    data: int, pipeline: int, size: int, mode: str | None, depth: int
) -> None:
    tensor: dict[str, Any] = {"size": size, "mode": mode}
    if mode == "2.5d":
        tensor["depth"] = depth
    world = data * pipeline * size
    q2 = round(size**0.5) ** 2 == size
    cube = round(size ** (1 / 3)) ** 3 == size
    flat = size // depth
    expected_ok = {
        None: size == 1,
        "1d": True,
        "sequence": True,
        "2d": q2,
        "3d": cube,
        "2.5d": size % depth == 0 and round(flat**0.5) ** 2 == flat,
    }[mode]
    parallel = {"data": data, "pipeline": pipeline, "tensor": tensor}
    if expected_ok:
        config = ParallelConfig.from_dict(parallel, world)
        _check_valid(config, world)
        assert (config.data_size, config.pipeline_size, config.tensor_size) == (
            data,
            pipeline,
            size,
        )
    else:
        with pytest.raises(ConfigError):
            ParallelConfig.from_dict(parallel, world)


# ---------------------------------------------------------------- config files with wrong types


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, float):
        return repr(value) if value == value and abs(value) != float("inf") else "nan"
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return str(value)


file_values = st.one_of(
    st.integers(-2, 10),
    st.booleans(),
    st.text(alphabet="abc2d.", max_size=4),
    st.floats(allow_nan=False, allow_infinity=False, width=32),
    st.lists(st.integers(0, 4), max_size=2),
)


@settings(
    max_examples=60, deadline=4000, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    pipeline=file_values,
    size=file_values,
    mode=file_values,
    fmt=st.sampled_from(["json", "toml", "py"]),
    world=st.integers(1, 16),
)
def test_config_files_with_wrong_types_give_config_errors(
    tmp_path_factory: pytest.TempPathFactory,
    pipeline: Any,
    size: Any,
    mode: Any,
    fmt: str,
    world: int,
) -> None:
    directory: Path = tmp_path_factory.mktemp("cfg")
    path = directory / f"config.{fmt}"
    block = {"pipeline": pipeline, "tensor": {"size": size, "mode": mode}}
    if fmt == "json":
        path.write_text(json.dumps({"parallel": block}))
    elif fmt == "toml":
        path.write_text(
            "[parallel]\n"
            f"pipeline = {_toml_value(pipeline)}\n"
            "[parallel.tensor]\n"
            f"size = {_toml_value(size)}\n"
            f"mode = {_toml_value(mode)}\n"
        )
    else:
        path.write_text(f"parallel = {block!r}\n")
    try:
        full = load_config(path)
        config = ParallelConfig.from_dict(full.get("parallel"), world)
    except ConfigError as err:
        assert str(err)
        return
    _check_valid(config, world)
    # Whatever was accepted from a file is accepted from the same dict.
    assert ParallelConfig.from_dict(Config(full).to_dict()["parallel"], world) == config


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("broken.json", '{"parallel": {"pipeline": 2,'),
        ("broken.toml", "[parallel\npipeline = 2"),
        ("broken.py", "parallel = dict(pipeline=2\n"),
        ("list.json", "[1, 2, 3]"),
        ("unknown.ini", "[parallel]\npipeline=2"),
        ("raises.py", "parallel = dict(pipeline=undefined_name)\n"),
        ("binary.json", "\xff\xfe{}"),
    ],
)
def test_unreadable_config_files_give_config_errors(tmp_path: Path, name: str, text: str) -> None:
    path = tmp_path / name
    path.write_bytes(text.encode("latin-1"))
    with pytest.raises(ConfigError, match=re.escape(name)):
        load_config(path)


def test_a_missing_config_file_is_reported_with_its_path(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"nothing\.toml"):
        load_config(tmp_path / "nothing.toml")
