"""The errors a checkpoint raises: every message names the file, key or shape at fault."""

from __future__ import annotations

__all__ = ["CheckpointCorruptError", "CheckpointError", "describe"]


class CheckpointError(RuntimeError):
    """A checkpoint cannot be saved or loaded into these parts (keys, shapes, layouts)."""


class CheckpointCorruptError(CheckpointError):
    """A checkpoint on disk is incomplete, truncated or altered since it was written."""


def describe(exc: BaseException) -> str:
    """``Type: what went wrong``, in one line, for an error quoted inside another's message.

    torch's weights-only unpickler and DCP explain themselves over many lines; the caller adds
    the file name. For the unpickler, the reason (``Unsupported global: GLOBAL datetime.date
    ...``) follows its advice on ``weights_only``, so that part is picked out.
    """
    text = str(exc).strip()
    marker = "WeightsUnpickler error:"
    if marker in text:
        lines = text.split(marker, 1)[1].strip().splitlines()
        reason = lines[0].split(". ")[0].rstrip(".") if lines else ""
        return f"{type(exc).__name__}: refused by the weights-only unpickler: {reason}"
    lines = text.splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else repr(exc)}"
