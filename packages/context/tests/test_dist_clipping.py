"""Global-norm clipping from ShardInfo on hand-made shards, against torch on full tensors.

Through ``tessera.context.clip_grad_norm`` (the engine's step) and through torch's own
``torch.nn.utils.clip_grad_norm_``, which a loop of one's own calls: on split parameters it
clips by the global norm too (``torch_clipping``), where torch's alone would clip each rank by
the norm of its blocks.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn

from tessera.context import (
    ParallelMode,
    ShardInfo,
    clip_grad_norm,
    create_context,
    no_context,
    set_context,
    set_shard_info,
)

M = ParallelMode
SHAPES = [(8, 4), (8,), (4, 8), (4,)]


def _full_grads() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return [torch.randn(*s, generator=g) for s in SHAPES]


def _infos(ctx: Any, mode: str) -> list[ShardInfo]:
    if mode == "1d":
        r, n = ctx.get_local_rank(M.PARALLEL_1D), ctx.get_world_size(M.PARALLEL_1D)
        d1 = M.PARALLEL_1D
        return [
            ShardInfo.from_split(SHAPES[0], {0: [(d1, r, n)]}),  # column parallel weight
            ShardInfo.from_split(SHAPES[1], {0: [(d1, r, n)]}),  # its bias
            ShardInfo.from_split(SHAPES[2], {1: [(d1, r, n)]}),  # row parallel weight
            ShardInfo.from_split(SHAPES[3], {}, replicated_modes=[d1]),  # bias kept whole
        ]
    row, col = M.PARALLEL_2D_ROW, M.PARALLEL_2D_COL
    rr, rc = ctx.get_local_rank(row), ctx.get_local_rank(col)
    q = ctx.get_world_size(row)
    return [
        ShardInfo.from_split(SHAPES[0], {0: [(col, rc, q)], 1: [(row, rr, q)]}),
        ShardInfo.from_split(SHAPES[1], {0: [(col, rc, q)]}, replicated_modes=[row]),
        ShardInfo.from_split(SHAPES[2], {0: [(row, rr, q)], 1: [(col, rc, q)]}),
        ShardInfo.from_split(SHAPES[3], {}, replicated_modes=[row, col]),
    ]


def _clip_shards(
    parallel: dict[str, Any], mode: str, norm_type: float, through_torch: bool = False
) -> dict[str, Any]:
    ctx = create_context(dict(parallel=parallel), timeout=60)
    try:
        pp, stage = ctx.pipeline_size, ctx.get_local_rank(M.PIPELINE)
        held = [i for i in range(len(SHAPES)) if pp == 1 or (i < 2) == (stage == 0)]
        infos = _infos(ctx, mode)
        grads = _full_grads()
        params = []
        for i in held:
            info = infos[i]
            p = nn.Parameter(torch.zeros(info.local_shape))
            p.grad = grads[i][info.slices].clone()
            set_shard_info(p, info)
            params.append(p)
        if through_torch:
            refused = pytest.raises(RuntimeError, match="no ParallelContext is current")
            with no_context(), refused:
                torch.nn.utils.clip_grad_norm_(params, 0.5, norm_type)
            set_context(ctx)
            norm = torch.nn.utils.clip_grad_norm_(params, 0.5, norm_type)
        else:
            norm = clip_grad_norm(params, 0.5, norm_type, context=ctx)
        return {
            "norm": norm.item(),
            "grads": {i: p.grad.clone() for i, p in zip(held, params, strict=True)},  # type: ignore[union-attr]
            "slices": {i: infos[i].slices for i in held},
        }
    finally:
        ctx.destroy()


LAYOUTS = {
    "dp2_1d2": (dict(tensor=dict(size=2, mode="1d")), "1d"),
    "pp2_1d2": (dict(pipeline=2, tensor=dict(size=2, mode="1d")), "1d"),
    "2d4": (dict(tensor=dict(size=4, mode="2d")), "2d"),
}


@pytest.mark.parametrize(
    ("norm_type", "through_torch"),
    [(2.0, False), (math.inf, False), (2.0, True)],
    ids=["l2", "inf", "l2-torch"],
)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_sharded_clip_equals_torch_on_full_params(
    dist: Any, layout: str, norm_type: float, through_torch: bool
) -> None:
    parallel, mode = LAYOUTS[layout]
    args = (parallel, mode, norm_type, through_torch)
    results = dist.run(_clip_shards, world_size=4, args=args, timeout=120)
    full = [nn.Parameter(torch.zeros(s)) for s in SHAPES]
    for p, g in zip(full, _full_grads(), strict=True):
        p.grad = g.clone()
    want = torch.nn.utils.clip_grad_norm_(full, 0.5, norm_type)
    assert want > 0.5  # the reference really clips
    for r in results:
        assert r["norm"] == pytest.approx(want.item(), rel=1e-6)
        for i, grad in r["grads"].items():
            torch.testing.assert_close(grad, full[i].grad[r["slices"][i]], rtol=1e-6, atol=1e-7)  # type: ignore[index]
