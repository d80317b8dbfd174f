"""Layout invariants for many configurations, computed without any process."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from tessera.context import ParallelConfig, ParallelMode, coordinates, global_rank, rank_groups

M = ParallelMode


def _configs() -> list[tuple[int, dict[str, Any]]]:
    """(world_size, parallel) for every valid split of world sizes 1..64 (a few per mode)."""
    out: list[tuple[int, dict[str, Any]]] = []
    tensors: list[dict[str, Any]] = [{"size": 1}]
    tensors += [{"size": t, "mode": m} for t in (1, 2, 3, 4, 6, 8) for m in ("1d", "sequence")]
    tensors += [{"size": q * q, "mode": "2d"} for q in (1, 2, 3)]
    tensors += [{"size": q * q * d, "mode": "2.5d", "depth": d} for q in (1, 2) for d in (1, 2, 3)]
    tensors += [{"size": q**3, "mode": "3d"} for q in (1, 2)]
    for world in (1, 2, 4, 6, 8, 12, 16, 18, 24, 32, 36, 48, 64):
        for pipeline in (1, 2, 3, 4):
            for tensor in tensors:
                if world % (pipeline * tensor["size"]) == 0:
                    out.append((world, {"pipeline": pipeline, "tensor": tensor}))
    return out


CONFIGS = _configs()


def _id(case: tuple[int, dict[str, Any]]) -> str:
    world, parallel = case
    t = parallel["tensor"]
    return f"w{world}-p{parallel['pipeline']}-t{t['size']}{t.get('mode') or ''}{t.get('depth', '')}"


def _of_mode(mode: str) -> list[tuple[int, dict[str, Any]]]:
    return [k for k in CONFIGS if k[1]["tensor"].get("mode") == mode]


def test_many_configs_are_covered() -> None:
    modes = {p["tensor"].get("mode") for _, p in CONFIGS}
    assert modes == {None, "1d", "2d", "2.5d", "3d", "sequence"}
    assert len(CONFIGS) > 200


EXPECTED_MODES = {
    None: [],
    "1d": [M.PARALLEL_1D],
    "2d": [M.PARALLEL_2D_ROW, M.PARALLEL_2D_COL],
    "2.5d": [M.PARALLEL_2P5D_ROW, M.PARALLEL_2P5D_COL, M.PARALLEL_2P5D_DEP, M.PARALLEL_2P5D_XZ],
    "3d": [
        M.PARALLEL_3D_INPUT,
        M.PARALLEL_3D_WEIGHT,
        M.PARALLEL_3D_OUTPUT,
        M.PARALLEL_3D_INPUT_X_WEIGHT,
        M.PARALLEL_3D_OUTPUT_X_WEIGHT,
    ],
    "sequence": [M.SEQUENCE, M.SEQUENCE_DP],
}


def _expected_sizes(c: ParallelConfig) -> dict[str, int]:
    q, d = c.tensor_dim, c.tensor_depth
    sizes = {
        M.GLOBAL: c.world_size,
        M.DATA: c.data_size,
        M.PIPELINE: c.pipeline_size,
        M.TENSOR: c.tensor_size,
        M.MODEL: c.pipeline_size * c.tensor_size,
        M.PARALLEL_1D: c.tensor_size,
        M.PARALLEL_2D_ROW: q,
        M.PARALLEL_2D_COL: q,
        M.PARALLEL_2P5D_ROW: q,
        M.PARALLEL_2P5D_COL: q,
        M.PARALLEL_2P5D_DEP: d,
        M.PARALLEL_2P5D_XZ: q * d,
        M.PARALLEL_3D_INPUT: q,
        M.PARALLEL_3D_WEIGHT: q,
        M.PARALLEL_3D_OUTPUT: q,
        M.PARALLEL_3D_INPUT_X_WEIGHT: q * q,
        M.PARALLEL_3D_OUTPUT_X_WEIGHT: q * q,
        M.SEQUENCE: c.tensor_size,
        M.SEQUENCE_DP: c.data_size * c.tensor_size,
    }
    return {str(k): v for k, v in sizes.items()}


@pytest.mark.parametrize("case", CONFIGS, ids=_id)
def test_groups_partition_the_ranks_with_the_stated_sizes(case: tuple[int, dict[str, Any]]) -> None:
    world, parallel = case
    c = ParallelConfig.from_dict(parallel, world)
    layout = rank_groups(c)
    base = [M.GLOBAL, M.DATA, M.PIPELINE, M.TENSOR, M.MODEL]
    assert list(layout) == base + EXPECTED_MODES[c.tensor_mode]
    sizes = _expected_sizes(c)
    for mode, groups in layout.items():
        flat = sorted(r for g in groups for r in g)
        assert flat == list(range(world)), f"{mode} does not partition the ranks"
        assert all(len(g) == sizes[str(mode)] for g in groups), mode
        assert all(list(g) == sorted(g) for g in groups), f"{mode} groups are not ascending"
    # every tensor-mode group lies inside one tensor group
    tensor_of = {r: g for g in layout[M.TENSOR] for r in g}
    for mode in EXPECTED_MODES[c.tensor_mode]:
        if mode is M.SEQUENCE_DP:
            continue
        for g in layout[mode]:
            assert set(g) <= set(tensor_of[g[0]]), mode


@pytest.mark.parametrize("case", CONFIGS, ids=_id)
def test_global_groups_follow_the_documented_coordinates(case: tuple[int, dict[str, Any]]) -> None:
    world, parallel = case
    c = ParallelConfig.from_dict(parallel, world)
    layout = rank_groups(c)
    for rank in range(world):
        d, p, t = coordinates(c, rank)
        assert rank == d * c.pipeline_size * c.tensor_size + p * c.tensor_size + t
        assert global_rank(c, d, p, t) == rank
    coords = [coordinates(c, r) for r in range(world)]
    for g in layout[M.DATA]:
        assert [coords[r][0] for r in g] == list(range(c.data_size))
        assert len({coords[r][1:] for r in g}) == 1
    for g in layout[M.PIPELINE]:
        assert [coords[r][1] for r in g] == list(range(c.pipeline_size))
        assert len({(coords[r][0], coords[r][2]) for r in g}) == 1
    for g in layout[M.TENSOR]:
        assert [coords[r][2] for r in g] == list(range(c.tensor_size))
        assert g == tuple(range(g[0], g[0] + c.tensor_size))  # consecutive: one node
    for g in layout[M.MODEL]:
        assert len({coords[r][0] for r in g}) == 1
    # a DATA group and a MODEL group meet in exactly one rank
    for data, model in itertools.product(layout[M.DATA], layout[M.MODEL]):
        assert len(set(data) & set(model)) == 1


def _tensor_coords(c: ParallelConfig, rank: int) -> tuple[int, ...]:
    t = coordinates(c, rank)[2]
    q = c.tensor_dim
    if c.tensor_mode == "2d":
        return divmod(t, q)  # (row, col)
    if c.tensor_mode == "2.5d":
        dep, rest = divmod(t, q * q)
        return (dep, *divmod(rest, q))  # (dep, row, col)
    if c.tensor_mode == "3d":
        z, rest = divmod(t, q * q)
        y, x = divmod(rest, q)
        return (x, y, z)
    return (t,)


def _block(c: ParallelConfig, rank: int) -> tuple[int, int]:
    return coordinates(c, rank)[:2]


def _varies(c: ParallelConfig, group: tuple[int, ...], axes: tuple[int, ...]) -> None:
    """The group has one block, is constant on the other axes, and is ordered by ``axes``."""
    cs = [_tensor_coords(c, r) for r in group]
    assert len({_block(c, r) for r in group}) == 1
    other = [i for i in range(len(cs[0])) if i not in axes]
    assert len({tuple(x[i] for i in other) for x in cs}) == 1
    keys = [tuple(x[i] for i in axes) for x in cs]
    assert keys == sorted(keys) and len(set(keys)) == len(keys)


@pytest.mark.parametrize("case", _of_mode("2d"), ids=_id)
def test_2d_rows_and_cols(case: tuple[int, dict[str, Any]]) -> None:
    c = ParallelConfig.from_dict(case[1], case[0])
    layout = rank_groups(c)
    for g in layout[M.PARALLEL_2D_ROW]:
        _varies(c, g, (1,))  # same row, ordered by col
    for g in layout[M.PARALLEL_2D_COL]:
        _varies(c, g, (0,))  # same col, ordered by row
    for row, col in itertools.product(layout[M.PARALLEL_2D_ROW], layout[M.PARALLEL_2D_COL]):
        same_block = _block(c, row[0]) == _block(c, col[0])
        assert len(set(row) & set(col)) == (1 if same_block else 0)


@pytest.mark.parametrize("case", _of_mode("2.5d"), ids=_id)
def test_2p5d_groups(case: tuple[int, dict[str, Any]]) -> None:
    c = ParallelConfig.from_dict(case[1], case[0])
    layout = rank_groups(c)
    for g in layout[M.PARALLEL_2P5D_ROW]:
        _varies(c, g, (2,))
    for g in layout[M.PARALLEL_2P5D_COL]:
        _varies(c, g, (1,))
    for g in layout[M.PARALLEL_2P5D_DEP]:
        _varies(c, g, (0,))
    for g in layout[M.PARALLEL_2P5D_XZ]:
        _varies(c, g, (0, 1))  # same col, ordered by (dep, row)
    # ROW and COL of one layer meet in one rank; each XZ group is its col's COL groups joined
    for row, col in itertools.product(layout[M.PARALLEL_2P5D_ROW], layout[M.PARALLEL_2P5D_COL]):
        same_layer = _block(c, row[0]) == _block(c, col[0]) and (
            _tensor_coords(c, row[0])[0] == _tensor_coords(c, col[0])[0]
        )
        assert len(set(row) & set(col)) == (1 if same_layer else 0)
    for xz in layout[M.PARALLEL_2P5D_XZ]:
        cols = [g for g in layout[M.PARALLEL_2P5D_COL] if set(g) <= set(xz)]
        assert sorted(r for g in cols for r in g) == sorted(xz)
        assert len(cols) == c.tensor_depth
        deps = [g for g in layout[M.PARALLEL_2P5D_DEP] if set(g) & set(xz)]
        assert all(set(g) <= set(xz) for g in deps)


@pytest.mark.parametrize("case", _of_mode("3d"), ids=_id)
def test_3d_groups(case: tuple[int, dict[str, Any]]) -> None:
    c = ParallelConfig.from_dict(case[1], case[0])
    layout = rank_groups(c)
    x, y, z = 0, 1, 2
    for g in layout[M.PARALLEL_3D_WEIGHT]:
        _varies(c, g, (x,))
    for g in layout[M.PARALLEL_3D_INPUT]:
        _varies(c, g, (y,))
    for g in layout[M.PARALLEL_3D_OUTPUT]:
        _varies(c, g, (z,))
    for g in layout[M.PARALLEL_3D_INPUT_X_WEIGHT]:
        _varies(c, g, (y, x))
    for g in layout[M.PARALLEL_3D_OUTPUT_X_WEIGHT]:
        _varies(c, g, (z, x))
    axes = [M.PARALLEL_3D_INPUT, M.PARALLEL_3D_WEIGHT, M.PARALLEL_3D_OUTPUT]
    for a, b in itertools.combinations(axes, 2):
        for ga, gb in itertools.product(layout[a], layout[b]):
            assert len(set(ga) & set(gb)) <= 1
    # a product group is the union of the 1-axis groups it contains
    for prod, parts in [
        (M.PARALLEL_3D_INPUT_X_WEIGHT, (M.PARALLEL_3D_INPUT, M.PARALLEL_3D_WEIGHT)),
        (M.PARALLEL_3D_OUTPUT_X_WEIGHT, (M.PARALLEL_3D_OUTPUT, M.PARALLEL_3D_WEIGHT)),
    ]:
        for g in layout[prod]:
            for part in parts:
                inside = [h for h in layout[part] if set(h) <= set(g)]
                assert sorted(r for h in inside for r in h) == sorted(g)


@pytest.mark.parametrize("case", _of_mode("sequence"), ids=_id)
def test_sequence_groups_follow_the_pipeline(case: tuple[int, dict[str, Any]]) -> None:
    c = ParallelConfig.from_dict(case[1], case[0])
    layout = rank_groups(c)
    assert layout[M.SEQUENCE] == layout[M.TENSOR]
    assert len(layout[M.SEQUENCE_DP]) == c.pipeline_size
    for g in layout[M.SEQUENCE_DP]:
        stages = {coordinates(c, r)[1] for r in g}
        assert len(stages) == 1  # one pipeline stage: the ranks holding the same parameters
        stage = stages.pop()
        data = [h for h in layout[M.DATA] if coordinates(c, h[0])[1] == stage]
        assert sorted(r for h in data for r in h) == sorted(g)
    for pipe, sdp in itertools.product(layout[M.PIPELINE], layout[M.SEQUENCE_DP]):
        assert len(set(pipe) & set(sdp)) == 1


def test_1d_is_the_tensor_group() -> None:
    layout = rank_groups(ParallelConfig.from_dict({"tensor": {"size": 4, "mode": "1d"}}, 8))
    assert layout[M.PARALLEL_1D] == layout[M.TENSOR] == [(0, 1, 2, 3), (4, 5, 6, 7)]


def test_documented_examples() -> None:
    c = ParallelConfig.from_dict({"pipeline": 2, "tensor": {"size": 4, "mode": "2d"}}, 16)
    layout = rank_groups(c)
    assert layout[M.DATA][:3] == [(0, 8), (1, 9), (2, 10)]
    assert layout[M.PIPELINE][:2] == [(0, 4), (1, 5)]
    assert layout[M.PARALLEL_2D_ROW][:2] == [(0, 1), (2, 3)]
    assert layout[M.PARALLEL_2D_COL][:2] == [(0, 2), (1, 3)]
    c3 = ParallelConfig.from_dict({"tensor": {"size": 8, "mode": "3d"}}, 8)
    l3 = rank_groups(c3)
    assert l3[M.PARALLEL_3D_WEIGHT][0] == (0, 1)
    assert l3[M.PARALLEL_3D_INPUT][0] == (0, 2)
    assert l3[M.PARALLEL_3D_OUTPUT][0] == (0, 4)
    assert l3[M.PARALLEL_3D_INPUT_X_WEIGHT] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert l3[M.PARALLEL_3D_OUTPUT_X_WEIGHT] == [(0, 1, 4, 5), (2, 3, 6, 7)]


def test_modes_and_strings_are_interchangeable_keys() -> None:
    layout = rank_groups(ParallelConfig.from_dict({}, 2))
    assert layout["data"] == layout[M.DATA]
    assert M.DATA == "data" and str(M.DATA) == "data" and f"{M.DATA}" == "data"


def test_coordinates_rejects_out_of_range_ranks() -> None:
    c = ParallelConfig.from_dict({}, 2)
    with pytest.raises(ValueError, match="rank 2 is outside world size 2"):
        coordinates(c, 2)
