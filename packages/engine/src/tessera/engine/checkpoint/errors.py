"""The errors a checkpoint raises: every message names the file, key or shape at fault."""

from __future__ import annotations

__all__ = ["CheckpointCorruptError", "CheckpointError"]


class CheckpointError(RuntimeError):
    """A checkpoint cannot be saved or loaded into these parts (keys, shapes, layouts)."""


class CheckpointCorruptError(CheckpointError):
    """A checkpoint on disk is incomplete, truncated or altered since it was written."""
