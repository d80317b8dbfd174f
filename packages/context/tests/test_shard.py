"""ShardInfo: validation, even splits, attach/read, serialization."""

from __future__ import annotations

import io
import re
from typing import Any

import pytest
import torch

from tessera.context import ParallelMode, ShardInfo, get_shard_info, set_shard_info

M = ParallelMode


def test_2d_weight_block() -> None:
    # q = 2; this rank is row 1, col 0 of the mesh: weight [out/q, in/q]
    info = ShardInfo.from_split(
        (8, 6), {0: [(M.PARALLEL_2D_COL, 1, 2)], 1: [(M.PARALLEL_2D_ROW, 0, 2)]}
    )
    assert info.local_shape == (4, 3)
    assert info.offsets == (4, 0)
    assert info.split_modes == (("parallel_2d_col",), ("parallel_2d_row",))
    assert info.split_dims == {0: ("parallel_2d_col",), 1: ("parallel_2d_row",)}
    assert info.sharded_modes == ("parallel_2d_col", "parallel_2d_row")
    assert info.is_sharded
    full = torch.arange(48.0).reshape(8, 6)
    assert torch.equal(full[info.slices], full[4:8, 0:3])
    assert info.global_numel == 48


def test_two_modes_on_one_dim_are_mixed_radix() -> None:
    # 2.5D: dim 0 split over (DEP, COL) with depth 2, q 2 -> 4 blocks; dep 1, col 1 -> block 3
    info = ShardInfo.from_split(
        (8,), {0: [(M.PARALLEL_2P5D_DEP, 1, 2), (M.PARALLEL_2P5D_COL, 1, 2)]}
    )
    assert (info.offsets, info.local_shape) == ((6,), (2,))
    assert info.split_modes == (("parallel_2p5d_dep", "parallel_2p5d_col"),)


def test_replicated_and_partial_grad_modes() -> None:
    info = ShardInfo.from_split(
        (4,), {}, replicated_modes=[M.SEQUENCE], partial_grad_modes=[M.SEQUENCE]
    )
    assert not info.is_sharded
    assert info.split_modes == ((),)
    assert info.replicated_modes == ("sequence",) and info.partial_grad_modes == ("sequence",)


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        (
            dict(global_shape=(4,), offsets=(3,), local_shape=(2,), split_modes=(("tensor",),)),
            "offset 3 + local size 2 = 5 exceeds the global size 4",
        ),
        (
            dict(global_shape=(4, 4), offsets=(0,), local_shape=(4, 4)),
            "offsets has 1 entries but global_shape (4, 4) has 2 dimensions",
        ),
        (
            dict(global_shape=(4,), offsets=(0,), local_shape=(2,)),
            "dim 0 is split over no mode but holds [0, 2) of 4",
        ),
        (dict(global_shape=(4,), offsets=(-1,), local_shape=(4,)), "non-negative ints"),
        (
            dict(
                global_shape=(4, 4),
                offsets=(0, 0),
                local_shape=(2, 2),
                split_modes=(("tensor",), ("tensor",)),
            ),
            "uses a mode for two dims",
        ),
        (
            dict(
                global_shape=(4,),
                offsets=(0,),
                local_shape=(2,),
                split_modes=(("tensor",),),
                replicated_modes=("tensor",),
            ),
            "both split and replicated",
        ),
        (
            dict(
                global_shape=(4,), offsets=(0,), local_shape=(4,), partial_grad_modes=("sequence",)
            ),
            "not in replicated_modes",
        ),
        (
            dict(global_shape=(4,), offsets=(0,), local_shape=(4,), replicated_modes="tensor"),
            "must be a sequence of modes",
        ),
        (
            dict(global_shape=(4,), offsets=(0,), local_shape=(4,), replicated_modes=("a", "a")),
            "lists a mode twice",
        ),
    ],
)
def test_invalid_shard_infos(kwargs: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ValueError) as info:
        ShardInfo(**kwargs)
    assert fragment in str(info.value)


def test_from_split_errors() -> None:
    with pytest.raises(ValueError, match=r"dim 0 of size 6 is not divisible into 4 = 4"):
        ShardInfo.from_split((6,), {0: [("tensor", 0, 4)]})
    with pytest.raises(ValueError, match="split dim 1 is outside"):
        ShardInfo.from_split((6,), {1: [("tensor", 0, 2)]})
    with pytest.raises(ValueError, match="local rank 2 is outside group size 2"):
        ShardInfo.from_split((6,), {0: [("tensor", 2, 2)]})


def test_attach_and_read() -> None:
    param = torch.nn.Parameter(torch.zeros(2, 3))
    assert get_shard_info(param) is None
    info = ShardInfo.from_split((4, 3), {0: [(M.PARALLEL_1D, 1, 2)]})
    set_shard_info(param, info)
    assert get_shard_info(param) is info
    expected = "shape (3,) cannot carry a ShardInfo whose local_shape is (2, 3)"
    with pytest.raises(ValueError, match=re.escape(expected)):
        set_shard_info(torch.zeros(3), info)


def test_round_trip_through_weights_only_checkpoint() -> None:
    info = ShardInfo.from_split(
        (4, 6),
        {1: [(M.PARALLEL_1D, 1, 2)]},
        replicated_modes=[M.SEQUENCE],
        partial_grad_modes=[M.SEQUENCE],
    )
    buffer = io.BytesIO()
    torch.save(info.to_dict(), buffer)
    buffer.seek(0)
    assert ShardInfo.from_dict(torch.load(buffer, weights_only=True)) == info


def test_is_frozen_and_hashable() -> None:
    info = ShardInfo((2,), (0,), (2,))
    with pytest.raises(AttributeError):
        info.offsets = (1,)  # type: ignore[misc]
    assert hash(info) == hash(ShardInfo((2,), (0,), (2,), ((),)))


def test_pipeline_shared_mark() -> None:
    """The tie key layers write on a weight two stages hold; a second, other key is refused."""
    from tessera.context import mark_pipeline_shared, pipeline_shared_key

    weight = torch.nn.Parameter(torch.zeros(4, 2))
    assert pipeline_shared_key(weight) is None
    mark_pipeline_shared(weight, "transformer.wte.weight")
    mark_pipeline_shared(weight, "transformer.wte.weight")  # the same key again: fine
    assert pipeline_shared_key(weight) == "transformer.wte.weight"
    with pytest.raises(ValueError, match=r"\[4, 2\] is already tied under 'transformer.wte"):
        mark_pipeline_shared(weight, "lm_head.weight")
    with pytest.raises(ValueError, match="non-empty string"):
        mark_pipeline_shared(torch.zeros(1), "")
