"""transformers' ``resize_token_embeddings`` on a parallelized model: refused, saying when to.

After tokens are added to a tokenizer, ``model.resize_token_embeddings(len(tokenizer))``
builds a new ``nn.Embedding`` from the old table's weight. On a parallelized model the table
is split (this rank's rows or columns), so transformers raises a ``TypeError`` about tessera's
class and no way forward; had it resized the block, each rank would have grown its own slice.
The split is made from the whole table, so the resize belongs before ``parallelize`` (or
before ``from_pretrained``'s parallel load): this method says so, naming both, before
anything changes. Under a mode that splits no weight (``'sequence'``) transformers' own
method runs.
"""

from __future__ import annotations

import types
from typing import Any

from torch import nn

__all__ = ["install_resize_refusal"]


def install_resize_refusal(model: nn.Module, mode: str) -> None:
    """Make ``model.resize_token_embeddings`` raise what to do (see the module doc).

    A bound method on the instance; a model without transformers' method is left alone.
    """
    if not callable(getattr(type(model), "resize_token_embeddings", None)):
        return

    def resize_token_embeddings(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        raise ValueError(
            f"{type(self).__name__}.resize_token_embeddings after parallelize: its token "
            f"table is split under tensor mode {mode!r} (this rank holds a block of it), and "
            "the split is made from the whole table. Resize the model before parallelize "
            "(model.resize_token_embeddings(n); then parallelize(model)), or load it with "
            "the new size and parallelize that"
        )

    setattr(model, "resize_token_embeddings", types.MethodType(resize_token_embeddings, model))  # noqa: B010
