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

import argparse
import copy
import json
import logging
import warnings
from typing import Any

import torch
from sweep_transformers import MAX_PARAMETERS, SKIPPED, SMALL, _words
from torch import nn

from tessera.testing import DistributedRunner

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

    from tessera.layers import gather_logits, parallelize

    ids = checks.token_ids()
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # padded queries attend to nothing real: compared at the real tokens only
    try:
        model = parallelize(copy.deepcopy(ref), context=ctx)
    except Exception as error:
        return "refused", _words(error)
    want = ref(input_ids=ids, attention_mask=mask)
    try:
        got = model(input_ids=ids, attention_mask=mask)
    except Exception as error:
        return "error", _words(error)
    ref_loss, loss = torch.zeros(()), torch.zeros(())
    fields = [k for k, v in want.items() if isinstance(v, torch.Tensor)]
    for key in fields:
        expected, value = want[key], got[key]
        if value.shape != expected.shape:
            value = gather_logits(value, context=ctx)
        if value.shape != expected.shape:
            return "DIFFERS", f"{key}: {list(value.shape)}, one process {list(expected.shape)}"
        if value.shape[:2] == mask.shape:  # token by token: the real tokens
            value, expected = value[mask.bool()], expected[mask.bool()]
        if not torch.allclose(value, expected, rtol=1e-5, atol=1e-5):
            return "DIFFERS", f"{key}: off by {float((value - expected).abs().max()):.3g}"
        weights = torch.randn(expected.shape, generator=torch.Generator().manual_seed(3))
        ref_loss, loss = ref_loss + (expected * weights).sum(), loss + (value * weights).sum()
    ref_loss.backward()
    loss.backward()
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


def sweep(classes: list[tuple[str, str]], tensor: dict[str, Any]) -> list[tuple[str, ...]]:
    """On every rank: ``(type, task, outcome, why)`` for each class under ``tensor``."""
    import test_parallelize as checks

    logging.disable(logging.WARNING)
    warnings.filterwarnings("ignore")
    ctx = checks._context(tensor)
    found = []
    try:
        for kind, mapping in classes:
            task = mapping.removeprefix("MODEL_FOR_").removesuffix("_MAPPING_NAMES").lower()
            try:
                ref = build(kind, mapping)
            except Exception as error:
                found.append((kind, task, "no build", _words(error)))
                continue
            found.append((kind, task, *compare(ref, ctx)))
    finally:
        ctx.destroy()
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("types", nargs="*", help="model types (default: every task head's)")
    parser.add_argument("--tensor", default='{"size": 2, "mode": "1d"}', help="the tensor block")
    args = parser.parse_args()
    tensor = json.loads(args.tensor)
    classes = task_classes(args.types)
    with DistributedRunner(timeout=30.0 * len(classes) + 60) as runner:
        (rows, *_) = runner.run(sweep, world_size=tensor["size"], args=(classes, tensor))
    for kind, task, outcome, why in rows:
        print(f"{outcome:9} {kind:24} {task:22} {why}")
    outcomes = ("OK", "refused", "error", "DIFFERS", "no build")
    print(", ".join(f"{sum(r[2] == o for r in rows)} {o}" for o in outcomes), f"under {tensor}")


if __name__ == "__main__":
    main()
