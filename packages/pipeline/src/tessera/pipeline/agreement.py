"""Pipeline ranks that must agree, checked once: the declared ``tensor_shape``.

With ``tensor_shape`` (or ``TENSOR_SHAPE``) no metadata travels with the activations: every
rank allocates its receive buffers from its own declaration. If one rank declares a different
shape, gloo receives a shorter message into a longer buffer without complaint (the tail is
garbage) and a longer one fails or hangs. One ``all_gather_object`` over the pipeline's cpu
group, the first time a runner runs with a given declaration, turns that into a
``ValueError`` on every pipeline rank. The local check that a stage's output matches the
declaration (``PipelineExecutor``) covers the other half: a model whose output is not what
every rank declared.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from tessera.pipeline.p2p import PayloadMeta

__all__ = ["agree_on_fixed_meta"]


def agree_on_fixed_meta(
    fixed: PayloadMeta,
    cpu_group: dist.ProcessGroup,
    agreed: set[tuple[int, str]],
) -> None:
    """Raise ``ValueError`` on every pipeline rank unless all declared the same tensor_shape.

    Args:
        fixed: this rank's declaration.
        cpu_group: the pipeline's CPU group.
        agreed: the declarations already agreed on (the runner's): skipped, and grown.
    """
    described = fixed.describe()
    key = (id(cpu_group), described)
    if key in agreed:
        return
    gathered: list[Any] = [None] * dist.get_world_size(cpu_group)
    dist.all_gather_object(gathered, described, group=cpu_group)
    if len(set(gathered)) > 1:
        listed = ", ".join(f"pipeline rank {r}: {d}" for r, d in enumerate(gathered))
        raise ValueError(
            "the pipeline ranks declare different tensor_shape / TENSOR_SHAPE ("
            f"{listed}); every rank must declare the same shape, or none so shapes are "
            "exchanged"
        )
    agreed.add(key)
