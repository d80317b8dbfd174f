"""Fine-tune a transformers checkpoint folder under any layout; write a folder others can load.

    torchrun --nproc-per-node 4 examples/finetune/finetune.py --config \
        examples/finetune/configs/2d.py --set checkpoint=gpt2-downloaded --set output=runs/ft

From a checkpoint folder on disk (``config.json``, safetensors, the tokenizer's files) to one
that transformers' ``from_pretrained`` loads: the model class that ``config.json`` names is built
on the meta device, converted for the config's layout (``parallelize``; a pipeline keeps this
rank's stage of ``pipeline_layers``) and each rank reads only its slices of the weights
(``load_pretrained``). The corpus is text read from disk (``data.files``, glob patterns;
default the Python standard library's sources), tokenized with the folder's own tokenizer and
cut into windows of ``data.seq_len`` tokens, the last ``data.eval_windows`` held out. The
Trainer shows a progress bar; every ``train.log_interval`` steps the log gets the loss, tokens
per second and model FLOPs utilization, each evaluation the held-out perplexity, TensorBoard
all of them (``output/tensorboard``). Checkpoints go to ``output/checkpoints`` every
``train.checkpoint_interval`` steps and a restarted job resumes from the newest intact one (the
same command again; ``train.stop_after`` ends a job early without changing the schedule). At
the end ``save_pretrained`` writes ``output/model`` (weights in the original names and forms,
and the tokenizer), and one rank loads it back with ``from_pretrained`` and checks that it
measures the run's perplexity.
"""

from __future__ import annotations

import glob
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from make_checkpoint import stdlib_sources
from toolkit.run import LossRecorder, load_config, parse_args, warmup_cosine, write_result

from tessera.context import ParallelContext, launch_from_torch
from tessera.engine import (
    BaseHook,
    LoadCheckpointHook,
    LossHook,
    LRSchedulerHook,
    SaveCheckpointHook,
    TensorboardHook,
    Trainer,
    get_dataloader,
    initialize,
)
from tessera.layers import (
    causal_lm_loss,
    load_pretrained,
    parallelize_pretrained,
    pipeline_layers,
    save_pretrained,
)
from tessera.pipeline import build_pipeline_model

DEFAULTS: dict[str, Any] = dict(
    seed=0,
    checkpoint=None,  # the folder to start from
    output="runs/finetune",  # checkpoints/, tensorboard/ and model/ (the result) go here
    data=dict(files=None, max_chars=300_000, seq_len=64, eval_windows=16),
    train=dict(
        batch_size=16,
        steps=40,
        stop_after=None,  # end this job after that many steps in all; the schedule is steps'
        lr=1e-3,
        warmup=4,
        weight_decay=0.0,
        log_interval=10,
        eval_interval=1,  # epochs between evaluations (and one at the end)
        checkpoint_interval=20,
        peak_tflops=None,  # per rank, for the utilization; default: a measured matmul rate
        tensorboard=True,
    ),
)


def read_corpus(files: Any, max_chars: int | None) -> list[str]:
    """The text of the files ``files`` (glob patterns) match, in sorted order, to ``max_chars``.

    ``None`` reads the Python standard library's sources, which every machine has.
    """
    if files is None:
        paths = stdlib_sources()
    else:
        patterns = [files] if isinstance(files, str) else list(files)
        paths = sorted({Path(p) for pattern in patterns for p in glob.glob(pattern)})
    if not paths:
        raise FileNotFoundError(f"data.files {files!r} matches no file")
    texts, total = [], 0
    for path in paths:
        text = path.read_text(encoding="utf-8", errors="replace")
        if max_chars is not None:
            text = text[: max_chars - total]
        texts.append(text)
        total += len(text)
        if max_chars is not None and total >= max_chars:
            break
    return texts


def token_windows(texts: list[str], tokenizer: Any, seq_len: int) -> torch.Tensor:
    """The documents tokenized, joined by the end-of-text token, cut into ``[n, seq_len]``."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("the checkpoint's tokenizer has no eos_token to join documents with")
    ids: list[int] = []
    for document in tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]:
        ids.extend(document)
        ids.append(eos)
    usable = (len(ids) // seq_len) * seq_len
    return torch.tensor(ids[:usable], dtype=torch.int64).view(-1, seq_len)  # [n, s]


def build_model(folder: str, ctx: ParallelContext, chunks: int) -> Any:
    """The folder's model on meta, converted for the context's layout: nothing read yet.

    ``parallelize_pretrained(load=False)`` builds the class ``config.json`` names on the meta
    device and converts it (a tensor mode allocates this rank's shards only); a pipeline then
    keeps this rank's stage (or chunks) of ``pipeline_layers``. ``load_pretrained`` allocates
    what is still on meta and reads the rank's slices: before ``initialize``, or after it under
    ZeRO-3, where FSDP2 shards the meta model first and each rank reads only its rows.
    """
    model: Any = parallelize_pretrained(folder, load=False)
    if ctx.pipeline_size > 1:  # the model as layers, this rank's stage of them
        model = build_pipeline_model(pipeline_layers(model), num_chunks=chunks)
    return model


def parameter_count(folder: str) -> int:
    """The whole model's parameters (a tied head once), counted on meta."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    return sum(p.numel() for p in model.parameters())


class NextTokenLoss(nn.Module):
    """The criterion: next-token loss of a transformers output or a last stage's logits."""

    def forward(self, output: Any, input_ids: torch.Tensor) -> torch.Tensor:
        logits = getattr(output, "logits", output)  # [b, s, v], split as the mode splits it
        return causal_lm_loss(logits, input_ids)


def measured_peak_flops(device: torch.device) -> float:
    """This rank's fp32 matmul rate (FLOP/s): the yardstick when no peak is configured."""
    n = 2048 if device.type == "cuda" else 256
    a = torch.randn(n, n, device=device)
    for _ in range(2):  # warm-up
        a @ a
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start, reps = time.perf_counter(), 10
    for _ in range(reps):
        a @ a
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return 2 * n**3 * reps / (time.perf_counter() - start)


class LanguageModelMetrics(BaseHook):
    """Tokens per second and model FLOPs utilization of each step; perplexity of evaluations.

    The FLOPs of a token are 6N for the forward and backward matmuls of N parameters plus 12
    L h s for attention's scores and weighted sum (L layers of width h at sequence s), as in
    the PaLM paper's appendix B; utilization divides the rate they are done at by the peak of
    every rank together. Runs before ``TensorboardHook`` (lower priority), which writes them.
    """

    def __init__(
        self, tokens_per_step: int, flops_per_token: float, peak_flops: float, log_every: int
    ) -> None:
        super().__init__(priority=5)
        self.tokens_per_step, self.flops_per_token = tokens_per_step, flops_per_token
        self.peak_flops, self.log_every = peak_flops, log_every
        self._start = 0.0

    def before_train_iter(self, trainer: Trainer) -> None:
        """Start the step's clock."""
        self._start = time.perf_counter()

    def after_train_iter(self, trainer: Trainer, output: Any, label: Any, loss: Any) -> None:
        """Add ``tokens_per_s`` and ``mfu`` to the step's metrics; log every ``log_every``."""
        rate = self.tokens_per_step / max(time.perf_counter() - self._start, 1e-12)
        metrics = trainer.step_metrics
        metrics["tokens_per_s"] = rate
        metrics["mfu"] = rate * self.flops_per_token / self.peak_flops
        if trainer.is_display_rank and trainer.global_step % self.log_every == 0:
            trainer.logger.info(
                f"step {trainer.global_step}: loss {metrics['loss']:.4f}, "
                f"{rate:,.0f} tokens/s, MFU {100 * metrics['mfu']:.2f}%"
            )

    def after_test(self, trainer: Trainer) -> None:
        """Add the perplexity of the held-out windows: exp of their mean token loss."""
        results = trainer.states.get("test_results", {})
        if "loss" in results:
            results["perplexity"] = math.exp(results["loss"])
            if trainer.is_display_rank:
                trainer.logger.info(
                    f"step {trainer.global_step}: eval loss {results['loss']:.4f}, "
                    f"perplexity {results['perplexity']:.3f}"
                )


def reloaded_perplexity(folder: Path, windows: torch.Tensor) -> float:
    """The saved folder through transformers alone: perplexity of ``windows`` in one process."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    AutoTokenizer.from_pretrained(folder)  # the tokenizer came along
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        loss = model(windows, labels=windows).loss
    return math.exp(float(loss))


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    cfg = load_config(args.config, DEFAULTS, args.overrides)
    data_cfg, train_cfg = cfg.data, cfg.train
    if cfg.checkpoint is None:
        raise ValueError("--set checkpoint=FOLDER: the checkpoint folder to start from")
    folder, output = str(cfg.checkpoint), Path(cfg.output)
    started = time.perf_counter()
    torch.set_num_threads(1)  # many ranks on few cores: threads only contend

    from transformers import AutoConfig, AutoTokenizer

    ctx = launch_from_torch(cfg, seed=cfg.seed)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    seq = int(data_cfg.seq_len)
    windows = token_windows(read_corpus(data_cfg.files, data_cfg.max_chars), tokenizer, seq)
    held_out = int(data_cfg.eval_windows)
    if len(windows) <= held_out:
        raise ValueError(
            f"the corpus makes {len(windows)} windows of {seq} tokens; data.eval_windows "
            f"{held_out} leaves none to train on (raise data.max_chars)"
        )
    for key, value in (("train.batch_size", train_cfg.batch_size), ("data.eval_windows", held_out)):
        if value % ctx.data_size:
            raise ValueError(f"{key} {value} is not divisible by {ctx.data_size} data ranks")
    train_set = TensorDataset(windows[:-held_out], windows[:-held_out])  # labels: the inputs
    eval_set = TensorDataset(windows[-held_out:], windows[-held_out:])

    chunks = int(cfg.get("num_chunks", 1))
    model = build_model(folder, ctx, chunks)
    # FSDP2 shards a meta model in initialize; every other layout is loaded before it
    load_after_initialize = int(cfg.get("zero", {}).get("stage", 0)) == 3
    if not load_after_initialize:
        load_pretrained(model, folder)
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
    test = get_dataloader(eval_set, batch_size=held_out // ctx.data_size)
    engine, train, test, scheduler = initialize(
        model, optimizer, NextTokenLoss(), train, test, scheduler
    )
    if load_after_initialize:
        load_pretrained(model, folder)  # into FSDP2's shards: each rank reads its rows
    size = parameter_count(folder)

    config = AutoConfig.from_pretrained(folder)
    layers, width = config.num_hidden_layers, config.hidden_size
    peak = (
        float(train_cfg.peak_tflops) * 1e12
        if train_cfg.peak_tflops is not None
        else measured_peak_flops(ctx.device)
    )
    recorder = LossRecorder()
    hooks: list[BaseHook] = [
        LossHook(),
        LRSchedulerHook(scheduler, by_epoch=False),
        LanguageModelMetrics(
            tokens_per_step=int(train_cfg.batch_size) * seq,
            flops_per_token=6 * size + 12 * layers * width * seq,
            peak_flops=peak * ctx.world_size,
            log_every=int(train_cfg.log_interval),
        ),
        LoadCheckpointHook(output / "checkpoints"),
        SaveCheckpointHook(output / "checkpoints", int(train_cfg.checkpoint_interval), keep_last=2),
        recorder,
    ]
    if train_cfg.tensorboard:
        hooks.append(TensorboardHook(output / "tensorboard"))
    trainer = Trainer(engine, metrics_log=args.metrics_log)
    stop = train_cfg.steps if train_cfg.stop_after is None else int(train_cfg.stop_after)
    epochs = math.ceil(stop / len(train))
    trainer.fit(
        train,
        epochs,
        max_steps=stop,
        test_dataloader=test,
        test_interval=int(train_cfg.eval_interval),
        hooks=hooks,
        display_progress=not args.quiet,
    )
    results = dict(trainer.states.get("test_results", {}))
    if trainer.global_step < train_cfg.steps:  # an early stop: resumed by the next job
        if trainer.is_display_rank:
            print(f"stopped after step {trainer.global_step} of {train_cfg.steps}", flush=True)
        ctx.destroy()
        return

    # The result: a checkpoint folder in the model's own names and forms, with the tokenizer.
    saved = save_pretrained(model, output / "model", tokenizer_from=folder)
    if trainer.is_display_rank:  # the folder, through transformers alone
        reloaded = reloaded_perplexity(saved, windows[-held_out:])
        run = results["perplexity"]
        print(
            f"[{Path(args.config).stem}] {ctx.world_size} ranks, {size:,} parameters: eval "
            f"perplexity {run:.4f} after {trainer.global_step} steps; from_pretrained({saved}) "
            f"measures {reloaded:.4f} ({time.perf_counter() - started:.1f} s)",
            flush=True,
        )
        if not math.isclose(reloaded, run, rel_tol=1e-4):
            raise AssertionError(
                f"the saved folder's perplexity {reloaded} is not the run's {run}: the weights "
                "written are not the weights trained"
            )
        write_result(
            args.result,
            dict(
                config=Path(args.config).stem,
                world_size=ctx.world_size,
                steps=trainer.global_step,
                losses=recorder.losses,
                eval_loss=results["loss"],
                eval_perplexity=run,
                reloaded_perplexity=reloaded,
                seconds=time.perf_counter() - started,
            ),
        )
    ctx.destroy()


if __name__ == "__main__":
    main()
