from __future__ import annotations

import pytest
import torch

from tessera.engine import DynamicLossScaler


def test_unscale_divides_and_detects_overflow() -> None:
    s = DynamicLossScaler(init_scale=8.0, growth_interval=2)
    g = [torch.full((3,), 16.0), torch.full((2,), 8.0)]
    assert s.unscale_(g) is False
    assert torch.equal(g[0], torch.full((3,), 2.0))
    assert torch.equal(g[1], torch.full((2,), 1.0))
    bad = [torch.tensor([1.0, float("inf")]), torch.ones(2)]
    assert s.unscale_(bad) is True
    nan = [torch.tensor([float("nan")])]
    assert s.unscale_(nan) is True


def test_update_backs_off_and_grows() -> None:
    s = DynamicLossScaler(init_scale=8.0, growth_interval=2, min_scale=2.0)
    s.update(True)
    assert s.scale == 4.0 and s.skipped_steps == 1
    s.update(False)
    assert s.scale == 4.0
    s.update(False)
    assert s.scale == 8.0
    for _ in range(5):
        s.update(True)
    assert s.scale == 2.0  # min_scale
    state = s.state_dict()
    other = DynamicLossScaler()
    other.load_state_dict(state)
    assert other.scale == 2.0 and other.skipped_steps == s.skipped_steps


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="backoff_factor"):
        DynamicLossScaler(backoff_factor=1.5)
    with pytest.raises(ValueError, match="growth_interval"):
        DynamicLossScaler(growth_interval=0)
