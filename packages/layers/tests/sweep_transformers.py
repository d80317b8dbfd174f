"""Every causal LM class of transformers, built small, parallelized, against one process.

Not a test (too slow for CI): a sweep for the one bug ``parallelize`` must never have, a model
that runs without an error and trains differently from one process. For each model type of
``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` it builds the class from a small config (2 layers,
hidden 32, 4 heads of 8, vocabulary 32, 4 experts of 32 where it has experts, every dropout
off; only keys the config knows), runs
the layers suite's check (``test_parallelize._lm_matches_reference``: state dict round trip,
loss, logits and every gradient against the same model on one process) under one layout, and
prints one line per type:

* ``OK``: equal to one process;
* ``refused``: ``parallelize`` (or the model) raised, with the first words of why;
* ``DIFFERS``: a check failed: the bug to fix;
* ``no build``: the class does not build from this config (or is over 5M parameters).

Run from ``packages/layers/tests`` (about a minute a layout at 2 ranks, two at 8)::

    python sweep_transformers.py --tensor '{"size": 4, "mode": "2d"}' [TYPE ...]
"""

from __future__ import annotations

import argparse
import json
import logging
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from tessera.testing import DistributedRunner

#: Every naming scheme's keys for one small model; a config takes the ones it knows.
SMALL: dict[str, Any] = dict(
    vocab_size=32,
    hidden_size=32,
    n_embd=32,
    d_model=32,
    num_hidden_layers=2,
    n_layer=2,
    num_layers=2,
    num_attention_heads=4,
    n_head=4,
    intermediate_size=64,
    n_inner=64,
    ffn_dim=64,
    max_position_embeddings=32,
    n_positions=32,
    num_key_value_heads=2,
    head_dim=8,
    rotary_dim=4,
    num_experts=4,
    num_local_experts=4,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
    n_shared_experts=1,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
)
#: Model types that are no decoder on token ids alone (encoder-decoders, speech, images, state
#: space models, cached recurrences): out of ``parallelize``'s scope, skipped.
# fmt: off
SKIPPED = frozenset({
    "bart", "bigbird_pegasus", "blenderbot", "blenderbot-small", "marian", "mbart", "mvp",
    "pegasus", "plbart", "prophetnet", "whisper", "trocr", "musicgen", "musicgen_melody",
    "moshi", "reformer", "xlnet", "ctrl", "cpmant", "git", "emu3", "fuyu", "got_ocr2", "mllama",
    "aria_text", "rwkv", "mamba", "mamba2", "falcon_mamba", "xlstm", "recurrent_gemma",
    "bert-generation",
})
# fmt: on
#: Larger than this is left out (the sweep holds one copy per rank and one reference).
MAX_PARAMETERS = 5_000_000


def causal_lm_types() -> list[str]:
    """The model types of transformers' causal LM classes, sorted, less :data:`SKIPPED`."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(k for k in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES if k not in SKIPPED)


def build(kind: str) -> nn.Module:
    """The small model of ``kind``, seeded alike on every rank, dropout off.

    Raises:
        MemoryError: it would hold more than :data:`MAX_PARAMETERS` parameters.
    """
    from hf_models import _distinct
    from transformers import AutoConfig, AutoModelForCausalLM

    base = AutoConfig.for_model(kind)
    known = {k: v for k, v in SMALL.items() if hasattr(base, k) or k in base.attribute_map}
    try:
        config = AutoConfig.for_model(kind, **known)
    except AttributeError:  # head_dim read from hidden and heads (Falcon's): not a key
        config = AutoConfig.for_model(kind, **{k: v for k, v in known.items() if k != "head_dim"})
    for key, value in config.to_dict().items():
        if "drop" in key and isinstance(value, float):
            setattr(config, key, 0.0)
    with torch.device("meta"):
        probe = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    count = sum(p.numel() for p in probe.parameters())
    if count > MAX_PARAMETERS:
        raise MemoryError(f"{count} parameters at this config")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    return _distinct(model, 0)


def _words(error: BaseException) -> str:
    return f"{type(error).__name__}: {' '.join(str(error).split())[:240]}"


def sweep(kinds: list[str], tensor: dict[str, Any], length: int) -> list[tuple[str, ...]]:
    """On every rank: ``(type, outcome, why)`` for each of ``kinds`` under ``tensor``, each
    row ``length`` tokens long."""
    return each_model(tensor, kinds, build, lambda kind, model, ctx: _lm(kind, model, ctx, length))


def _lm(kind: str, model: nn.Module, ctx: Any, length: int) -> tuple[str, str, str]:
    """``(type, outcome, why)`` of one causal LM against one process."""
    import test_parallelize as checks

    try:
        checks._lm_matches_reference(model, ctx, length=length)
        return kind, "OK", ""
    except AssertionError as error:
        return kind, "DIFFERS", _words(error)
    except Exception as error:
        where = traceback.extract_tb(error.__traceback__)[-1].filename.rsplit("/", 1)[-1]
        return kind, "refused", f"[{where}] {_words(error)}"


def each_model(
    tensor: dict[str, Any],
    items: list[Any],
    build: Callable[[Any], nn.Module],
    check: Callable[[Any, nn.Module, Any], tuple[str, ...]],
    label: Callable[[Any], tuple[str, ...]] = lambda item: (item,),
) -> list[tuple[str, ...]]:
    """On every rank, under a context of ``tensor`` (warnings off): for each item, its row
    ``check(item, model, ctx)``, or ``(*label(item), "no build", why)`` where ``build``
    raised."""
    import test_parallelize as checks

    logging.disable(logging.WARNING)
    warnings.filterwarnings("ignore")
    ctx = checks._context(tensor)
    found = []
    try:
        for item in items:
            try:
                ref = build(item)
            except Exception as error:
                found.append((*label(item), "no build", _words(error)))
                continue
            found.append(check(item, ref, ctx))
    finally:
        ctx.destroy()
    return found


def sweep_arguments(doc: str | None, what: str) -> argparse.ArgumentParser:
    """The command line every sweep takes: model types, and ``--tensor``'s block."""
    parser = argparse.ArgumentParser(description=doc)
    parser.add_argument("types", nargs="*", help=f"model types (default: every {what})")
    parser.add_argument("--tensor", default='{"size": 2, "mode": "1d"}', help="the tensor block")
    return parser


def run_sweep(
    sweep: Callable[..., list[tuple[str, ...]]],
    items: list[Any],
    tensor: dict[str, Any],
    *extra: Any,
    seconds: float = 30.0,
) -> None:
    """``sweep(items, tensor, *extra)`` on the ranks ``tensor`` asks for, then its report."""
    with DistributedRunner(timeout=seconds * len(items) + 60) as runner:
        (rows, *_) = runner.run(sweep, world_size=tensor["size"], args=(items, tensor, *extra))
    report(rows, tensor)


def report(rows: list[tuple[str, ...]], tensor: dict[str, Any]) -> None:
    """One line per row (``(type, ..., outcome, why)``), then the count of each outcome."""
    for row in rows:
        print(f"{row[-2]:9}", *(f"{cell:24}" for cell in row[:-2]), row[-1])
    outcomes = ("OK", "refused", "error", "DIFFERS", "no build")
    print(", ".join(f"{sum(r[-2] == o for r in rows)} {o}" for o in outcomes), f"under {tensor}")


def main() -> None:
    parser = sweep_arguments(__doc__, "causal LM's")
    parser.add_argument("--length", type=int, default=8, help="tokens per row (at most 8)")
    args = parser.parse_args()
    tensor = json.loads(args.tensor)
    run_sweep(sweep, args.types or causal_lm_types(), tensor, args.length, seconds=60.0)


if __name__ == "__main__":
    main()
