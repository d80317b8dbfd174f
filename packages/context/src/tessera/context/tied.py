"""Weights tied across pipeline stages: the mark layers write and the engine reads.

A head tied to the token embedding is one Parameter in a single process (Press & Wolf 2017).
Cut into a pipeline, the first stage uses it as the embedding and the last as the head, so two
ranks each hold a copy, and each copy receives only its own use's gradient. Whoever builds the
stages marks the copies with the same key; the engine then sums their gradients over the pair
of first and last stage (Megatron-LM's embedding group, Narayanan et al. 2021), which keeps the
copies equal. The mark lives here, below tessera-layers and tessera-engine, so that the package
that builds stages and the package that trains them need not know each other.
"""

from __future__ import annotations

import torch

__all__ = ["PIPELINE_SHARED_ATTR", "mark_pipeline_shared", "pipeline_shared_key"]

#: The attribute ``mark_pipeline_shared`` sets on a parameter: its tie key.
PIPELINE_SHARED_ATTR = "_tessera_pipeline_shared"


def mark_pipeline_shared(param: torch.Tensor, key: str = "embedding") -> None:
    """Mark ``param`` as this stage's copy of the weight tied under ``key``.

    Raises:
        ValueError: ``key`` is empty, or ``param`` already carries another key.
    """
    if not isinstance(key, str) or not key:
        raise ValueError(f"mark_pipeline_shared: the key must be a non-empty string, got {key!r}")
    current = pipeline_shared_key(param)
    if current is not None and current != key:
        raise ValueError(
            f"mark_pipeline_shared: this parameter {list(param.shape)} is already tied under "
            f"{current!r}, not {key!r}"
        )
    setattr(param, PIPELINE_SHARED_ATTR, key)


def pipeline_shared_key(param: torch.Tensor) -> str | None:
    """The key ``param`` was marked with, or ``None``."""
    key = getattr(param, PIPELINE_SHARED_ATTR, None)
    return key if isinstance(key, str) else None
