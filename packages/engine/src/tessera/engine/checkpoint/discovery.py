"""Finding the newest good checkpoint of a run, and keeping only the last few.

A run's checkpoints live in one directory as ``step_<8 digits>`` subdirectories. Hidden
``.step_*.tmp-*`` directories are saves that never finished (a killed process): they are never
candidates and are removed by the next ``prune_checkpoints``. A published checkpoint whose
files no longer match its manifest is skipped with a warning, so a restart resumes from the
newest checkpoint that is intact.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from pathlib import Path

from tessera.context import ParallelContext

from .comm import Comm
from .errors import CheckpointCorruptError
from .files import verify_checkpoint

__all__ = ["checkpoint_dirs", "latest_checkpoint", "prune_checkpoints", "step_dir"]

_LOG = logging.getLogger(__name__)
_STEP = re.compile(r"^step_(\d+)$")
_STALE = re.compile(r"^\.step_\d+\.(tmp|old)-[0-9a-f]+$")


def step_dir(directory: str | os.PathLike[str], step: int) -> Path:
    """``directory/step_00000042``: where the hooks save step ``step``."""
    return Path(directory) / f"step_{step:08d}"


def checkpoint_dirs(directory: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """``(step, path)`` of every published ``step_*`` directory, newest first."""
    root = Path(directory)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = _STEP.match(child.name)
        if match and child.is_dir():
            found.append((int(match.group(1)), child))
    return sorted(found, reverse=True)


def latest_checkpoint(
    directory: str | os.PathLike[str], context: ParallelContext | None = None
) -> Path | None:
    """The newest checkpoint in ``directory`` whose files all match their manifest.

    Every rank must call it (the listing comes from rank 0, the checksums are shared among
    the ranks), and every rank gets the same answer.
    """
    comm = Comm(context)
    listing = comm.broadcast(
        [str(p) for _, p in checkpoint_dirs(directory)] if comm.is_coordinator else []
    )
    for candidate in listing:
        try:
            verify_checkpoint(candidate, comm)
        except CheckpointCorruptError as exc:
            _LOG.warning("skipping checkpoint %s: %s", candidate, exc)
            continue
        return Path(candidate)
    return None


def prune_checkpoints(directory: str | os.PathLike[str], keep_last: int) -> list[Path]:
    """Delete all but the newest ``keep_last`` checkpoints and unfinished saves (call on one rank).

    Returns:
        The directories removed.
    """
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    removed = [path for _, path in checkpoint_dirs(directory)[keep_last:]]
    root = Path(directory)
    if root.is_dir():
        removed += [c for c in root.iterdir() if _STALE.match(c.name) and c.is_dir()]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed
