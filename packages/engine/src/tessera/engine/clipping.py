"""Global-norm clipping of a model split in any way: ``tessera.context.grad_norm``'s.

It lives beside ``ShardInfo`` so that a loop of one's own clips alike
(``torch.nn.utils.clip_grad_norm_`` on tessera's split parameters, tessera.context's
``torch_clipping``); the engine's step calls :func:`clip_grad_norm` from here.
"""

from __future__ import annotations

from tessera.context import (
    SplitKey,
    clip_grad_norm,
    combine_norms,
    global_grad_norm,
    norm_contributions,
    reduce_contributions,
)

__all__ = [
    "SplitKey",
    "clip_grad_norm",
    "combine_norms",
    "global_grad_norm",
    "norm_contributions",
    "reduce_contributions",
]
