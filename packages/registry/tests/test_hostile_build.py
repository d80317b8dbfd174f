"""Hostile ``build`` configs and overrides (hypothesis): an object or a ConfigError, nothing else.

The registered components accept whatever they are given, so every exception that escapes
``build`` would be ``build``'s own: a bad type, key, keyword or nesting must come back as a
``ConfigError`` naming its key path, never a ``TypeError``/``KeyError`` from deep inside.
"""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tessera.registry import Config, ConfigError, Registry, build

SETTINGS = settings(max_examples=300, deadline=2000, suppress_health_check=[HealthCheck.too_slow])

PARTS: Registry[Any] = Registry("hostile_parts")


@PARTS.register
class Point:
    def __init__(self, x: Any, y: Any = 0) -> None:
        self.x, self.y = x, y


@PARTS.register
class Bag:
    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs


@PARTS.register(name="Nested")
class NestedPart:
    def __init__(self, child: Any = None, items: Any = (), *, flag: Any = False) -> None:
        self.child, self.items, self.flag = child, items, flag


@PARTS.register
def pair(first: Any, second: Any) -> tuple[Any, Any]:
    return first, second


NAMES = ["Point", "Bag", "Nested", "pair"]
KEYS = ["x", "y", "child", "items", "flag", "first", "second", "type", "kwargs"]

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=True),
    st.text(max_size=8),
    st.binary(max_size=4),
)
type_specs = st.one_of(
    st.sampled_from(NAMES),
    st.sampled_from(["Pointt", "bag", "", "nested", "Adam", "0"]),  # misspelled / foreign
    scalars,
    st.lists(st.integers(), max_size=2),
    st.just(Point),
    st.just(pair),
)
keys = st.one_of(st.sampled_from(KEYS), st.text(max_size=5), st.integers(-2, 2), st.none())


def configs(depth: int = 2) -> st.SearchStrategy[Any]:
    """A mapping that may carry a type, with keys and values of every sort, nested."""
    if depth == 0:
        leaves: st.SearchStrategy[Any] = scalars
    else:
        inner = configs(depth - 1)
        leaves = st.one_of(scalars, inner, st.lists(st.one_of(scalars, inner), max_size=3))
        leaves = st.one_of(leaves, st.tuples(leaves, scalars))
    body = st.dictionaries(keys, leaves, max_size=4)
    return st.one_of(
        body,
        st.builds(lambda t, rest: {"type": t, **rest}, type_specs, body),
    )


@SETTINGS
@given(cfg=st.one_of(configs(), scalars, st.lists(scalars, max_size=2)))
def test_random_build_configs_give_an_object_or_a_config_error(cfg: Any) -> None:
    try:
        built = build(cfg, PARTS)
    except ConfigError as err:
        assert str(err)
        return
    assert built is not None


@SETTINGS
@given(cfg=configs(), overrides=st.dictionaries(st.sampled_from(KEYS[:7]), scalars, max_size=2))
def test_overrides_are_passed_as_given(cfg: Any, overrides: dict[str, Any]) -> None:
    try:
        build(cfg, PARTS, **overrides)
    except ConfigError as err:
        assert str(err)


@SETTINGS
@given(
    base=st.dictionaries(st.text(max_size=4), scalars, max_size=3),
    items=st.lists(st.text(max_size=12), max_size=4),
)
def test_random_overrides_give_a_config_or_a_config_error(
    base: dict[str, Any], items: list[str]
) -> None:
    try:
        result = Config(base).apply_overrides(items)
    except ConfigError as err:
        assert str(err)
        return
    assert isinstance(result, Config)


def test_non_string_keywords_are_a_config_error_naming_them() -> None:
    try:
        build({"type": "Bag", 3: "x"}, PARTS)
    except ConfigError as err:
        assert "3" in str(err)
    else:
        raise AssertionError("a non-string keyword was accepted")
