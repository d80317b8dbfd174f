"""Command line, configuration and result plumbing shared by the example training scripts."""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tessera.engine import BaseHook, Trainer
from tessera.layers import load_full_state_dict
from tessera.registry import Config

__all__ = [
    "LossRecorder",
    "load_config",
    "load_into",
    "parse_args",
    "warmup_cosine",
    "write_result",
]


def parse_args(description: str, argv: Sequence[str] | None = None) -> argparse.Namespace:
    """``--config FILE [--set key.path=value ...] [--result FILE] [--metrics-log FILE]``."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--config", required=True, help="a python config file (configs/*.py)")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config entry, e.g. --set train.steps=50 (repeatable)",
    )
    parser.add_argument("--result", help="write the run's summary (JSON) here")
    parser.add_argument("--metrics-log", help="the Trainer's JSON-lines metrics log")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser.parse_args(argv)


def load_config(path: str, defaults: Mapping[str, Any], overrides: Sequence[str] = ()) -> Config:
    """``defaults``, updated by the config file, updated by ``--set`` overrides."""
    return Config(dict(defaults)).merge(Config.from_file(path)).apply_overrides(overrides)


def load_into(modules: nn.Module | Sequence[nn.Module], full: Mapping[str, torch.Tensor]) -> None:
    """Give every rank its block of the full state dict.

    A pipeline stage holds a subset of the full model's parameter names (tessera-pipeline keeps
    them), so each module takes exactly the entries it has; a missing one is an error.
    """
    for module in [modules] if isinstance(modules, nn.Module) else modules:
        names = set(module.state_dict())
        missing = sorted(names - set(full))
        if missing:
            raise KeyError(f"the full state dict lacks {missing}")
        load_full_state_dict(module, {k: v for k, v in full.items() if k in names})


def warmup_cosine(
    optimizer: torch.optim.Optimizer, warmup: int, total: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up for ``warmup`` steps, then cosine decay to 10% at step ``total``."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


class LossRecorder(BaseHook):
    """Keeps every step's loss (the Trainer's value: the mean over data ranks)."""

    def __init__(self, priority: int = 20) -> None:
        super().__init__(priority)
        self.losses: list[float] = []

    def after_train_iter(
        self, trainer: Trainer, output: Any, label: Any, loss: torch.Tensor | None
    ) -> None:
        self.losses.append(trainer.step_metrics["loss"])


def write_result(path: str | None, result: Mapping[str, Any]) -> None:
    """Write ``result`` as JSON (creating the folder)."""
    if path is None:
        return
    file = Path(path)
    file.parent.mkdir(parents=True, exist_ok=True)
    file.write_text(json.dumps(result, indent=1) + "\n")
