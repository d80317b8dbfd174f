"""Checkpoint faults on 2 gloo ranks: every rank raises the same error, none waits for a peer.

A file altered after the save, with its manifest entry rewritten to match (so the checksums
pass), fails while being decoded, on one rank or on all; every rank must raise
``CheckpointCorruptError`` naming it, without waiting out a timeout. A rank that fails in the
middle of a save or a load is named on the others (``RankFailedError``) through the context's
failure board. Each call launches its own job (``init_process_group=False``): a failure may cut
the job's connections, which must not reach the pool's default group. Contexts use a 4 s
collective timeout and 0.2 s heartbeats.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as tdist
from engine_testlib import make_data, make_model
from torch import nn

from tessera.context import launch
from tessera.engine import CheckpointParts, load_checkpoint, save_checkpoint
from tessera.engine.checkpoint import api as checkpoint_api
from tessera.engine.checkpoint.files import sha256_file

TIMEOUT = 4.0
BEAT = 0.2


def _launch() -> Any:
    return launch(
        {"parallel": {}},
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        host="127.0.0.1",
        port=int(os.environ["MASTER_PORT"]),
        timeout=TIMEOUT,
        heartbeat_interval=BEAT,
    )


def _run(dist: Any, fn: Any, *args: Any) -> list[Any]:
    return dist.run(fn, world_size=2, args=args, init_process_group=False, timeout=90)


def _parts(ctx: Any, seed: int, train: bool) -> CheckpointParts:
    model = make_model(seed)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    if train:  # Adam state to save
        x, y = make_data()
        nn.CrossEntropyLoss()(model(x), y).backward()
        opt.step()
    return CheckpointParts(model, opt, context=ctx)


def _outcome(fn: Any, ctx: Any) -> dict[str, Any]:
    start = time.monotonic()
    try:
        fn()
        return {"outcome": "finished"}
    except BaseException as err:  # torch's CheckpointException is a BaseException
        board = ctx.failure_board
        return {
            "outcome": type(err).__name__,
            "message": str(err),
            "rank": getattr(err, "rank", None),
            "where": getattr(err, "where", None),
            "seconds": time.monotonic() - start,
            "posted": [r.describe() for r in board.reports()] if board is not None else [],
        }


def _save(path: str) -> None:
    ctx = _launch()
    try:
        save_checkpoint(path, _parts(ctx, 0, train=True), step=1)
    finally:
        ctx.destroy()


def _load(path: str) -> dict[str, Any]:
    ctx = _launch()
    try:
        parts = _parts(ctx, 5, train=False)
        return _outcome(lambda: load_checkpoint(path, parts), ctx)
    finally:
        ctx.destroy()


@pytest.fixture(scope="module")
def saved(dist: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("faults") / "good"
    _run(dist, _save, str(path))
    return path


def _tamper(path: Path, victim: str) -> None:
    """Replace ``victim`` by something that does not decode; rewrite its manifest entry."""
    target = path / victim
    if victim.endswith(".pt"):  # a type the weights-only unpickler refuses
        torch.save({"rng": datetime.date(2024, 1, 1)}, target)
    else:  # same size, every byte changed
        target.write_bytes(bytes((b + 1) % 256 for b in target.read_bytes()))
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"][victim] = {"bytes": target.stat().st_size, "sha256": sha256_file(target)}
    (path / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize(
    "victim",
    ["rank_00001.pt", "__1_0.distcp"],
    ids=["rank_file_read_by_rank_1_only", "tensor_data_read_by_all"],
)
def test_a_file_that_does_not_decode_fails_every_rank_alike(
    dist: Any, saved: Path, tmp_path: Path, victim: str
) -> None:
    path = tmp_path / "c"
    shutil.copytree(saved, path)
    assert (path / victim).stat().st_size > 0
    _tamper(path, victim)
    results = _run(dist, _load, str(path))
    for got in results:
        assert got["outcome"] == "CheckpointCorruptError", got
        assert str(path / victim) in got["message"], got
        assert got["seconds"] < TIMEOUT, got  # agreed, not a peer's timeout
        assert got["posted"] == [], got  # an error every rank raised blames no rank
    assert results[0]["message"] == results[1]["message"]


def _fail_rank_1_in(what: str, path: str, error: type[Exception] = OSError) -> dict[str, Any]:
    """Rank 1's node-local disk fails in the middle of a save or load (after the first steps)."""
    ctx = _launch()
    point = "write_bytes" if what == "save" else "read_blocks"
    real = getattr(checkpoint_api, point)

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise error(f"rank 1's disk failed in {point}")

    try:
        if tdist.get_rank() == 1:
            setattr(checkpoint_api, point, broken)
        if what == "save":
            parts = _parts(ctx, 0, train=True)
            return _outcome(lambda: save_checkpoint(path, parts, step=2), ctx)
        parts = _parts(ctx, 5, train=False)
        return _outcome(lambda: load_checkpoint(path, parts), ctx)
    finally:
        setattr(checkpoint_api, point, real)
        ctx.destroy()


@pytest.mark.parametrize(("what", "error"), [("save", ValueError), ("load", OSError)])
def test_a_rank_failing_mid_save_or_load_is_named(
    dist: Any, saved: Path, tmp_path: Path, what: str, error: type[Exception]
) -> None:
    path = str(tmp_path / "new") if what == "save" else str(saved)
    results = _run(dist, _fail_rank_1_in, what, path, error)
    assert results[1]["outcome"] == error.__name__, results[1]
    got = results[0]
    assert got["outcome"] == "RankFailedError", got
    assert (got["rank"], got["where"]) == (1, f"checkpoint.{what}"), got
    assert (f"rank 1 failed in 'checkpoint.{what}': {error.__name__}: rank 1's disk failed"
            in got["message"])  # fmt: skip
    assert not (tmp_path / "new").exists()  # nothing published
    assert [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name] == []  # nor left behind


def test_a_write_failing_on_one_rank_is_a_checkpoint_error_on_every_rank(
    dist: Any, tmp_path: Path
) -> None:
    # A disk that fills up under rank 1's own file: said alike on both ranks, nothing posted
    # (no rank is blamed for a full disk), the partial save removed.
    results = _run(dist, _fail_rank_1_in, "save", str(tmp_path / "new"))
    for got in results:
        assert got["outcome"] == "CheckpointError", got
        assert f"rank 1: cannot save checkpoint {tmp_path / 'new'}: writing " in got["message"]
        assert "rank_00001.pt failed with OSError: rank 1's disk failed" in got["message"]
        assert got["posted"] == [], got
        assert got["seconds"] < TIMEOUT, got  # agreed, not a peer's timeout
    assert results[0]["message"] == results[1]["message"]
    assert list(tmp_path.iterdir()) == []


def _rank_1_writes_late(path: str) -> None:
    """Rank 1 writes its own file half a second after rank 0 is ready to list the directory."""
    ctx = _launch()
    real = checkpoint_api.write_bytes

    def late(*args: Any, **kwargs: Any) -> Any:
        time.sleep(0.5)
        return real(*args, **kwargs)

    try:
        if tdist.get_rank() == 1:
            checkpoint_api.write_bytes = late  # type: ignore[assignment]
        save_checkpoint(path, _parts(ctx, 0, train=True), step=3)
    finally:
        checkpoint_api.write_bytes = real  # type: ignore[assignment]
        ctx.destroy()


def test_the_manifest_lists_a_slow_ranks_file(dist: Any, tmp_path: Path) -> None:
    # Without an agreement before the listing, rank 1's file was written after rank 0 listed
    # the directory: published, present, but in no manifest, so never verified.
    path = tmp_path / "late"
    _run(dist, _rank_1_writes_late, str(path))
    manifest = json.loads((path / "manifest.json").read_text())
    assert {"rank_00000.pt", "rank_00001.pt"} <= set(manifest["files"]), sorted(manifest["files"])
