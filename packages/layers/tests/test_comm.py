"""Each communication op: forward value and exact backward, on 2 and 4 ranks, dims 0/1/-1."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist_

from tessera.layers import (
    all_to_all,
    broadcast,
    copy_to_group,
    gather_along_dim,
    reduce_from_group,
    reduce_scatter_along_dim,
    split_along_dim,
)


def _per_rank(world: int, shape: tuple[int, ...], seed: int) -> list[torch.Tensor]:
    """Every rank's tensor, known to every rank."""
    return [
        torch.randn(shape, generator=torch.Generator().manual_seed(seed + r)) for r in range(world)
    ]


def _run(op, x: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.clone().requires_grad_()
    y = op(x)
    y.backward(grad)
    assert x.grad is not None
    return y.detach(), x.grad


def _check_ops() -> int:
    group = dist_.group.WORLD
    world, rank = dist_.get_world_size(), dist_.get_rank()
    eq = dict(rtol=1e-6, atol=1e-6)
    checks = 0
    for dim in (0, 1, -1):
        shape = [world * 2, world * 2, world * 2]
        xs = _per_rank(world, tuple(shape), 100)
        gs = _per_rank(world, tuple(shape), 200)
        x, g = xs[rank], gs[rank]
        total_g = sum(gs)

        y, dx = _run(lambda t: copy_to_group(t, group), x, g)
        torch.testing.assert_close(y, x, **eq)
        torch.testing.assert_close(dx, total_g, **eq)

        y, dx = _run(lambda t: reduce_from_group(t, group), x, g)
        torch.testing.assert_close(y, sum(xs), **eq)
        torch.testing.assert_close(dx, g, **eq)

        small_g = [t.chunk(world, dim)[0] for t in gs]  # gradients of a chunk-shaped output
        y, dx = _run(lambda t, d=dim: split_along_dim(t, d, group), x, small_g[rank])
        torch.testing.assert_close(y, x.chunk(world, dim)[rank], **eq)
        torch.testing.assert_close(dx, torch.cat(small_g, dim), **eq)

        chunks = [t.chunk(world, dim)[0] for t in xs]
        y, dx = _run(lambda t, d=dim: gather_along_dim(t, d, group), chunks[rank], g)
        torch.testing.assert_close(y, torch.cat(chunks, dim), **eq)
        torch.testing.assert_close(dx, g.chunk(world, dim)[rank], **eq)

        y, dx = _run(
            lambda t, d=dim: gather_along_dim(t, d, group, partial_grad=True), chunks[rank], g
        )
        torch.testing.assert_close(dx, total_g.chunk(world, dim)[rank], **eq)

        y, dx = _run(lambda t, d=dim: reduce_scatter_along_dim(t, d, group), x, small_g[rank])
        torch.testing.assert_close(y, sum(xs).chunk(world, dim)[rank], **eq)
        torch.testing.assert_close(dx, torch.cat(small_g, dim), **eq)
        checks += 6

    # all-to-all [b, s, h/p] -> [b, s/p, h]: rank r gets its sequence chunk of the full tensor
    full = _per_rank(1, (2, world * 2, world * 3), 300)[0]
    local = full.chunk(world, -1)[rank]
    grad_full = _per_rank(1, tuple(full.shape), 400)[0]
    y, dx = _run(lambda t: all_to_all(t, 1, -1, group), local, grad_full.chunk(world, 1)[rank])
    torch.testing.assert_close(y, full.chunk(world, 1)[rank], **eq)
    torch.testing.assert_close(dx, grad_full.chunk(world, -1)[rank], **eq)

    # broadcast from the last rank: it gets the summed gradient, the others zero
    src = world - 1
    y, dx = _run(lambda t: broadcast(t, src, group), xs[rank], gs[rank])
    torch.testing.assert_close(y, xs[src], **eq)
    torch.testing.assert_close(dx, total_g if rank == src else torch.zeros_like(x), **eq)

    # a size that does not split raises before any collective, naming size and divisor
    odd = torch.zeros(2, world * 2 + 1)
    for fn in (
        lambda: split_along_dim(odd, 1, group),
        lambda: reduce_scatter_along_dim(odd, 1, group),
        lambda: all_to_all(odd, 1, 0, group),
    ):
        try:
            fn()
        except ValueError as e:
            assert f"size {world * 2 + 1} is not divisible by {world}" in str(e), str(e)
        else:
            raise AssertionError("expected ValueError")
    try:
        broadcast(x, world, group)
    except ValueError as e:
        assert f"group of size {world}" in str(e)
    else:
        raise AssertionError("expected ValueError")
    return checks + 2


def _check_ops_over_collectives() -> int:
    """The same checks with blocks moved by collectives (NCCL's path) instead of pairwise."""
    import tessera.layers.comm.inflight as inflight

    pairwise = inflight._pairwise
    inflight._pairwise = lambda group: False  # type: ignore[assignment]
    try:
        return _check_ops()
    finally:
        inflight._pairwise = pairwise  # type: ignore[assignment]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("transport", ["pairwise", "collectives"])
def test_comm_ops_forward_and_backward(dist, world: int, transport: str) -> None:
    check = _check_ops if transport == "pairwise" else _check_ops_over_collectives
    assert dist.run(check, world_size=world, timeout=60.0) == [20] * world


def _check_block_dtypes() -> int:
    """Gather, scatter and all-to-all blocks keep every dtype, complex and empty blocks too."""
    from tessera.layers.comm.inflight import (
        start_all_to_all_blocks,
        start_gather_blocks,
        start_scatter_blocks,
    )

    group = dist_.group.WORLD
    world, rank = dist_.get_world_size(), dist_.get_rank()
    checks = 0
    for dtype in (torch.complex64, torch.bool, torch.int64, torch.bfloat16):
        for shape in ((2, 3), (0, 3)):
            # rank r's block for rank d: values r * 10 + d + 1, then cast
            def block(
                r: int, d: int, shape: tuple[int, ...] = shape, dtype: torch.dtype = dtype
            ) -> torch.Tensor:
                return torch.full(shape, r * 10 + d + 1).to(dtype)

            got = start_gather_blocks(block(rank, 0), group, world).wait()
            assert got.dtype == dtype
            assert torch.equal(got, torch.stack([block(r, 0) for r in range(world)]))
            sends = torch.stack([block(rank, d) for d in range(world)])
            got = start_all_to_all_blocks(sends, group, world).wait()
            assert torch.equal(got, torch.stack([block(r, rank) for r in range(world)]))
            if dtype != torch.bool:
                got = start_scatter_blocks(sends, group, world).wait()
                want = torch.stack([block(r, rank) for r in range(world)]).sum(0)
                assert torch.equal(got, want.to(dtype))
            checks += 1
    return checks


def test_blocks_keep_every_dtype(dist) -> None:
    assert dist.run(_check_block_dtypes, world_size=2, timeout=60.0) == [8, 8]
