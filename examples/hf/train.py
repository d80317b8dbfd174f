"""Train a transformers GPT-2 or Llama, built from its config, under any layout: ``parallelize``.

    torchrun --nproc-per-node 4 examples/hf/train.py --config examples/hf/configs/2d.py

The model is transformers' own class (random weights, nothing downloaded), trained on the
Python standard library's source, character by character. Nothing in this script knows the
layout: ``parallelize`` converts the model for the config's tensor mode (cutting every shard
from the plain model's weights), ``causal_lm_loss`` takes the split logits, and the engine
adds data parallelism, gradient handlers and clipping. With a pipeline, ``pipeline_layers``
restates the model (Llama, GPT-2) as layers and ``build_pipeline_model`` keeps this rank's stage.
Every layout starts from the same weights and reads the same batches, so the loss curves
agree with one process
(``examples/hf/parity.py`` runs them side by side). At the end the full state dict is
gathered and loaded into the original transformers class with ``strict=True``.
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models import build
from toolkit.run import LossRecorder, load_config, parse_args, write_result

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gpt"))
from data import CharVocab, corpus

from tessera.context import launch_from_torch
from tessera.engine import (
    CheckpointParts,
    LossHook,
    Trainer,
    export_torch_state_dict,
    get_dataloader,
    initialize,
    save_checkpoint,
)
from tessera.layers import (
    causal_lm_loss,
    gather_full_state_dict,
    original_names,
    parallelize,
    pipeline_layers,
)
from tessera.pipeline import build_pipeline_model

DEFAULTS: dict[str, Any] = dict(
    seed=42,
    model=dict(kind="gpt2", seq_len=32, hidden=32, depth=2, heads=4, kv_heads=None),
    train=dict(batch_size=16, steps=20, lr=3e-3, num_test=32, checkpoint=None),
)


class CausalLMLoss(nn.Module):
    """The engine's criterion: next-token loss of a transformers output, from split logits."""

    def forward(self, output: Any, input_ids: torch.Tensor) -> torch.Tensor:
        logits = getattr(output, "logits", output)  # a pipeline's last stage returns logits
        return causal_lm_loss(logits, input_ids)


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    cfg = load_config(args.config, DEFAULTS, args.overrides)
    model_cfg, train_cfg = dict(cfg.model), cfg.train
    started = time.perf_counter()
    torch.set_num_threads(1)

    text = corpus()
    vocab = CharVocab(text, multiple=16)
    ids = vocab.encode(text)
    seq = int(model_cfg["seq_len"])
    windows = ids[: (len(ids) // seq) * seq].view(-1, seq)  # [n, s]: inputs are their labels
    train_set = TensorDataset(windows[: -train_cfg.num_test], windows[: -train_cfg.num_test])
    test_set = TensorDataset(windows[-train_cfg.num_test :], windows[-train_cfg.num_test :])

    ctx = launch_from_torch(cfg, seed=cfg.seed)
    plain = build(vocab.size, seed=cfg.seed, **model_cfg)  # identical on every rank
    original = {k: v.clone() for k, v in plain.state_dict().items()}
    model: nn.Module = parallelize(plain)  # in place: the config's tensor mode, these weights
    names = {name: name for name in model.state_dict()}
    if ctx.pipeline_size > 1:  # the model as layers, this rank's stage of them
        layers = pipeline_layers(model)
        names = original_names(layers, model)
        stage = build_pipeline_model(layers)
        assert isinstance(stage, nn.Module)
        model = stage
    optimizer = torch.optim.AdamW(model.parameters(), lr=train_cfg.lr)
    train = get_dataloader(
        train_set,
        shuffle=True,
        seed=cfg.seed,
        batch_size=train_cfg.batch_size // ctx.data_size,
        drop_last=True,
    )
    test = get_dataloader(test_set, batch_size=train_cfg.num_test // ctx.data_size)
    engine, train, test, _ = initialize(model, optimizer, CausalLMLoss(), train, test)

    recorder = LossRecorder()
    trainer = Trainer(engine, metrics_log=args.metrics_log)
    epochs = math.ceil(train_cfg.steps / len(train))
    trainer.fit(
        train,
        epochs,
        max_steps=train_cfg.steps,
        test_dataloader=test,
        test_interval=epochs,
        hooks=[LossHook(), recorder],
        display_progress=not args.quiet,
    )
    test_loss = trainer.states["test_results"]["loss"]

    # Back to the original class, exactly: names, Conv1D orientation, fused q/k/v, tied head.
    stage_state = {names[k]: v for k, v in gather_full_state_dict(model).items()}
    states: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(states, stage_state)  # every pipeline stage's part
    full = {k: v for state in states for k, v in state.items()}
    exported = build(vocab.size, seed=cfg.seed, **model_cfg)
    exported.load_state_dict(full, strict=True)
    changed = sum(not torch.equal(full[k], v) for k, v in original.items())
    if train_cfg.checkpoint is not None:
        # An engine checkpoint holds tessera's forms (Conv1D transposed, q/k/v fused); its
        # export turns them back: the same original state dict as the gather above.
        save_checkpoint(train_cfg.checkpoint, CheckpointParts(model))
        if trainer.is_display_rank:
            exported_state = export_torch_state_dict(train_cfg.checkpoint)
            assert sorted(exported_state) == sorted(full)
            assert all(torch.equal(exported_state[k], v) for k, v in full.items())
            build(vocab.size, seed=cfg.seed, **model_cfg).load_state_dict(exported_state)
            print("the engine checkpoint exports to the same state dict (strict)", flush=True)
    if trainer.is_display_rank:
        print(
            f"[{Path(args.config).stem}] {ctx.world_size} ranks, {model_cfg['kind']}: test loss "
            f"{test_loss:.4f} after {trainer.global_step} steps; the trained state dict loads "
            f"into {type(exported).__name__} (strict), {changed} of {len(original)} tensors "
            f"changed ({time.perf_counter() - started:.1f} s)",
            flush=True,
        )
        write_result(
            args.result,
            dict(
                config=Path(args.config).stem,
                world_size=ctx.world_size,
                device=str(ctx.device),
                steps=trainer.global_step,
                test_loss=test_loss,
                losses=recorder.losses,
                seconds=time.perf_counter() - started,
            ),
        )
    ctx.destroy()


if __name__ == "__main__":
    main()
