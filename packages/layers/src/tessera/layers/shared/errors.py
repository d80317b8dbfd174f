"""The error raised when a tensor mode has no implementation of a layer (never a fallback)."""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["ModeNotImplementedError"]


class ModeNotImplementedError(NotImplementedError):
    """``layer`` has no implementation for tensor mode ``mode``.

    Building a plain torch layer instead would silently train an unparallel (and, across
    ranks, inconsistent) model, so the dispatching layers raise this.

    Attributes:
        layer: The dispatching layer or function, e.g. ``"Linear"``.
        mode: The context's tensor mode, e.g. ``"2d"``.
        available: The modes that do have an implementation.
    """

    def __init__(self, layer: str, mode: str, available: Iterable[str]) -> None:
        self.layer, self.mode = layer, mode
        self.available = tuple(sorted(available))
        have = ", ".join(repr(m) for m in self.available) or "none"
        super().__init__(
            f"tessera.layers has no {layer} for tensor mode {mode!r} yet "
            f"(modes with a {layer}: {have}; without tensor parallelism it is plain torch)"
        )
