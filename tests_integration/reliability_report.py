"""tessera's reliability report: hostile configs, injected faults, hangs, wrong results.

    python tests_integration/reliability_report.py [--configs 2000] [--repeats 1] [--seed 0]

(``nox -s reliability``.) Three parts, each bounded in time:

1. **Hostile configs.** Random ``parallel`` blocks and world sizes (sizes of every type,
   huge and negative numbers, NaN, typos, nested junk, as the hypothesis tests draw them) go
   through ``ParallelConfig.from_dict``; random ``build`` configs through
   ``tessera.registry.build``. The only acceptable outcomes are a valid result (checked
   against the invariants the rest of tessera relies on) or a ``ConfigError``. Any other
   exception, or an accepted config that breaks an invariant, is a *wrong result*; a call
   that takes longer than ``--config-deadline`` seconds (interrupted by ``SIGALRM``) is a
   *hang*.
2. **Injected faults** on real gloo ranks (``tessera.testing.DistributedRunner``, each job
   launched with ``launch_from_torch`` with a short collective timeout and fast heartbeats):
   a rank raising mid-step, a rank dying (``os._exit``) mid-step, a rank raising in a
   data x pipeline hybrid, a ``TENSOR_SHAPE`` that differs on one rank, a ``TENSOR_SHAPE``
   wrong on every rank, a model built differently on one rank, plus a healthy control run.
   Every surviving rank must stop with the documented error (``RankFailedError`` naming the
   failed rank, or the same ``ValueError`` everywhere); a survivor that finishes as if
   nothing happened, or names the wrong rank, is a *wrong result*; a job that outlives its
   bound is a *hang*. The *detection time* is measured on the survivors from the moment of
   the fault (the faulty rank's clock, same machine) or, for mismatches, from the moment the
   last rank entered ``initialize``.
3. **Round two** (issue #18, ``reliability_cases.py``), each case one launched job on 2-3
   ranks: ``nonfinite="raise"`` (NonFiniteError on every rank naming the step and the rank
   whose loss went NaN, no parameter updated), ``"skip"`` and ``"warn"`` (every rank skips
   that step alike); seven engine configs that must be a ConfigError (near-miss keys, NaN
   numbers, fp16 with bf16, an unknown schedule, ``sequence_paralel`` under
   ``parallel.tensor``); a batch shape differing on one rank on the first step; a replicated
   weight differing on one tensor rank; ``parallel`` layouts differing per rank; a rank stopped
   (SIGSTOP), killed (SIGKILL) mid-step, or killed while the others are in ``initialize``;
   checkpoints: a tampered ``rank_*.pt`` and ``.distcp`` (CheckpointCorruptError on every
   rank naming the file), a crash between the two renames of an overwriting publish (then a
   newer damaged checkpoint, ``prune_checkpoints(keep_last=1)`` and ``latest_checkpoint``
   must still resume the last published values), a rank dying mid-save (named; the previous
   checkpoint intact). Issue 40 adds, through the Trainer and its checkpoint hooks: uneven
   data, a read that hangs, a full disk in a save (a real tmpfs when this process may mount
   one), a save's leftovers swept at restart, a resume of a job killed mid-accumulation, an
   IterableDataset's epoch end, SIGTERM to one rank and a second SIGTERM in its save (each
   resume compared bitwise with an uninterrupted run).
4. **The report**: a table with, per case, the cases tried, clear errors, wrong results, hangs,
   wrong rank named, checkpoints lost, preemptions saved and the worst time from the fault to
   the last rank's exit. The goal row is 0 / 0 / 0 / 0 and a worst time under ``--exit-bound``
   (15 s; a preemption's signal to exit under ``--save-bound``, 30 s); the exit status is 1
   otherwise.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as tdist
from torch import nn

from tessera.context import (
    TENSOR_MODES,
    ConfigError,
    ParallelConfig,
    ParallelMode,
    RankFailedError,
    launch_from_torch,
    rank_groups,
)
from tessera.engine import initialize
from tessera.pipeline import build_pipeline_model
from tessera.registry import Registry, build
from tessera.testing import DistributedRunner, RankError, RankTimeoutError

sys.path.insert(0, str(Path(__file__).parent))
import reliability_cases as cases  # next to this script

# ------------------------------------------------------------------------------ hostile configs


class _Hang(Exception):
    """Raised by SIGALRM inside a config call that took too long."""


@contextmanager
def _deadline(seconds: float) -> Iterator[None]:
    def _alarm(signum: int, frame: Any) -> None:
        raise _Hang()

    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _scalar(rng: random.Random) -> Any:
    return rng.choice(
        [
            lambda: None,
            lambda: rng.random() < 0.5,
            lambda: rng.randint(-3, 70),
            lambda: rng.randint(-(2**70), 2**70),
            lambda: rng.choice([math.nan, math.inf, -math.inf, 0.5, 2.0, -1.0]),
            lambda: "".join(rng.choice("ab1d .-_\x00") for _ in range(rng.randint(0, 6))),
            lambda: rng.choice(["2", "1d", "2d", "2.5d", "3d", "sequence", "4", "size"]),
        ]
    )()


def _value(rng: random.Random, depth: int = 0) -> Any:
    roll = rng.random()
    if depth >= 2 or roll < 0.6:
        return _scalar(rng)
    if roll < 0.8:
        return [_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    keys = [_scalar(rng) for _ in range(rng.randint(0, 3))]
    return {k if isinstance(k, (str, int)) else str(k): _value(rng, depth + 1) for k in keys}


def _size(rng: random.Random) -> Any:
    return rng.randint(1, 8) if rng.random() < 0.6 else _value(rng)


def _tensor_block(rng: random.Random) -> Any:
    if rng.random() < 0.3:
        return _size(rng)
    block: dict[str, Any] = {}
    if rng.random() < 0.9:
        block["size"] = (
            rng.choice([1, 2, 4, 8, 9, 16, 27, 64]) if rng.random() < 0.7 else _value(rng)
        )
    if rng.random() < 0.9:
        block["mode"] = rng.choice([None, *TENSOR_MODES]) if rng.random() < 0.7 else _value(rng)
    if rng.random() < 0.4:
        block["depth"] = rng.randint(0, 4) if rng.random() < 0.7 else _value(rng)
    if rng.random() < 0.1:
        block["sequence_parallel"] = _value(rng)
    return block


def random_parallel(rng: random.Random) -> tuple[Any, Any]:
    """A random ``parallel`` block and world size, most of them almost right."""
    roll = rng.random()
    if roll < 0.05:
        parallel: Any = None
    elif roll < 0.15:
        parallel = _value(rng)
    else:
        parallel = {}
        for key in ("data", "pipeline"):
            if rng.random() < 0.6:
                parallel[key] = _size(rng) if rng.random() < 0.8 else {"size": _size(rng)}
        if rng.random() < 0.7:
            parallel["tensor"] = _tensor_block(rng)
        if rng.random() < 0.05:
            parallel["extra"] = _value(rng)
        if rng.random() < 0.05:
            parallel["pipline"] = _value(rng)  # a typo
    if isinstance(parallel, dict) and rng.random() < 0.7:
        # the world size the block asks for, when it is computable: the accepted path
        world: Any = 1
        for key in ("data", "pipeline"):
            entry = parallel.get(key, 1)
            entry = entry.get("size", 1) if isinstance(entry, dict) else entry
            world = world * entry if isinstance(entry, int) and not isinstance(entry, bool) else 0
        tensor = parallel.get("tensor", 1)
        tensor = tensor.get("size", 1) if isinstance(tensor, dict) else tensor
        is_int = isinstance(tensor, int) and not isinstance(tensor, bool)
        world = world * tensor if is_int else rng.randint(1, 64)
        world = world if isinstance(world, int) and 0 < world <= 4096 else rng.randint(1, 64)
    else:
        world = rng.choice(
            [rng.randint(1, 64), rng.randint(-2, 0), True, 2.0, "4", None, 2**65, math.nan]
        )
    return parallel, world


#: The outcome of one hostile config that kept the contract: refused with a ConfigError.
REFUSED = "refused"


def _check_parallel(parallel: Any, world: Any) -> str | None:
    """None: ``from_dict`` accepted a valid block; ``REFUSED``: a clear ConfigError; else why."""
    try:
        config = ParallelConfig.from_dict(parallel, world)
    except ConfigError as err:
        return REFUSED if str(err) else "ConfigError without a message"
    if config.world_size != world:
        return f"world size {config.world_size} != {world}"
    if config.data_size * config.pipeline_size * config.tensor_size != world:
        return "data * pipeline * tensor != world size"
    if config.tensor_mode not in (None, *TENSOR_MODES):
        return f"tensor mode {config.tensor_mode!r}"
    if config.tensor_size > 1 and config.tensor_mode is None:
        return "tensor size > 1 without a mode"
    if config.extra:
        return None  # user initializers are looked up by name
    for mode, groups in rank_groups(config).items():
        members = [rank for group in groups for rank in group]
        if len(members) != len(set(members)) or not set(members) <= set(range(world)):
            return f"the {mode} groups are not disjoint ranks of 0..{world - 1}"
    return None


PARTS: Registry[Any] = Registry("reliability_parts")


@PARTS.register
class Point:
    """A component with a required argument."""

    def __init__(self, x: Any, y: Any = 0) -> None:
        self.x, self.y = x, y


@PARTS.register
class Bag:
    """A component taking any keywords."""

    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs


@PARTS.register(name="Nested")
class NestedPart:
    """A component holding other components, with a keyword-only flag."""

    def __init__(self, child: Any = None, items: Any = (), *, flag: Any = False) -> None:
        self.child, self.items, self.flag = child, items, flag


def random_build_config(rng: random.Random, depth: int = 0) -> Any:
    """A random ``build`` config: known and unknown types, keys, nesting and junk."""
    if rng.random() < 0.1:
        return _value(rng)
    cfg: dict[Any, Any] = {}
    if rng.random() < 0.9:
        names = ["Point", "Bag", "Nested", "Nope", ""]
        cfg["type"] = rng.choice(names) if rng.random() < 0.85 else _value(rng)
    for _ in range(rng.randint(0, 3)):
        key = rng.choice(["x", "y", "child", "items", "flag", "type", "kwargs", 3, ""])
        roll = rng.random()
        if depth < 2 and roll < 0.3:
            cfg[key] = random_build_config(rng, depth + 1)
        elif depth < 2 and roll < 0.4:
            cfg[key] = [random_build_config(rng, depth + 1) for _ in range(rng.randint(0, 2))]
        else:
            cfg[key] = _value(rng)
    return cfg


def _check_build(cfg: Any) -> str | None:
    try:
        build(cfg, PARTS)
    except ConfigError as err:
        return REFUSED if str(err) else "ConfigError without a message"
    return None


@dataclass
class Tally:
    """What happened, by category."""

    tried: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    hangs: list[str] = field(default_factory=list)
    wrong: list[str] = field(default_factory=list)
    detection: list[tuple[float, str]] = field(default_factory=list)
    #: table row -> category (clear, ok, wrong, hang, wrong_rank, lost) -> count
    rows: dict[str, Counter[str]] = field(default_factory=dict)
    #: table row -> (worst seconds from the fault to the last rank's exit, the case)
    worst: dict[str, tuple[float, str]] = field(default_factory=dict)

    def add(self, row: str, category: str, seconds: float | None = None, label: str = "") -> None:
        """Count one case of ``row``."""
        self.rows.setdefault(row, Counter())[category] += 1
        if seconds is not None and seconds > self.worst.get(row, (-1.0, ""))[0]:
            self.worst[row] = (seconds, label)


def hostile_configs(count: int, seed: int, deadline: float, tally: Tally) -> None:
    """``count`` random parallel blocks and ``count`` random build configs."""
    rng = random.Random(seed)
    checks: list[tuple[str, Callable[[], tuple[Any, Callable[[], str | None]]]]] = [
        ("parallel", lambda: _parallel_case(rng)),
        ("build", lambda: _build_case(rng)),
    ]
    for kind, draw in checks:
        for _ in range(count):
            case, check = draw()
            tally.tried += 1
            row = f"hostile {kind} configs"
            try:
                with _deadline(deadline):
                    problem = check()
            except _Hang:
                tally.hangs.append(f"{kind} {case!r}: no answer within {deadline:g} s")
                tally.add(row, "hang")
                continue
            except Exception as err:
                problem = f"{type(err).__name__}: {err}"
            if problem is None:
                tally.outcomes[f"{kind} accepted"] += 1
                tally.add(row, "ok")
            elif problem == REFUSED:
                tally.outcomes[f"{kind} refused"] += 1
                tally.add(row, "clear")
            else:
                tally.wrong.append(f"{kind} {case!r}: {problem}"[:500])
                tally.add(row, "wrong")


def _parallel_case(rng: random.Random) -> tuple[Any, Callable[[], str | None]]:
    parallel, world = random_parallel(rng)
    return (parallel, world), lambda: _check_parallel(parallel, world)


def _build_case(rng: random.Random) -> tuple[Any, Callable[[], str | None]]:
    cfg = random_build_config(rng)
    return cfg, lambda: _check_build(cfg)


# ------------------------------------------------------------------------------ injected faults

STEPS = 3
BATCH = 8
MICRO = 2


class _Fault(nn.Module):
    """Identity, except on the faulty rank once armed: raise or die, noting the time first."""

    def __init__(self) -> None:
        super().__init__()
        self.action: str | None = None  # "raise" | "exit", set by the loop when due
        self.note: Callable[[], None] = lambda: None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.action is not None:
            self.note()
            if self.action == "exit":
                os._exit(3)
            raise ValueError(f"injected fault on rank {tdist.get_rank()}")
        return x


def _model(width: int = 8) -> nn.Sequential:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        # 6 layers, cut [0, 3, 6] under a pipeline: a fault layer in each stage
        return nn.Sequential(
            nn.Linear(4, width), _Fault(), nn.Tanh(), nn.Linear(width, 3), _Fault(), nn.Identity()
        )


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, 4, generator=g), torch.randint(0, 3, (BATCH,), generator=g)


#: kind -> (world size, parallel block)
SCENARIOS: dict[str, tuple[int, dict[str, Any]]] = {
    "healthy": (2, {}),
    "raise": (2, {}),
    "exit": (2, {}),
    "hybrid_raise": (4, {"data": 2, "pipeline": 2}),
    "tensor_shape_differs": (2, {"pipeline": 2}),
    "tensor_shape_wrong": (2, {"pipeline": 2}),
    "model_differs": (2, {}),
}


def _fault_job(
    kind: str, faulty: int, fault_step: int, out: str, timeout: float, beat: float
) -> dict[str, Any]:
    """One job on every rank; writes and returns what this rank saw."""
    cases._warm_up()  # no first import under way once heartbeats run
    rank = int(os.environ["RANK"])
    parallel = SCENARIOS[kind][1]
    config: dict[str, Any] = {"parallel": parallel}
    if parallel.get("pipeline", 1) > 1:
        config["NUM_MICRO_BATCHES"] = MICRO
        micro = BATCH // parallel.get("data", 1) // MICRO
        shape = [micro, 8]  # stage 0's output per microbatch
        if kind == "tensor_shape_differs" and rank == faulty:
            shape = [micro, 9]
        if kind == "tensor_shape_wrong":
            shape = [micro, 7]
        config["TENSOR_SHAPE"] = shape
    record: dict[str, Any] = {"rank": rank, "kind": kind}

    def note() -> None:
        record["t_fault"] = time.time()
        Path(out, "fault.json").write_text(json.dumps({"t_fault": record["t_fault"]}))

    ctx = launch_from_torch(config, timeout=timeout, heartbeat_interval=beat)
    try:
        model = _model(width=9 if kind == "model_differs" and rank == faulty else 8)
        stage: Any = model
        if ctx.pipeline_size > 1:
            stage = build_pipeline_model(model, 1, method=[0, 3, 6], context=ctx)
        faults = [m for m in stage.modules() if isinstance(m, _Fault)]
        for fault in faults:
            fault.note = note
        data_rank, data_size = ctx.get_local_rank(ParallelMode.DATA), ctx.data_size
        part = BATCH // data_size
        record["t_enter"] = time.time()
        try:
            engine, *_ = initialize(
                stage,
                torch.optim.SGD(stage.parameters(), lr=0.1),
                nn.CrossEntropyLoss(),
                config=config,
                context=ctx,
            )
            for step in range(STEPS):
                due = rank == faulty and step == fault_step
                if due and kind in ("raise", "exit", "hybrid_raise"):
                    faults[0].action = "exit" if kind == "exit" else "raise"
                x, y = _batch(step)
                mine = slice(data_rank * part, (data_rank + 1) * part)
                engine.zero_grad()
                engine.execute_schedule(iter([(x[mine], y[mine])]))
                engine.step()
            record["outcome"] = "finished"
            record["checksum"] = float(
                sum(p.detach().double().sum() for p in engine.module.parameters())
            )
        except RankFailedError as err:
            record.update(outcome="RankFailedError", failed=err.rank, message=str(err)[:300])
        except ValueError as err:
            record.update(outcome="ValueError", message=str(err)[:300])
        record["t_detect"] = time.time()
    finally:
        ctx.destroy()
    record["t_exit"] = time.time()
    Path(out, f"rank{rank}.json").write_text(json.dumps(record))
    return record


#: How ``_judge`` starts a problem that is a wrong rank named.
WRONG_RANK = "wrong rank: "


def _judge(kind: str, faulty: int, world: int, records: dict[int, dict[str, Any]]) -> str | None:
    """None when every rank did what the contract says, else the first violation."""
    survivors = [r for r in range(world) if not (kind == "exit" and r == faulty)]
    for r in survivors:
        if r not in records:
            return f"rank {r} reported nothing"
    got = {r: records[r]["outcome"] for r in survivors}
    if kind == "healthy":
        sums = {records[r]["checksum"] for r in survivors if "checksum" in records[r]}
        if set(got.values()) != {"finished"} or len(sums) != 1:
            return f"healthy run: {got}, parameter checksums {sums}"
        return None
    if kind in ("raise", "exit", "hybrid_raise"):
        for r in survivors:
            if r == faulty:
                if got[r] != "ValueError":
                    return f"the faulty rank {r} ended with {got[r]}"
                continue
            named = records[r].get("failed")
            ok_names = (faulty, None) if kind == "exit" else (faulty,)
            if got[r] != "RankFailedError":
                return f"rank {r}: {got[r]}, expected RankFailedError"
            if named not in ok_names:
                return f"{WRONG_RANK}rank {r} named rank {named}, expected rank {faulty}"
        return None
    if kind in ("tensor_shape_differs", "model_differs"):
        if set(got.values()) != {"ValueError"}:
            return f"expected the same ValueError on every rank, got {got}"
        return None
    if kind == "tensor_shape_wrong":
        if "finished" in got.values() or "ValueError" not in got.values():
            return f"expected a ValueError on the sender and no finished rank, got {got}"
        return None
    raise AssertionError(kind)


def _exit_seconds(
    kind: str, faulty: int, records: dict[int, dict[str, Any]], t_fault: float | None
) -> float:
    """From the fault to the last rank's exit (a rank that died exits at the fault)."""
    if kind in ("tensor_shape_differs", "model_differs", "tensor_shape_wrong"):
        start = max(r["t_enter"] for r in records.values())
    else:
        assert t_fault is not None
        start = t_fault
    return max(r["t_exit"] for r in records.values()) - start


def _detection_seconds(
    kind: str, faulty: int, records: dict[int, dict[str, Any]], t_fault: float | None
) -> float:
    if kind in ("tensor_shape_differs", "model_differs"):
        start = max(r["t_enter"] for r in records.values())
    elif kind == "tensor_shape_wrong":
        start = max(r["t_enter"] for r in records.values())  # the first step's send
    else:
        if t_fault is None:
            raise AssertionError(f"{kind}: the faulty rank noted no fault; records {records}")
        start = t_fault
    return max(r["t_detect"] - start for rank, r in records.items() if rank != faulty) + 0.0


def injected_faults(
    runner: DistributedRunner,
    repeats: int,
    seed: int,
    timeout: float,
    beat: float,
    tally: Tally,
    log: Callable[[str], None],
) -> int:
    """Every scenario ``repeats`` times (random faulty rank and step); returns faults injected."""
    rng = random.Random(seed)
    injected = 0
    for _ in range(repeats):
        for kind, (world, _) in SCENARIOS.items():
            faulty, fault_step = rng.randrange(world), rng.randrange(STEPS)
            if kind == "tensor_shape_wrong":
                faulty = 0  # the sender finds out; the fault is everyone's
            with tempfile.TemporaryDirectory() as out:
                started = time.monotonic()
                try:
                    runner.run(
                        _fault_job,
                        world,
                        args=(kind, faulty, fault_step, out, timeout, beat),
                        init_process_group=False,
                    )
                except RankTimeoutError as err:
                    tally.hangs.append(f"{kind} (rank {faulty}, step {fault_step}): {err}")
                    tally.add(kind, "hang")
                    continue
                except RankError as err:
                    if kind != "exit":
                        tally.wrong.append(f"{kind}: a rank failed unexpectedly: {err}"[-1500:])
                        tally.add(kind, "wrong")
                        continue
                fault_file = Path(out, "fault.json")
                t_fault = (
                    json.loads(fault_file.read_text())["t_fault"] if fault_file.exists() else None
                )
                records = {
                    int(p.stem.removeprefix("rank")): json.loads(p.read_text())
                    for p in Path(out).glob("rank*.json")
                }
                elapsed = time.monotonic() - started
            problem = _judge(kind, faulty, world, records)
            if kind != "healthy":
                injected += 1
            label = f"{kind} (rank {faulty}, step {fault_step})"
            if problem is not None:
                tally.wrong.append(f"{label}: {problem}")
                log(f"  {label}: WRONG: {problem}")
                tally.add(kind, "wrong_rank" if problem.startswith(WRONG_RANK) else "wrong")
                continue
            tally.outcomes[f"fault {kind} ok"] += 1
            if kind == "healthy":
                log(f"  {label}: all ranks finished alike ({elapsed:.1f} s)")
                tally.add(kind, "ok")
                continue
            seconds = _detection_seconds(kind, faulty, records, t_fault)
            to_exit = _exit_seconds(kind, faulty, records, t_fault)
            tally.detection.append((seconds, label))
            tally.add(kind, "clear", to_exit, label)
            log(
                f"  {label}: detected in {seconds:.2f} s, every rank out in {to_exit:.2f} s "
                f"({elapsed:.1f} s in all)"
            )
    return injected


# ------------------------------------------------------------------------------ round two


def round_two(
    runner: DistributedRunner,
    repeats: int,
    seed: int,
    timeout: float,
    beat: float,
    tally: Tally,
    log: Callable[[str], None],
) -> None:
    """Every case of ``reliability_cases.CASES`` ``repeats`` times, each launched for real."""
    rng = random.Random(seed + 1)
    for _ in range(repeats):
        for case in cases.CASES:
            faulty, fault_step = rng.choice(case.faulty_from), rng.randrange(cases.STEPS)
            with tempfile.TemporaryDirectory() as out:
                job = cases.Job(case.kind, faulty, fault_step, out, timeout, beat, case.variant)
                started = time.monotonic()
                got = cases.run_case(runner, case, job)
                elapsed = time.monotonic() - started
            tally.add(case.row, got.category, got.seconds, got.label)
            seconds = "-" if got.seconds is None else f"{got.seconds:.2f} s"
            log(
                f"  {got.label}: {got.category}, fault to every rank's exit {seconds} "
                f"({elapsed:.1f} s in all) {got.detail}"[:300]
            )
            if got.category in ("clear", "ok", "preempted"):
                continue
            ranks = "; ".join(
                f"rank {r}: {rec.get('outcome')} {rec.get('message', '')}"[:400]
                for r, rec in sorted(got.records.items())
            )
            line = f"{got.label}: {got.category}: {got.detail} [{ranks}]"
            (tally.hangs if got.category == "hang" else tally.wrong).append(line[:2500])


# ------------------------------------------------------------------------------ the report

#: The table's columns: heading, categories counted.
COLUMNS: list[tuple[str, tuple[str, ...]]] = [
    ("tried", ("clear", "ok", "preempted", "wrong", "hang", "wrong_rank", "lost")),
    ("clear err", ("clear",)),
    ("ran ok", ("ok",)),
    ("wrong", ("wrong",)),
    ("hangs", ("hang",)),
    ("wrong rank", ("wrong_rank",)),
    ("ckpt lost", ("lost",)),
    ("preempt saved", ("preempted",)),
]


def _cells(counts: Counter[str]) -> str:
    return "  ".join(
        f"{sum(counts[c] for c in cats):>{13 if h == 'preempt saved' else 10}}"
        for h, cats in COLUMNS
    )


def _too_slow(tally: Tally, exit_bound: float, save_bound: float) -> list[str]:
    """Rows whose worst fault-to-exit time missed its bound (a preemption: ``save_bound``)."""
    slow = []
    for row, (seconds, label) in tally.worst.items():
        bound = save_bound if tally.rows[row]["preempted"] else exit_bound
        if seconds >= bound:
            slow.append(f"{label}: {seconds:.2f} s >= {bound:g} s")
    return slow


def table(tally: Tally) -> list[str]:
    """The summary table: one row per case, then the total (the goal row)."""
    width = max(len(row) for row in [*tally.rows, "total (goal: 0/0/0/0, worst < bound)"])
    head = "  ".join(f"{h:>13}" if h == "preempt saved" else f"{h:>10}" for h, _ in COLUMNS)
    lines = [f"{'case':<{width}}  {head}  {'worst fault->exit':>17}"]
    total: Counter[str] = Counter()
    for row, counts in tally.rows.items():
        total += counts
        cells = _cells(counts)
        worst = tally.worst.get(row)
        lines.append(f"{row:<{width}}  {cells}  {f'{worst[0]:.2f} s' if worst else '-':>17}")
    cells = _cells(total)
    worst_all = max(tally.worst.values(), default=None)
    lines.append("-" * len(lines[0]))
    worst_text = f"{worst_all[0]:.2f} s" if worst_all else "-"
    lines.append(f"{'total':<{width}}  {cells}  {worst_text:>17}")
    return lines


def main(argv: list[str] | None = None) -> int:
    """Run everything, print the report, return the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", type=int, default=2000, help="random configs of each kind")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each fault scenario")
    parser.add_argument("--case-repeats", type=int, default=1, help="runs of each round-2 case")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=4.0, help="collective timeout (s)")
    parser.add_argument("--heartbeat", type=float, default=0.5, help="heartbeat interval (s)")
    parser.add_argument("--config-deadline", type=float, default=2.0, help="per config (s)")
    parser.add_argument(
        "--exit-bound", type=float, default=15.0, help="goal: fault to every rank's exit (s)"
    )
    parser.add_argument(
        "--save-bound", type=float, default=30.0, help="goal: a preempted job's save and exit (s)"
    )
    parser.add_argument(
        "--cases",
        default=None,
        help="run only the launched cases whose row contains one of these comma-separated "
        "texts (no hostile configs, no round one)",
    )
    args = parser.parse_args(argv)
    if args.cases is not None:
        wanted = [w.strip() for w in args.cases.split(",") if w.strip()]
        cases.CASES[:] = [c for c in cases.CASES if any(w in c.row for w in wanted)]
        args.configs, args.repeats = 0, 0
    torch.set_num_threads(1)

    def log(line: str) -> None:
        print(line, flush=True)

    tally = Tally()
    start = time.monotonic()
    log(f"hostile configs: {args.configs} parallel blocks + {args.configs} build configs ...")
    hostile_configs(args.configs, args.seed, args.config_deadline, tally)
    configs_tried = tally.tried
    log(
        f"  {configs_tried} tried in {time.monotonic() - start:.1f} s: "
        f"{dict(sorted(tally.outcomes.items()))}"
    )
    bound = 3 * args.timeout + 60.0  # a job's whole life: startup on busy cores, faults, teardown
    with DistributedRunner(
        timeout=bound, failure_grace=2 * args.timeout + 10.0, startup_timeout=240.0
    ) as runner:
        log(
            f"injected faults: {len(SCENARIOS)} scenarios x {args.repeats}, collective timeout "
            f"{args.timeout:g} s, heartbeat {args.heartbeat:g} s ..."
        )
        faults = injected_faults(
            runner, args.repeats, args.seed, args.timeout, args.heartbeat, tally, log
        )
        log(f"round two: {len(cases.CASES)} launched cases x {args.case_repeats} ...")
        round_two(runner, args.case_repeats, args.seed, args.timeout, args.heartbeat, tally, log)
    worst = max(tally.detection, default=(math.nan, "-"))
    worst_exit = max(
        (w for row, w in tally.worst.items() if not tally.rows[row]["preempted"]),
        default=(math.nan, "-"),
    )
    failed = sum(
        counts[c] for counts in tally.rows.values() for c in ("wrong", "hang", "wrong_rank", "lost")
    )
    slow = _too_slow(tally, args.exit_bound, args.save_bound)
    too_slow = bool(slow)
    preempt_rows = [row for row, counts in tally.rows.items() if counts["preempted"]]
    worst_save = max((tally.worst[row] for row in preempt_rows if row in tally.worst), default=None)
    log("")
    log("tessera reliability report")
    log("")
    for line in table(tally):
        log(f"  {line}")
    log("")
    log(f"  hostile configs tried      {configs_tried}")
    launched = len(cases.CASES) * args.case_repeats
    log(f"  faults injected            {faults} (round one) + {launched} cases (round two)")
    log(f"  worst detection time       {worst[0]:.2f} s ({worst[1]})")
    log(
        f"  worst fault to last exit   {worst_exit[0]:.2f} s ({worst_exit[1]}); "
        f"goal < {args.exit_bound:g} s: {'MISSED' if worst_exit[0] >= args.exit_bound else 'met'}"
    )
    if worst_save is not None:
        log(
            f"  preempted: signal to exit   {worst_save[0]:.2f} s ({worst_save[1]}); "
            f"goal < {args.save_bound:g} s: "
            f"{'met' if worst_save[0] < args.save_bound else 'MISSED'}"
        )
    for line in slow:
        log(f"  too slow: {line}")
    log(f"  collective timeout         {args.timeout:g} s, heartbeat {args.heartbeat:g} s")
    log(f"  total time                 {time.monotonic() - start:.1f} s")
    log(f"  goal row                   {'MISSED' if failed or too_slow else 'met'}")
    for line in tally.hangs:
        log(f"HANG: {line}")
    for line in tally.wrong:
        log(f"WRONG: {line}")
    return 1 if failed or too_slow else 0


if __name__ == "__main__":
    sys.exit(main())
