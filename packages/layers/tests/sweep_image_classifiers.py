"""Every image classifier of transformers, parallelized, against one process.

Not a test (a few minutes for every layout): the vision companion of ``sweep_transformers.py``
and ``sweep_task_heads.py``, for the models a researcher brings to classify images
(``*ForImageClassification``: ViT, DeiT, BEiT, DINOv2, Swin, ConvNeXt, ...). Each class is
built from one small config (6x6 images in 2x2 patches where it has patches, every dropout
off), run on the same batch, and its logits compared with one process's, then every
gradient of a weighted sum of them. One line per class:

* ``OK``: equal to one process;
* ``refused``: ``parallelize`` raised, with the first words of why;
* ``error``: the parallelized model raised in its forward;
* ``DIFFERS``: a value, shape or gradient differs: the bug to fix;
* ``no build``: the class does not build from this config (or is over 5M parameters).

Run from ``packages/layers/tests``::

    python sweep_image_classifiers.py --tensor '{"size": 2, "mode": "sequence"}' [TYPE ...]
"""

from __future__ import annotations

import json
from typing import Any

import torch
from sweep_task_heads import compare_outputs
from sweep_transformers import MAX_PARAMETERS, each_model, run_sweep, sweep_arguments
from torch import nn

#: The config every class is built from, where it has the key (hierarchical models: one stage
#: per depth, as small as they build).
SMALL_IMAGES: dict[str, Any] = dict(
    image_size=8,
    patch_size=2,
    num_channels=3,
    hidden_size=16,
    embed_dim=16,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=32,
    depths=[1, 1],
    num_heads=[2, 4],
    hidden_sizes=[16, 32],
    window_size=2,
    num_labels=8,
)


def image_classifiers(kinds: list[str]) -> list[str]:
    """The model types of transformers' image classifiers (of ``kinds`` if given), sorted."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES as MAPPING,
    )

    return sorted(k for k in MAPPING if not kinds or k in kinds)


def build(kind: str) -> nn.Module:
    """The small image classifier of ``kind``, seeded alike on every rank, dropout off.

    Raises:
        MemoryError: it would hold more than :data:`MAX_PARAMETERS` parameters.
    """
    import transformers
    from hf_models import _distinct
    from transformers import AutoConfig
    from transformers.models.auto import modeling_auto

    names = modeling_auto.MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES[kind]
    cls = getattr(transformers, names if isinstance(names, str) else names[0])
    base = AutoConfig.for_model(kind)
    known = {k: v for k, v in SMALL_IMAGES.items() if hasattr(base, k)}
    config = AutoConfig.for_model(kind, **known)
    for key, value in config.to_dict().items():
        if ("drop" in key or "dropout" in key) and isinstance(value, float):
            setattr(config, key, 0.0)
    with torch.device("meta"):
        probe = cls._from_config(config, attn_implementation="eager")
    count = sum(p.numel() for p in probe.parameters())
    if count > MAX_PARAMETERS:
        raise MemoryError(f"{count} parameters at this config")
    torch.manual_seed(0)
    model = cls._from_config(config, attn_implementation="eager")
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    return _distinct(model, 0).eval()


def images(model: nn.Module) -> torch.Tensor:
    """A batch of 4 images the model takes, the same on every rank."""
    config = model.config
    size = getattr(config, "image_size", 8)
    size = size[0] if isinstance(size, (list, tuple)) else size
    channels = getattr(config, "num_channels", 3)
    generator = torch.Generator().manual_seed(7)
    return torch.randn(4, channels, size, size, generator=generator)


def sweep(kinds: list[str], tensor: dict[str, Any]) -> list[tuple[str, ...]]:
    """On every rank: ``(type, outcome, why)`` for each image classifier under ``tensor``."""
    return each_model(
        tensor,
        kinds,
        build,
        lambda kind, ref, ctx: (kind, *compare_outputs(ref, ctx, dict(pixel_values=images(ref)))),
    )


def main() -> None:
    args = sweep_arguments(__doc__, "image classifier").parse_args()
    tensor = json.loads(args.tensor)
    run_sweep(sweep, image_classifiers(args.types), tensor)


if __name__ == "__main__":
    main()
