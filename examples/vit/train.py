"""Train the ViT on scikit-learn's digits under any parallel layout.

    torchrun --nproc-per-node 4 examples/vit/train.py --config examples/vit/configs/2d.py

Every layout starts from the same full weights: every rank builds the plain single-process model
from the config's seed *before* launching (no context yet, so the dispatching layers are plain
torch), then ``load_full_state_dict`` gives each rank its block of it (by name for a pipeline
stage). Data order follows the same seed, so under every layout the job sees the same batches.
"""

from __future__ import annotations

import math
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
    LogMetricByEpochHook,
    LossHook,
    LRSchedulerHook,
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


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    cfg = load_config(args.config, DEFAULTS, args.overrides)
    model_cfg, train_cfg = dict(cfg.model), cfg.train
    started = time.perf_counter()
    torch.set_num_threads(1)  # tiny model, many ranks per core: threads only contend

    # 1. the full single-process weights, identical on every rank and in every layout
    torch.manual_seed(cfg.seed)
    full = build_vit(**model_cfg).state_dict()

    # 2. the parallel job
    ctx = launch_from_torch(cfg, seed=cfg.seed)
    if ctx.config.tensor_mode == "sequence":
        full = to_ring_layout(full, model_cfg["heads"])
    layers = build_vit(**model_cfg)
    chunks = int(cfg.get("NUM_CHUNKS", 1))
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
    microbatches = int(getattr(engine.schedule, "num_microbatches", 1))
    recorder = LossRecorder()
    hooks = [
        LossHook(),
        AccuracyHook(ViTAccuracy(microbatches)),
        ThroughputHook(),
        LRSchedulerHook(scheduler, by_epoch=False),
        LogMetricByEpochHook(),
        recorder,
    ]
    trainer = Trainer(engine, metrics_log=args.metrics_log)
    epochs = math.ceil(train_cfg.steps / len(train))
    trainer.fit(
        train,
        epochs,
        max_steps=train_cfg.steps,
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
