"""Norms with a weight per head: what the probe accepts, what it refuses, which heads a rank
holds. Their numerics under every mode are in test_parallelize.py (StableLM, Cohere)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tessera.layers.conversion.per_head_norm import (
    per_head_formula,
    per_head_norm_spec,
    rank_heads,
)


class _HeadsLast(nn.Module):
    """Cohere's kind: one ``[heads, d]`` weight, input ``[b, s, heads, d]``."""

    def __init__(self, heads: int = 4, dim: int = 8, *, same_row: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(heads, dim))
        self.eps, self.same_row = 1e-5, same_row

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight[:1] if self.same_row else self.weight  # row 0 for every head
        return nn.functional.layer_norm(x, x.shape[-1:], eps=self.eps) * weight


class _ListOfNorms(nn.Module):
    """StableLM's kind: a LayerNorm per head, input ``[b, heads, s, d]``."""

    def __init__(self, heads: int = 4, dim: int = 8) -> None:
        super().__init__()
        self.norms = nn.ModuleList(nn.LayerNorm(dim) for _ in range(heads))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = torch.split(x, 1, dim=1)
        return torch.cat([norm(part) for norm, part in zip(self.norms, parts, strict=True)], 1)


def test_the_probe_finds_the_heads_dim_and_the_parameters_in_head_order() -> None:
    last = per_head_norm_spec("q_norm", _HeadsLast(), 8)
    assert (last.heads, last.head_axis, last.weights, last.biases) == (4, -2, ("weight",), ())
    listed = per_head_norm_spec("q_layernorm", _ListOfNorms(), 8)
    assert (listed.heads, listed.head_axis, listed.norm.kind) == (4, 1, "layer")
    assert listed.weights == tuple(f"norms.{i}.weight" for i in range(4))
    assert listed.biases == tuple(f"norms.{i}.bias" for i in range(4))


def test_the_formula_on_a_block_of_heads_equals_the_module_on_those_heads() -> None:
    torch.manual_seed(0)
    module = _ListOfNorms()
    for norm in module.norms:
        nn.init.normal_(norm.weight)
        nn.init.normal_(norm.bias)
    spec = per_head_norm_spec("q_layernorm", module, 8)
    x = torch.randn(2, 4, 3, 8)
    weight = torch.stack([n.weight for n in module.norms])[2:]  # heads 2 and 3
    bias = torch.stack([n.bias for n in module.norms])[2:]
    torch.testing.assert_close(per_head_formula(spec, x[:, 2:], weight, bias), module(x)[:, 2:])


def test_a_module_scaling_every_head_by_one_row_is_refused_by_name() -> None:
    with pytest.raises(TypeError, match=r"'q_norm' \(_HeadsLast\) has role 'head_norm'.*differ"):
        per_head_norm_spec("q_norm", _HeadsLast(same_row=True), 8)


def test_one_head_is_found_on_the_dim_its_module_splits() -> None:
    # a list of one norm splits dim 1 (StableLM with one key/value head): only dim 1 computes
    assert per_head_norm_spec("k_layernorm", _ListOfNorms(heads=1), 8).head_axis == 1


def test_a_submodule_the_replacement_would_not_run_is_refused() -> None:
    module = _HeadsLast()
    module.dropout = nn.Dropout(0.1).eval()  # idle in eval mode: a probe would not see it
    with pytest.raises(TypeError, match=r"holds submodules without parameters \(Dropout\)"):
        per_head_norm_spec("q_norm", module, 8)


def test_weights_neither_per_head_nor_of_the_head_size_are_refused() -> None:
    with pytest.raises(TypeError, match=r"neither one \[heads, 4\] nor one \[4\] per head"):
        per_head_norm_spec("q_norm", _HeadsLast(dim=8), 4)


@pytest.mark.parametrize(
    ("heads", "share", "block", "expected"),
    [(8, 2, 1, (4, 4)), (4, 4, 3, (3, 1)), (2, 4, 3, (1, 1)), (1, 4, 2, (0, 1))],
)
def test_rank_heads_splits_or_repeats(
    heads: int, share: int, block: int, expected: tuple[int, int]
) -> None:
    # 2 key/value heads over 4 ranks: ranks 2 and 3 attend with head 1
    assert rank_heads(heads, share, block) == expected
