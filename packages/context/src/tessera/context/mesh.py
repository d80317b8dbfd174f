"""A torch ``DeviceMesh`` over a context's own groups, for FSDP2 and DTensor.

torch's mesh would create its own groups; built with ``DeviceMesh.from_group`` from the
context's DATA, PIPELINE and TENSOR groups instead, it shares them, so a job holds one set of
communicators and the mesh's coordinates are tessera's rank layout.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from .config import ParallelConfig

__all__ = ["device_mesh_of"]


def device_mesh_of(
    config: ParallelConfig, groups: Sequence[dist.ProcessGroup], device: torch.device
) -> Any:
    """A ``DeviceMesh`` with dims ("dp", "pp", "tp") over ``groups`` (data, pipeline, tensor).

    The mesh is ``arange(world_size).reshape(data, pipeline, tensor)``: the global layout of
    :func:`tessera.context.global_rank`.
    """
    from torch.distributed.device_mesh import DeviceMesh

    mesh = torch.arange(config.world_size, dtype=torch.int).reshape(
        config.data_size, config.pipeline_size, config.tensor_size
    )
    return DeviceMesh.from_group(
        list(groups), device.type, mesh=mesh, mesh_dim_names=("dp", "pp", "tp")
    )
