"""Crash-safe files: durable writes, the checksum manifest, atomic publication.

A checkpoint directory is written under a hidden temporary name next to its final name; only
when every rank has finished and ``manifest.json`` (size and sha256 of every file) is on disk
does rank 0 rename it to the final name and fsync the parent directory. A rename within one
directory is atomic on POSIX file systems, so the final name either does not exist or names a
complete checkpoint: a process killed during a save leaves only a temporary directory, and the
previous checkpoint untouched.

Overwriting a name takes two renames (POSIX cannot rename a directory over a non-empty one):
the old directory is moved aside to ``.<name>.old-<token>``, made durable, and only then the
new one takes the name; the aside copy is deleted last. A crash between the two renames
leaves the name empty and the previous checkpoint, still complete, under its aside name, which
``latest_checkpoint`` and ``prune_checkpoints`` treat as that step's checkpoint (discovery.py).

The manifest also catches what happens after publication (a disk that truncates a file, a
copy that lost bytes): ``verify_checkpoint`` recomputes every checksum before anything is
loaded and names the file that does not match.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .comm import Comm
from .errors import CheckpointCorruptError, CheckpointError

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "MANIFEST",
    "aside_dir",
    "fsync_dir",
    "is_complete",
    "publish",
    "read_json",
    "sha256_file",
    "temporary_dir",
    "verify_checkpoint",
    "write_bytes",
    "write_json",
]

FORMAT = "tessera-checkpoint"
FORMAT_VERSION = 1
#: Written last, before publication: ``{"files": {name: {"bytes", "sha256"}}, ...}``.
MANIFEST = "manifest.json"
_CHUNK = 1 << 20


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (created or renamed files) durable."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # e.g. a platform without directory handles
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_bytes(path: Path, data: bytes) -> None:
    """Write and fsync a file."""
    with path.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def write_json(path: Path, data: Mapping[str, Any]) -> None:
    """Write and fsync a JSON file."""
    write_bytes(path, json.dumps(data, indent=1, sort_keys=True).encode("utf-8"))


def read_json(path: Path) -> dict[str, Any]:
    """Read a JSON object, naming the file when it is missing or unreadable."""
    try:
        with path.open("r", encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError as exc:
        raise CheckpointCorruptError(f"{path} is missing") from exc
    except (OSError, ValueError) as exc:
        raise CheckpointCorruptError(f"{path} is not readable JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise CheckpointCorruptError(f"{path} holds a {type(data).__name__}, not an object")
    return data


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file's bytes."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def temporary_dir(final: Path, token: str) -> Path:
    """The hidden directory a checkpoint is written to before it becomes ``final``."""
    return final.parent / f".{final.name}.tmp-{token}"


def aside_dir(final: Path, token: str) -> Path:
    """Where ``publish`` moves the checkpoint it replaces until the new one has its name."""
    return final.parent / f".{final.name}.old-{token}"


def _read_manifest(directory: Path) -> tuple[dict[str, Any], list[tuple[str, dict[str, Any]]]]:
    """A checkpoint's manifest and its ``(file name, {"bytes", "sha256"})`` entries, sorted.

    Raises:
        CheckpointCorruptError: no directory, no manifest, or not one this version reads.
    """
    if not directory.is_dir():
        raise CheckpointCorruptError(f"{directory} is not a checkpoint directory")
    manifest = read_json(directory / MANIFEST)
    if manifest.get("format") != FORMAT:
        raise CheckpointCorruptError(f"{directory / MANIFEST} is not a {FORMAT} manifest")
    try:
        version = int(manifest.get("version", 0))
        files = sorted(manifest.get("files", {}).items())
        if not all(isinstance(name, str) and isinstance(e, dict) for name, e in files):
            raise TypeError("an entry of 'files' is not a {bytes, sha256} object")
    except (TypeError, ValueError, AttributeError) as exc:
        raise CheckpointCorruptError(f"{directory / MANIFEST} is malformed: {exc}") from exc
    if version > FORMAT_VERSION:
        raise CheckpointCorruptError(
            f"{directory} has format version {version}; this tessera-engine reads up to "
            f"{FORMAT_VERSION}"
        )
    return manifest, files


def is_complete(path: str | os.PathLike[str]) -> bool:
    """Whether a checkpoint has its manifest and every file at the size it lists.

    A cheap test (no checksum is recomputed) for deciding what may be deleted: a save that
    never finished, or a directory half deleted, fails it; a flipped bit does not.
    """
    directory = Path(path)
    try:
        _, files = _read_manifest(directory)
        return all(
            (directory / name).is_file() and (directory / name).stat().st_size == e.get("bytes")
            for name, e in files
        )
    except (CheckpointCorruptError, OSError):
        return False


def _check_file(directory: Path, name: str, expected: Mapping[str, Any]) -> str | None:
    path = directory / name
    if not path.is_file():
        return f"{path} is missing (listed in {MANIFEST})"
    try:
        size = path.stat().st_size
        if size != expected.get("bytes"):
            return f"{path} has {size} bytes, {MANIFEST} says {expected.get('bytes')} (truncated?)"
        digest = sha256_file(path)
    except OSError as exc:  # e.g. unreadable on this rank's node: reported, not raised alone
        return f"{path} cannot be read: {exc}"
    if digest != expected.get("sha256"):
        return f"{path} has sha256 {digest}, {MANIFEST} says {expected.get('sha256')} (corrupted)"
    return None


def verify_checkpoint(path: str | os.PathLike[str], comm: Comm | None = None) -> dict[str, Any]:
    """Check every file of a checkpoint against its manifest; return the manifest.

    In a job, the files are split among the ranks and the verdict is shared, so every rank
    raises the same error (collective when ``comm`` spans several ranks; default: this
    process alone).

    Raises:
        CheckpointCorruptError: no manifest (an incomplete or foreign directory), or a file
            that is missing, truncated or altered; the message names the file.
    """
    comm = comm if comm is not None else Comm.local()
    directory = Path(path)
    errors: list[str] = []
    manifest: dict[str, Any] = {}
    try:
        manifest, files = _read_manifest(directory)
        for i, (name, expected) in enumerate(files):
            if i % comm.world_size == comm.rank:
                problem = _check_file(directory, name, expected)
                if problem is not None:
                    errors.append(problem)
    except CheckpointCorruptError as exc:
        errors.append(str(exc))
    comm.agree(errors, f"checkpoint {directory} is corrupt or incomplete", CheckpointCorruptError)
    return manifest


def publish(tmp: Path, final: Path, token: str) -> None:
    """Make ``tmp`` (complete, fsynced) visible as ``final`` (rank 0 only).

    At every point a complete checkpoint is reachable: ``final`` (old or new), or the old one
    under ``aside_dir(final, token)`` between the two renames of an overwrite. A failed second
    rename moves the old directory back.

    Raises:
        CheckpointError: ``final`` exists and is not a directory.
        OSError: a rename failed (the previous checkpoint, if any, is back at ``final``).
    """
    fsync_dir(tmp)
    parent = final.parent
    old: Path | None = None
    if final.exists() or final.is_symlink():
        if not final.is_dir():
            raise CheckpointError(f"{final} exists and is not a checkpoint directory")
        old = aside_dir(final, token)
        os.rename(final, old)
        fsync_dir(parent)  # the aside name is durable before the final name is reused
    try:
        os.rename(tmp, final)
    except OSError:
        if old is not None:
            with contextlib.suppress(OSError):
                os.rename(old, final)
        raise
    fsync_dir(parent)
    if old is not None:
        with contextlib.suppress(OSError):
            shutil.rmtree(old)
