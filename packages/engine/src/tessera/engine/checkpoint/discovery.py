"""Finding the newest good checkpoint of a run, and keeping only the last few.

A run's checkpoints live in one directory as ``step_<8 digits>`` subdirectories. Hidden
``.step_*.tmp-*`` directories are saves that never finished (a killed process): they are never
candidates and are removed by the next ``prune_checkpoints``. A hidden ``.step_N.old-*``
directory is the previous ``step_N`` that an overwrite moved aside (files.py); a crash before
the new one took the name leaves it as the only copy of step N, so it is a candidate too, after
``step_N`` itself. A checkpoint whose files no longer match its manifest is skipped with a
warning, so a restart resumes from the newest checkpoint that is intact, and pruning counts
only complete checkpoints, so it never deletes the last one.
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
from .files import is_complete, verify_checkpoint

__all__ = ["checkpoint_dirs", "latest_checkpoint", "prune_checkpoints", "step_dir"]

_LOG = logging.getLogger(__name__)
_STEP = re.compile(r"^step_(\d+)$")
_ASIDE = re.compile(r"^\.step_(\d+)\.old-[0-9a-f]+$")
_UNFINISHED = re.compile(r"^\.step_\d+\.tmp-[0-9a-f]+$")


def step_dir(directory: str | os.PathLike[str], step: int) -> Path:
    """``directory/step_00000042``: where the hooks save step ``step``."""
    return Path(directory) / f"step_{step:08d}"


def checkpoint_dirs(directory: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """``(step, path)`` of every published ``step_*`` directory, newest first."""
    return [(step, path) for step, aside, path in _candidates(directory) if not aside]


def _candidates(directory: str | os.PathLike[str]) -> list[tuple[int, bool, Path]]:
    """``(step, aside, path)`` of the published and the moved-aside checkpoints.

    Newest step first; within a step, the published directory before its aside copies.
    """
    root = Path(directory)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        for pattern, aside in ((_STEP, False), (_ASIDE, True)):
            match = pattern.match(child.name)
            if match and child.is_dir():
                found.append((int(match.group(1)), aside, child))
    return sorted(found, key=lambda c: (-c[0], c[1], c[2].name))


def latest_checkpoint(
    directory: str | os.PathLike[str], context: ParallelContext | None = None
) -> Path | None:
    """The newest checkpoint in ``directory`` whose files all match their manifest.

    Every rank must call it (the listing comes from rank 0, the checksums are shared among
    the ranks), and every rank gets the same answer. After a crash in the middle of
    overwriting ``step_N``, the answer can be the previous ``step_N`` under its aside name.
    """
    comm = Comm(context)
    listing = comm.broadcast(
        [(str(p), aside) for _, aside, p in _candidates(directory)] if comm.is_coordinator else []
    )
    for candidate, aside in listing:
        try:
            verify_checkpoint(candidate, comm)
        except CheckpointCorruptError as exc:
            _LOG.warning("skipping checkpoint %s: %s", candidate, exc)
            continue
        if aside:
            _LOG.warning(
                "resuming from %s: an overwrite of that step was interrupted before the new "
                "checkpoint was published",
                candidate,
            )
        return Path(candidate)
    return None


def prune_checkpoints(directory: str | os.PathLike[str], keep_last: int) -> list[Path]:
    """Keep the newest ``keep_last`` complete checkpoints; delete older ones and leftovers.

    Complete means the manifest and every file it lists at its size (checksums are not
    recomputed). A newer incomplete checkpoint is kept, not counted, so a damaged newest
    checkpoint never costs the last good one. Leftovers are unfinished saves and the aside
    copy of a step whose published directory is complete. Call on one rank.

    Returns:
        The directories removed.
    """
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    removed: list[Path] = []
    complete_steps: set[int] = set()
    for step, aside, path in _candidates(directory):
        if len(complete_steps) >= keep_last or (aside and step in complete_steps):
            removed.append(path)
        elif is_complete(path):
            complete_steps.add(step)
    root = Path(directory)
    if root.is_dir():
        removed += [c for c in root.iterdir() if _UNFINISHED.match(c.name) and c.is_dir()]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed
