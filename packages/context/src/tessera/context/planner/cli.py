"""``python -m tessera.context plan``: print the layouts that fit, fastest first.

Example (one command line, wrapped here)::

    python -m tessera.context plan --layers 24 --hidden 2048 --heads 16 --seq 1024
        --vocab 50304 --batch 16 --world 16 --memory 16GiB --dtype fp16 --top 10

The machine model is ``--flops/--bandwidth/--latency`` where given, else what ``--calibrate``
measures on this machine (as ``--world`` ranks running on it at once see it), else a nominal
accelerator node (``DEFAULT_MACHINE``); its backend is ``--backend`` where given, else gloo
with ``--calibrate``, else NCCL.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from collections.abc import Sequence
from dataclasses import replace

from tessera.registry import ConfigError

from .comm import BACKENDS
from .layouts import MODES
from .machine import DEFAULT_MACHINE, Machine, calibrate
from .precision import DTYPES
from .rank import plan_layouts
from .shapes import ModelShape
from .table import format_header, format_rows
from .units import parse_bytes

__all__ = ["build_parser", "main"]

#: The most ranks ``--calibrate`` runs at once by default (threads of this process, each
#: gloo rank holding a socket to every other: 16 keep well within a usual open-file limit).
CALIBRATE_RANKS = 16


def build_parser() -> argparse.ArgumentParser:
    """The ``plan`` command's arguments."""
    parser = argparse.ArgumentParser(
        prog="python -m tessera.context plan",
        description=(
            "List the data x pipeline x tensor layouts (with ZeRO stage and activation "
            "checkpointing) under which a transformer fits a per-rank memory budget, "
            "fastest first by a machine model."
        ),
    )
    model = parser.add_argument_group(
        "model and batch (--seq and --batch always; the rest, or --config)"
    )
    model.add_argument(
        "--config",
        help="a transformers config.json (GPT-2 or the Llama family): the model's numbers and "
        "kind read from it; --layers, --hidden, --heads, --vocab override them",
    )
    for name, text in (
        ("layers", "transformer blocks"),
        ("hidden", "model width h"),
        ("heads", "attention heads"),
        ("seq", "sequence length"),
        ("vocab", "vocabulary size (0: blocks only, no embedding or head)"),
        ("batch", "global batch in samples"),
    ):
        model.add_argument(f"--{name}", type=int, required=name in _ALWAYS, help=text)
    model.add_argument("--ffn-multiple", type=int, help="MLP width / h (default 4)")
    model.add_argument("--dropout", action="store_true", help="dropout p > 0 (saves its masks)")
    job = parser.add_argument_group("job")
    job.add_argument("--world", type=int, required=True, help="ranks in the job")
    job.add_argument("--memory", required=True, help="bytes per rank, e.g. 16GiB, 80GB")
    job.add_argument("--dtype", choices=DTYPES, default="fp32", help="fp32, or fp16/bf16 mixed")
    job.add_argument("--mode", choices=MODES, help="only this tensor mode")
    job.add_argument("--tensor", type=int, help="only this tensor size")
    job.add_argument("--pipeline", type=int, help="only this pipeline size")
    machine = parser.add_argument_group("machine model (default: a nominal accelerator node)")
    machine.add_argument("--flops", type=float, help="flop/s of one rank")
    machine.add_argument("--bandwidth", type=float, help="bytes/s one rank sends")
    machine.add_argument("--latency", type=float, help="seconds per collective call")
    machine.add_argument(
        "--backend",
        choices=BACKENDS,
        help="how tessera moves tensor-parallel blocks: NCCL's all-gathers and reduce-scatters "
        "or gloo's pairwise sends (default: gloo with --calibrate, else nccl)",
    )
    machine.add_argument(
        "--calibrate",
        action="store_true",
        help="measure this machine as the job's ranks on it see it, all at once (a matmul on "
        "each and a gloo all-reduce among them, a few seconds)",
    )
    machine.add_argument(
        "--calibrate-ranks",
        type=int,
        metavar="N",
        help=f"ranks --calibrate runs at once (default: --world, at most {CALIBRATE_RANKS})",
    )
    show = parser.add_argument_group("output")
    show.add_argument("--top", type=int, default=20, help="fitting layouts shown (default 20)")
    show.add_argument("--all", action="store_true", help="also list what does not fit, and why")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``plan`` command on ``argv`` (default ``sys.argv[1:]``); returns the exit code.

    Bad input exits with status 2 and a message naming the flag and the arithmetic.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        shape = _shape(args)
        budget = parse_bytes(args.memory)
        if args.top < 1:
            raise ConfigError(f"top must be a positive int, got {args.top}")
        machine, source = _machine(args)
        estimates = plan_layouts(
            shape,
            args.world,
            budget,
            machine,
            dtype=args.dtype,
            mode=args.mode,
            tensor=args.tensor,
            pipeline=args.pipeline,
        )
    except ConfigError as error:
        parser.error(_flagged(str(error), frozenset(vars(args))))
    fitting = [e for e in estimates if e.fits]
    others = [e for e in estimates if not e.fits]
    print(format_header(shape, args.world, budget, machine, args.dtype, source))
    shown = fitting[: args.top]
    print(f"{len(fitting)} of {len(estimates)} layouts fit; the fastest {len(shown)}:")
    if shown:
        print(format_rows(shown))
    else:
        closest = others[0] if others else None
        hint = f" The closest: {closest.layout.name}: {closest.problems[0]}." if closest else ""
        print(f"No layout fits.{hint}")
    if args.all and others:
        print(f"\n{len(others)} layouts do not fit (smallest first):")
        print(format_rows(others, first=len(fitting) + 1, why=True))
    elif others:
        print(f"({len(others)} layouts that do not fit are listed with --all.)")
    return 0


#: Flags every command needs; the model's other numbers come from them or from ``--config``.
_ALWAYS = ("seq", "batch")
_MODEL_FLAGS = ("layers", "hidden", "heads", "vocab")


def _shape(args: argparse.Namespace) -> ModelShape:
    """The model from ``--config`` (overridden by the flags given) or from the flags alone."""
    given = {k: getattr(args, k) for k in _MODEL_FLAGS if getattr(args, k) is not None}
    if args.config is None:
        missing = [f"--{k}" for k in _MODEL_FLAGS if k not in given]
        if missing:
            raise ConfigError(f"{', '.join(missing)} missing: give them, or --config FILE")
        return ModelShape(
            **given,
            seq=args.seq,
            batch=args.batch,
            ffn_multiple=4 if args.ffn_multiple is None else args.ffn_multiple,
            dropout=args.dropout,
        )
    if args.ffn_multiple is not None:
        raise ConfigError("ffn_multiple with --config: the config gives the MLP's width")
    try:
        config = json.loads(pathlib.Path(args.config).read_text())
    except (OSError, ValueError) as error:
        raise ConfigError(f"config {args.config} cannot be read as JSON: {error}") from None
    if not isinstance(config, dict):
        raise ConfigError(f"config {args.config} holds no JSON object")
    shape = ModelShape.from_config(config, seq=args.seq, batch=args.batch)
    return replace(shape, dropout=args.dropout, **given)


def _machine(args: argparse.Namespace) -> tuple[Machine, str]:
    """The machine model from the flags, measured with ``--calibrate``, and whence it came."""
    base, source = DEFAULT_MACHINE, "nominal default; --calibrate measures this one"
    if args.calibrate:
        ranks = args.calibrate_ranks
        if ranks is None:
            ranks = max(2, min(args.world, CALIBRATE_RANKS))
        base = calibrate(ranks=ranks)
        source = f"calibrated on this machine, {ranks} ranks at once"
    if args.backend is not None:
        base = replace(base, backend=args.backend)
    given = {k: getattr(args, k) for k in ("flops", "bandwidth", "latency")}
    given = {k: v for k, v in given.items() if v is not None}
    if given:
        source = "given" if len(given) == 3 else f"{source}, given " + ", ".join(given)
        return Machine(**{**base.__dict__, **given}), source
    return base, source


def _flagged(message: str, flags: frozenset[str]) -> str:
    """Spell the key a message starts with as its flag (``--world 12 ...``) if it is one.

    A key the config gave (``kv_heads``) is left as it is.
    """
    key, _, rest = message.partition(" ")
    return f"--{key.replace('_', '-')} {rest}" if key in flags else message


if __name__ == "__main__":
    sys.exit(main())
