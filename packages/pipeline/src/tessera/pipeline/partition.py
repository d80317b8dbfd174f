"""Cutting a sequence of layers into contiguous parts, one per virtual stage.

A partition is written as ``boundaries``: a list of ``num_stages * num_chunks + 1`` increasing
ints with ``boundaries[0] == 0`` and ``boundaries[-1] == num_items``; virtual stage ``v`` holds
items ``range(boundaries[v], boundaries[v + 1])``, and chunk ``c`` of pipeline rank ``r`` is
virtual stage ``c * num_stages + r`` (interleaved assignment, Narayanan et al. 2021). Every part
holds at least one item.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = [
    "partition_uniform",
    "partition_balanced",
    "check_boundaries",
    "stage_ranges",
]


def _num_parts(num_items: int, num_stages: int, num_chunks: int) -> int:
    for name, value in (("num_stages", num_stages), ("num_chunks", num_chunks)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    parts = num_stages * num_chunks
    if num_items < parts:
        raise ValueError(
            f"cannot cut {num_items} layers into {parts} virtual stages "
            f"({num_stages} stages x {num_chunks} chunks): every virtual stage needs at least one "
            "layer"
        )
    return parts


def partition_uniform(num_items: int, num_stages: int, num_chunks: int = 1) -> list[int]:
    """Cut ``num_items`` into ``num_stages * num_chunks`` parts whose sizes differ by at most 1.

    The first ``num_items % parts`` parts get the extra item.

    Returns:
        The boundaries (see the module docstring).

    Raises:
        ValueError: fewer items than virtual stages (both numbers are named).
    """
    parts = _num_parts(num_items, num_stages, num_chunks)
    base, extra = divmod(num_items, parts)
    boundaries = [0]
    for v in range(parts):
        boundaries.append(boundaries[-1] + base + (1 if v < extra else 0))
    return boundaries


def partition_balanced(weights: Sequence[float], num_stages: int, num_chunks: int = 1) -> list[int]:
    """Cut ``weights`` into contiguous parts minimising the heaviest part's total weight.

    Exact: the optimum is the total of some contiguous run of weights, so the candidate totals are
    sorted and the smallest one for which a greedy cut needs no more than ``parts`` parts is found
    by binary search (``O(n^2 log n)``, fine for the layer counts of real models). Among the cuts
    reaching that optimum it returns the most even one, the smallest sum of squared part weights
    (dynamic programming, skipped for very large inputs, where the greedy cut is kept), with ties
    going to longer earlier parts, so layers without weight (activations, dropout) stay with the
    layer before them. All-zero weights fall back to :func:`partition_uniform`.

    Args:
        weights: non-negative weight per item (e.g. its parameter count).
        num_stages: pipeline stages.
        num_chunks: model chunks per stage.

    Returns:
        The boundaries (see the module docstring).

    Raises:
        ValueError: a negative or non-finite weight, or fewer items than virtual stages.
    """
    n = len(weights)
    parts = _num_parts(n, num_stages, num_chunks)
    for index, weight in enumerate(weights):
        if not math.isfinite(weight) or weight < 0:
            raise ValueError(f"weights[{index}] = {weight!r}; weights must be finite and >= 0")
    prefix = [0.0]
    for weight in weights:
        prefix.append(prefix[-1] + weight)
    if prefix[-1] == 0:
        return partition_uniform(n, num_stages, num_chunks)

    # Every part total is computed as prefix[j] - prefix[i], here and in the greedy check, so the
    # comparisons agree exactly even with float rounding.
    candidates = sorted({prefix[j] - prefix[i] for i in range(n) for j in range(i + 1, n + 1)})
    lo, hi = 0, len(candidates) - 1  # the whole sum always fits in one part
    while lo < hi:
        mid = (lo + hi) // 2
        if _greedy_parts(prefix, candidates[mid]) <= parts:
            hi = mid
        else:
            lo = mid + 1
    limit = candidates[lo]
    if n * n * parts <= _EVEN_WORK_LIMIT:
        return _most_even_cut(prefix, limit, parts)
    return _cut(prefix, limit, parts)


_EVEN_WORK_LIMIT = 2_000_000


def _most_even_cut(prefix: Sequence[float], limit: float, parts: int) -> list[int]:
    """The cut into ``parts`` non-empty parts under ``limit`` with the least sum of squares."""
    n = len(prefix) - 1
    inf = math.inf
    # cost[k][j]: best sum of squares cutting items [0, j) into k parts; start[k][j]: where the
    # k-th part starts in that best cut.
    cost = [[inf] * (n + 1) for _ in range(parts + 1)]
    start = [[0] * (n + 1) for _ in range(parts + 1)]
    cost[0][0] = 0.0
    for k in range(1, parts + 1):
        for j in range(k, n - (parts - k) + 1):
            best, where = inf, -1
            for i in range(j - 1, k - 2, -1):  # latest start first: ties keep longer early parts
                total = prefix[j] - prefix[i]
                if total > limit:
                    break
                candidate = cost[k - 1][i] + total * total
                if candidate < best:
                    best, where = candidate, i
            cost[k][j], start[k][j] = best, where
    boundaries = [n]
    for k in range(parts, 0, -1):
        boundaries.append(start[k][boundaries[-1]])
    return boundaries[::-1]


def _greedy_parts(prefix: Sequence[float], limit: float) -> int | float:
    """Parts needed when each takes as many items as fit under ``limit`` (inf if one cannot)."""
    n = len(prefix) - 1
    start, count = 0, 0
    while start < n:
        end = _furthest_end(prefix, start, limit)
        if end == start:
            return math.inf
        start, count = end, count + 1
    return count


def _furthest_end(prefix: Sequence[float], start: int, limit: float) -> int:
    """Largest ``end`` with ``prefix[end] - prefix[start] <= limit`` (``start`` if none)."""
    # prefix is non-decreasing and float subtraction is monotone, so binary search is exact.
    lo, hi = start, len(prefix) - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if prefix[mid] - prefix[start] <= limit:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _cut(prefix: Sequence[float], limit: float, parts: int) -> list[int]:
    """Exactly ``parts`` non-empty parts under ``limit``, each as long as the rest allows."""
    n = len(prefix) - 1
    boundaries = [0]
    for k in range(parts):
        start = boundaries[-1]
        leave = parts - k - 1  # one item for each later part
        end = min(_furthest_end(prefix, start, limit), n - leave)
        boundaries.append(end)
    return boundaries


def check_boundaries(boundaries: Sequence[int], num_items: int, num_parts: int) -> list[int]:
    """Validate an explicit partition; returns it as a list.

    Raises:
        ValueError: wrong length, not starting at 0 / ending at ``num_items``, or an empty part.
    """
    bounds = [int(b) for b in boundaries]
    if len(bounds) != num_parts + 1:
        raise ValueError(
            f"{num_parts} virtual stages need {num_parts + 1} boundaries, got {len(bounds)}: "
            f"{bounds}"
        )
    if bounds[0] != 0 or bounds[-1] != num_items:
        raise ValueError(
            f"boundaries must start at 0 and end at the number of layers {num_items}, got {bounds}"
        )
    for v in range(num_parts):
        if bounds[v + 1] <= bounds[v]:
            raise ValueError(
                f"virtual stage {v} would be empty: boundaries[{v}] = {bounds[v]} >= "
                f"boundaries[{v + 1}] = {bounds[v + 1]}"
            )
    return bounds


def stage_ranges(
    boundaries: Sequence[int], pipeline_rank: int, num_stages: int, num_chunks: int = 1
) -> list[range]:
    """The item ranges of each chunk of ``pipeline_rank``, chunk 0 first."""
    if not 0 <= pipeline_rank < num_stages:
        raise ValueError(f"pipeline_rank {pipeline_rank} is outside [0, {num_stages})")
    check_boundaries(boundaries, boundaries[-1], num_stages * num_chunks)
    ranges = []
    for chunk in range(num_chunks):
        v = chunk * num_stages + pipeline_rank
        ranges.append(range(boundaries[v], boundaries[v + 1]))
    return ranges
