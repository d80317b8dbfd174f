"""No tensor mode's name is compared outside its own folder (issue 38, point 2).

A mode is an object (``tessera.context.TensorMode``, and tessera-layers' ``ModeLayers``):
code asks it what it needs instead of comparing ``tensor_mode == '2d'``, so a user's mode
takes every path a built-in one does. This test reads the source of every package and finds
each comparison, table key, index, match case or listed element that spells a built-in mode's
name outside the folders that own that mode.
"""

from __future__ import annotations

import ast
import collections
from collections.abc import Iterator
from pathlib import Path

from tessera.context import TENSOR_MODES

PACKAGES = Path(__file__).resolve().parents[2]

#: The folders that own a mode, and the names each may compare.
OWN_FOLDERS: dict[str, frozenset[str]] = {
    "context/src/tessera/context/tensor_modes/": frozenset(TENSOR_MODES),
    "layers/src/tessera/layers/parallel_1d/": frozenset({"1d"}),
    "layers/src/tessera/layers/mesh/": frozenset({"2d", "2.5d"}),
    "layers/src/tessera/layers/cube/": frozenset({"3d"}),
    "layers/src/tessera/layers/sequence/": frozenset({"sequence"}),
}


def _spelled(node: ast.AST) -> Iterator[str]:
    """The mode name ``node`` spells, if it is a string constant naming one."""
    if isinstance(node, ast.Constant) and node.value in TENSOR_MODES:
        yield str(node.value)


def _compared(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """(line, name) of each mode name compared, used as a key or index, or listed.

    A comparison (``mode == '2d'``), a table key (``{'2d': ...}``), an index
    (``TABLE['2d']``), a match case, or an element of a tuple, list or set (``mode in ('2d',
    '2.5d')``, a module-level ``MESH_MODES = ('2d', '2.5d')``). Naming a mode in a message
    (an f-string, a docstring) is none of these.
    """
    for node in ast.walk(tree):
        parts: list[ast.AST] = []
        if isinstance(node, ast.Compare):
            parts = [node.left, *node.comparators]
        elif isinstance(node, ast.Dict):
            parts = [key for key in node.keys if key is not None]
        elif isinstance(node, ast.Subscript):
            parts = [node.slice]
        elif isinstance(node, ast.MatchValue):
            parts = [node.value]
        elif isinstance(node, ast.Tuple | ast.List | ast.Set):
            parts = list(node.elts)
        for part in parts:
            for name in _spelled(part):
                yield node.lineno, name


def _violations() -> dict[str, list[tuple[int, str]]]:
    found: dict[str, list[tuple[int, str]]] = collections.defaultdict(list)
    for path in sorted(PACKAGES.glob("*/src/**/*.py")):
        where = path.relative_to(PACKAGES).as_posix()
        allowed = next((names for f, names in OWN_FOLDERS.items() if where.startswith(f)), None)
        for line, name in _compared(ast.parse(path.read_text(encoding="utf-8"))):
            if allowed is None or name not in allowed:
                found[where].append((line, name))
    return found


def test_the_scan_finds_a_comparison() -> None:
    source = "if mode in ('2d', '2.5d'):\n    x = {'3d': 1}['3d']\nelif m == 'sequence': pass\n"
    assert sorted(name for _, name in _compared(ast.parse(source))) == [
        "2.5d",
        "2d",
        "3d",
        "3d",
        "sequence",
    ]
    assert [name for _, name in _compared(ast.parse("SPLIT = ['1d']"))] == ["1d"]
    assert list(_compared(ast.parse("name = '2d'\nprint(f'mode {name!r}', '1d')"))) == []


def test_no_mode_name_is_compared_outside_its_folder() -> None:
    assert (PACKAGES / "context" / "src").is_dir(), f"no package sources under {PACKAGES}"
    found = _violations()
    assert not found, (
        f"a mode's name is compared outside its folder; ask the TensorMode object instead: {found}"
    )
