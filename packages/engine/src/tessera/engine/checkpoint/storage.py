"""The disk under a checkpoint: leftovers of failed saves, free space, write failures.

A brief full disk used to become permanent: a save that failed for lack of space left its
partial ``.step_*.tmp-*`` folder behind, only a later *successful* save's pruning removed it,
so every restart failed again on the space its own leftovers held. And it never said so: DCP
reports a failed write as ``CheckpointException ranks:dict_keys([1])`` around a
``RuntimeError: [enforce fail at inline_container.cc] unexpected pos 704 vs 598``, with no
errno and no path. This module holds what fixes both:

- ``sweep_leftovers``: at start-up, remove the temporary folders of earlier crashed saves (a
  complete one, whose save died between its manifest and its rename, is published instead,
  never deleted);
- ``space_problem``: before a save writes anything, compare the free space with the size of
  the last checkpoint;
- ``write_failure`` / ``write_failure_message``: find the ``OSError`` (or torch's short-write
  error) inside whatever a write raised, and say what failed, where, the errno and the bytes
  needed;
- ``prepare_checkpoint_dir``: a folder that is read-only or cannot be created is refused when
  the job starts, on every rank, not at its first save hours later.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import shutil
import uuid
from collections.abc import Sequence
from pathlib import Path

from tessera.context import ParallelContext

from .comm import Comm
from .errors import CheckpointError
from .files import MANIFEST, is_complete, publish

__all__ = [
    "failed_ranks",
    "last_checkpoint_bytes",
    "prepare_checkpoint_dir",
    "space_problem",
    "sweep_leftovers",
    "write_failure",
    "write_failure_message",
]

_LOG = logging.getLogger(__name__)
#: ``.<final name>.tmp-<token>``: a save's temporary folder (files.temporary_dir, 12 hex).
_TEMPORARY = re.compile(r"^\.(.+)\.tmp-([0-9a-f]{12})$")
_STEP = re.compile(r"^step_(\d+)$")
#: What torch's zip writer (inline_container.cc) says when a write came back short.
_SHORT_WRITE = ("unexpected pos", "file write failed", "failed writing file")


def _tree_bytes(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += (Path(root) / name).stat().st_size
    return total


def sweep_leftovers(directory: str | os.PathLike[str]) -> list[Path]:
    """Remove the temporary folders of saves that never finished in ``directory``.

    Call on one rank, while no save into ``directory`` is in flight (at start-up). A temporary
    folder that is complete (its manifest lists every file at its size: the save died after
    writing it, before the rename) is published under its final name when that name is free,
    and kept otherwise: a complete checkpoint is never deleted.

    Returns:
        The folders removed.
    """
    root = Path(directory)
    if not root.is_dir():
        return []
    removed: list[Path] = []
    for child in sorted(root.iterdir()):
        match = _TEMPORARY.match(child.name)
        if match is None or not child.is_dir() or child.is_symlink():
            continue
        if is_complete(child):
            final = root / match.group(1)
            if not (final.exists() or final.is_symlink()):
                publish(child, final, match.group(2))
                _LOG.warning("published %s: its save stopped just before the rename", final)
            continue
        held = _tree_bytes(child)
        shutil.rmtree(child, ignore_errors=True)
        removed.append(child)
        _LOG.warning("removed %s (%d bytes), left by a save that never finished", child, held)
    return removed


def last_checkpoint_bytes(directory: str | os.PathLike[str]) -> tuple[Path, int] | None:
    """The newest ``step_*`` checkpoint in ``directory`` with a manifest, and its bytes.

    The size a next save will need about as much of (the same model and optimizer).
    """
    root = Path(directory)
    if not root.is_dir():
        return None
    steps = sorted(
        ((int(m.group(1)), c) for c in root.iterdir() if (m := _STEP.match(c.name))),
        reverse=True,
    )
    for _, path in steps:
        if (path / MANIFEST).is_file():  # published: every file it holds is the save's
            return path, _tree_bytes(path)
    return None


def _free_bytes(directory: Path) -> int | None:
    try:
        return int(shutil.disk_usage(directory).free)
    except OSError:
        return None


def space_problem(final: Path) -> str | None:
    """Why ``final`` cannot be saved for lack of space, or ``None`` (rank 0, before writing).

    The estimate is the last checkpoint's size next to ``final``; without one, nothing is
    checked (the first save's size is not known before it is written).
    """
    last = last_checkpoint_bytes(final.parent)
    if last is None:
        return None
    path, need = last
    free = _free_bytes(final.parent)
    if free is None or free >= need:
        return None
    return (
        f"cannot save checkpoint {final}: errno {errno.ENOSPC} (ENOSPC, no space left on "
        f"device) expected: about {need} bytes needed (the size of the last checkpoint, "
        f"{path}), {free} bytes free on {final.parent}; {need - free} more bytes must be freed "
        "before saving. Nothing was written"
    )


def write_failure(exc: BaseException) -> BaseException | None:
    """The ``OSError`` (or torch's short-write ``RuntimeError``) behind a failed write.

    Looks through DCP's ``CheckpointException`` (its ``failures``: rank -> (exception,
    traceback)) and through ``__cause__`` / ``__context__`` chains. ``None`` when the failure
    is not the storage's (a bug, a bad state): that is left to propagate as it was.
    """
    pending: list[BaseException] = [exc]
    seen: set[int] = set()
    short: BaseException | None = None
    while pending:
        current = pending.pop(0)
        if id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError):
            return current
        text = str(current).lower() if isinstance(current, RuntimeError) else ""
        if short is None and any(marker in text for marker in _SHORT_WRITE):
            short = current
        failures = getattr(current, "failures", None)
        if isinstance(failures, dict):
            for value in failures.values():
                inner = value[0] if isinstance(value, tuple) and value else value
                if isinstance(inner, BaseException):
                    pending.append(inner)
        for nested in (current.__cause__, current.__context__):
            if nested is not None:
                pending.append(nested)
    return short


def failed_ranks(exc: BaseException) -> list[int]:
    """The ranks DCP's ``CheckpointException`` lists as failed (empty for other errors)."""
    failures = getattr(exc, "failures", None)
    return sorted(int(r) for r in failures) if isinstance(failures, dict) else []


def write_failure_message(
    final: Path, failure: BaseException, where: Path | None = None, ranks: Sequence[int] = ()
) -> str:
    """What failed, where, the errno (when known) and the bytes a save needs.

    Args:
        final: The checkpoint being saved.
        failure: What ``write_failure`` found.
        where: The file being written, when the caller knows it (else the OSError's own).
        ranks: The ranks whose write failed, when known (DCP's failures).
    """
    target = where if where is not None else final
    code = failure.errno if isinstance(failure, OSError) else None
    if isinstance(failure, OSError) and failure.filename is not None and where is None:
        target = Path(os.fsdecode(failure.filename))
    if code is not None:
        cause = f"errno {code} ({errno.errorcode.get(code, '?')}, {os.strerror(code)})"
    elif isinstance(failure, OSError):
        cause = f"{type(failure).__name__}: {failure} (errno unknown)"
    else:
        first = str(failure).strip().splitlines()
        cause = (
            "errno unknown: torch's writer wrote fewer bytes than it asked for "
            f"({first[0] if first else type(failure).__name__})"
        )
    last = last_checkpoint_bytes(final.parent)
    free = _free_bytes(final.parent)
    need = (
        f"about {last[1]} bytes needed (the size of the last checkpoint, {last[0]})"
        if last is not None
        else "bytes needed unknown (no earlier checkpoint to measure)"
    )
    room = f", {free} bytes free on {final.parent}" if free is not None else ""
    short_of_room = last is not None and free is not None and free < last[1]
    full = "; the disk is full" if code in (errno.ENOSPC, errno.EDQUOT) or short_of_room else ""
    on = f" on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}" if ranks else ""
    return (
        f"cannot save checkpoint {final}: writing {target}{on} failed with {cause}; {need}{room}"
        f"{full}. The partial save was removed; the previous checkpoints are untouched"
    )


def _writable_problem(directory: Path, rank: int) -> str | None:
    """Why this rank cannot create and write files in ``directory``, or ``None``."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return f"cannot create checkpoint folder {directory}: {_os_text(exc)}"
    if not directory.is_dir():
        return f"checkpoint folder {directory} exists and is not a directory"
    probe = directory / f".tessera-write-probe-{rank}-{uuid.uuid4().hex[:8]}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, b"x")
        finally:
            os.close(fd)
    except OSError as exc:
        return f"cannot write in checkpoint folder {directory}: {_os_text(exc)}"
    finally:
        with contextlib.suppress(OSError):
            probe.unlink()
    return None


def _os_text(exc: OSError) -> str:
    code = exc.errno
    if code is None:
        return str(exc)
    return f"errno {code} ({errno.errorcode.get(code, '?')}, {os.strerror(code)})"


def prepare_checkpoint_dir(
    directory: str | os.PathLike[str], context: ParallelContext | None = None
) -> list[Path]:
    """Refuse a checkpoint folder no save could write; sweep earlier saves' leftovers.

    Every rank calls it (collective) when the job starts (``SaveCheckpointHook`` does, when it
    is attached): each rank creates the folder if needed and writes a probe file there (a rank
    on a node where the shared file system is mounted read-only is caught too), then rank 0
    removes the temporary folders of earlier crashed saves (``sweep_leftovers``).

    Returns:
        The leftovers removed (on rank 0; empty elsewhere).

    Raises:
        CheckpointError: on every rank, when a rank cannot create or write the folder (it names
            the rank, the folder and the errno).
    """
    comm = Comm(context)
    root = Path(directory).absolute()
    with comm.guard("checkpoint.prepare"):
        problem = _writable_problem(root, comm.rank)
        comm.agree([problem] if problem else [], "checkpoint folder refused", CheckpointError)
        removed: list[str] = []
        error: str | None = None
        if comm.is_coordinator:
            try:
                removed = [str(p) for p in sweep_leftovers(root)]
            except OSError as exc:
                error = f"cannot sweep leftovers in {root}: {_os_text(exc)}"
        error = comm.broadcast(error)
        if error is not None:
            raise CheckpointError(error)
    return [Path(p) for p in removed]
