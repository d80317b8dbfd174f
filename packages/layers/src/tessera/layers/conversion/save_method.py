"""transformers' ``model.save_pretrained(folder)`` of a parallelized model: the gathered checkpoint.

transformers' own method writes ``model.state_dict()``: on a parallelized model, this rank's
blocks under the original names, from every rank at once into the same files (each calls it
as the main process unless told otherwise). The folder then holds one rank's shards, its
writers racing, and the save reports success: the run's result is lost, found out only when
``from_pretrained`` refuses the shapes (or, with ``ignore_mismatched_sizes``, initializes
them at random).

So the parallelized model's ``save_pretrained`` is tessera's
(:func:`tessera.layers.save_pretrained`): every tensor gathered whole, one rank writing, the
folder put in place atomically, what ``from_pretrained`` reads. It is collective, as the
gathers are: every rank of the model calls it (``is_main_process``, which accelerate passes
on every rank, is ignored: tessera picks the writer; so is a ``save_function``, which
transformers uses for pickle files only, as accelerate's own pattern passes). Arguments tessera
cannot honour (a ``state_dict`` of the caller's, ``push_to_hub``, a ``variant``, pickle files)
are refused by name before any collective.
"""

from __future__ import annotations

import os
import types
from typing import Any

from torch import nn

from tessera.context import ParallelContext

__all__ = ["install_save_method"]

#: transformers' arguments whose defaults tessera's writer matches; others are refused.
_DEFAULTS: dict[str, Any] = {
    "state_dict": None,
    "push_to_hub": False,
    "safe_serialization": True,
    "variant": None,
    "save_peft_format": True,
    "save_original_format": True,  # transformers 5: the checkpoint's own names, as tessera's
    "distributed_checkpoint": False,
}
#: Arguments transformers itself ignores when it writes safetensors: accelerate's documented
#: ``save_pretrained(..., is_main_process=..., save_function=accelerator.save)`` passes one
#: (it writes pickles only), ``token`` is for the hub alone.
_IGNORED = ("save_function", "token")


def install_save_method(model: nn.Module, context: ParallelContext) -> None:
    """Make ``model.save_pretrained`` write the gathered checkpoint (see the module doc).

    A bound method on the instance (a deep copy binds it to the copy); a model without
    transformers' ``save_pretrained`` is left alone.
    """
    if not callable(getattr(type(model), "save_pretrained", None)):
        return

    def save_pretrained(
        self: nn.Module,
        save_directory: str | os.PathLike[str],
        is_main_process: bool = True,
        *,
        max_shard_size: int | str = "5GB",
        **kwargs: Any,
    ) -> None:
        from ..state.pretrained import save_pretrained as gathered_save

        for key, value in kwargs.items():
            if key in _IGNORED:
                continue
            if key not in _DEFAULTS or value != _DEFAULTS[key]:
                raise ValueError(
                    f"{type(self).__name__}.save_pretrained of a parallelized model: "
                    f"{key}={value!r} is not supported; it writes the gathered weights as "
                    "safetensors in the original names (tessera.layers.save_pretrained), "
                    "called on every rank. Push or convert the folder once it is written"
                )
        gathered_save(self, save_directory, max_shard_size=max_shard_size, context=context)

    setattr(model, "save_pretrained", types.MethodType(save_pretrained, model))  # noqa: B010
