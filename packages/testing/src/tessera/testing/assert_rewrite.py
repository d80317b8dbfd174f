"""Import a test module in a worker with pytest's assertion rewriting applied.

Inside the test process pytest rewrites ``assert`` statements in test modules, so a failing
``assert a == b`` reports both values. A spawned worker imports the module afresh through the
plain import system and would only say ``AssertionError``. Rewriting the module the same way in
the worker keeps rank failures as readable as local ones. This leans on pytest's
``rewrite_asserts``; if that is unavailable or changes shape, the worker falls back to a plain
import and only the detail of assertion messages is lost.
"""

from __future__ import annotations

import ast
import importlib.util
import sys
from typing import Any

__all__ = ["import_rewritten"]


def _rewrite(tree: ast.Module, source: bytes, path: str) -> None:
    try:
        from _pytest.assertion.rewrite import rewrite_asserts
    except ImportError:
        return
    rewriter: Any = rewrite_asserts
    try:
        rewriter(tree, source, path, None)
    except Exception:  # pytest internals changed: keep the plain asserts
        return


def import_rewritten(name: str, path: str) -> None:
    """Load module ``name`` from ``path`` with rewritten asserts into ``sys.modules``.

    Does nothing when ``sys.modules`` already holds ``name`` loaded from the same file, so the
    module is executed once per worker, like a normal import. Errors raised while executing the
    module propagate (they are the user's and belong in the rank's traceback).
    """
    existing = sys.modules.get(name)
    if existing is not None and getattr(existing, "__file__", None) == path:
        return
    with open(path, "rb") as handle:
        source = handle.read()
    tree = ast.parse(source, filename=path)
    _rewrite(tree, source, path)
    code = compile(tree, path, "exec", dont_inherit=True)
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        exec(code, module.__dict__)
    except BaseException:
        del sys.modules[name]
        raise
