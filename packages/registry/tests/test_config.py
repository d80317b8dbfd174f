"""``Config``: attribute access, conversions, overrides, merge and every file format."""

from __future__ import annotations

import builtins
import copy
import json
import pickle
import sys
from pathlib import Path

import pytest

from tessera.registry import Config, ConfigError

NESTED = {"parallel": {"tensor": {"mode": "2d", "size": 4}, "data": 2}, "lr": 0.1}


def test_recursive_attribute_access() -> None:
    cfg = Config(NESTED)
    assert cfg.parallel.tensor.mode == "2d"
    assert cfg.parallel.tensor.size == 4
    assert cfg["parallel"]["data"] == 2
    assert isinstance(cfg, dict)


def test_mappings_become_config_through_every_access_path() -> None:
    cfg = Config(NESTED)
    assert isinstance(cfg["parallel"], Config)
    assert isinstance(cfg.get("parallel"), Config)
    assert all(isinstance(v, Config) for k, v in cfg.items() if k == "parallel")
    cfg["extra"] = {"a": {"b": 1}}
    assert cfg.extra.a.b == 1
    cfg.other = {"c": 2}
    assert cfg.other.c == 2
    cfg.update({"u": {"v": 3}}, w={"x": 4})
    assert cfg.u.v == 3 and cfg.w.x == 4
    assert cfg.setdefault("s", {"t": 5}).t == 5
    merged = cfg | {"m": {"n": 6}}
    assert isinstance(merged, Config) and merged.m.n == 6
    assert isinstance({"r": 1} | cfg, Config)
    cfg |= {"i": {"j": 7}}
    assert cfg.i.j == 7
    assert isinstance(cfg.copy(), Config) and cfg.copy().i.j == 7


def test_mappings_inside_lists_become_config() -> None:
    cfg = Config({"layers": [{"type": "A", "size": 1}, 3], "pair": ({"k": 1}, 2)})
    assert cfg.layers[0].type == "A"
    assert cfg.layers[1] == 3
    assert cfg.pair[0].k == 1


def test_missing_attribute_names_key_and_closest_keys() -> None:
    cfg = Config(NESTED)
    with pytest.raises(AttributeError) as info:
        _ = cfg.parallel.tensr
    assert str(info.value) == (
        "config has no key 'tensr'; did you mean 'tensor'? (keys: 'tensor', 'data')"
    )
    with pytest.raises(AttributeError) as info2:
        _ = cfg.zzz
    assert str(info2.value) == "config has no key 'zzz' (keys: 'parallel', 'lr')"
    assert not hasattr(cfg, "nothing")
    assert getattr(cfg, "nothing", 5) == 5


def test_delattr() -> None:
    cfg = Config({"a": 1})
    del cfg.a
    assert "a" not in cfg
    with pytest.raises(AttributeError, match="config has no key 'a'"):
        del cfg.a


def test_dict_methods_win_over_keys() -> None:
    cfg = Config({"items": 3})
    assert callable(cfg.items)
    assert cfg["items"] == 3


def test_to_dict_returns_plain_containers() -> None:
    cfg = Config({"a": {"b": [{"c": 1}]}, "t": ({"d": 2},)})
    plain = cfg.to_dict()
    assert plain == {"a": {"b": [{"c": 1}]}, "t": ({"d": 2},)}
    assert type(plain) is dict
    assert type(plain["a"]) is dict
    assert type(plain["a"]["b"][0]) is dict
    assert type(plain["t"][0]) is dict
    json.dumps(plain)
    plain["a"]["b"].append(1)
    assert cfg.a.b == [{"c": 1}]  # a copy, not a view


def test_copy_and_pickle_round_trip() -> None:
    cfg = Config(NESTED)
    for clone in (copy.copy(cfg), copy.deepcopy(cfg), pickle.loads(pickle.dumps(cfg))):
        assert isinstance(clone, Config)
        assert clone == cfg
        assert clone.parallel.tensor.mode == "2d"
    assert repr(Config({"a": 1})) == "Config({'a': 1})"


def test_merge_is_recursive_and_returns_new() -> None:
    base = Config(NESTED)
    merged = base.merge({"parallel": {"tensor": {"size": 8}, "pipeline": 2}, "lr": 0.2})
    assert merged.parallel.tensor == {"mode": "2d", "size": 8}
    assert merged.parallel.pipeline == 2
    assert merged.parallel.data == 2
    assert merged.lr == 0.2
    assert isinstance(merged.parallel.tensor, Config)
    assert base.parallel.tensor.size == 4 and "pipeline" not in base.parallel


def test_merge_replaces_non_mappings() -> None:
    merged = Config({"a": {"b": 1}, "l": [1, 2]}).merge({"a": 5, "l": [3]})
    assert merged == {"a": 5, "l": [3]}
    merged2 = Config({"a": 5}).merge({"a": {"b": 1}})
    assert merged2.a.b == 1


def test_apply_overrides_parses_literals_and_creates_mappings() -> None:
    base = Config(NESTED)
    cfg = base.apply_overrides(
        [
            "parallel.tensor.size=1",
            "lr=1e-3",
            "name='x'",
            "mode=2d",
            "flag=True",
            "nothing=None",
            "shape=[1, 2]",
            "new.deep.key = 3",
            "sub={'a': 1}",
            "expr=1+",
            "eq=a=b",
        ]
    )
    assert cfg.parallel.tensor.size == 1
    assert cfg.parallel.tensor.mode == "2d"
    assert cfg.lr == 1e-3 and isinstance(cfg.lr, float)
    assert cfg.name == "x"
    assert cfg.mode == "2d"
    assert cfg.flag is True
    assert cfg.nothing is None
    assert cfg.shape == [1, 2]
    assert cfg.new.deep.key == 3
    assert isinstance(cfg.sub, Config) and cfg.sub.a == 1
    assert cfg.expr == "1+"
    assert cfg.eq == "a=b"
    assert base.parallel.tensor.size == 4  # the original is untouched
    assert "new" not in base


@pytest.mark.parametrize(
    ("item", "message"),
    [
        ("novalue", "override 'novalue' is not of the form 'key.path=value'"),
        ("=3", "override '=3' is not of the form 'key.path=value'"),
        ("a..b=1", "override 'a..b=1': key path 'a..b' has an empty segment"),
        (
            "lr.x=1",
            "override 'lr.x=1': 'lr' is a float (0.1), not a mapping, so it has no key 'x'",
        ),
    ],
)
def test_apply_overrides_errors(item: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        Config(NESTED).apply_overrides([item])
    assert str(info.value) == message


def test_apply_overrides_rejects_a_bare_string() -> None:
    with pytest.raises(ConfigError, match="takes a list of 'key=value' strings"):
        Config().apply_overrides("a=1")


# ---------------------------------------------------------------------- files


def test_from_python_file_keeps_public_variables(tmp_path: Path) -> None:
    path = tmp_path / "cfg.py"
    path.write_text(
        "import math\n"
        "import os.path\n"
        "from collections import OrderedDict\n"
        "from math import sqrt\n"
        "parallel = dict(tensor=dict(size=4, mode='2d'), data=2)\n"
        "lr = 1e-3 * math.sqrt(4)\n"
        "_private = 1\n"
        "def schedule(step):\n"
        "    return step * 2\n"
        "class Model:\n"
        "    pass\n"
    )
    cfg = Config.from_file(path)
    assert set(cfg) == {"parallel", "lr", "schedule", "Model"}
    assert cfg.parallel.tensor.mode == "2d"
    assert cfg.lr == pytest.approx(2e-3)
    assert cfg.schedule(3) == 6
    assert isinstance(cfg.Model, type)


def test_from_python_file_executes_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    marker: list[str] = []
    monkeypatch.setattr(builtins, "_tessera_marker", marker, raising=False)
    path = tmp_path / "run.py"
    path.write_text("import builtins\nbuiltins._tessera_marker.append('ran')\nx = 1\n")
    assert Config.from_file(str(path)) == {"x": 1}
    assert marker == ["ran"]


def test_from_toml(tmp_path: Path) -> None:
    path = tmp_path / "cfg.toml"
    path.write_text('lr = 0.001\n[parallel.tensor]\nmode = "2d"\nsize = 4\n')
    cfg = Config.from_file(path)
    assert cfg.parallel.tensor.size == 4
    assert cfg.lr == 0.001


def test_from_json(tmp_path: Path) -> None:
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(NESTED))
    cfg = Config.from_file(path)
    assert cfg == NESTED
    assert cfg.parallel.tensor.mode == "2d"


@pytest.mark.parametrize("suffix", [".yaml", ".yml"])
def test_from_yaml(tmp_path: Path, suffix: str) -> None:
    pytest.importorskip("yaml")
    path = tmp_path / f"cfg{suffix}"
    path.write_text("parallel:\n  tensor:\n    mode: 2d\n    size: 4\nlr: 0.1\n")
    cfg = Config.from_file(path)
    assert cfg.parallel.tensor.mode == "2d"
    assert cfg.lr == 0.1


def test_yaml_executes_nothing(tmp_path: Path) -> None:
    pytest.importorskip("yaml")
    path = tmp_path / "evil.yaml"
    path.write_text("x: !!python/object/apply:os.system ['echo hacked']\n")
    with pytest.raises(ConfigError, match=r"evil\.yaml: invalid YAML"):
        Config.from_file(path)


def test_empty_yaml_is_empty_config(tmp_path: Path) -> None:
    pytest.importorskip("yaml")
    path = tmp_path / "empty.yaml"
    path.write_text("")
    assert Config.from_file(path) == {}


def test_yaml_without_pyyaml_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "cfg.yaml"
    path.write_text("a: 1\n")
    monkeypatch.setitem(sys.modules, "yaml", None)  # makes `import yaml` raise ImportError
    with pytest.raises(ConfigError) as info:
        Config.from_file(path)
    assert str(info.value) == (
        f"{path}: reading YAML needs PyYAML, which is not installed (pip install pyyaml)"
    )


def test_unknown_suffix(tmp_path: Path) -> None:
    path = tmp_path / "cfg.ini"
    path.write_text("[a]\n")
    with pytest.raises(ConfigError) as info:
        Config.from_file(path)
    assert str(info.value) == (
        f"{path}: unknown config suffix '.ini'; supported: .py, .toml, .json, .yaml, .yml"
    )


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="config file not found"):
        Config.from_file(tmp_path / "nope.json")


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("bad.json", "{", "bad.json: invalid JSON"),
        ("bad.toml", "a = ", "bad.toml: invalid TOML"),
        ("list.json", "[1, 2]", "list.json: the top level must be a mapping, got list"),
    ],
)
def test_parse_errors_name_the_file(tmp_path: Path, name: str, text: str, message: str) -> None:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        Config.from_file(path)


def test_config_error_is_a_value_error() -> None:
    assert issubclass(ConfigError, ValueError)
