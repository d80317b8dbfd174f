"""A full disk, leftovers of failed saves, an unwritable folder: one process each.

A full disk is simulated: DCP's file streams raise ``OSError(ENOSPC)`` after a few bytes (as a
write on a full file system does), tessera's own writes raise it, or ``shutil.disk_usage``
reports almost no free space.
"""

from __future__ import annotations

import contextlib
import errno
import re
import shutil
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_testlib import make_data, make_model
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.utils.data import TensorDataset

from tessera.engine import (
    CheckpointError,
    CheckpointParts,
    Engine,
    SaveCheckpointHook,
    Trainer,
    get_dataloader,
    latest_checkpoint,
    prepare_checkpoint_dir,
    save_checkpoint,
    verify_checkpoint,
)
from tessera.engine.checkpoint import api as checkpoint_api
from tessera.engine.checkpoint import storage


def _parts() -> CheckpointParts:
    model = make_model(0)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    x, y = make_data()
    nn.CrossEntropyLoss()(model(x), y).backward()
    opt.step()
    return CheckpointParts(model, opt)


def _bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir() if p.is_file())


def _listing(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


class _FullDisk:
    """A stream that takes ``room`` bytes, then fails as a full file system does."""

    def __init__(self, inner: Any, room: int) -> None:
        self.inner, self.room = inner, room

    def write(self, data: Any) -> int:
        size = len(memoryview(data).cast("B"))
        if size > self.room:
            raise OSError(errno.ENOSPC, "No space left on device")
        self.room -= size
        return int(self.inner.write(data))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _fill_the_disk(monkeypatch: pytest.MonkeyPatch, room: int = 100) -> None:
    real = FileSystem.create_stream

    @contextlib.contextmanager
    def create_stream(self: FileSystem, path: Any, mode: str) -> Iterator[Any]:
        with real(self, path, mode) as stream:
            yield _FullDisk(stream, room) if "w" in mode else stream

    monkeypatch.setattr(FileSystem, "create_stream", create_stream)


def test_a_full_disk_is_a_checkpoint_error_and_the_partial_save_is_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = save_checkpoint(tmp_path / "step_00000001", _parts(), step=1)
    size = _bytes(first)
    _fill_the_disk(monkeypatch)
    with pytest.raises(CheckpointError) as info:
        save_checkpoint(tmp_path / "step_00000002", _parts(), step=2)
    message = str(info.value)
    assert f"cannot save checkpoint {tmp_path / 'step_00000002'}" in message
    assert "errno 28 (ENOSPC" in message and "the disk is full" in message
    assert f"about {size} bytes needed (the size of the last checkpoint, {first})" in message
    assert _listing(tmp_path) == ["step_00000001"]  # no .step_00000002.tmp-* left behind
    verify_checkpoint(first)


def test_a_full_disk_in_tesseras_own_files_names_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full(path: Path, data: bytes) -> None:
        path.write_bytes(data[:10])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint_api, "write_bytes", full)
    with pytest.raises(CheckpointError, match=r"rank_00000\.pt failed with errno 28 \(ENOSPC"):
        save_checkpoint(tmp_path / "step_00000001", _parts(), step=1)
    assert _listing(tmp_path) == []


def test_free_space_is_checked_before_anything_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = save_checkpoint(tmp_path / "step_00000001", _parts(), step=1)
    size = _bytes(first)
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(storage.shutil, "disk_usage", lambda _: usage._replace(free=size - 1))

    def no_write(*args: Any) -> Any:
        raise AssertionError("a stream was opened after the space check failed")

    monkeypatch.setattr(FileSystem, "create_stream", no_write)
    with pytest.raises(CheckpointError) as info:
        save_checkpoint(tmp_path / "step_00000002", _parts(), step=2)
    assert f"about {size} bytes needed" in str(info.value)
    assert f"{size - 1} bytes free on {tmp_path}; 1 more bytes" in str(info.value)
    assert "errno 28 (ENOSPC" in str(info.value)
    assert _listing(tmp_path) == ["step_00000001"]


def test_torchs_short_write_without_errno_is_recognized(tmp_path: Path) -> None:
    # What the issue saw: DCP's CheckpointException around inline_container's RuntimeError.
    short = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    wrapped = CheckpointException("write", {1: (short, traceback.StackSummary())})
    assert storage.write_failure(wrapped) is short
    assert storage.write_failure(CheckpointException("write", {0: (KeyError("w"), None)})) is None
    message = storage.write_failure_message(tmp_path / "step_2", short, tmp_path, [1])
    assert "on rank 1 failed with errno unknown" in message
    assert "unexpected pos 704 vs 598" in message


def test_the_sweep_removes_unfinished_saves_and_never_a_complete_checkpoint(
    tmp_path: Path,
) -> None:
    first = save_checkpoint(tmp_path / "step_00000001", _parts(), step=1)
    crashed = tmp_path / ".step_00000002.tmp-0123456789ab"  # killed while writing
    crashed.mkdir()
    (crashed / "__0_0.distcp").write_bytes(b"x" * 1000)
    unrenamed = tmp_path / ".step_00000003.tmp-abcdef012345"  # killed just before the rename
    shutil.copytree(first, unrenamed)
    aside = tmp_path / ".step_00000001.old-0123456789ab"  # an overwrite's aside copy
    shutil.copytree(first, aside)
    removed = prepare_checkpoint_dir(tmp_path)
    assert removed == [crashed]
    assert _listing(tmp_path) == [aside.name, "step_00000001", "step_00000003"]
    verify_checkpoint(tmp_path / "step_00000003")
    assert latest_checkpoint(tmp_path) == tmp_path / "step_00000003"


def _trainer() -> tuple[Trainer, Any]:
    model = make_model(0)
    engine = Engine(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss())
    x, y = make_data()
    return Trainer(engine), get_dataloader(TensorDataset(x, y), batch_size=4)


class _Steps(SaveCheckpointHook):
    """Counts the steps taken (a save hook that never saves)."""

    steps = 0

    def after_train_iter(self, trainer: Trainer, *args: Any) -> None:
        type(self).steps += 1


def test_an_unwritable_folder_is_refused_when_training_starts(tmp_path: Path) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    trainer, loader = _trainer()
    hooks = [_Steps(tmp_path / "elsewhere", interval=1), SaveCheckpointHook(blocker / "ckpt")]
    with pytest.raises(CheckpointError) as info:
        trainer.fit(loader, epochs=1, hooks=hooks, display_progress=False)
    assert re.search(rf"cannot create checkpoint folder {blocker / 'ckpt'}: errno 20 \(ENOTDIR",
                     str(info.value)), str(info.value)  # fmt: skip
    assert _Steps.steps == 0  # refused before the first step, not at the first save


def test_a_read_only_folder_is_refused_when_training_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = storage.os.open

    def read_only(path: Any, flags: int, *args: Any) -> int:
        if flags & storage.os.O_WRONLY:
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real(path, flags, *args)

    monkeypatch.setattr(storage.os, "open", read_only)
    trainer, loader = _trainer()
    with pytest.raises(CheckpointError, match=r"cannot write in checkpoint folder .*errno 30"):
        trainer.fit(loader, epochs=1, hooks=[SaveCheckpointHook(tmp_path)],
                    display_progress=False)  # fmt: skip
