"""Train a character-level GPT on the Python standard library's source, then sample from it.

    torchrun --nproc-per-node 4 examples/gpt/train.py --config examples/gpt/configs/pipeline_1d.py

As in the ViT example, every layout starts from the same full weights (built before launching,
then ``load_full_state_dict``). At the end the full state dict is gathered from every tensor
rank (``gather_full_state_dict``) and pipeline stage, loaded into the plain torch model on
the rank that shows progress, and a sample of generated text is printed.
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from data import CharVocab, corpus, windows
from model import GPTLoss, build_gpt, generate
from toolkit.run import (
    LossRecorder,
    load_config,
    load_into,
    parse_args,
    warmup_cosine,
    write_result,
)

from tessera.context import launch_from_torch, set_context
from tessera.engine import (
    LogMetricByEpochHook,
    LossHook,
    LRSchedulerHook,
    ThroughputHook,
    Trainer,
    get_dataloader,
    initialize,
)
from tessera.layers import gather_full_state_dict
from tessera.pipeline import build_pipeline_model

DEFAULTS: dict[str, Any] = dict(
    seed=42,
    model=dict(seq_len=64, hidden=64, depth=2, heads=4, mlp_ratio=4, dropout=0.0),
    train=dict(
        batch_size=32,
        test_batch_size=32,
        num_test=64,
        steps=300,
        lr=1e-2,
        weight_decay=0.01,
        warmup=10,
    ),
    sample=dict(prompt="def ", length=300, temperature=0.7),
)


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    cfg = load_config(args.config, DEFAULTS, args.overrides)
    model_cfg, train_cfg = dict(cfg.model), cfg.train
    started = time.perf_counter()
    torch.set_num_threads(1)

    text = corpus()
    vocab = CharVocab(text)
    train_set, test_set = windows(vocab.encode(text), model_cfg["seq_len"], train_cfg.num_test)

    torch.manual_seed(cfg.seed)
    full = build_gpt(vocab.size, **model_cfg).state_dict()  # no context yet: plain torch

    ctx = launch_from_torch(cfg, seed=cfg.seed)
    layers = build_gpt(vocab.size, **model_cfg)
    chunks = int(cfg.get("num_chunks", cfg.get("NUM_CHUNKS", 1)))  # or Colossal-AI's spelling
    model: Any = (
        build_pipeline_model(layers, num_chunks=chunks) if ctx.pipeline_size > 1 else layers
    )
    load_into(model, full)
    modules = model if isinstance(model, list) else [model]
    params = [p for m in modules for p in m.parameters()]
    optimizer = torch.optim.AdamW(params, lr=train_cfg.lr, weight_decay=train_cfg.weight_decay)
    scheduler = warmup_cosine(optimizer, train_cfg.warmup, train_cfg.steps)
    train = get_dataloader(
        train_set,
        shuffle=True,
        seed=cfg.seed,
        batch_size=train_cfg.batch_size // ctx.data_size,
        drop_last=True,
    )
    test = get_dataloader(test_set, batch_size=train_cfg.test_batch_size // ctx.data_size)
    engine, train, test, scheduler = initialize(model, optimizer, GPTLoss(), train, test, scheduler)

    recorder = LossRecorder()
    hooks = [
        LossHook(),
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

    # the full model: every tensor rank's blocks, every stage's layers, on every rank
    stage_state: dict[str, torch.Tensor] = {}
    for module in modules:
        stage_state.update(gather_full_state_dict(module))
    states: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(states, stage_state)
    trained = {k: v for state in states for k, v in state.items()}

    if trainer.is_display_rank:  # the rank that holds the test loss
        # the plain single-process model: built *and run* with no current context, so the
        # dispatching layers are torch's and split_batch is the identity
        previous = set_context(None)
        plain = build_gpt(vocab.size, **model_cfg)
        plain.load_state_dict(trained)
        sample = cfg.sample
        ids = generate(
            plain.eval(),
            vocab.encode(sample.prompt),
            sample.length,
            model_cfg["seq_len"],
            len(vocab.chars),
            sample.temperature,
            cfg.seed,
        )
        set_context(previous)
        print(
            f"[{Path(args.config).stem}] {ctx.world_size} ranks: test loss "
            f"{results['loss']:.4f} (perplexity {math.exp(results['loss']):.2f}) after "
            f"{trainer.global_step} steps ({time.perf_counter() - started:.1f} s)\n"
            f"--- sample (temperature {sample.temperature}) ---\n{vocab.decode(ids)}\n---",
            flush=True,
        )
        write_result(
            args.result,
            dict(
                config=Path(args.config).stem,
                world_size=ctx.world_size,
                steps=trainer.global_step,
                test_loss=results["loss"],
                losses=recorder.losses,
                sample=vocab.decode(ids),
                seconds=time.perf_counter() - started,
            ),
        )
    ctx.destroy()


if __name__ == "__main__":
    main()
