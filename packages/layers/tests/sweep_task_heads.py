"""Every token classifier and question-answering class of transformers, parallelized, against
one process.

Not a test (a few minutes for every layout): the companion of ``sweep_transformers.py`` for the
task heads a fine-tune puts on a bare model (``*ForTokenClassification``,
``*ForQuestionAnswering``), whose output tessera must give back as one process's. Each class
is built from the same small config as the causal LMs' sweep (every dropout off), run on a
left-padded batch, and each tensor of its output (gathered with ``gather_logits`` where it
comes back split) is compared at the real tokens, then every gradient of a weighted sum of
them. One line per class:

* ``OK``: equal to one process;
* ``refused``: ``parallelize`` raised, with the first words of why;
* ``error``: the parallelized model raised in its forward;
* ``DIFFERS``: a value, shape or gradient differs: the bug to fix;
* ``no build``: the class does not build from this config (or is over 5M parameters).

Run from ``packages/layers/tests``::

    python sweep_task_heads.py --tensor '{"size": 2, "mode": "sequence"}' [TYPE ...]
"""

from __future__ import annotations

import copy
import json
from typing import Any

import torch
import torch.nn.functional as F
from sweep_transformers import (
    MAX_PARAMETERS,
    SKIPPED,
    SMALL,
    _words,
    each_model,
    run_sweep,
    sweep_arguments,
)
from torch import nn

#: transformers' mappings of the task heads swept, and the labels each head has.
TASKS = {
    "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES": 3,
    "MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES": 2,  # start and end
}


def task_classes(kinds: list[str]) -> list[tuple[str, str]]:
    """``(model type, mapping)`` of every task head of :data:`TASKS` (of ``kinds`` if given)."""
    from transformers.models.auto import modeling_auto

    found = []
    for mapping in TASKS:
        for kind in sorted(getattr(modeling_auto, mapping)):
            if kind not in SKIPPED and (not kinds or kind in kinds):
                found.append((kind, mapping))
    return found


def build(kind: str, mapping: str) -> nn.Module:
    """The small model of ``kind``'s class in ``mapping``, seeded alike, dropout off.

    Raises:
        MemoryError: it would hold more than :data:`MAX_PARAMETERS` parameters.
    """
    import transformers
    from hf_models import _distinct
    from transformers import AutoConfig
    from transformers.models.auto import modeling_auto

    cls = getattr(transformers, getattr(modeling_auto, mapping)[kind])
    base = AutoConfig.for_model(kind)
    known = {k: v for k, v in SMALL.items() if hasattr(base, k) or k in base.attribute_map}
    config = AutoConfig.for_model(kind, **known)
    for key, value in config.to_dict().items():
        if "drop" in key and isinstance(value, float):
            setattr(config, key, 0.0)
    config.num_labels, config.classifier_dropout = TASKS[mapping], 0.0
    with torch.device("meta"):
        probe = cls._from_config(config, attn_implementation="eager")
    count = sum(p.numel() for p in probe.parameters())
    if count > MAX_PARAMETERS:
        raise MemoryError(f"{count} parameters at this config")
    torch.manual_seed(0)
    model = cls._from_config(config, attn_implementation="eager")
    for module in model.modules():  # a head's own dropout, whatever its config calls it
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    return _distinct(model, 0)


def compare(ref: nn.Module, ctx: Any) -> tuple[str, str]:
    """``(outcome, why)`` of ``ref`` parallelized against itself on a left-padded batch."""
    import test_parallelize as checks

    ids = checks.token_ids()
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # padded queries attend to nothing real: compared at the real tokens only
    return compare_outputs(ref, ctx, dict(input_ids=ids, attention_mask=mask), mask)


def compare_outputs(
    ref: nn.Module, ctx: Any, inputs: dict[str, torch.Tensor], mask: torch.Tensor | None = None
) -> tuple[str, str]:
    """``(outcome, why)`` of ``ref`` parallelized against itself on ``inputs``: every tensor
    of its output (at the tokens ``mask`` keeps, where given), then every gradient of a
    weighted sum of them."""
    import test_parallelize as checks

    from tessera.layers import gather_logits, parallelize, token_loss

    try:
        want = ref(**inputs)
    except Exception as error:  # the inputs are not this model's (ImageGPT takes pixel ids)
        return "no build", f"one process: {_words(error)}"
    try:
        model = parallelize(copy.deepcopy(ref), context=ctx)
    except Exception as error:
        return "refused", _words(error)
    try:
        got = model(**inputs)
    except Exception as error:
        return "error", _words(error)
    ref_loss, loss = torch.zeros(()), torch.zeros(())
    fields = [k for k, v in want.items() if isinstance(v, torch.Tensor)]
    generator = torch.Generator().manual_seed(3)
    for key in fields:
        expected, split = want[key], got[key]
        value = split if split.shape == expected.shape else gather_logits(split, context=ctx)
        if value.shape != expected.shape:
            return "DIFFERS", f"{key}: {list(value.shape)}, one process {list(expected.shape)}"
        kept = mask is not None and value.shape[:2] == mask.shape  # token by token
        real = (lambda x: x[mask.bool()]) if kept else (lambda x: x)
        if not torch.allclose(real(value), real(expected), rtol=1e-5, atol=1e-5):
            off = float((real(value) - real(expected)).abs().max())
            return "DIFFERS", f"{key}: off by {off:.3g}"
        if split is value:  # whole: a weighted sum of it
            weights = torch.randn(expected.shape, generator=generator)
            ref_loss = ref_loss + (real(expected) * real(weights)).sum()
            loss = loss + (real(value) * real(weights)).sum()
            continue
        # split logits (gather_logits passes no gradient): the loss on them against torch's
        labels = torch.randint(expected.shape[-1], expected.shape[:-1], generator=generator)
        if kept:
            labels[~mask.bool()] = -100
        flat = expected.reshape(-1, expected.shape[-1])
        ref_loss = ref_loss + F.cross_entropy(flat, labels.reshape(-1))
        loss = loss + token_loss(split, labels, context=ctx)
    if not fields or not ref_loss.requires_grad:
        return "error", f"no differentiable tensor in its output ({type(want).__name__})"
    ref_loss.backward()
    try:
        loss.backward()
    except Exception as error:
        return "error", f"backward: {_words(error)}"
    sequence = ctx.config.tensor_mode == "sequence"
    grads = checks._full_grads(model, ctx, mean_loss=sequence)
    off = [
        name
        for name, p in ref.named_parameters()
        if p.grad is not None and not torch.allclose(grads[name], p.grad, rtol=1e-4, atol=1e-4)
    ]
    if off:
        return "DIFFERS", f"the gradients of {len(off)} parameters, {off[:3]}"
    return "OK", ", ".join(fields)


def _task(mapping: str) -> str:
    return mapping.removeprefix("MODEL_FOR_").removesuffix("_MAPPING_NAMES").lower()


def sweep(classes: list[tuple[str, str]], tensor: dict[str, Any]) -> list[tuple[str, ...]]:
    """On every rank: ``(type, task, outcome, why)`` for each class under ``tensor``."""

    def label(item: tuple[str, str]) -> tuple[str, str]:
        kind, mapping = item
        return kind, mapping.removeprefix("MODEL_FOR_").removesuffix("_MAPPING_NAMES").lower()

    return each_model(
        tensor,
        classes,
        lambda item: build(*item),
        lambda item, ref, ctx: (*label(item), *compare(ref, ctx)),
        label,
    )


def main() -> None:
    args = sweep_arguments(__doc__, "task head's").parse_args()
    tensor = json.loads(args.tensor)
    run_sweep(sweep, task_classes(args.types), tensor)


if __name__ == "__main__":
    main()
