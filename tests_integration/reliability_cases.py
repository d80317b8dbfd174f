"""The reliability report's second round of launched cases (issue #18), one job per case.

Each case is a small gloo job (2 or 3 ranks, a 67-parameter model) launched for real with
``launch_from_torch``, a short collective timeout and fast heartbeats. Every rank writes what it
saw to ``rank<r>.json`` in the case's folder (a killed rank writes nothing; the faulty rank
notes the moment of its fault in ``fault.json`` first), with the time it left the job (after
``ctx.destroy()``). ``run_case`` launches the job, reads the records and classifies the outcome:

- ``clear``: every rank stopped with the documented error (naming what it must name);
- ``ok``: a control case (``nonfinite="skip"`` / ``"warn"``) trained on as documented;
- ``wrong``: a rank finished as if nothing happened, raised something else, or holds wrong
  values;
- ``hang``: the job outlived its bound, or a survivor reported nothing within the grace after
  a rank died;
- ``wrong_rank``: an error named a rank (or step) other than the one at fault;
- ``lost``: no complete checkpoint holding the last published values could be found.

The time measured is from the fault (the faulty rank's clock, same machine; for a mismatch,
the moment the last rank reached the call that must refuse it) to the last rank's exit (a
rank killed by the fault exits at the fault; a stopped rank exits once resumed).
"""

from __future__ import annotations

import contextlib
import datetime
import importlib
import json
import math
import os
import shutil
import signal
import subprocess
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as tdist
from torch import nn

from tessera.context import ParallelMode, RankFailedError, launch_from_torch
from tessera.engine import (
    CheckpointParts,
    NonFiniteError,
    initialize,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from tessera.engine.checkpoint import api as checkpoint_api  # to fail inside a save
from tessera.engine.checkpoint import prune_checkpoints, step_dir, verify_checkpoint
from tessera.engine.checkpoint.files import sha256_file
from tessera.testing import DistributedRunner, RankError, RankTimeoutError

STEPS = 3
BATCH = 12  # divisible by 2 and 3 data ranks

# ------------------------------------------------------------------------------ pieces


class _Fault(nn.Module):
    """Identity, except on the faulty rank once armed: stop (SIGSTOP), die (SIGKILL) or raise."""

    def __init__(self) -> None:
        super().__init__()
        self.action: str | None = None
        self.out = ""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.action is not None:
            action, self.action = self.action, None
            _note_fault(self.out)
            if action == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)  # resumed by a survivor (SIGCONT)
            elif action == "raise":
                raise ValueError(f"injected fault on rank {tdist.get_rank()}")
            else:
                os.kill(os.getpid(), signal.SIGKILL)
        return x


def _model(seed: int = 0) -> nn.Sequential:
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(4, 8), _Fault(), nn.Tanh(), nn.Linear(8, 3))


def _flat(model: nn.Module) -> list[float]:
    return [float(v) for p in model.parameters() for v in p.detach().double().flatten()]


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, 4, generator=g), torch.randint(0, 3, (BATCH,), generator=g)


def _note_fault(out: str) -> None:
    """The moment of the fault, written before it happens (first writer wins)."""
    try:  # exclusive: ranks noting the same fault at once must not both write
        fd = os.open(Path(out, "fault.json"), os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    except FileExistsError:
        return
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps({"t_fault": time.time(), "pid": os.getpid()}))


_CONTEXT: list[Any] = []  # this rank's context, for the board's posts in a record


def _launch(config: dict[str, Any], timeout: float, beat: float) -> Any:
    ctx = launch_from_torch(config, timeout=timeout, heartbeat_interval=beat)
    _CONTEXT[:] = [ctx]
    return ctx


def _barrier(ctx: Any) -> None:
    tdist.barrier(group=ctx.get_cpu_group(ParallelMode.GLOBAL))


def _error(rec: dict[str, Any], err: BaseException) -> None:
    """Write down how this rank stopped."""
    rec["outcome"] = type(err).__name__
    rec["message"] = str(err)[:1500]
    rec["trace"] = "".join(traceback.format_exception(err))[-1500:]
    board = _CONTEXT[0].failure_board if _CONTEXT else None
    with contextlib.suppress(Exception):
        rec["posts"] = [r.describe() for r in board.reports()] if board is not None else []
    if isinstance(err, RankFailedError):
        rec["failed"] = err.rank
    if isinstance(err, NonFiniteError):
        report = err.report
        rec["nonfinite"] = [report.step, list(report.loss_ranks), list(report.grad_ranks)]


@dataclass(frozen=True)
class Job:
    """What every rank of one launched case is told."""

    kind: str
    faulty: int
    fault_step: int
    out: str
    timeout: float
    beat: float
    variant: str = ""


def _warm_up() -> None:
    """Import what a first step imports lazily (optimizers, DDP, DCP) before heartbeats start.

    On a loaded machine a rank holding the GIL in a long first import misses its heartbeats
    and is declared dead (a false positive; see the notes in the report's docstring).
    """
    torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    torch.optim.Adam([nn.Parameter(torch.zeros(1))], lr=0.1)
    importlib.import_module("torch.distributed.checkpoint")
    importlib.import_module("torch.nn.parallel")


def case_job(job: Job) -> dict[str, Any]:
    """One case on every rank; writes and returns this rank's record."""
    _warm_up()
    rank = int(os.environ["RANK"])
    rec: dict[str, Any] = {"rank": rank, "t_start": time.time()}
    try:
        BODIES[job.kind](job, rank, rec)
        rec.setdefault("outcome", "finished")
    except BaseException as err:  # torch's CheckpointException is a BaseException
        _error(rec, err)
    rec.setdefault("t_exit", time.time())
    Path(job.out, f"rank{rank}.json").write_text(json.dumps(rec))
    return rec


# ------------------------------------------------------------------------------ bodies: training


def _train(job: Job, rank: int, rec: dict[str, Any]) -> None:
    """Data-parallel steps, the faulty rank's fault armed at ``fault_step``.

    The fault: NaN data (``nonfinite``), SIGSTOP, SIGKILL (mid-step, or before initialize), or
    one row fewer on the first step (``batch_shape_differs``).
    """
    world = int(os.environ["WORLD_SIZE"])
    config: dict[str, Any] = {"parallel": {"data": world}}
    if job.kind == "nonfinite":
        config["nonfinite"] = job.variant
    ctx = _launch(config, job.timeout, job.beat)
    model = _model()
    fault = next(m for m in model.modules() if isinstance(m, _Fault))
    fault.out = job.out
    part = BATCH // world
    mine = slice(rank * part, (rank + 1) * part)
    try:
        if job.kind == "rank_killed_init" and rank == job.faulty:
            _note_fault(job.out)
            os.kill(os.getpid(), signal.SIGKILL)  # e.g. the OOM killer, moving the model
        engine, *_ = initialize(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            nn.CrossEntropyLoss(),
            config=config,
            context=ctx,
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(STEPS):
                x, y = _batch(step)
                x, y = x[mine], y[mine]
                due = rank == job.faulty and step == job.fault_step
                if due and job.kind == "nonfinite":
                    _note_fault(job.out)
                    x = x * math.nan  # this rank's loss goes NaN
                if due and job.kind in ("rank_stopped", "rank_killed"):
                    fault.action = "stop" if job.kind == "rank_stopped" else "kill"
                if job.kind == "batch_shape_differs" and step == 0:
                    if rank == job.faulty:
                        x, y = x[:-1], y[:-1]
                    rec["t_enter"] = time.time()
                rec["before"] = _flat(model)
                engine.zero_grad()
                engine.execute_schedule(iter([(x, y)]))
                engine.step()
        rec["warned"] = sum("nonfinite" in str(w.message) for w in caught)
        rec["skipped"] = engine.skipped_steps
    finally:
        rec["params"] = _flat(model)
        stopped = Path(job.out, "fault.json")
        if job.kind == "rank_stopped" and rank != job.faulty and stopped.exists():
            # resume the stopped rank so that it can leave too (as a launcher would kill it)
            with contextlib.suppress(ProcessLookupError):
                os.kill(json.loads(stopped.read_text())["pid"], signal.SIGCONT)
        ctx.destroy()
        rec["t_exit"] = time.time()


# ------------------------------------------------------------------------------ bodies: configs

#: variant -> (the bad configuration keys, a word the ConfigError must contain)
ENGINE_CONFIGS: dict[str, tuple[dict[str, Any], str]] = {
    "gradient_acumulation": ({"gradient_acumulation": 2}, "gradient_accumulation"),
    "clip_grad_nrom": ({"clip_grad_nrom": 1.0}, "clip_grad_norm"),
    "tensor.sequence_paralel": (
        {"parallel": {"tensor": {"size": 2, "mode": "1d", "sequence_paralel": True}}},
        "sequence_parallel",
    ),
    "clip_grad_norm=nan": ({"clip_grad_norm": math.nan}, "clip_grad_norm"),
    "fp16.init_scale=nan": ({"fp16": {"init_scale": math.nan}}, "init_scale"),
    "fp16=dict()+bf16": ({"fp16": {}, "bf16": True}, "bf16"),
    "unknown schedule": ({"schedule": {"type": "NoSuchSchedule"}}, "NoSuchSchedule"),
}


def _engine_config(job: Job, rank: int, rec: dict[str, Any]) -> None:
    """The same bad configuration on every rank: a ConfigError at launch or initialize."""
    bad, _ = ENGINE_CONFIGS[job.variant]
    config: dict[str, Any] = {"parallel": {"data": int(os.environ["WORLD_SIZE"])}, **bad}
    rec["t_enter"] = time.time()
    ctx = _launch(config, job.timeout, job.beat)
    try:
        model = _model()
        initialize(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            nn.CrossEntropyLoss(),
            config=config,
            context=ctx,
        )
    finally:
        ctx.destroy()
        rec["t_exit"] = time.time()


def _layouts_differ(job: Job, rank: int, rec: dict[str, Any]) -> None:
    """The faulty rank is launched with another ``parallel`` block (same world size)."""
    world = int(os.environ["WORLD_SIZE"])
    parallel: dict[str, Any] = {"tensor": {"size": world, "mode": "1d"}}
    if rank == job.faulty:
        parallel = {"data": world}
    rec["t_enter"] = time.time()
    ctx = _launch({"parallel": parallel}, job.timeout, job.beat)
    ctx.destroy()


def _replica_differs(job: Job, rank: int, rec: dict[str, Any]) -> None:
    """Tensor ranks (1D) holding a plain model, one weight off on the faulty rank.

    Replicated parameters that would train apart: initialize's checksums must refuse them.
    """
    world = int(os.environ["WORLD_SIZE"])
    config: dict[str, Any] = {"parallel": {"tensor": {"size": world, "mode": "1d"}}}
    ctx = _launch(config, job.timeout, job.beat)
    try:
        model = _model()
        if rank == job.faulty:
            with torch.no_grad():
                model[0].weight[0, 0] += 1e-3
        rec["t_enter"] = time.time()
        initialize(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            nn.CrossEntropyLoss(),
            config=config,
            context=ctx,
        )
    finally:
        ctx.destroy()
        rec["t_exit"] = time.time()


# ------------------------------------------------------------------------------ bodies: checkpoints


def _trained(ctx: Any, steps: int, seed: int = 0) -> CheckpointParts:
    """A model and Adam after ``steps`` local steps: the same values on every rank."""
    model = _model(seed)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for step in range(steps):
        x, y = _batch(step)
        opt.zero_grad()
        nn.CrossEntropyLoss()(model(x), y).backward()
        opt.step()
    return CheckpointParts(model, opt, context=ctx)


def _more(parts: CheckpointParts) -> None:
    """One more local step (the same on every rank)."""
    assert isinstance(parts.model, nn.Module) and parts.optimizer is not None
    x, y = _batch(7)
    parts.optimizer.zero_grad()
    nn.CrossEntropyLoss()(parts.model(x), y).backward()
    parts.optimizer.step()


def _tamper(path: Path, victim: str) -> None:
    """Replace ``victim`` by bytes that do not decode; rewrite its manifest entry to match.

    The checksums pass, so only the reader can find out.
    """
    target = path / victim
    if victim.endswith(".pt"):  # a type the weights-only unpickler refuses
        torch.save({"rng": datetime.date(2024, 1, 1)}, target)
    else:  # same size, every byte changed
        target.write_bytes(bytes((b + 1) % 256 for b in target.read_bytes()))
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"][victim] = {"bytes": target.stat().st_size, "sha256": sha256_file(target)}
    (path / "manifest.json").write_text(json.dumps(manifest))


def _victim(path: Path, variant: str, faulty: int) -> str:
    if variant == "rank file":
        return f"rank_{faulty:05d}.pt"
    names = sorted(p.name for p in path.glob("*.distcp"))
    own = f"__{faulty}_0.distcp"
    return own if own in names else names[0]


def _ckpt_tampered(job: Job, rank: int, rec: dict[str, Any]) -> None:
    """Save, alter one file after the save (manifest rewritten to match), load.

    Every rank must raise CheckpointCorruptError naming the file, and leave the model untouched
    when the file is found before any tensor is read.
    """
    ctx = _launch({"parallel": {}}, job.timeout, job.beat)
    try:
        path = Path(job.out, "ckpt")
        save_checkpoint(path, _trained(ctx, 1), step=1)
        _barrier(ctx)
        victim = _victim(path, job.variant, job.faulty)
        rec["victim"] = str(path / victim)
        if rank == 0:
            _tamper(path, victim)
        _barrier(ctx)
        fresh = _trained(ctx, 0, seed=5)
        assert isinstance(fresh.model, nn.Module)
        rec["before"] = _flat(fresh.model)
        rec["t_enter"] = time.time()
        try:
            load_checkpoint(path, fresh)
        finally:
            rec["params"] = _flat(fresh.model)
    finally:
        ctx.destroy()
        rec["t_exit"] = time.time()


def _crash_between_renames(job: Job, rank: int, rec: dict[str, Any]) -> None:
    """Save steps 1 and 2, train on, overwrite step 2: the publisher dies between renames.

    Rank 0 dies right after it moved the old step 2 aside, before the new one took the name.
    """
    ctx = _launch({"parallel": {}}, job.timeout, job.beat)
    real_rename = os.rename

    def crash_after_aside(src: Any, dst: Any) -> None:
        real_rename(src, dst)
        if ".old-" in os.fspath(dst):
            _note_fault(job.out)
            os._exit(9)

    try:
        root = Path(job.out, "run")
        parts = _trained(ctx, 1)
        save_checkpoint(step_dir(root, 1), parts, step=1)
        _more(parts)
        save_checkpoint(step_dir(root, 2), parts, step=2)
        assert isinstance(parts.model, nn.Module)
        rec["published"] = _flat(parts.model)
        _more(parts)
        if rank == 0:
            os.rename = crash_after_aside
        save_checkpoint(step_dir(root, 2), parts, step=2)
    finally:
        os.rename = real_rename
        ctx.destroy()
        rec["t_exit"] = time.time()


def _recover(job: Job, rank: int, rec: dict[str, Any]) -> None:
    """After the crash: resume from ``latest_checkpoint``.

    First a newer, damaged checkpoint appears and rank 0 prunes to one complete checkpoint.
    """
    ctx = _launch({"parallel": {}}, job.timeout, job.beat)
    try:
        root = Path(job.out, "run")
        if rank == 0:
            rec["found"] = sorted(p.name for p in root.iterdir())
            aside = sorted(root.glob(".step_00000002.old-*"))
            if aside:  # a newer step whose biggest file lost its second half
                newer = step_dir(root, 3)
                shutil.copytree(aside[0], newer)
                biggest = max(newer.iterdir(), key=lambda p: p.stat().st_size)
                rec["truncated"] = [biggest.name, biggest.stat().st_size]
                biggest.write_bytes(biggest.read_bytes()[: biggest.stat().st_size // 2])
                rec["sizes"] = {p.name: p.stat().st_size for p in sorted(aside[0].iterdir())}
            rec["pruned"] = sorted(p.name for p in prune_checkpoints(root, keep_last=1))
            rec["left"] = sorted(p.name for p in root.iterdir())
        _barrier(ctx)
        latest = latest_checkpoint(root, ctx)
        rec["latest"] = None if latest is None else latest.name
        if latest is not None:
            fresh = _trained(ctx, 0, seed=5)
            assert isinstance(fresh.model, nn.Module)
            rec["step"] = load_checkpoint(latest, fresh).step
            rec["params"] = _flat(fresh.model)
    finally:
        ctx.destroy()
        rec["t_exit"] = time.time()


def _dies_mid_save(job: Job, rank: int, rec: dict[str, Any]) -> None:
    """Overwrite a checkpoint; the faulty rank dies while writing its file.

    The survivor must name it, and the previous checkpoint must still verify and load with its
    values.
    """
    ctx = _launch({"parallel": {}}, job.timeout, job.beat)
    real_write = checkpoint_api.write_bytes

    def die(*args: Any, **kwargs: Any) -> None:
        _note_fault(job.out)
        os._exit(9)

    path = Path(job.out, "ckpt")
    try:
        parts = _trained(ctx, 1)
        save_checkpoint(path, parts, step=1)
        assert isinstance(parts.model, nn.Module)
        rec["published"] = _flat(parts.model)
        _more(parts)
        if rank == job.faulty:
            checkpoint_api.write_bytes = die
        try:
            save_checkpoint(path, parts, step=2)
        except BaseException as err:
            _error(rec, err)
    finally:
        checkpoint_api.write_bytes = real_write
        ctx.destroy()
        rec["t_exit"] = time.time()
    # After this rank left: is the previous checkpoint whole, and does it load alone?
    try:
        rec["manifest_step"] = verify_checkpoint(path)["step"]
        fresh = _trained(None, 0, seed=5)
        assert isinstance(fresh.model, nn.Module)
        load_checkpoint(path, fresh)
        rec["params"] = _flat(fresh.model)
    except BaseException as err:
        rec["reload_error"] = f"{type(err).__name__}: {err}"[:500]


# ---------------------------------------------------------------------- bodies: data (issue 40)

#: Seconds without progress after which the read-hang case's stalled rank is named; its
#: collective timeout is far longer, so only progress detection can name it in time.
READ_HANG_PROGRESS = 2.0
READ_HANG_TIMEOUT = 60.0


class _Stream(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
    """``rows`` samples without len(); ``hang`` blocks in the read of the second batch."""

    def __init__(self, rows: int, hang: Callable[[], None] | None = None) -> None:
        self.rows, self.hang = rows, hang

    def __iter__(self) -> Any:
        x, y = _batch(0)
        for i in range(self.rows):
            if self.hang is not None and i == 2:
                self.hang()
            yield x[i % BATCH], y[i % BATCH]


def _fit(ctx: Any, loader: Any) -> None:
    from tessera.engine import Trainer

    model = _model()
    config = {"gradient_handlers": [{"type": "DataParallelGradientHandler"}]}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = initialize(model, opt, nn.CrossEntropyLoss(), config=config, context=ctx)[0]
    Trainer(engine).fit(loader, epochs=1, display_progress=False)


def _uneven_data(job: Job, rank: int, rec: dict[str, Any]) -> None:
    """The faulty data rank's loader holds one batch fewer (with len(), or a stream)."""
    from torch.utils.data import DataLoader, TensorDataset

    world = int(os.environ["WORLD_SIZE"])
    ctx = _launch({"parallel": {"data": world}}, job.timeout, job.beat)
    try:
        batches = 3 if rank == job.faulty else 4
        if job.variant == "len":
            x, y = _batch(0)
            data: Any = TensorDataset(x[: 2 * batches], y[: 2 * batches])
        else:
            data = _Stream(2 * batches)
        rec["t_enter"] = time.time()
        _fit(ctx, DataLoader(data, batch_size=2))
    finally:
        ctx.destroy()
        rec["t_exit"] = time.time()


def _read_hangs(job: Job, rank: int, rec: dict[str, Any]) -> None:
    """The faulty rank's loader blocks in a read that releases the GIL (its heartbeat beats)."""
    ctx = launch_from_torch(
        {"parallel": {"data": int(os.environ["WORLD_SIZE"])}},
        timeout=READ_HANG_TIMEOUT,
        heartbeat_interval=job.beat,
        progress_timeout=READ_HANG_PROGRESS,
    )
    _CONTEXT[:] = [ctx]

    def hang() -> None:  # a read on a dead NFS server, until the job is aborted
        _note_fault(job.out)
        deadline = time.monotonic() + READ_HANG_TIMEOUT
        while not ctx.failures.aborted and time.monotonic() < deadline:
            time.sleep(0.05)

    try:
        from torch.utils.data import DataLoader

        _fit(ctx, DataLoader(_Stream(8, hang if rank == job.faulty else None), batch_size=2))
    finally:
        ctx.destroy()
        rec["t_exit"] = time.time()


# ------------------------------------------------------ bodies: trainer checkpoints (issue 40)

#: Rows of the Trainer cases' dataset: 6 batches of 2 per rank and epoch on 2 ranks.
ROWS = 24
EPOCHS = 2
#: Where the Trainer cases' checkpoints live, under the case's folder.
RUN = "run"
#: variant -> (gradient accumulation, the checkpoint the resumed job must load)
RESUMES: dict[str, tuple[int, str]] = {
    "ckpt_leftovers": (1, "step_00000003"),  # saves at 3; killed inside the save of 6
    "ckpt_accumulation": (2, "step_00000004"),  # due at 3 (mid-step), taken at 4; killed at 5
    "preempted": (2, "step_00000006"),  # signalled at 5 (mid-step): saved at 6
    "preempted_twice": (1, "step_00000002"),  # saves at 2; both signals at 3, in the save
}


def _dataset() -> Any:
    from torch.utils.data import TensorDataset

    g = torch.Generator().manual_seed(7)
    return TensorDataset(
        torch.randn(ROWS, 4, generator=g), torch.randint(0, 3, (ROWS,), generator=g)
    )


def _steps_hook(at: int = 0, action: Any = None, priority: int = 50) -> Any:
    """A hook noting each step's loss (equal on every rank) and acting once at step ``at``.

    Priority 50: before ``SaveCheckpointHook`` (100) and ``PreemptionHook`` (110) of the step.
    """
    from tessera.engine import BaseHook

    class Steps(BaseHook):
        def __init__(self) -> None:
            super().__init__(priority)
            self.losses: list[float] = []

        def after_train_iter(self, trainer: Any, output: Any, label: Any, loss: Any) -> None:
            self.losses.append(trainer.step_metrics["loss"])
            if action is not None and trainer.global_step == at:
                action(trainer)

    return Steps()


def _ckpt_fit(ctx: Any, accumulation: int, hooks: list[Any]) -> nn.Module:
    """The Trainer over a shuffled resumable loader, Adam, data-parallel gradients."""
    from tessera.engine import Trainer, get_dataloader

    model = _model()
    config: dict[str, Any] = {"gradient_handlers": [{"type": "DataParallelGradientHandler"}]}
    if accumulation > 1:
        config["gradient_accumulation"] = accumulation
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    engine = initialize(model, opt, nn.CrossEntropyLoss(), config=config, context=ctx)[0]
    loader = get_dataloader(_dataset(), shuffle=True, batch_size=2, context=ctx)
    Trainer(engine).fit(loader, epochs=EPOCHS, hooks=hooks, display_progress=False)
    return model


def _kill_everyone(job: Job) -> None:
    """SIGKILL every rank of the job (a node losing power), this one last."""
    _note_fault(job.out)
    pids = [int(p.read_text()) for p in Path(job.out).glob("pid*.txt")]
    for pid in sorted(set(pids) - {os.getpid()}):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def _names(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir()) if root.is_dir() else []


def _disk_full(job: Job, rank: int, rec: dict[str, Any]) -> None:
    """Saves every 2 steps; after the save of step 2 the disk fills; the save of 4 fails.

    ``tmpfs``: the checkpoint folder is a small tmpfs the report mounted; rank 0 writes a file
    leaving a page more than the last checkpoint's size free (so the free-space check passes)
    and the save runs out of space in its writes. ``injected``: the faulty rank's rank-file
    write raises ENOSPC. Every rank must raise CheckpointError naming the path and the errno;
    no temporary folder may be left; step 2 must still load with its values.
    """
    from tessera.engine import SaveCheckpointHook

    ctx = _launch({"parallel": {"data": int(os.environ["WORLD_SIZE"])}}, job.timeout, job.beat)
    root = Path(job.out, "disk", RUN)
    real_write = checkpoint_api.write_bytes

    def full(*args: Any, **kwargs: Any) -> None:
        raise OSError(28, os.strerror(28), str(args[0]) if args else "?")

    def fill(trainer: Any) -> None:
        rec["published"] = _flat(trainer.engine.module)
        if rank != job.faulty:
            return
        _note_fault(job.out)
        if job.variant == "tmpfs":
            need = sum(p.stat().st_size for p in (root / "step_00000002").iterdir())
            free = shutil.disk_usage(root).free
            size = (free - need - 4096) // 4096 * 4096
            with open(Path(job.out, "disk", "other_job.bin"), "wb") as f:
                f.write(b"\0" * max(size, 0))
            rec["filled"] = [need, free, shutil.disk_usage(root).free]
        else:
            checkpoint_api.write_bytes = full

    try:
        _ckpt_fit(ctx, 1, [SaveCheckpointHook(root, interval=2), _steps_hook(2, fill, 105)])
    except BaseException as err:
        _error(rec, err)
    finally:
        checkpoint_api.write_bytes = real_write
        ctx.destroy()
        rec["t_exit"] = time.time()
    rec["left"] = _names(root)
    try:  # the previous checkpoint, alone
        rec["manifest_step"] = verify_checkpoint(root / "step_00000002")["step"]
        fresh = _trained(None, 0, seed=5)
        assert isinstance(fresh.model, nn.Module)
        load_checkpoint(root / "step_00000002", fresh, strict=False)
        rec["params"] = _flat(fresh.model)
    except BaseException as err:
        rec["reload_error"] = f"{type(err).__name__}: {err}"[:500]


def _crashed_run(job: Job, rank: int, rec: dict[str, Any]) -> None:
    """The first job of a resume case: it ends by SIGKILL or a preemption signal.

    - ``ckpt_leftovers``: saves every 3 steps; every rank is killed inside the save of step 6
      (its temporary folder left behind);
    - ``ckpt_accumulation``: 2 micro-steps per optimizer step, a save due every 3 steps;
      every rank is killed at step 5, between micro-steps;
    - ``preempted``: the faulty rank gets SIGTERM at step 5 (between micro-steps); every rank
      must save at step 6 and raise SystemExit(75);
    - ``preempted_twice``: saves every 2 steps; every rank gets SIGTERM at step 3 and again in
      the preemption save's first write: every rank exits at once (status 143).
    """
    from tessera.engine import PreemptionHook, SaveCheckpointHook

    Path(job.out, f"pid{rank}.txt").write_text(str(os.getpid()))
    ctx = _launch({"parallel": {"data": int(os.environ["WORLD_SIZE"])}}, job.timeout, job.beat)
    root = Path(job.out, RUN)
    accumulation = RESUMES[job.kind][0]
    real_write = checkpoint_api.write_bytes

    def kill_in_write(*args: Any, **kwargs: Any) -> None:
        _kill_everyone(job)

    def second_signal(*args: Any, **kwargs: Any) -> Any:
        os.kill(os.getpid(), signal.SIGTERM)  # the handler exits at once
        return real_write(*args, **kwargs)

    def act(trainer: Any) -> None:
        if job.kind == "ckpt_leftovers":
            checkpoint_api.write_bytes = kill_in_write
        elif job.kind == "ckpt_accumulation":
            _kill_everyone(job)
        elif job.kind == "preempted" and rank == job.faulty:
            _note_fault(job.out)
            os.kill(os.getpid(), signal.SIGTERM)
        elif job.kind == "preempted_twice":
            _note_fault(job.out)
            os.kill(os.getpid(), signal.SIGTERM)
            checkpoint_api.write_bytes = second_signal

    interval = {"ckpt_leftovers": 3, "ckpt_accumulation": 3, "preempted": 100}.get(job.kind, 2)
    save = SaveCheckpointHook(root, interval=interval)
    at = {"ckpt_leftovers": 5, "ckpt_accumulation": 5, "preempted": 5}.get(job.kind, 3)
    try:
        _ckpt_fit(ctx, accumulation, [save, PreemptionHook(save), _steps_hook(at, act)])
    except SystemExit as err:
        rec.update(outcome="SystemExit", code=err.code, saved=[p.name for p in save.saved])
    finally:
        checkpoint_api.write_bytes = real_write
        ctx.destroy()
        rec["t_exit"] = time.time()


def _resumed_run(job: Job, rank: int, rec: dict[str, Any]) -> None:
    """The job restarted after ``_crashed_run`` (``variant``): sweep, resume, compare.

    With ``LoadCheckpointHook`` and ``SaveCheckpointHook`` on the same folder (the sweep runs
    when the save hook is attached), then an uninterrupted run from scratch in the same
    process: the resumed losses must equal its losses from the loaded step on, bitwise.
    """
    from tessera.engine import LoadCheckpointHook, SaveCheckpointHook

    ctx = _launch({"parallel": {"data": int(os.environ["WORLD_SIZE"])}}, job.timeout, job.beat)
    root = Path(job.out, RUN)
    accumulation = RESUMES[job.variant][0]
    try:
        if rank == 0:
            rec["found"] = _names(root)
        _barrier(ctx)
        load, steps = LoadCheckpointHook(root), _steps_hook()
        model = _ckpt_fit(ctx, accumulation, [load, SaveCheckpointHook(root, 100), steps])
        rec["loaded"] = None if load.loaded is None else load.loaded.name
        rec["losses"], rec["params"] = steps.losses, _flat(model)
        if rank == 0:
            rec["left"] = _names(root)
        reference = _steps_hook()
        model = _ckpt_fit(ctx, accumulation, [reference])
        rec["reference"], rec["reference_params"] = reference.losses, _flat(model)
    finally:
        ctx.destroy()
        rec["t_exit"] = time.time()


def _stream_epochs(job: Job, rank: int, rec: dict[str, Any]) -> None:
    """Two epochs over an IterableDataset (each ends in StopIteration), then a real fault.

    No rank may have a failure posted after the epochs; then the faulty rank raises in the
    next epoch and every other rank must name it (not a rank whose epoch ended).
    """
    from torch.utils.data import DataLoader

    from tessera.engine import Trainer

    ctx = _launch({"parallel": {"data": int(os.environ["WORLD_SIZE"])}}, job.timeout, job.beat)
    try:
        model = _model()
        fault = next(m for m in model.modules() if isinstance(m, _Fault))
        fault.out = job.out
        config = {"gradient_handlers": [{"type": "DataParallelGradientHandler"}]}
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        engine = initialize(model, opt, nn.CrossEntropyLoss(), config=config, context=ctx)[0]
        trainer = Trainer(engine)
        trainer.fit(DataLoader(_Stream(8), batch_size=2), epochs=2, display_progress=False)
        rec["steps"] = trainer.global_step
        board = ctx.failure_board
        rec["posts_before"] = [r.describe() for r in board.reports()] if board else []
        ctx.check_failures("after the epochs")
        _barrier(ctx)
        if rank == job.faulty:
            fault.action = "raise"
        Trainer(engine).fit(DataLoader(_Stream(8), batch_size=2), epochs=1, display_progress=False)
    finally:
        ctx.destroy()
        rec["t_exit"] = time.time()


BODIES: dict[str, Callable[[Job, int, dict[str, Any]], None]] = {
    "nonfinite": _train,
    "batch_shape_differs": _train,
    "rank_stopped": _train,
    "rank_killed": _train,
    "rank_killed_init": _train,
    "engine_config": _engine_config,
    "layouts_differ": _layouts_differ,
    "replica_differs": _replica_differs,
    "ckpt_tampered": _ckpt_tampered,
    "ckpt_crash_between_renames": _crash_between_renames,
    "ckpt_recover": _recover,
    "ckpt_dies_mid_save": _dies_mid_save,
    "uneven_data": _uneven_data,
    "read_hangs": _read_hangs,
    "ckpt_disk_full": _disk_full,
    **{kind: _crashed_run for kind in RESUMES},
    "ckpt_resume": _resumed_run,
    "stream_epochs": _stream_epochs,
}

# ------------------------------------------------------------------------------ judging

Verdict = tuple[str, str]  # (category, detail)


def _all(records: dict[int, dict[str, Any]], ranks: list[int], outcome: str) -> Verdict | None:
    """``wrong`` unless every rank of ``ranks`` ended with ``outcome``."""
    got = {r: records[r]["outcome"] for r in ranks}
    if set(got.values()) != {outcome}:
        detail = "; ".join(
            f"rank {r}: {records[r]['outcome']} {records[r].get('message', '')[:200]}"
            for r in ranks
            if records[r]["outcome"] != outcome
        )
        return "wrong", f"expected {outcome} on ranks {ranks}: {detail}"
    return None


def _named(records: dict[int, dict[str, Any]], ranks: list[int], ok: tuple[Any, ...]) -> Verdict:
    bad = {r: records[r].get("failed") for r in ranks if records[r].get("failed") not in ok}
    if bad:
        return "wrong_rank", f"named {bad}, expected one of {list(ok)}"
    return "clear", ""


def _files(records: dict[int, dict[str, Any]]) -> str:
    """What rank 0 of the recovery job found, pruned and left, for a lost checkpoint."""
    keys = ("found", "truncated", "sizes", "pruned", "left")
    return json.dumps({k: records.get(0, {}).get(k) for k in keys})


def judge(case: Case, job: Job, world: int, records: dict[int, dict[str, Any]]) -> Verdict:
    """The category of one finished job's records."""
    everyone = list(range(world))
    survivors = [r for r in everyone if not (case.dies and r == job.faulty)]
    missing = [r for r in survivors if r not in records]
    if missing:
        return "hang", f"ranks {missing} reported nothing"
    kind = job.kind
    if kind == "nonfinite" and job.variant == "raise":
        wrong = _all(records, everyone, "NonFiniteError")
        if wrong:
            return wrong
        expected = [job.fault_step + 1, [job.faulty]]
        for r in everyone:
            if records[r]["nonfinite"][:2] != expected:
                return "wrong_rank", f"rank {r}: (step, loss ranks) {records[r]['nonfinite'][:2]}"
            if records[r]["params"] != records[r]["before"]:
                return "wrong", f"rank {r}: the parameters changed in the refused step"
        return "clear", ""
    if kind == "nonfinite":  # skip / warn: every rank skips that one step and trains on alike
        wrong = _all(records, everyone, "finished")
        if wrong:
            return wrong
        params = [records[r]["params"] for r in everyone]
        if not all(math.isfinite(v) for v in params[0]) or any(p != params[0] for p in params):
            return "wrong", "parameters non-finite or different across ranks"
        skipped = [records[r]["skipped"] for r in everyone]
        warned = [records[r]["warned"] for r in everyone]
        if skipped != [1] * world or warned != [int(job.variant == "warn")] * world:
            return "wrong", f"skipped steps {skipped}, warnings {warned}"
        return "ok", ""
    if kind in ("rank_stopped", "rank_killed", "rank_killed_init"):
        others = [r for r in everyone if r != job.faulty]
        wrong = _all(records, others, "RankFailedError")
        if wrong:
            return wrong
        if kind == "rank_stopped" and records[job.faulty]["outcome"] == "finished":
            return "wrong", "the stopped rank finished its steps once resumed"
        return _named(records, others, (job.faulty,))
    if kind in ("batch_shape_differs", "replica_differs"):
        wrong = _all(records, everyone, "ValueError")
        if wrong:
            return wrong
        what = "batch" if kind == "batch_shape_differs" else "parameter values"
        if not all(f"disagree on the {what}" in records[r]["message"] for r in everyone):
            return "wrong", f"the ValueError does not say the ranks disagree on the {what}"
        return "clear", ""
    if kind in ("engine_config", "layouts_differ"):
        wrong = _all(records, everyone, "ConfigError")
        if wrong:
            return wrong
        messages = {records[r]["message"] for r in everyone}
        word = ENGINE_CONFIGS[job.variant][1] if kind == "engine_config" else "ranks"
        if len(messages) != 1 or word not in next(iter(messages)):
            return "wrong", f"messages differ or do not name {word!r}: {messages}"
        return "clear", ""
    if kind == "uneven_data":
        wrong = _all(records, everyone, "ValueError")
        if wrong:
            return wrong
        if not all("uneven data" in records[r]["message"] for r in everyone):
            return "wrong", "the ValueError does not say the data is uneven"
        if not all(f"ranks [{job.faulty}]" in records[r]["message"] for r in everyone):
            return "wrong_rank", f"the message does not name rank {job.faulty}"
        return "clear", ""
    if kind == "read_hangs":
        others = [r for r in everyone if r != job.faulty]
        wrong = _all(records, others, "RankFailedError")
        if wrong:
            return wrong
        if records[job.faulty]["outcome"] == "finished":
            return "wrong", "the rank blocked in its read finished its steps"
        return _named(records, others, (job.faulty,))
    if kind == "ckpt_disk_full":
        wrong = _all(records, everyone, "CheckpointError")
        if wrong:
            return wrong
        final = str(Path(job.out, "disk", RUN, "step_00000004"))
        for r in everyone:
            if final not in records[r]["message"] or "errno 28" not in records[r]["message"]:
                return "wrong", f"rank {r}'s error does not name {final} and errno 28"
        left = [n for r in everyone for n in records[r]["left"] if ".tmp-" in n]
        if left:
            return "wrong", f"temporary folders left behind: {sorted(set(left))}"
        for r in everyone:
            if "reload_error" in records[r] or records[r].get("params") != records[r]["published"]:
                return "lost", f"rank {r}: {records[r].get('reload_error', 'other values')}"
        return "clear", ""
    if kind == "stream_epochs":
        posted = {r: records[r].get("posts_before") for r in everyone}
        if any(p != [] for p in posted.values()):
            return "wrong", f"failures posted after clean epochs (or none recorded): {posted}"
        others = [r for r in everyone if r != job.faulty]
        wrong = _all(records, [job.faulty], "ValueError") or _all(
            records, others, "RankFailedError"
        )
        return wrong or _named(records, others, (job.faulty,))
    if kind == "preempted":
        for r in everyone:
            rec = records[r]
            if rec["outcome"] != "SystemExit" or rec.get("code") != 75:
                return "wrong", f"rank {r}: {rec['outcome']} {rec.get('code')}, expected exit 75"
            if RESUMES[kind][1] not in rec.get("saved", []):
                return "lost", f"rank {r} saved {rec.get('saved')}, not {RESUMES[kind][1]}"
        return "preempted", ""
    if kind == "ckpt_resume":
        expected = RESUMES[job.variant][1]
        loaded = {records[r].get("loaded") for r in everyone}
        if loaded != {expected}:
            lost = loaded == {None} or min(str(x) for x in loaded) < expected
            return "lost" if lost else "wrong", f"resumed from {loaded}, expected {expected}"
        found, left = records[0]["found"], records[0]["left"]
        if job.variant == "ckpt_leftovers" and not any(".tmp-" in n for n in found):
            return "wrong", f"the crash left no temporary folder to sweep: {found}"
        if any(".tmp-" in n for n in left):
            return "wrong", f"leftovers not swept: {left}"
        step = int(expected.removeprefix("step_"))
        for r in everyone:
            rec = records[r]
            if rec["losses"] != rec["reference"][step:]:
                return "wrong", (
                    f"rank {r}: resumed losses {rec['losses']} != uninterrupted "
                    f"{rec['reference'][step:]}"
                )
            if rec["params"] != rec["reference_params"]:
                return "wrong", f"rank {r}: final parameters differ from the uninterrupted run"
        return "ok", f"found {found}, resumed from {expected}, left {left}"
    if kind == "ckpt_tampered":
        wrong = _all(records, everyone, "CheckpointCorruptError")
        if wrong:
            return wrong
        victim = records[0]["victim"]
        messages = {records[r]["message"] for r in everyone}
        if len(messages) != 1 or victim not in next(iter(messages)):
            return "wrong", f"the ranks' messages differ or do not name {victim}"
        if job.variant == "rank file" and any(
            records[r]["params"] != records[r]["before"] for r in everyone
        ):
            return "wrong", "the model changed although the rank file was refused first"
        return "clear", ""
    if kind == "ckpt_crash_between_renames":
        # rank 0 hosts the store: a survivor can name it, or say the store host died
        wrong = _all(records, [1], "RankFailedError")
        return wrong or _named(records, [1], (0, None))
    if kind == "ckpt_recover":
        wrong = _all(records, everyone, "finished")
        latest = {records[r].get("latest") for r in everyone}
        if latest == {None} or wrong:
            detail = wrong[1] if wrong else ""
            return "lost", f"no checkpoint found after the crash {_files(records)} {detail}"
        published = json.loads(Path(job.out, "published.json").read_text())
        if any(records[r].get("params") != published for r in everyone):
            return "lost", f"{latest} does not hold the last published values {_files(records)}"
        return "ok", ""
    if kind == "ckpt_dies_mid_save":
        others = [r for r in everyone if r != job.faulty]
        for r in others:
            if "reload_error" in records[r] or records[r].get("params") != records[r]["published"]:
                return "lost", f"rank {r}: {records[r].get('reload_error', 'other values')}"
        wrong = _all(records, others, "RankFailedError")
        return wrong or _named(records, others, (job.faulty,))
    raise AssertionError(kind)


# ------------------------------------------------------------------------------ running


@dataclass(frozen=True)
class Case:
    """One launched case: a row of the report's table."""

    row: str
    kind: str
    world: int
    variant: str = ""
    dies: bool = False  # the faulty rank's process dies
    faulty_from: tuple[int, ...] = (0, 1)  # drawn from these
    fault_at_start: bool = False  # the fault is the job's own input (no fault.json)
    all_die: bool = False  # every rank's process dies (then a second job resumes)


CASES: list[Case] = [
    Case("nonfinite='raise'", "nonfinite", 2, "raise"),
    Case("nonfinite='skip'", "nonfinite", 2, "skip"),
    Case("nonfinite='warn'", "nonfinite", 2, "warn"),
    *[
        Case("engine config refused", "engine_config", 2, variant, fault_at_start=True)
        for variant in ENGINE_CONFIGS
    ],
    Case("batch shape differs", "batch_shape_differs", 2, fault_at_start=True),
    Case("replicated weight differs", "replica_differs", 2, fault_at_start=True),
    Case("parallel layouts differ", "layouts_differ", 2, fault_at_start=True),
    Case("rank stopped (SIGSTOP)", "rank_stopped", 3, faulty_from=(1, 2)),
    Case("rank killed (SIGKILL)", "rank_killed", 3, dies=True, faulty_from=(1, 2)),
    Case("rank killed in initialize", "rank_killed_init", 3, dies=True, faulty_from=(1, 2)),
    Case("ckpt rank file tampered", "ckpt_tampered", 2, "rank file", fault_at_start=True),
    Case("ckpt .distcp tampered", "ckpt_tampered", 2, "distcp", fault_at_start=True),
    Case(
        "ckpt crash between renames", "ckpt_crash_between_renames", 2, dies=True, faulty_from=(0,)
    ),
    Case("ckpt rank dies mid-save", "ckpt_dies_mid_save", 2, dies=True, faulty_from=(1,)),
    Case("uneven data (len)", "uneven_data", 2, "len", fault_at_start=True),
    Case("uneven data (stream)", "uneven_data", 2, "stream", fault_at_start=True),
    Case("rank blocked in a read", "read_hangs", 3, faulty_from=(1, 2)),
    Case("ckpt full disk", "ckpt_disk_full", 2),
    Case("ckpt leftovers swept", "ckpt_leftovers", 2, all_die=True),
    Case("resume mid-accumulation", "ckpt_accumulation", 2, all_die=True),
    Case("stream epoch end", "stream_epochs", 3, faulty_from=(1, 2)),
    Case("preempted (SIGTERM)", "preempted", 2),
    Case("preempted, 2nd SIGTERM", "preempted_twice", 2, all_die=True),
]


@dataclass
class Outcome:
    """One case's verdict and fault-to-exit time."""

    case: Case
    label: str
    category: str
    detail: str
    seconds: float | None
    records: dict[int, dict[str, Any]]


#: The launcher's error when the rendezvous port was taken meanwhile (not the case's fault).
_PORT_TAKEN = "could not host the rendezvous store"


def _launch_job(
    runner: DistributedRunner, case: Case, job: Job, deaths: dict[int, str] | None = None
) -> tuple[Verdict | None, dict[int, dict[str, Any]]]:
    """Run ``job``; a hang or a rank lost outside the case (or None), and the records found.

    ``deaths`` receives the launcher's account of each rank that died, and the moment the
    launch returned (key -1, ``time.time()``).
    """
    problem: Verdict | None = None
    try:
        runner.run(case_job, case.world, args=(job,), init_process_group=False)
    except RankTimeoutError as err:
        problem = "hang", f"no answer within the bound: {str(err)[:300]}"
    except RankError as err:
        expected = set(range(case.world)) if case.all_die else {job.faulty}
        if not ((case.dies or case.all_die) and set(err.failures) == expected):
            problem = "wrong", f"a rank failed outside the case: {str(err)[-600:]}"
        if deaths is not None:
            deaths.update(err.failures)
    if deaths is not None:
        deaths[-1] = str(time.time())
    records = {
        int(p.stem.removeprefix("rank")): json.loads(p.read_text())
        for p in Path(job.out).glob("rank*.json")
    }
    return problem, records


def _fault_to_exit(case: Case, job: Job, records: dict[int, dict[str, Any]]) -> float | None:
    fault = Path(job.out, "fault.json")
    if case.fault_at_start:
        starts = [r["t_enter"] for r in records.values() if "t_enter" in r]
        start = max(starts) if len(starts) == case.world else None
    else:
        start = json.loads(fault.read_text())["t_fault"] if fault.exists() else None
    if start is None or not records:
        return None
    exits = [r["t_exit"] for r in records.values()]
    return max(exits) - start


def _mount_tmpfs(folder: Path) -> bool:
    """A 2 MiB tmpfs at ``folder`` (root only); whether it worked."""
    folder.mkdir(parents=True, exist_ok=True)
    if not hasattr(os, "geteuid") or os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    command = ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(folder)]
    return subprocess.run(command, capture_output=True, check=False).returncode == 0


def run_case(runner: DistributedRunner, case: Case, job: Job) -> Outcome:
    """Launch one case (and, after a crash or preemption, the job that resumes its folder).

    A full disk is a real one where this process may mount a small tmpfs (root), else an
    ENOSPC raised by the faulty rank's write (the label says which).
    """
    if case.kind != "ckpt_disk_full":
        return _run_case(runner, case, job)
    disk = Path(job.out, "disk")
    mounted = _mount_tmpfs(disk)
    try:
        return _run_case(runner, case, replace(job, variant="tmpfs" if mounted else "injected"))
    finally:
        if mounted:
            subprocess.run(["umount", str(disk)], capture_output=True, check=False)


def _run_case(runner: DistributedRunner, case: Case, job: Job) -> Outcome:
    label = f"{case.row}{f' [{case.variant}]' if case.kind == 'engine_config' else ''}"
    if case.kind == "ckpt_disk_full":
        label += f" [{job.variant}]"
    if case.dies or case.kind == "rank_stopped":
        label += f" (rank {job.faulty}, step {job.fault_step})"
    if case.kind in ("stream_epochs", "preempted"):
        label += f" (rank {job.faulty})"
    deaths: dict[int, str] = {}
    for _ in range(3):
        deaths.clear()
        problem, records = _launch_job(runner, case, job, deaths)
        if not any(_PORT_TAKEN in r.get("message", "") for r in records.values()):
            break
        # another job on this machine took the fresh rendezvous port: launch again
        for stale in [*Path(job.out).glob("rank*.json"), Path(job.out, "fault.json")]:
            stale.unlink(missing_ok=True)
    if problem is not None:
        return Outcome(case, label, *problem, None, records)
    if case.all_die:
        return _resume(runner, case, job, label, deaths)
    seconds = _fault_to_exit(case, job, records)
    category, detail = judge(case, job, case.world, records)
    if case.kind == "preempted" and category == "preempted":
        resumed = _resume(runner, case, job, label, deaths)
        if resumed.category != "ok":
            return resumed
        detail = f"saved {records[0]['saved']}; {resumed.detail}"
    if category in ("clear", "ok") and seconds is None and case.kind != "nonfinite":
        category, detail = "wrong", "no fault time recorded: the fault did not happen"
    if case.kind == "ckpt_crash_between_renames" and category == "clear":
        published = records[1]["published"]
        Path(job.out, "published.json").write_text(json.dumps(published))
        recovery = Job("ckpt_recover", job.faulty, 0, job.out, job.timeout, job.beat)
        for name in [f"rank{r}.json" for r in range(case.world)]:
            Path(job.out, name).unlink(missing_ok=True)
        problem, after = _launch_job(runner, Case(case.row, "ckpt_recover", 2), recovery)
        if problem is not None:
            return Outcome(case, label, problem[0], f"resuming: {problem[1]}", seconds, after)
        resumed, why = judge(case, recovery, case.world, after)
        if resumed != "ok":
            return Outcome(case, label, resumed, why, seconds, after)
        detail = f"resumed from {after[0]['latest']}, pruned {after[0]['pruned']}"
    return Outcome(case, label, category, detail, seconds, records)


def _resume(
    runner: DistributedRunner, case: Case, job: Job, label: str, deaths: dict[int, str]
) -> Outcome:
    """After a job that every rank left by SIGKILL or a signal: launch the resumed job.

    The time is from the fault to the moment the launcher saw every rank gone.
    """
    fault = Path(job.out, "fault.json")
    if not fault.exists():
        return Outcome(case, label, "wrong", "the fault did not happen", None, {})
    t_fault = json.loads(fault.read_text())["t_fault"]
    seconds = float(deaths[-1]) - t_fault
    if case.kind == "preempted":
        seconds = None  # the preemption job's own records time it
    if case.kind == "preempted_twice":
        statuses = {r: text for r, text in deaths.items() if r >= 0}
        if not all("exit code 143" in text for text in statuses.values()):
            detail = "; ".join(f"rank {r}: {text[-200:]}" for r, text in statuses.items())
            return Outcome(case, label, "wrong", f"expected exit 143: {detail}", seconds, {})
    for name in [f"rank{r}.json" for r in range(case.world)]:
        Path(job.out, name).unlink(missing_ok=True)
    resume = Job("ckpt_resume", job.faulty, 0, job.out, job.timeout, job.beat, case.kind)
    problem, after = _launch_job(runner, Case(case.row, "ckpt_resume", case.world), resume)
    if problem is not None:
        return Outcome(case, label, problem[0], f"resuming: {problem[1]}", seconds, after)
    category, detail = judge(case, resume, case.world, after)
    return Outcome(case, label, category, detail, seconds, after)
