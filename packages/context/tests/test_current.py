"""The current-context pointer and ``no_context()``, which hides it for a ``with`` block."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, cast

import pytest
import torch
import torch.distributed as dist

from tessera.context import (
    ParallelContext,
    ParallelMode,
    get_context,
    has_context,
    launch_from_torch,
    no_context,
    set_context,
)

# The pointer never looks inside what it holds: stand-ins are enough for the pure tests.
FIRST = cast(ParallelContext, object())
SECOND = cast(ParallelContext, object())


@pytest.fixture
def current() -> Iterator[None]:
    """Whatever a test makes current is cleared afterwards."""
    previous = set_context(None)
    try:
        yield
    finally:
        set_context(previous)


@pytest.mark.usefixtures("current")
def test_no_context_hides_the_current_one_and_restores_it() -> None:
    set_context(FIRST)
    with no_context():
        assert not has_context()
        with pytest.raises(RuntimeError, match="no current ParallelContext"):
            get_context()
    assert get_context() is FIRST


@pytest.mark.usefixtures("current")
def test_no_context_restores_after_an_exception() -> None:
    set_context(FIRST)
    with pytest.raises(ValueError, match="inside"), no_context():
        raise ValueError("inside")
    assert get_context() is FIRST


@pytest.mark.usefixtures("current")
def test_no_context_nests_and_works_without_a_current_context() -> None:
    with no_context():
        assert not has_context()
    assert not has_context()
    set_context(FIRST)
    with no_context():
        with no_context():
            assert not has_context()
        assert not has_context()
    assert get_context() is FIRST


@pytest.mark.usefixtures("current")
def test_what_is_made_current_inside_the_block_ends_with_it() -> None:
    set_context(FIRST)
    with no_context():
        set_context(SECOND)
        assert get_context() is SECOND
    assert get_context() is FIRST


def _launch_and_hide() -> dict[str, Any]:
    ctx = launch_from_torch({"parallel": {"tensor": {"size": 2, "mode": "1d"}}}, timeout=60)
    try:
        with no_context():
            hidden = not has_context()
            # nothing was destroyed: the groups still work, reached through ctx itself
            t = torch.tensor([float(ctx.global_rank + 1)])
            dist.all_reduce(t, group=ctx.get_group(ParallelMode.TENSOR))
        return {"hidden": hidden, "sum": t.item(), "restored": get_context() is ctx}
    finally:
        ctx.destroy()


def test_no_context_under_a_launched_context(dist: Any) -> None:
    results = dist.run(_launch_and_hide, world_size=2, init_process_group=False, timeout=120)
    assert results == [{"hidden": True, "sum": 3.0, "restored": True}] * 2
