"""The norm arithmetic, without processes."""

from __future__ import annotations

import math

import torch

from tessera.context import combine_norms, norm_contributions


def test_contributions_grouped_by_sorted_modes() -> None:
    a, b, c = torch.tensor([3.0, 4.0]), torch.tensor([1.0]), torch.tensor([2.0, 2.0])
    parts = norm_contributions([(a, ("x", "w")), (b, ()), (c, ("w", "x"))])
    assert set(parts) == {("w", "x"), ()}
    assert parts[("w", "x")].item() == 25.0 + 8.0
    assert parts[()].item() == 1.0
    assert combine_norms(parts).item() == 34.0


def test_empty_block_still_gives_its_key() -> None:
    parts = norm_contributions([(torch.zeros(0), ("parallel_1d",))])
    assert parts == {("parallel_1d",): torch.tensor(0.0)}


def test_inf_and_p_norms() -> None:
    a, b = torch.tensor([-5.0, 1.0]), torch.tensor([3.0])
    parts = norm_contributions([(a, ("m",)), (b, ())], math.inf)
    assert combine_norms(parts, math.inf).item() == 5.0
    parts3 = norm_contributions([(a, ()), (b, ())], 3.0)
    assert combine_norms(parts3, 3.0).item() == 125.0 + 1.0 + 27.0
    assert combine_norms({}).item() == 0.0
