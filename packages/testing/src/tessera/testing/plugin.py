"""pytest plugin (auto-loaded through the ``pytest11`` entry point): the ``dist`` fixture."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from .runner import DistributedRunner

__all__ = ["dist"]


@pytest.fixture(scope="session")
def dist() -> Iterator[DistributedRunner]:
    """A session-wide :class:`DistributedRunner`; its worker pools are reused by all tests.

    Usage::

        def test_sum(dist):
            assert dist.run(body, world_size=4) == [...]

    The workers are stopped when the session ends (and, as a fallback, at interpreter exit).
    """
    runner = DistributedRunner()
    try:
        yield runner
    finally:
        runner.close()
