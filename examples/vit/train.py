"""Train the ViT on scikit-learn's digits under any parallel layout.

    torchrun --nproc-per-node 4 examples/vit/train.py --config examples/vit/configs/2d.py

Reliability options (see examples/README.md): ``--checkpoint-dir DIR`` saves every
``--checkpoint-interval`` steps and resumes from the newest intact checkpoint there, so a job
restarted by ``torchrun --max-restarts`` continues by itself; ``--timeout`` and ``--heartbeat``
set the collective timeout and heartbeat interval (seconds) that bound how long the other ranks
wait on a failed one; ``--max-steps`` stops early without changing the lr schedule;
``--kill-rank R --kill-at-step S`` makes rank R exit abruptly after step S on the first attempt
only (fault injection for the elastic-restart test). The display rank ends with one line
``final: step N loss L test_loss T`` (floats in ``repr``, so equal runs print equal text).

Every layout starts from the same full weights: every rank builds the plain single-process model
from the config's seed *before* launching (no context yet, so the dispatching layers are plain
torch), then ``load_full_state_dict`` gives each rank its block of it (by name for a pipeline
stage). Data order follows the same seed, so under every layout the job sees the same batches.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from data import digits
from model import ViTAccuracy, ViTLoss, build_vit
from toolkit.run import (
    LossRecorder,
    load_config,
    load_into,
    parse_args,
    warmup_cosine,
    write_result,
)
from toolkit.transformer import to_ring_layout

from tessera.context import launch_from_torch
from tessera.engine import (
    AccuracyHook,
    BaseHook,
    LoadCheckpointHook,
    LogMetricByEpochHook,
    LossHook,
    LRSchedulerHook,
    SaveCheckpointHook,
    ThroughputHook,
    Trainer,
    get_dataloader,
    initialize,
)
from tessera.pipeline import build_pipeline_model

#: What a config file does not set. Config files hold the `parallel` block and engine keys.
DEFAULTS: dict[str, Any] = dict(
    seed=42,
    model=dict(
        img_size=8,
        patch_size=2,
        in_chans=1,
        num_classes=10,
        hidden=32,
        depth=2,
        heads=4,
        mlp_ratio=2,
        dropout=0.0,
        pos_std=0.5,
    ),
    train=dict(
        batch_size=64,  # global: divided over the data-parallel ranks
        test_batch_size=128,
        steps=66,  # 3 epochs of 22 batches
        lr=1e-2,
        weight_decay=0.05,
        warmup=6,
    ),
)


def reliability_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """The checkpoint, timeout and fault-injection options; the rest goes to ``parse_args``."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--checkpoint-dir", help="save here and resume from the newest one")
    parser.add_argument("--checkpoint-interval", type=int, default=2, help="steps between saves")
    parser.add_argument("--max-steps", type=int, help="stop after this many steps in all")
    parser.add_argument("--timeout", type=float, help="collective timeout, seconds")
    parser.add_argument("--heartbeat", type=float, help="heartbeat interval, seconds")
    parser.add_argument("--kill-rank", type=int, help="fault injection: the rank that dies")
    parser.add_argument("--kill-at-step", type=int, help="... right after this global step")
    return parser.parse_known_args(argv)


class KillOnce(BaseHook):
    """Fault injection: ``os._exit`` on one rank after one step, on torchrun's first attempt.

    Runs after ``SaveCheckpointHook`` (priority 100), like a crash between two steps. The
    process dies without raising, so nothing is posted to the failure board: the other ranks
    find out from a closed connection or their collective timeout, and torchrun, seeing a
    worker exit non-zero, stops the rest and restarts the job (``--max-restarts``).
    """

    def __init__(self, rank: int, step: int) -> None:
        super().__init__(priority=200)
        self.rank, self.step = rank, step

    def after_train_iter(self, trainer: Trainer, output: Any, label: Any, loss: Any) -> None:
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        ctx = trainer.engine.context
        rank = ctx.global_rank if ctx is not None else 0
        if first_attempt and rank == self.rank and trainer.global_step == self.step:
            print(f"fault injection: rank {rank} exits after step {self.step}", flush=True)
            os._exit(17)


def main() -> None:
    extra, rest = reliability_args(sys.argv[1:])
    args = parse_args(__doc__.splitlines()[0], rest)
    cfg = load_config(args.config, DEFAULTS, args.overrides)
    model_cfg, train_cfg = dict(cfg.model), cfg.train
    started = time.perf_counter()
    torch.set_num_threads(1)  # tiny model, many ranks per core: threads only contend

    # 1. the full single-process weights, identical on every rank and in every layout
    torch.manual_seed(cfg.seed)
    full = build_vit(**model_cfg).state_dict()

    # 2. the parallel job
    heartbeat = {} if extra.heartbeat is None else {"heartbeat_interval": extra.heartbeat}
    ctx = launch_from_torch(cfg, seed=cfg.seed, timeout=extra.timeout, **heartbeat)
    if ctx.config.tensor_mode == "sequence":
        full = to_ring_layout(full, model_cfg["heads"])
    layers = build_vit(**model_cfg)
    chunks = int(cfg.get("num_chunks", cfg.get("NUM_CHUNKS", 1)))  # or Colossal-AI's spelling
    model: Any = (
        build_pipeline_model(layers, num_chunks=chunks) if ctx.pipeline_size > 1 else layers
    )
    load_into(model, full)
    modules = model if isinstance(model, list) else [model]
    params = [p for m in modules for p in m.parameters()]
    optimizer = torch.optim.AdamW(params, lr=train_cfg.lr, weight_decay=train_cfg.weight_decay)
    scheduler = warmup_cosine(optimizer, train_cfg.warmup, train_cfg.steps)

    # 3. data: each data-parallel rank reads its share of every global batch
    train_set, test_set = digits()
    for key in ("batch_size", "test_batch_size"):
        if train_cfg[key] % ctx.data_size:
            raise ValueError(
                f"train.{key} {train_cfg[key]} is not divisible by {ctx.data_size} data ranks"
            )
    train = get_dataloader(
        train_set,
        shuffle=True,
        seed=cfg.seed,
        batch_size=train_cfg.batch_size // ctx.data_size,
        drop_last=True,
    )
    test = get_dataloader(test_set, batch_size=train_cfg.test_batch_size // ctx.data_size)

    engine, train, test, scheduler = initialize(model, optimizer, ViTLoss(), train, test, scheduler)
    microbatches = engine.num_microbatches
    recorder = LossRecorder()
    hooks = [
        LossHook(),
        AccuracyHook(ViTAccuracy(microbatches)),
        ThroughputHook(),
        LRSchedulerHook(scheduler, by_epoch=False),
        LogMetricByEpochHook(),
        recorder,
    ]
    if extra.checkpoint_dir is not None:
        hooks.append(LoadCheckpointHook(extra.checkpoint_dir))
        hooks.append(
            SaveCheckpointHook(extra.checkpoint_dir, extra.checkpoint_interval, keep_last=2)
        )
    if extra.kill_rank is not None and extra.kill_at_step is not None:
        hooks.append(KillOnce(extra.kill_rank, extra.kill_at_step))
    max_steps = train_cfg.steps if extra.max_steps is None else extra.max_steps
    trainer = Trainer(engine, metrics_log=args.metrics_log)
    epochs = math.ceil(max_steps / len(train))
    trainer.fit(
        train,
        epochs,
        max_steps=max_steps,
        test_dataloader=test,
        test_interval=epochs,
        hooks=hooks,
        display_progress=not args.quiet,
    )
    results = trainer.states["test_results"]
    if trainer.is_display_rank:
        print(
            f"[{Path(args.config).stem}] {ctx.world_size} ranks: test accuracy "
            f"{results['accuracy']:.4f}, test loss {results['loss']:.4f} after "
            f"{trainer.global_step} steps ({time.perf_counter() - started:.1f} s)",
            flush=True,
        )
        last = trainer.step_metrics.get("loss", float("nan"))
        print(
            f"final: step {trainer.global_step} loss {last!r} test_loss {results['loss']!r}",
            flush=True,
        )
        write_result(
            args.result,
            dict(
                config=Path(args.config).stem,
                world_size=ctx.world_size,
                parallel=cfg.get("parallel"),
                steps=trainer.global_step,
                test_accuracy=results["accuracy"],
                test_loss=results["loss"],
                losses=recorder.losses,
                seconds=time.perf_counter() - started,
            ),
        )
    ctx.destroy()


if __name__ == "__main__":
    main()
