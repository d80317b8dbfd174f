"""The pytest plugin, seen from a fresh pytest session in a subprocess."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

_INNER_TEST = """
import torch
import torch.distributed as tdist


def body(value):
    t = torch.tensor([float(tdist.get_rank())])
    tdist.all_reduce(t)
    if tdist.get_rank() == 1:
        assert value == 3
    return t.item()


def test_passes(dist):
    assert dist.run(body, world_size=2, args=(3,)) == [1.0, 1.0]


def test_fails_on_rank_one(dist):
    dist.run(body, world_size=2, args=(2,))
"""


@pytest.mark.pinned_torch_only
def test_fixture_works_in_rootdir_relative_test_modules(tmp_path: Path) -> None:
    # Like the monorepo: tests/ without __init__.py, default "prepend" import mode, so the
    # worker can only unpickle `body` if it receives the session's sys.path.
    tests = tmp_path / "pkg" / "tests"
    tests.mkdir(parents=True)
    (tests / "test_inner_harness.py").write_text(textwrap.dedent(_INNER_TEST))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            f"--rootdir={tmp_path}",
            "pkg/tests",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = proc.stdout + proc.stderr
    assert "1 failed, 1 passed" in out, out
    assert "RankError" in out and "--- rank 1 traceback ---" in out, out
    assert "assert 2 == 3" in out, out
