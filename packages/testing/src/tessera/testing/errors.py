"""Exceptions that carry a remote rank's failure back into the test process."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

__all__ = ["RankError", "RankTimeoutError"]


def _format_stacks(stacks: Mapping[int, str]) -> str:
    """Render the stack dumps of unfinished ranks, most useful when a collective hangs."""
    parts = []
    for rank in sorted(stacks):
        text = stacks[rank].strip()
        if text:
            parts.append(f"--- rank {rank} was at ---\n{text}")
    return "\n".join(parts)


class RankError(RuntimeError):
    """One or more ranks raised while running a function under the harness.

    The message holds every failed rank's remote traceback, so pytest shows where each rank
    broke without anyone having to read worker logs.

    Attributes:
        failures: rank -> formatted remote traceback (text).
        exceptions: rank -> the remote exception object if it could be pickled back, else its
            repr.
        unfinished: ranks that had neither returned nor failed when the pool was stopped
            (typically blocked in a collective waiting for a failed rank).
        stacks: rank -> Python stack dump of each unfinished rank, where one could be taken.
    """

    def __init__(
        self,
        fn_name: str,
        world_size: int,
        failures: Mapping[int, str],
        exceptions: Mapping[int, BaseException | str] | None = None,
        unfinished: Sequence[int] = (),
        stacks: Mapping[int, str] | None = None,
    ) -> None:
        self.fn_name = fn_name
        self.world_size = world_size
        self.failures = dict(failures)
        self.exceptions = dict(exceptions or {})
        self.unfinished = sorted(unfinished)
        self.stacks = dict(stacks or {})
        super().__init__(self._render())

    def _render(self) -> str:
        ranks = sorted(self.failures)
        lines = [
            f"{len(ranks)} of {self.world_size} rank(s) failed in {self.fn_name} "
            f"(failed ranks: {ranks})"
        ]
        for rank in ranks:
            lines.append(f"--- rank {rank} traceback ---")
            lines.append(self.failures[rank].rstrip())
        if self.unfinished:
            lines.append(
                f"ranks {self.unfinished} had not finished when the pool was stopped "
                "(probably blocked in a collective with a failed rank)"
            )
            stacks = _format_stacks(self.stacks)
            if stacks:
                lines.append(stacks)
        return "\n".join(lines)

    def __reduce__(self) -> tuple[object, ...]:
        # Keep the exception picklable (pytest-xdist and friends send exceptions around).
        return (
            type(self),
            (
                self.fn_name,
                self.world_size,
                self.failures,
                {r: repr(e) for r, e in self.exceptions.items()},
                self.unfinished,
                self.stacks,
            ),
        )


class RankTimeoutError(TimeoutError):
    """A call did not finish on every rank within its timeout.

    Attributes:
        unfinished: the ranks that had not returned when the timeout expired.
        finished: the ranks that had returned.
        stacks: rank -> Python stack dump of each unfinished rank, where one could be taken.
    """

    def __init__(
        self,
        fn_name: str,
        world_size: int,
        timeout: float,
        unfinished: Sequence[int],
        stacks: Mapping[int, str] | None = None,
    ) -> None:
        self.fn_name = fn_name
        self.world_size = world_size
        self.timeout = timeout
        self.unfinished = sorted(unfinished)
        self.finished = [r for r in range(world_size) if r not in set(unfinished)]
        self.stacks = dict(stacks or {})
        message = (
            f"{fn_name} did not finish within {timeout:g} s on ranks {self.unfinished} "
            f"of world size {world_size} (finished: {self.finished}); a rank probably skipped "
            "or reordered a collective. The worker pool was killed and restarts on next use."
        )
        stack_text = _format_stacks(self.stacks)
        if stack_text:
            message += "\n" + stack_text
        super().__init__(message)

    def __reduce__(self) -> tuple[object, ...]:
        return (
            type(self),
            (self.fn_name, self.world_size, self.timeout, self.unfinished, self.stacks),
        )
