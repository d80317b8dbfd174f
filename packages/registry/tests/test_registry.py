"""Registration forms, duplicates, lookups and the not-found messages of ``Registry``."""

from __future__ import annotations

import re

import pytest

from tessera.registry import Registry


def make() -> Registry[object]:
    return Registry("widgets")


def test_bare_decorator_registers_under_dunder_name_and_returns_the_class() -> None:
    reg = make()

    @reg.register
    class Widget:
        pass

    assert reg.get("Widget") is Widget
    assert isinstance(Widget(), Widget)


def test_decorator_factory_with_name() -> None:
    reg = make()

    @reg.register(name="Fancy")
    class Widget:
        pass

    assert reg.get("Fancy") is Widget
    assert "Widget" not in reg


def test_plain_call_with_and_without_name() -> None:
    reg = make()

    def factory() -> int:
        return 3

    assert reg.register(factory) is factory
    assert reg.register(factory, name="alias") is factory
    assert reg.get("factory") is factory
    assert reg.get("alias") is factory


def test_decorator_factory_with_no_arguments() -> None:
    reg = make()

    @reg.register()
    def thing() -> None:
        pass

    assert reg.get("thing") is thing


def test_duplicate_name_raises_naming_both_objects() -> None:
    reg = make()

    def first() -> None:
        pass

    def second() -> None:
        pass

    reg.register(first, name="x")
    with pytest.raises(ValueError) as info:
        reg.register(second, name="x")
    message = str(info.value)
    assert "registry 'widgets'" in message
    assert "name 'x' is already registered" in message
    assert "first" in message and "second" in message
    assert "override=True" in message
    assert reg.get("x") is first


def test_duplicate_with_override_replaces() -> None:
    reg = make()
    reg.register(int, name="x")
    reg.register(float, name="x", override=True)
    assert reg.get("x") is float


def test_registering_the_same_object_twice_is_a_no_op() -> None:
    reg = make()
    reg.register(int)
    reg.register(int)
    assert reg.names() == ["int"]


def test_object_without_name_needs_explicit_name() -> None:
    reg = make()
    with pytest.raises(TypeError, match=r"cannot infer a name for 5 .*pass name="):
        reg.register(5)
    reg.register(5, name="five")
    assert reg.get("five") == 5


def test_contains_names_iter_len() -> None:
    reg = make()
    reg.register(int, name="b")
    reg.register(str, name="a")
    assert "a" in reg and "b" in reg
    assert "c" not in reg
    assert 3 not in reg
    assert reg.names() == ["a", "b"]
    assert list(reg) == ["a", "b"]
    assert len(reg) == 2


def test_get_unknown_suggests_closest_names() -> None:
    reg = make()
    for name in ["Linear1D", "Linear2D", "Embedding2D", "LayerNorm"]:
        reg.register(object(), name=name)
    with pytest.raises(KeyError) as info:
        reg.get("Linera2D")
    message = info.value.args[0]
    assert message.startswith("registry 'widgets' has no name 'Linera2D'; did you mean 'Linear2D'")
    assert "'Linear1D'" in message
    assert "LayerNorm" not in message


def test_get_unknown_suggestion_is_case_insensitive() -> None:
    reg = make()
    reg.register(object(), name="CrossEntropyLoss")
    with pytest.raises(KeyError, match=r"did you mean 'CrossEntropyLoss'\?"):
        reg.get("crossentropyloss")


def test_get_unknown_without_close_match_lists_known_names() -> None:
    reg = make()
    reg.register(object(), name="alpha")
    reg.register(object(), name="beta")
    with pytest.raises(KeyError) as info:
        reg.get("zzzzzz")
    assert info.value.args[0] == "registry 'widgets' has no name 'zzzzzz'; known names: alpha, beta"


def test_get_unknown_in_many_names_reports_count() -> None:
    reg = make()
    for i in range(40):
        reg.register(object(), name=f"n{i:02d}")
    with pytest.raises(KeyError, match=re.escape("it knows 40 names, see .names()")):
        reg.get("zzzzzzzz")


def test_get_in_empty_registry_names_the_group() -> None:
    reg: Registry[object] = Registry("layers", group="tessera.no_such_group_for_tests")
    with pytest.raises(KeyError) as info:
        reg.get("Linear2D")
    message = info.value.args[0]
    assert "registry 'layers' has no name 'Linear2D': it is empty" in message
    assert "entry-point group 'tessera.no_such_group_for_tests'" in message
    assert "installed" in message


def test_fallback_is_lazy_and_lower_precedence() -> None:
    calls: list[int] = []

    def fallback() -> dict[str, object]:
        calls.append(1)
        return {"a": "from-fallback", "b": "fb-b"}

    reg: Registry[object] = Registry("r", fallback=fallback)
    reg.register("registered", name="a")
    assert calls == []
    assert reg.get("a") == "registered"  # found before the fallback is needed
    assert calls == []
    assert reg.get("b") == "fb-b"
    assert "b" in reg
    assert reg.names() == ["a", "b"]
    assert calls == [1]  # called once, cached


def test_repr_and_properties() -> None:
    reg: Registry[object] = Registry("layers", group="tessera.layers")
    assert reg.name == "layers"
    assert reg.group == "tessera.layers"
    assert repr(reg) == "Registry('layers', group='tessera.layers')"
