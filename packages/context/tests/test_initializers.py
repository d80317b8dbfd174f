"""Custom process-group initializers, checked without processes."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import pytest
from custom_modes import EmbeddingGroupInitializer, PairsInitializer

from tessera.context import (
    PROCESS_GROUP_INITIALIZERS,
    ConfigError,
    ParallelConfig,
    ProcessGroupInitializer,
    Tensor2DInitializer,
    rank_groups,
)


def _cfg(world: int, **parallel: Any) -> ParallelConfig:
    return ParallelConfig.from_dict(parallel, world)


def test_registered_initializer_by_name() -> None:
    layout = rank_groups(_cfg(8, pipeline=4, extra=[{"type": "EmbeddingGroupInitializer"}]))
    assert layout["embedding"] == [(0, 3), (4, 7)]  # data 2 x pipeline 4: stages 0 and 3


def test_initializer_passed_as_class_with_arguments() -> None:
    layout = rank_groups(_cfg(5, extra=[{"type": PairsInitializer, "stride": 2}]))
    assert layout["pairs"] == [(0, 1), (2, 3), (4,)]
    assert layout["pairs_reversed"] == [(1, 0), (3, 2), (4,)]
    assert list(layout)[-2:] == ["pairs", "pairs_reversed"]  # after the built-in modes


def test_partial_coverage_is_allowed() -> None:
    layout = rank_groups(_cfg(6, pipeline=3, extra=[{"type": EmbeddingGroupInitializer}]))
    assert layout["embedding"] == [(0, 2), (3, 5)]  # the middle stage (1, 4) has no group


def test_builtin_initializers_are_registered_through_entry_points() -> None:
    assert PROCESS_GROUP_INITIALIZERS.get("Tensor2DInitializer") is Tensor2DInitializer
    for name in (
        "GlobalInitializer",
        "Tensor1DInitializer",
        "Tensor2p5DInitializer",
        "Tensor3DInitializer",
        "SequenceInitializer",
    ):
        assert name in PROCESS_GROUP_INITIALIZERS


class _Bad(ProcessGroupInitializer):
    modes = ("bad",)
    groups: Sequence[Sequence[Any]] = ()

    def rank_groups(self, config: ParallelConfig) -> Mapping[str, Sequence[Sequence[int]]]:
        return {"bad": self.groups}


def _bad(groups: Sequence[Sequence[Any]]) -> type[_Bad]:
    return type("Bad", (_Bad,), {"groups": groups})


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [
        ({"type": "NoSuchInitializer"}, "no process-group initializer named 'NoSuchInitializer'"),
        ({"type": int}, "is not a ProcessGroupInitializer subclass"),
        ({"type": PairsInitializer, "strde": 2}, "cannot construct PairsInitializer"),
        ({"type": _bad([(0, 4)])}, "holds 4, not a rank in 0..3"),
        ({"type": _bad([(0, "1")])}, "holds '1'"),
        ({"type": _bad([(0, 1), (1, 2)])}, "rank 1 is in group 0 and group 1"),
        ({"type": _bad([()])}, "group 0 of mode 'bad' is empty"),
        ({"type": Tensor2DInitializer}, "mode 'parallel_2d_row', which Tensor2DInitializer"),
    ],
)
def test_invalid_extra_initializers(extra: dict[str, Any], fragment: str) -> None:
    config = _cfg(4, tensor={"size": 4, "mode": "2d"}, extra=[extra])
    with pytest.raises(ConfigError) as info:
        rank_groups(config)
    assert fragment in str(info.value)
    assert "parallel.extra[0]" in str(info.value)


def test_declared_and_returned_modes_must_match() -> None:
    class Liar(ProcessGroupInitializer):
        modes = ("a",)

        def rank_groups(self, config: ParallelConfig) -> dict[str, list[tuple[int, ...]]]:
            return {"b": [(0,)]}

    expected = "declares modes ['a'] but returned groups for ['b']"
    with pytest.raises(ConfigError, match=re.escape(expected)):
        rank_groups(_cfg(1, extra=[{"type": Liar}]))


def test_a_mode_name_cannot_be_taken_twice() -> None:
    with pytest.raises(ConfigError, match=re.escape("'pairs', which parallel.extra[0]")):
        rank_groups(_cfg(2, extra=[{"type": PairsInitializer}, {"type": PairsInitializer}]))


def test_no_declared_modes() -> None:
    class Empty(ProcessGroupInitializer):
        def rank_groups(self, config: ParallelConfig) -> dict[str, list[tuple[int, ...]]]:
            return {}

    with pytest.raises(ConfigError, match="declares no modes"):
        rank_groups(_cfg(1, extra=[{"type": Empty}]))


def test_builtin_initializer_refuses_another_mode() -> None:
    with pytest.raises(
        ConfigError, match=re.escape("tensor mode '2d', but parallel.tensor.mode is '1d'")
    ):
        Tensor2DInitializer().rank_groups(_cfg(4, tensor={"size": 4, "mode": "1d"}))


def test_readme_example_is_the_tested_one() -> None:
    from pathlib import Path

    here = Path(__file__).parent
    readme = (here.parent / "README.md").read_text()
    tested = (here / "custom_modes.py").read_text()
    start = readme.index("@PROCESS_GROUP_INITIALIZERS.register\nclass EmbeddingGroupInitializer")
    end = readme.index('return {"embedding": groups}', start)
    assert readme[start:end] in tested
