"""``build``: types by name or class, recursion, per-key registries and exact error messages."""

from __future__ import annotations

from collections import namedtuple
from typing import Any

import pytest
import torch

from tessera.registry import (
    DEFAULT_KEY_REGISTRIES,
    LOSSES,
    LR_SCHEDULERS,
    MODELS,
    OPTIMIZERS,
    Config,
    ConfigError,
    Registry,
    build,
)


class Inner:
    def __init__(self, size: int, scale: float = 1.0) -> None:
        self.size = size
        self.scale = scale


class Outer:
    def __init__(self, inner: Any, name: str = "outer", extras: Any = None) -> None:
        self.inner = inner
        self.name = name
        self.extras = extras


class Exploding:
    def __init__(self, value: int) -> None:
        raise TypeError("boom from inside the constructor")


class TakesKwargs:
    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs


@pytest.fixture
def reg() -> Registry[Any]:
    r: Registry[Any] = Registry("parts")
    r.register(Inner)
    r.register(Outer)
    r.register(Exploding)
    r.register(TakesKwargs)
    return r


def test_build_by_name_and_by_class(reg: Registry[Any]) -> None:
    obj = build({"type": "Inner", "size": 3}, reg)
    assert isinstance(obj, Inner) and obj.size == 3 and obj.scale == 1.0
    obj2 = build({"type": Inner, "size": 4, "scale": 2.0})
    assert isinstance(obj2, Inner) and (obj2.size, obj2.scale) == (4, 2.0)


def test_build_with_a_plain_callable() -> None:
    def make_pair(a: int, b: int = 2) -> tuple[int, int]:
        return (a, b)

    assert build({"type": make_pair, "a": 1}) == (1, 2)


def test_overrides_are_added_and_win(reg: Registry[Any]) -> None:
    obj = build({"type": "Inner", "size": 3}, reg, size=7, scale=0.5)
    assert (obj.size, obj.scale) == (7, 0.5)


def test_overrides_are_passed_unbuilt(reg: Registry[Any]) -> None:
    raw = {"type": "Inner", "size": 1}
    obj = build({"type": "Outer"}, reg, inner=raw)
    assert obj.inner is raw


def test_cfg_is_not_modified(reg: Registry[Any]) -> None:
    cfg = {"type": "Outer", "inner": {"type": "Inner", "size": 2}}
    build(cfg, reg, name="x")
    assert cfg == {"type": "Outer", "inner": {"type": "Inner", "size": 2}}


def test_nested_mapping_is_built_in_the_same_registry(reg: Registry[Any]) -> None:
    obj = build({"type": "Outer", "inner": {"type": "Inner", "size": 5}}, reg)
    assert isinstance(obj.inner, Inner) and obj.inner.size == 5


def test_nested_inside_lists_tuples_and_plain_mappings(reg: Registry[Any]) -> None:
    cfg = {
        "type": "Outer",
        "inner": [{"type": "Inner", "size": 1}, 7, ({"type": "Inner", "size": 2},)],
        "extras": {"first": {"type": "Inner", "size": 3}, "plain": {"a": 1}},
    }
    obj = build(cfg, reg)
    assert isinstance(obj.inner, list)
    assert obj.inner[0].size == 1
    assert obj.inner[1] == 7
    assert isinstance(obj.inner[2], tuple) and obj.inner[2][0].size == 2
    assert type(obj.extras) is dict
    assert obj.extras["first"].size == 3
    assert obj.extras["plain"] == {"a": 1}


def test_namedtuple_is_passed_as_is(reg: Registry[Any]) -> None:
    Point = namedtuple("Point", "x y")
    point = Point(1, 2)
    obj = build({"type": "Outer", "inner": point}, reg)
    assert obj.inner is point


def test_build_accepts_config(reg: Registry[Any]) -> None:
    cfg = Config({"type": "Outer", "inner": {"type": "Inner", "size": 9}})
    assert build(cfg, reg).inner.size == 9


def test_key_maps_nested_config_to_torch_registries() -> None:
    cfg = {
        "type": Outer,
        "inner": {"type": Inner, "size": 1},
        "extras": {
            "loss": {"type": "CrossEntropyLoss", "label_smoothing": 0.1},
            "criterion": {"type": "MSELoss"},
        },
    }
    obj = build(cfg)
    assert isinstance(obj.extras["loss"], torch.nn.CrossEntropyLoss)
    assert obj.extras["loss"].label_smoothing == 0.1
    assert isinstance(obj.extras["criterion"], torch.nn.MSELoss)


def test_optimizer_and_scheduler_from_config_with_params_override() -> None:
    model = torch.nn.Linear(2, 2)
    opt = build({"type": "SGD", "lr": 0.5, "momentum": 0.9}, OPTIMIZERS, params=model.parameters())
    assert isinstance(opt, torch.optim.SGD)
    assert opt.param_groups[0]["lr"] == 0.5
    sched = build({"type": "StepLR", "step_size": 3}, LR_SCHEDULERS, optimizer=opt)
    assert isinstance(sched, torch.optim.lr_scheduler.StepLR)


def test_default_key_registries_mapping() -> None:
    assert DEFAULT_KEY_REGISTRIES["optimizer"] is OPTIMIZERS
    assert DEFAULT_KEY_REGISTRIES["lr_scheduler"] is LR_SCHEDULERS
    assert DEFAULT_KEY_REGISTRIES["loss"] is LOSSES
    assert DEFAULT_KEY_REGISTRIES["criterion"] is LOSSES
    assert DEFAULT_KEY_REGISTRIES["model"] is MODELS
    assert set(DEFAULT_KEY_REGISTRIES) == {
        "model",
        "layer",
        "layers",
        "optimizer",
        "lr_scheduler",
        "loss",
        "criterion",
    }
    with pytest.raises(TypeError):
        DEFAULT_KEY_REGISTRIES["x"] = MODELS  # type: ignore[index]


def test_custom_key_registries(reg: Registry[Any]) -> None:
    other: Registry[Any] = Registry("others")

    @other.register(name="Inner")
    class OtherInner:
        def __init__(self, size: int) -> None:
            self.size = size

    cfg = {"type": "Outer", "inner": {"type": "Inner", "size": 1}}
    assert isinstance(build(cfg, reg).inner, Inner)
    assert isinstance(build(cfg, reg, registries={"inner": other}).inner, OtherInner)


def test_unknown_type_names_path_and_suggestion(reg: Registry[Any]) -> None:
    with pytest.raises(ConfigError) as info:
        build({"type": "Outer", "inner": {"type": "Iner", "size": 1}}, reg)
    assert str(info.value) == (
        "inner.type: registry 'parts' has no name 'Iner'; did you mean 'Inner'?"
    )


def test_unknown_type_at_top_level(reg: Registry[Any]) -> None:
    with pytest.raises(ConfigError, match=r"^type: registry 'parts' has no name 'Nope'"):
        build({"type": "Nope"}, reg)


def test_unknown_nested_optimizer_path() -> None:
    with pytest.raises(ConfigError) as info:
        build({"type": Outer, "inner": 1, "extras": {"optimizer": {"type": "Adamm"}}})
    message = str(info.value)
    assert message.startswith("extras.optimizer.type: registry 'optimizers' has no name 'Adamm'")
    assert "did you mean 'Adam'" in message


def test_missing_type(reg: Registry[Any]) -> None:
    with pytest.raises(ConfigError) as info:
        build({"size": 1}, reg)
    assert str(info.value) == "<root>: missing 'type' (keys present: 'size')"


def test_name_without_registry() -> None:
    with pytest.raises(ConfigError, match=r"^type: 'Inner' is a name but no registry applies"):
        build({"type": "Inner", "size": 1})


def test_type_that_is_not_callable(reg: Registry[Any]) -> None:
    with pytest.raises(ConfigError) as info:
        build({"type": 3}, reg)
    assert str(info.value) == "type: must be a registered name or a class/callable, got int 3"
    reg.register(5, name="five")
    with pytest.raises(ConfigError, match=r"^type: 'five' in registry 'parts' is 5, not callable"):
        build({"type": "five"}, reg)


def test_not_a_mapping() -> None:
    with pytest.raises(ConfigError, match="needs a mapping with a 'type' key, got list"):
        build([1, 2])  # type: ignore[arg-type]


def test_bad_keyword_lists_accepted_ones(reg: Registry[Any]) -> None:
    with pytest.raises(ConfigError) as info:
        build({"type": "Outer", "inner": {"type": "Inner", "size": 1, "sise": 2}}, reg)
    assert str(info.value) == (
        "inner.sise: Inner accepts no keyword 'sise'; accepted keywords: size, scale"
    )


def test_bad_keyword_on_torch_optimizer() -> None:
    with pytest.raises(ConfigError) as info:
        build({"type": Outer, "inner": 0, "extras": {"optimizer": {"type": "Adam", "lrr": 1}}})
    message = str(info.value)
    assert message.startswith("extras.optimizer.lrr: Adam accepts no keyword 'lrr'; accepted")
    assert "params, lr, betas, eps, weight_decay" in message
    model = torch.nn.Linear(1, 1)
    with pytest.raises(
        ConfigError, match=r"^lrr: Adam accepts no keyword 'lrr'; accepted keywords: params, lr"
    ):
        build({"type": "Adam", "lrr": 1}, OPTIMIZERS, params=model.parameters())


def test_top_level_bad_keyword(reg: Registry[Any]) -> None:
    with pytest.raises(ConfigError) as info:
        build({"type": "Inner", "size": 1}, reg, colour="red", shape="x")
    assert str(info.value) == (
        "colour: Inner accepts no keyword 'colour', 'shape'; accepted keywords: size, scale"
    )


def test_missing_required_keyword(reg: Registry[Any]) -> None:
    with pytest.raises(ConfigError) as info:
        build({"type": "Outer", "inner": {"type": "Inner", "scale": 2.0}}, reg)
    assert str(info.value) == (
        "inner: Inner is missing required keyword(s) 'size'; accepted keywords: size, scale"
    )


def test_var_keyword_target_accepts_anything(reg: Registry[Any]) -> None:
    obj = build({"type": "TakesKwargs", "anything": 1}, reg)
    assert obj.kwargs == {"anything": 1}


def test_type_error_inside_constructor_is_not_misreported(reg: Registry[Any]) -> None:
    with pytest.raises(TypeError, match="boom from inside the constructor") as info:
        build({"type": "Exploding", "value": 1}, reg)
    assert not isinstance(info.value, ConfigError)


def test_list_items_path_in_errors(reg: Registry[Any]) -> None:
    cfg = {"type": "Outer", "inner": [{"type": "Inner", "size": 1}, {"type": "Inner", "x": 1}]}
    with pytest.raises(ConfigError, match=r"^inner\[1\]\.x: Inner accepts no keyword 'x'"):
        build(cfg, reg)
