"""Real gloo runs: the groups a context creates reach exactly the ranks its layout names."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from tessera.context import ConfigError, ParallelConfig, ParallelMode, create_context, rank_groups

M = ParallelMode


def _reach_every_mode(parallel: dict[str, Any]) -> dict[str, Any]:
    """All-reduce a one-hot of the global rank over every mode's group."""
    ctx = create_context(dict(parallel=parallel), timeout=60)
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        reached: dict[str, list[int]] = {}
        expected: dict[str, list[int]] = {}
        for mode in ctx.modes:
            one_hot = torch.zeros(world)
            one_hot[rank] = 1.0
            dist.all_reduce(one_hot, group=ctx.get_group(mode))
            reached[mode] = [r for r in range(world) if one_hot[r] == 1.0]
            expected[mode] = sorted(ctx.get_ranks_in_group(mode))
            assert one_hot.sum().item() == ctx.get_world_size(mode)
            assert ctx.get_ranks_in_group(mode)[ctx.get_local_rank(mode)] == rank
            assert dist.get_rank(ctx.get_group(mode)) == ctx.get_local_rank(mode)
        return {"reached": reached, "expected": expected, "modes": ctx.modes}
    finally:
        ctx.destroy()


CONFIGS = {
    "dp2_pp2_1d2": dict(pipeline=2, tensor=dict(size=2, mode="1d")),
    "pp2_2d4": dict(pipeline=2, tensor=dict(size=4, mode="2d")),
    "2p5d8_depth2": dict(tensor=dict(size=8, mode="2.5d", depth=2)),
    "3d8": dict(tensor=dict(size=8, mode="3d")),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_every_group_reaches_exactly_its_ranks(dist: Any, name: str) -> None:
    parallel = CONFIGS[name]
    results = dist.run(_reach_every_mode, world_size=8, args=(parallel,), timeout=240)
    layout = rank_groups(ParallelConfig.from_dict(parallel, 8))
    for rank, result in enumerate(results):
        assert result["reached"] == result["expected"]
        assert set(result["modes"]) == {str(m) for m in layout}
        for mode, groups in layout.items():
            (mine,) = [g for g in groups if rank in g]
            assert result["expected"][str(mode)] == sorted(mine)


# --------------------------------------------------------------------------- queries


def _queries() -> dict[str, Any]:
    ctx = create_context(
        {"parallel": {"pipeline": 2, "tensor": {"size": 2, "mode": "1d"}}}, timeout=60
    )
    try:
        out: dict[str, Any] = {
            "coords": ctx.coordinates,
            "sizes": (ctx.world_size, ctx.data_size, ctx.pipeline_size, ctx.tensor_size),
            "backend": ctx.backend,
            "device": str(ctx.device),
            "first_last": (ctx.is_first_rank(M.PIPELINE), ctx.is_last_rank(M.PIPELINE)),
            "next_prev": (ctx.get_next_global_rank(M.TENSOR), ctx.get_prev_global_rank(M.TENSOR)),
            "pipeline_ranks": ctx.get_ranks_in_group(M.PIPELINE),
            "cpu_is_main": ctx.get_cpu_group(M.TENSOR) is ctx.get_group(M.TENSOR),
            "initialized": (
                ctx.is_initialized(M.PARALLEL_1D),
                ctx.is_initialized("parallel_1d"),
                ctx.is_initialized(M.PARALLEL_2D_ROW),
                ctx.is_initialized("nope"),
            ),
            "timeout": ctx.timeout.total_seconds(),
            "full": ctx.full_config["parallel"]["pipeline"],
            # the facade is one line over each part; the parts answer alike
            "parts": (
                ctx.groups.of(M.TENSOR).group is ctx.get_group(M.TENSOR),
                ctx.groups.of(M.PIPELINE).neighbour(1) == ctx.get_next_global_rank(M.PIPELINE),
                ctx.groups.of("model").size == ctx.get_world_size(M.MODEL),
                ctx.groups.modes == ctx.modes,
                ctx.rng.active,
                ctx.failures.board is ctx.failure_board,
            ),
        }
        try:
            ctx.get_group(M.PARALLEL_2D_ROW)
        except ValueError as exc:
            out["error"] = str(exc)
        t = torch.ones(1)
        dist.all_reduce(t, group=ctx.get_cpu_group(M.MODEL))
        out["model_sum"] = t.item()
        return out
    finally:
        ctx.destroy()
        assert ctx.is_destroyed and not ctx.is_initialized(M.TENSOR)


def test_context_queries(dist: Any) -> None:
    results = dist.run(_queries, world_size=4, timeout=120)
    for rank, r in enumerate(results):
        assert r["coords"] == (0, rank // 2, rank % 2)
        assert r["sizes"] == (4, 1, 2, 2)
        assert (r["backend"], r["device"]) == ("gloo", "cpu")
        assert r["first_last"] == (rank < 2, rank >= 2)
        partner = rank ^ 1
        assert r["next_prev"] == (partner, partner)
        assert r["pipeline_ranks"] == [rank % 2, rank % 2 + 2]
        assert r["cpu_is_main"]
        assert r["initialized"] == (True, True, False, False)
        assert r["timeout"] == 60.0
        assert r["full"] == 2
        assert r["parts"] == (True, True, True, True, "__default__", True)
        assert "parallel mode 'parallel_2d_row' is not initialized" in r["error"]
        assert "'global', 'data', 'pipeline', 'tensor', 'model', 'parallel_1d'" in r["error"]
        assert r["model_sum"] == 4.0


def _queries_after_destroy() -> str:
    ctx = create_context({}, timeout=60)
    ctx.destroy()
    ctx.destroy()  # idempotent
    try:
        ctx.get_group(M.DATA)
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def test_destroyed_context_refuses_queries(dist: Any) -> None:
    for message in dist.run(_queries_after_destroy, world_size=2, timeout=60):
        assert "was destroyed" in message


# --------------------------------------------------------------------------- custom modes


def _custom_modes() -> dict[str, Any]:
    from custom_modes import PairsInitializer

    parallel = {
        "pipeline": 4,
        "extra": [{"type": "EmbeddingGroupInitializer"}, {"type": PairsInitializer}],
    }
    ctx = create_context({"parallel": parallel}, timeout=60)
    try:
        rank = dist.get_rank()
        out: dict[str, Any] = {"embedding": ctx.is_initialized("embedding")}
        if out["embedding"]:
            t = torch.tensor([float(rank)])
            dist.all_reduce(t, group=ctx.get_group("embedding"))
            out["embedding_sum"] = t.item()
            out["embedding_ranks"] = ctx.get_ranks_in_group("embedding")
        else:
            try:
                ctx.get_group("embedding")
            except ValueError as exc:
                out["error"] = str(exc)
        out["pairs_reversed_local"] = ctx.get_local_rank("pairs_reversed")
        gathered = [torch.zeros(1) for _ in range(2)]
        mine = torch.tensor([float(rank)])
        dist.all_gather(gathered, mine, group=ctx.get_group("pairs_reversed"))
        out["gathered"] = [g.item() for g in gathered]
        return out
    finally:
        ctx.destroy()


def test_custom_modes(dist: Any) -> None:
    results = dist.run(_custom_modes, world_size=4, timeout=120)
    for rank, r in enumerate(results):
        # pipeline 4: the first and last stage (ranks 0 and 3) share the embedding group
        assert r["embedding"] == (rank in (0, 3))
        if rank in (0, 3):
            assert r["embedding_sum"] == 3.0 and r["embedding_ranks"] == [0, 3]
        else:
            assert f"global rank {rank} is in no group of mode 'embedding'" in r["error"]
        # (1, 0), (3, 2): local ranks follow the initializer's order, not the sorted one
        assert r["pairs_reversed_local"] == 1 - rank % 2
        pair = [rank | 1, rank & ~1]
        assert r["gathered"] == [float(p) for p in pair]


# --------------------------------------------------------------------------- two contexts


def _two_contexts() -> dict[str, Any]:
    a = create_context({"parallel": {"tensor": {"size": 2, "mode": "1d"}}}, timeout=60)
    b = create_context({"parallel": {"pipeline": 2}}, timeout=60)
    rank = dist.get_rank()
    x = torch.tensor([float(rank)])
    y = torch.tensor([float(rank)])
    dist.all_reduce(x, group=a.get_group(M.TENSOR))  # pairs (0,1), (2,3)
    dist.all_reduce(y, group=b.get_group(M.PIPELINE))  # b is data 2 x pipeline 2: (0,1), (2,3)
    a.destroy()
    z = torch.tensor([float(rank)])
    dist.all_reduce(z, group=b.get_group(M.DATA))  # b still works after a is gone
    out = {"x": x.item(), "y": y.item(), "z": z.item(), "b_tensor": b.get_world_size(M.TENSOR)}
    b.destroy()
    return out


def test_two_contexts_do_not_interfere(dist: Any) -> None:
    for rank, r in enumerate(dist.run(_two_contexts, world_size=4, timeout=120)):
        assert r["x"] == float((rank & ~1) + (rank | 1))
        assert r["y"] == r["x"]
        assert r["z"] == float(rank % 2 + rank % 2 + 2)  # b's DATA: (0, 2), (1, 3)
        assert r["b_tensor"] == 1


# --------------------------------------------------------------------------- errors


def _mismatched(config: Any) -> str:
    try:
        create_context(config, timeout=30)
    except ConfigError as exc:
        return str(exc)
    return "no error"


def test_world_size_mismatch_is_a_config_error(dist: Any) -> None:
    pc = ParallelConfig.from_dict({"pipeline": 2, "tensor": {"size": 2, "mode": "1d"}}, 4)
    for message in dist.run(_mismatched, world_size=2, args=(pc,), timeout=60):
        assert "covers data 1 * pipeline 2 * tensor 2 = 4 ranks" in message
        assert "default process group has 2" in message
    bad = {"parallel": {"tensor": {"size": 4, "mode": "2d"}}}
    for message in dist.run(_mismatched, world_size=2, args=(bad,), timeout=60):
        assert "world size 2 is not divisible by pipeline 1 * tensor 4" in message


def test_create_context_needs_a_default_group() -> None:
    assert not torch.distributed.is_initialized()
    with pytest.raises(RuntimeError, match="needs an initialized default process group"):
        create_context({})


# --------------------------------------------------------------------------- seeds


def _seed_streams(parallel: dict[str, Any]) -> dict[str, Any]:
    ctx = create_context({"parallel": parallel}, seed=5, timeout=60)
    try:
        ctx.reseed()
        default1 = torch.rand(3)
        with ctx.seed(M.TENSOR):
            tensor1 = torch.rand(3)
            with ctx.seed(None):
                nested_default = torch.rand(3)
        default2 = torch.rand(3)
        with ctx.seed(M.TENSOR):
            tensor2 = torch.rand(3)
        state = ctx.get_rng_state()
        after_a = (torch.rand(2), _in_stream(ctx))
        ctx.set_rng_state(state)
        after_b = (torch.rand(2), _in_stream(ctx))
        return {
            "default": torch.cat([default1, nested_default, default2]).tolist(),
            "tensor": torch.cat([tensor1, tensor2]).tolist(),
            "restored": all(torch.equal(a, b) for a, b in zip(after_a, after_b, strict=True)),
            "default_seed": ctx.default_seed,
            "coords": ctx.coordinates,
        }
    finally:
        ctx.destroy()


def _in_stream(ctx: Any) -> torch.Tensor:
    with ctx.seed(M.TENSOR):
        return torch.rand(2)


def test_seed_streams(dist: Any) -> None:
    # dp2 x 1d(2): default equal everywhere, TENSOR differs across tensor ranks only
    results = dist.run(_seed_streams, world_size=4, args=({"tensor": {"size": 2, "mode": "1d"}},))
    assert all(r["restored"] for r in results)
    assert all(r["default"] == results[0]["default"] for r in results)
    assert all(r["default_seed"] == 5 for r in results)
    by_tensor_rank = {r["coords"][2]: r["tensor"] for r in results}
    assert by_tensor_rank[0] != by_tensor_rank[1]
    for r in results:  # equal across data replicas
        assert r["tensor"] == by_tensor_rank[r["coords"][2]]
        assert r["tensor"] != r["default"][: len(r["tensor"])]
    # pp2 x 1d(2): the default stream differs per stage (seed + pipeline rank)
    results = dist.run(
        _seed_streams, world_size=4, args=({"pipeline": 2, "tensor": {"size": 2, "mode": "1d"}},)
    )
    assert [r["default_seed"] for r in results] == [5, 5, 6, 6]
    assert results[0]["default"] == results[1]["default"] != results[2]["default"]
    assert results[2]["default"] == results[3]["default"]
    assert len({tuple(r["tensor"]) for r in results}) == 4


# --------------------------------------------------------------------------- device mesh


def _device_mesh() -> dict[str, Any]:
    ctx = create_context({"parallel": {"tensor": {"size": 2, "mode": "1d"}}}, timeout=60)
    try:
        mesh = ctx.device_mesh()
        t = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(t, group=mesh.get_group("dp"))
        return {
            "names": mesh.mesh_dim_names,
            "shape": tuple(mesh.mesh.shape),
            "mesh": mesh.mesh.tolist(),
            "tp_ranks": torch.distributed.get_process_group_ranks(mesh.get_group("tp")),
            "tp_expected": ctx.get_ranks_in_group(M.TENSOR),
            "dp_sum": t.item(),
            "cached": ctx.device_mesh() is mesh,
        }
    finally:
        ctx.destroy()


def test_device_mesh(dist: Any) -> None:
    for rank, r in enumerate(dist.run(_device_mesh, world_size=4, timeout=120)):
        assert r["names"] == ("dp", "pp", "tp")
        assert r["shape"] == (2, 1, 2)
        assert r["mesh"] == [[[0, 1]], [[2, 3]]]
        assert r["tp_ranks"] == r["tp_expected"]
        assert r["dp_sum"] == float(rank % 2 + rank % 2 + 2)
        assert r["cached"]


def _new_group_without_sort_ranks(
    calls: list[list[int]],
) -> Any:
    """``dist.new_group`` as torch 2.11 has it: no ``sort_ranks`` (it sorts every group)."""

    def new_group(ranks: list[int] | None = None, timeout: Any = None, backend: Any = None) -> str:
        calls.append(list(ranks or []))
        return "group"

    return new_group


def test_groups_keep_their_order_on_a_torch_that_would_sort_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A torch without ``sort_ranks`` builds every built-in group; an unsorted one is refused."""
    from datetime import timedelta

    from tessera.context.groups import new_group_in_order

    calls: list[list[int]] = []
    monkeypatch.setattr(dist, "new_group", _new_group_without_sort_ranks(calls))
    assert new_group_in_order((0, 2, 5), timedelta(seconds=1), None) == "group"
    assert calls == [[0, 2, 5]]
    with pytest.raises(RuntimeError, match=r"process group \[4, 1\] lists its ranks out of"):
        new_group_in_order((4, 1), timedelta(seconds=1), "gloo")
    assert calls == [[0, 2, 5]]  # refused before any group was created
    for world, parallel in [
        (8, {"tensor": {"size": 8, "mode": "3d"}}),
        (16, {"pipeline": 2, "tensor": {"size": 8, "mode": "2.5d", "depth": 2}}),
        (8, {"pipeline": 2, "tensor": {"size": 4, "mode": "2d"}}),
        (8, {"tensor": {"size": 4, "mode": "sequence"}}),
    ]:
        for groups in rank_groups(ParallelConfig.from_dict(parallel, world)).values():
            assert all(list(g) == sorted(g) for g in groups), (parallel, groups)
