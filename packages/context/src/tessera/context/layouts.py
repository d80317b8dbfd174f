"""Rank layouts: which global ranks form each process group, as pure arithmetic.

Nothing here touches torch.distributed: the functions map a ``ParallelConfig`` to lists of rank
groups, so every layout is tested for many world sizes without starting a process.

Global layout (fixed, documented in the README)::

    rank = data_rank * (pipeline_size * tensor_size) + pipeline_rank * tensor_size + tensor_rank

Tensor ranks are innermost, so one tensor group is a block of consecutive ranks, which a
launcher places on one node's fast links. Each tensor mode then gives the tensor rank its own
coordinates (see the functions below); its groups are computed in tensor-rank space and lifted
to global ranks by adding the block's first rank.

A group is a tuple of global ranks ordered by local rank (the rank inside the group).
"""

from __future__ import annotations

from .config import ParallelConfig
from .modes import ParallelMode

__all__ = [
    "Group",
    "Groups",
    "coordinates",
    "global_groups",
    "global_rank",
    "groups_1d",
    "groups_2d",
    "groups_2p5d",
    "groups_3d",
    "lift",
    "sequence_groups",
]

#: One process group: global ranks, ordered by local rank.
Group = tuple[int, ...]
#: All the groups of one mode (each rank is in at most one of them).
Groups = list[Group]


def global_rank(
    config: ParallelConfig, data_rank: int, pipeline_rank: int, tensor_rank: int
) -> int:
    """The global rank at coordinates (data, pipeline, tensor)."""
    return (
        data_rank * config.pipeline_size * config.tensor_size
        + pipeline_rank * config.tensor_size
        + tensor_rank
    )


def coordinates(config: ParallelConfig, rank: int) -> tuple[int, int, int]:
    """The (data_rank, pipeline_rank, tensor_rank) of global ``rank``; inverse of global_rank."""
    if not 0 <= rank < config.world_size:
        raise ValueError(f"rank {rank} is outside world size {config.world_size}")
    model = config.pipeline_size * config.tensor_size
    return rank // model, (rank % model) // config.tensor_size, rank % config.tensor_size


def global_groups(config: ParallelConfig) -> dict[str, Groups]:
    """The groups every configuration has.

    * GLOBAL: all ranks.
    * DATA: same (pipeline, tensor) coordinates, ordered by data rank (the replicas of a shard).
    * PIPELINE: same (data, tensor), ordered by pipeline rank (the stages of one pipeline).
    * TENSOR: same (data, pipeline), ordered by tensor rank (one stage's tensor group).
    * MODEL: same data rank, ordered by global rank (pipeline x tensor: one model replica).
    """
    d, p, t = config.data_size, config.pipeline_size, config.tensor_size
    r = global_rank
    return {
        ParallelMode.GLOBAL: [tuple(range(config.world_size))],
        ParallelMode.DATA: [
            tuple(r(config, i, j, k) for i in range(d)) for j in range(p) for k in range(t)
        ],
        ParallelMode.PIPELINE: [
            tuple(r(config, i, j, k) for j in range(p)) for i in range(d) for k in range(t)
        ],
        ParallelMode.TENSOR: [
            tuple(r(config, i, j, k) for k in range(t)) for i in range(d) for j in range(p)
        ],
        ParallelMode.MODEL: [
            tuple(r(config, i, j, k) for j in range(p) for k in range(t)) for i in range(d)
        ],
    }


def lift(config: ParallelConfig, local: dict[str, Groups]) -> dict[str, Groups]:
    """Turn groups of tensor ranks (``0 .. tensor_size-1``) into groups of global ranks.

    The same tensor-rank groups are repeated in every tensor block, i.e. for every
    (data_rank, pipeline_rank), by adding the block's first global rank.
    """
    starts = [
        global_rank(config, i, j, 0)
        for i in range(config.data_size)
        for j in range(config.pipeline_size)
    ]
    return {
        mode: [tuple(start + t for t in group) for start in starts for group in groups]
        for mode, groups in local.items()
    }


def groups_1d(size: int) -> dict[str, Groups]:
    """1D (Megatron-LM, Shoeybi et al. 2019): PARALLEL_1D is the whole tensor group."""
    return {ParallelMode.PARALLEL_1D: [tuple(range(size))]}


def groups_2d(q: int) -> dict[str, Groups]:
    """2D (SUMMA / Optimus, Xu et al. 2021): a q x q mesh.

    Coordinates: ``tensor_rank = row * q + col``.

    * PARALLEL_2D_ROW: same row, ordered by col (local rank = col).
    * PARALLEL_2D_COL: same col, ordered by row (local rank = row).

    A ROW group and a COL group meet in exactly one rank.
    """
    return {
        ParallelMode.PARALLEL_2D_ROW: [
            tuple(row * q + col for col in range(q)) for row in range(q)
        ],
        ParallelMode.PARALLEL_2D_COL: [
            tuple(row * q + col for row in range(q)) for col in range(q)
        ],
    }


def groups_2p5d(q: int, depth: int) -> dict[str, Groups]:
    """2.5D (Tesseract, Wang et al. 2021): ``depth`` stacked q x q layers.

    Coordinates: ``tensor_rank = dep * q * q + row * q + col``.

    * PARALLEL_2P5D_ROW: same (dep, row), ordered by col (size q).
    * PARALLEL_2P5D_COL: same (dep, col), ordered by row (size q).
    * PARALLEL_2P5D_DEP: same (row, col), ordered by dep (size depth).
    * PARALLEL_2P5D_XZ: same col, ordered by (dep, row) (size q * depth): the COL groups of
      every layer joined, over which a weight split by column is reduced.
    """

    def rank(dep: int, row: int, col: int) -> int:
        return dep * q * q + row * q + col

    layers, side = range(depth), range(q)
    return {
        ParallelMode.PARALLEL_2P5D_ROW: [
            tuple(rank(d, r, c) for c in side) for d in layers for r in side
        ],
        ParallelMode.PARALLEL_2P5D_COL: [
            tuple(rank(d, r, c) for r in side) for d in layers for c in side
        ],
        ParallelMode.PARALLEL_2P5D_DEP: [
            tuple(rank(d, r, c) for d in layers) for r in side for c in side
        ],
        ParallelMode.PARALLEL_2P5D_XZ: [
            tuple(rank(d, r, c) for d in layers for r in side) for c in side
        ],
    }


def groups_3d(q: int) -> dict[str, Groups]:
    """3D (Bian et al. 2021, "Maximizing Parallelism in Distributed Training"): a q x q x q cube.

    Coordinates: ``tensor_rank = z * q * q + y * q + x`` where x is the weight axis, y the
    input axis and z the output axis; a 1-axis group varies only its own axis.

    * PARALLEL_3D_WEIGHT: same (y, z), ordered by x (size q).
    * PARALLEL_3D_INPUT: same (x, z), ordered by y (size q).
    * PARALLEL_3D_OUTPUT: same (x, y), ordered by z (size q).
    * PARALLEL_3D_INPUT_X_WEIGHT: same z, ordered by (y, x) (size q*q).
    * PARALLEL_3D_OUTPUT_X_WEIGHT: same y, ordered by (z, x) (size q*q).
    """

    def rank(x: int, y: int, z: int) -> int:
        return z * q * q + y * q + x

    s = range(q)
    return {
        ParallelMode.PARALLEL_3D_INPUT: [tuple(rank(x, y, z) for y in s) for z in s for x in s],
        ParallelMode.PARALLEL_3D_WEIGHT: [tuple(rank(x, y, z) for x in s) for z in s for y in s],
        ParallelMode.PARALLEL_3D_OUTPUT: [tuple(rank(x, y, z) for z in s) for y in s for x in s],
        ParallelMode.PARALLEL_3D_INPUT_X_WEIGHT: [
            tuple(rank(x, y, z) for y in s for x in s) for z in s
        ],
        ParallelMode.PARALLEL_3D_OUTPUT_X_WEIGHT: [
            tuple(rank(x, y, z) for z in s for x in s) for y in s
        ],
    }


def sequence_groups(config: ParallelConfig) -> dict[str, Groups]:
    """Sequence parallelism (Li et al. 2021, "Sequence Parallelism: Long Sequence Training").

    * SEQUENCE: the tensor group: its ranks hold consecutive chunks of the sequence.
    * SEQUENCE_DP: same pipeline rank, ordered by global rank (size data * tensor): every rank
      that holds a copy of the same stage's parameters, across data and sequence ranks; the
      gradient of a sequence-parallel stage is all-reduced over it.
    """
    d, p, t = config.data_size, config.pipeline_size, config.tensor_size
    return {
        ParallelMode.SEQUENCE: global_groups(config)[ParallelMode.TENSOR],
        ParallelMode.SEQUENCE_DP: [
            tuple(global_rank(config, i, j, k) for i in range(d) for k in range(t))
            for j in range(p)
        ],
    }
