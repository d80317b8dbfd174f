"""Crash-safe files: durable writes, the checksum manifest, atomic publication.

A checkpoint directory is written under a hidden temporary name next to its final name; only
when every rank has finished and ``manifest.json`` (size and sha256 of every file) is on disk
does rank 0 rename it to the final name and fsync the parent directory. A rename within one
directory is atomic on POSIX file systems, so the final name either does not exist or names a
complete checkpoint: a process killed during a save leaves only a temporary directory, and the
previous checkpoint untouched. Overwriting a name moves the old directory aside first and
deletes it only after the new one is in place.

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
    "fsync_dir",
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


def _check_file(directory: Path, name: str, expected: Mapping[str, Any]) -> str | None:
    path = directory / name
    if not path.is_file():
        return f"{path} is missing (listed in {MANIFEST})"
    size = path.stat().st_size
    if size != expected.get("bytes"):
        return f"{path} has {size} bytes, {MANIFEST} says {expected.get('bytes')} (truncated?)"
    digest = sha256_file(path)
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
        if not directory.is_dir():
            raise CheckpointCorruptError(f"{directory} is not a checkpoint directory")
        manifest = read_json(directory / MANIFEST)
        if manifest.get("format") != FORMAT:
            raise CheckpointCorruptError(f"{directory / MANIFEST} is not a {FORMAT} manifest")
        if int(manifest.get("version", 0)) > FORMAT_VERSION:
            raise CheckpointCorruptError(
                f"{directory} has format version {manifest.get('version')}; this tessera-engine "
                f"reads up to {FORMAT_VERSION}"
            )
        files = sorted(manifest.get("files", {}).items())
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
    """Atomically make ``tmp`` (complete, fsynced) visible as ``final`` (rank 0 only).

    Raises:
        CheckpointError: ``final`` exists and is not a directory.
    """
    fsync_dir(tmp)
    parent = final.parent
    old: Path | None = None
    if final.exists() or final.is_symlink():
        if not final.is_dir():
            raise CheckpointError(f"{final} exists and is not a checkpoint directory")
        old = parent / f".{final.name}.old-{token}"
        os.rename(final, old)
    os.rename(tmp, final)
    fsync_dir(parent)
    if old is not None:
        with contextlib.suppress(OSError):
            shutil.rmtree(old)
