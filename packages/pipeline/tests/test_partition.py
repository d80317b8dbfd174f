import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tessera.pipeline import (
    check_boundaries,
    partition_balanced,
    partition_uniform,
    stage_ranges,
)


def part_sums(weights, boundaries):
    return [sum(weights[a:b]) for a, b in itertools.pairwise(boundaries)]


def brute_force_min_max(weights, parts):
    n = len(weights)
    return min(
        max(part_sums(weights, [0, *cuts, n]))
        for cuts in itertools.combinations(range(1, n), parts - 1)
    )


def test_uniform_gives_extras_to_the_first_parts():
    assert partition_uniform(10, 4) == [0, 3, 6, 8, 10]
    assert partition_uniform(8, 2, num_chunks=2) == [0, 2, 4, 6, 8]
    assert partition_uniform(3, 3) == [0, 1, 2, 3]


def test_too_few_items_names_both_numbers():
    with pytest.raises(
        ValueError, match=r"cannot cut 5 layers into 6 virtual stages \(3 stages x 2"
    ):
        partition_uniform(5, 3, num_chunks=2)
    with pytest.raises(ValueError, match="cannot cut 3 layers into 4 virtual stages"):
        partition_balanced([1, 2, 3], 4)


def test_balanced_examples():
    assert partition_balanced([1, 1, 1, 1], 2) == [0, 2, 4]
    assert partition_balanced([10, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1], 2) == [0, 1, 11]
    # zero-weight layers (activations) stay with the layer before them
    assert partition_balanced([10, 0, 10, 0], 2) == [0, 2, 4]
    assert partition_balanced([0, 0, 0, 0], 2) == [0, 2, 4]  # falls back to uniform
    assert partition_balanced([5, 1, 1, 1, 1, 1, 1, 5], 2, num_chunks=2) == [0, 1, 4, 7, 8]


def test_balanced_rejects_bad_weights():
    with pytest.raises(ValueError, match=r"weights\[1\] = -1"):
        partition_balanced([1, -1, 2], 2)
    with pytest.raises(ValueError, match="num_stages must be a positive int"):
        partition_balanced([1, 2], 0)


@settings(max_examples=200, deadline=None)
@given(
    weights=st.lists(st.integers(min_value=0, max_value=30), min_size=1, max_size=9),
    stages=st.integers(min_value=1, max_value=4),
    chunks=st.integers(min_value=1, max_value=2),
)
def test_balanced_is_optimal_against_brute_force(weights, stages, chunks):
    parts = stages * chunks
    if len(weights) < parts:
        with pytest.raises(ValueError, match="cannot cut"):
            partition_balanced(weights, stages, chunks)
        return
    boundaries = partition_balanced(weights, stages, chunks)
    check_boundaries(boundaries, len(weights), parts)
    assert max(part_sums(weights, boundaries)) == brute_force_min_max(weights, parts)


@settings(max_examples=100, deadline=None)
@given(
    weights=st.lists(
        st.floats(min_value=0, max_value=1e6, allow_nan=False), min_size=2, max_size=8
    ),
    stages=st.integers(min_value=1, max_value=2),
)
def test_balanced_with_floats_is_optimal(weights, stages):
    boundaries = partition_balanced(weights, stages)
    best = brute_force_min_max(weights, stages)
    assert max(part_sums(weights, boundaries)) == pytest.approx(best, rel=1e-9, abs=1e-9)


def test_check_boundaries_errors():
    assert check_boundaries((0, 2, 4), 4, 2) == [0, 2, 4]
    with pytest.raises(ValueError, match="2 virtual stages need 3 boundaries, got 2"):
        check_boundaries([0, 4], 4, 2)
    with pytest.raises(ValueError, match="end at the number of layers 4"):
        check_boundaries([0, 2, 3], 4, 2)
    with pytest.raises(ValueError, match="virtual stage 1 would be empty"):
        check_boundaries([0, 2, 2, 4], 4, 3)


def test_stage_ranges_interleaved_assignment():
    boundaries = partition_uniform(8, 2, num_chunks=2)  # [0, 2, 4, 6, 8]
    # rank 0 holds virtual stages 0 and 2, rank 1 holds 1 and 3
    assert stage_ranges(boundaries, 0, 2, 2) == [range(0, 2), range(4, 6)]
    assert stage_ranges(boundaries, 1, 2, 2) == [range(2, 4), range(6, 8)]
    with pytest.raises(ValueError, match="outside"):
        stage_ranges(boundaries, 2, 2, 2)


def test_large_inputs_use_the_greedy_cut_and_stay_optimal():
    weights = [(i * 7919) % 101 for i in range(1500)]
    boundaries = partition_balanced(weights, 2)
    check_boundaries(boundaries, 1500, 2)
    best = max(part_sums(weights, boundaries))
    # with 2 parts the optimum is the best single cut
    assert best == min(max(sum(weights[:c]), sum(weights[c:])) for c in range(1, 1500))
