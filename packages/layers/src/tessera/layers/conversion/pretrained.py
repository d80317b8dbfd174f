"""The common case of a pretrained checkpoint in one call: built, parallelized and loaded.

It sits above ``parallelize`` and ``load_pretrained`` (state/pretrained.py), which it composes.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tessera.context import ParallelContext

from ..state.pretrained import load_pretrained
from .api import parallelize
from .meta import meta_parameters

__all__ = ["parallelize_pretrained"]


def parallelize_pretrained(
    folder: str | os.PathLike[str],
    *,
    dtype: torch.dtype = torch.float32,
    load: bool = True,
    context: ParallelContext | None = None,
    **parallelize_options: Any,
) -> nn.Module:
    """The common case in one line: the model ``config.json`` names, parallelized and loaded.

    Builds the class of ``config.json``'s ``architectures`` on the meta device, parallelizes
    it under the context's layout (allocating this rank's shards only) and loads the folder
    with :func:`load_pretrained` (each rank reading only the slices of its blocks; without a
    tensor mode, allocating the whole model on each rank first, which data parallelism
    holds). A model another class should hold, or a plan of one's own, goes through those
    three steps by hand (docs/pretrained.md).

    Where a rank holds less than what ``parallelize`` leaves it, load later, with
    ``load=False``: a pipeline stage (``load_pretrained`` on the stage of
    ``build_pipeline_model(pipeline_layers(model))`` reads its layers only) and ZeRO-2/3
    without a tensor mode (the model stays on meta through ``initialize``, which shards it
    there; ``load_pretrained`` after it allocates and reads each data rank's rows only).

    Args:
        folder: A transformers checkpoint folder (``config.json`` and safetensors).
        dtype: The parameters' dtype (the checkpoint's tensors are converted to it).
        load: Load the folder now; ``False`` returns the model parallelized, its weights not
            read (on meta where no tensor mode allocated them) for a later
            :func:`load_pretrained`.
        context: The ParallelContext (default the current one).
        **parallelize_options: Passed to :func:`~tessera.layers.parallelize` (``plan``,
            ``sequence_attention``).

    Raises:
        ValueError: ``config.json`` names no class transformers has.
    """
    import transformers

    config = transformers.AutoConfig.from_pretrained(folder)
    names = list(getattr(config, "architectures", None) or [])
    model_class = getattr(transformers, names[0], None) if names else None
    if model_class is None:
        raise ValueError(
            f"parallelize_pretrained: {Path(folder) / 'config.json'} names the architectures "
            f"{names}, none a transformers class; build the model yourself, then parallelize "
            "and load_pretrained it"
        )
    with meta_parameters():
        model = model_class(config).to(dtype)  # on meta: no memory, no copy
    model = parallelize(model, context=context, **parallelize_options)
    if load:
        load_pretrained(model, folder, context=context)
    return model
