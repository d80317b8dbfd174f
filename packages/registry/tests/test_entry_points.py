"""Lazy filling of a registry from the entry points of an installed (fake) distribution."""

from __future__ import annotations

import sys
import textwrap
import uuid
from collections.abc import Callable, Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest

from tessera.registry import Registry

FakeDist = Callable[..., tuple[str, str]]


@pytest.fixture
def fake_dist(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeDist]:
    """Install a distribution on a temporary sys.path entry; return (group, module name).

    The distribution is a ``*.dist-info`` directory (METADATA + entry_points.txt) next to a
    module ``mod_<id>.py`` that defines ``Widget``, ``Gadget`` and a broken ``Thing`` import.
    Group and module names are unique per call so tests cannot see each other's state, unless
    ``group``/``module`` are passed to declare a second distribution in the same group.
    """
    created: list[str] = []

    def make(
        entries: dict[str, str],
        dist_name: str = "fake-widgets",
        group: str | None = None,
        module: str | None = None,
    ) -> tuple[str, str]:
        token = uuid.uuid4().hex[:8]
        group = group or f"tessera.test_{token}"
        module = module or f"mod_{token}"
        root = tmp_path / token
        root.mkdir()
        monkeypatch.syspath_prepend(str(root))
        (root / f"{module}.py").write_text(
            textwrap.dedent(
                """
                class Widget:
                    def __init__(self, size=1):
                        self.size = size

                class Gadget:
                    pass
                """
            )
        )
        info = root / f"{dist_name.replace('-', '_')}-1.2.3.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: {dist_name}\nVersion: 1.2.3\n"
        )
        lines = [f"[{group}]"]
        lines += [f"{name} = {value.format(module=module)}" for name, value in entries.items()]
        (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
        created.append(module)
        return group, module

    yield make
    for module in created:
        sys.modules.pop(module, None)


def test_names_and_contains_read_metadata_without_importing(fake_dist: FakeDist) -> None:
    group, module = fake_dist({"Widget": "{module}:Widget", "Gadget": "{module}:Gadget"})
    reg: Registry[object] = Registry("widgets", group=group)
    assert reg.names() == ["Gadget", "Widget"]
    assert "Widget" in reg
    assert len(reg) == 2
    assert list(reg) == ["Gadget", "Widget"]
    assert module not in sys.modules


def test_get_loads_only_on_first_lookup(fake_dist: FakeDist) -> None:
    group, module = fake_dist({"Widget": "{module}:Widget"})
    reg: Registry[object] = Registry("widgets", group=group)
    assert module not in sys.modules
    widget = reg.get("Widget")
    assert module in sys.modules
    assert widget is sys.modules[module].Widget
    assert reg.get("Widget") is widget


def test_construction_does_not_scan(fake_dist: FakeDist, monkeypatch: pytest.MonkeyPatch) -> None:
    group, _ = fake_dist({"Widget": "{module}:Widget"})
    calls: list[str | None] = []
    real = metadata.entry_points

    def counting(**kwargs: str) -> Any:
        calls.append(kwargs.get("group"))
        return real(**kwargs)

    monkeypatch.setattr(metadata, "entry_points", counting)
    reg: Registry[object] = Registry("widgets", group=group)
    reg.register(int, name="int")
    assert calls == []
    assert "Widget" in reg
    reg.get("Widget")
    reg.names()
    assert calls == [group]  # one scan, then cached


def test_broken_entry_point_fails_only_its_own_name(fake_dist: FakeDist) -> None:
    group, module = fake_dist(
        {
            "Widget": "{module}:Widget",
            "Broken": "no_such_module_for_tessera_tests:Thing",
            "Missing": "{module}:NoSuchAttr",
        }
    )
    reg: Registry[object] = Registry("widgets", group=group)
    with pytest.raises(ImportError) as info:
        reg.get("Broken")
    message = str(info.value)
    assert message.startswith("registry 'widgets': entry point 'Broken = ")
    assert "no_such_module_for_tessera_tests:Thing" in message
    assert f"in group '{group}'" in message
    assert "distribution fake-widgets 1.2.3" in message
    assert "ModuleNotFoundError" in message
    assert isinstance(info.value.__cause__, ModuleNotFoundError)

    with pytest.raises(ImportError, match=r"entry point 'Missing = .*AttributeError"):
        reg.get("Missing")

    # The other names still work and the broken ones stay listed.
    assert reg.get("Widget") is sys.modules[module].Widget
    assert reg.names() == ["Broken", "Missing", "Widget"]


def test_unknown_name_suggests_entry_point_names(fake_dist: FakeDist) -> None:
    group, module = fake_dist({"Widget": "{module}:Widget"})
    reg: Registry[object] = Registry("widgets", group=group)
    with pytest.raises(KeyError, match=r"did you mean 'Widget'\?"):
        reg.get("Widgt")
    assert module not in sys.modules


def test_registration_of_the_same_object_agrees_with_entry_point(fake_dist: FakeDist) -> None:
    group, module = fake_dist({"Widget": "{module}:Widget"})
    reg: Registry[object] = Registry("widgets", group=group)
    imported = __import__(module)
    reg.register(imported.Widget)  # a module decorating its own class
    assert reg.get("Widget") is imported.Widget


def test_registration_conflicting_with_entry_point_raises_on_lookup(
    fake_dist: FakeDist,
) -> None:
    group, _ = fake_dist({"Widget": "{module}:Widget"})
    reg: Registry[object] = Registry("widgets", group=group)

    class Widget:
        pass

    reg.register(Widget)
    with pytest.raises(ValueError) as info:
        reg.get("Widget")
    message = str(info.value)
    assert "name 'Widget' is registered to" in message
    assert "test_registration_conflicting_with_entry_point_raises_on_lookup" in message
    assert "override=True" in message
    with pytest.raises(ValueError, match="name 'Widget' is registered to"):
        reg.get("Widget")  # still a conflict on the next lookup, not silently resolved


def test_override_shadows_entry_point_before_and_after_scan(fake_dist: FakeDist) -> None:
    group, module = fake_dist({"Widget": "{module}:Widget", "Gadget": "{module}:Gadget"})
    reg: Registry[object] = Registry("widgets", group=group)
    reg.register("mine", name="Widget", override=True)  # before the scan
    assert reg.get("Widget") == "mine"
    reg.register("mine too", name="Gadget", override=True)  # after the scan
    assert reg.get("Gadget") == "mine too"
    assert module not in sys.modules


def test_two_distributions_with_different_targets_are_ambiguous(fake_dist: FakeDist) -> None:
    group, module = fake_dist({"Widget": "{module}:Widget"}, dist_name="first-dist")
    # A second distribution declaring the same name in the same group, pointing elsewhere.
    fake_dist({"Widget": "{module}:Gadget"}, dist_name="second-dist", group=group, module=module)
    reg: Registry[object] = Registry("widgets", group=group)
    assert reg.names() == ["Widget"]
    with pytest.raises(ValueError) as exc:
        reg.get("Widget")
    message = str(exc.value)
    assert "name 'Widget' is declared by 2 entry points with different targets" in message
    assert "first-dist" in message and "second-dist" in message
    assert "uninstall one of the distributions" in message


def test_same_entry_point_seen_twice_is_not_ambiguous(fake_dist: FakeDist) -> None:
    group, module = fake_dist({"Widget": "{module}:Widget"}, dist_name="first-dist")
    fake_dist({"Widget": "{module}:Widget"}, dist_name="first-dist", group=group, module=module)
    reg: Registry[object] = Registry("widgets", group=group)
    assert reg.get("Widget") is sys.modules[module].Widget


def test_builtin_registries_use_tessera_groups() -> None:
    from tessera import registry

    expected = {
        "LAYERS": "tessera.layers",
        "MODELS": "tessera.models",
        "OPTIMIZERS": "tessera.optimizers",
        "LR_SCHEDULERS": "tessera.lr_schedulers",
        "LOSSES": "tessera.losses",
    }
    for attr, group in expected.items():
        reg = getattr(registry, attr)
        assert isinstance(reg, Registry)
        assert reg.group == group
        assert reg.name == attr.lower()
    for moved in ("GRADIENT_HANDLERS", "PROCESS_GROUP_INITIALIZERS", "SCHEDULES", "HOOKS"):
        assert not hasattr(registry, moved)  # owned by tessera.engine / tessera.context
    for removed in ("DATASETS", "SAMPLERS", "TRANSFORMS"):
        assert not hasattr(registry, removed)  # a user's own, declared where they are used
