"""Counter-based draws (shared/counter_random.py) and a traced split region's (rank_draws.py).

One process: the streams of two "ranks" are two values of ``RankDraws(rank)`` over the same
global generator state, which is what every tensor rank holds.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tessera.layers.shared.counter_random import draw_key, philox4x32, uniform
from tessera.layers.shared.rank_draws import RankDraws, rank_dropout_attention


@pytest.mark.parametrize(
    ("counter", "key", "expected"),
    [  # Random123's known-answer vectors for Philox4x32-10
        ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
        ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
        (
            (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
            (0xA4093822, 0x299F31D0),
            (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
        ),
    ],
)
def test_philox_gives_the_known_answers(
    counter: tuple[int, ...], key: tuple[int, ...], expected: tuple[int, ...]
) -> None:
    words = [torch.tensor([w], dtype=torch.int64) for w in counter]
    keys = [torch.tensor(w, dtype=torch.int64) for w in key]
    out = philox4x32((words[0], words[1], words[2], words[3]), (keys[0], keys[1]))
    assert tuple(int(w) for w in out) == expected


def test_uniform_streams_are_uniform_independent_and_replayable() -> None:
    torch.manual_seed(0)
    key = draw_key("cpu")
    first, second = (uniform((50_000,), key, stream) for stream in (0, 1))
    assert torch.equal(first, uniform((50_000,), key, 0))  # a function of key and counter
    assert float(first.min()) >= 0.0 and float(first.max()) < 1.0
    for numbers in (first, second):
        counts = torch.histc(numbers, bins=10, min=0.0, max=1.0)
        chi2 = float(((counts - 5000) ** 2 / 5000).sum())
        assert chi2 < 27.9, chi2  # 9 degrees of freedom, p = 0.001
    correlation = torch.corrcoef(torch.stack([first, second]))[0, 1]
    assert abs(float(correlation)) < 0.02
    assert not torch.equal(uniform((8,), draw_key("cpu"), 0), first[:8])  # a fresh key


def _draws_of(rank: int, draw: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``draw()`` inside ``RankDraws(rank)`` from seed 0, and the global generator's next draw."""
    torch.manual_seed(0)
    with RankDraws(rank):
        out = draw()
    return out, torch.rand(4)


x = torch.ones(32, 64)
q, k, v = (torch.randn(2, 4, 6, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))


@pytest.mark.parametrize(
    "draw",
    [
        lambda: F.dropout(x, 0.3),
        lambda: nn.Dropout(0.5)(x),
        lambda: F.dropout2d(x.view(2, 16, 8, 8), 0.5),
        lambda: x.new_empty(4, 8).uniform_(**{"from": 5.0, "to": 6.0}),
        lambda: x.new_empty(32, 1).bernoulli_(0.8),  # stochastic depth's per-sample mask
        lambda: torch.bernoulli(torch.full((32, 64), 0.4)),
        lambda: torch.rand(8, 8) + torch.randn_like(x).sum(),
        lambda: F.scaled_dot_product_attention(q, k, v, dropout_p=0.2, is_causal=True),
    ],
    ids=["dropout", "Dropout", "dropout2d", "uniform_", "bernoulli_", "bernoulli", "rand", "sdpa"],
)
def test_each_rank_draws_its_own_numbers_and_the_global_stream_stays_alike(
    draw: Callable[[], torch.Tensor],
) -> None:
    (mine, after_mine), (theirs, after_theirs) = (_draws_of(r, draw) for r in (0, 1))
    assert not torch.equal(mine, theirs)
    assert torch.equal(after_mine, after_theirs)  # a replicated region's next mask: alike
    assert torch.equal(mine, _draws_of(0, draw)[0])  # replayed from the global state


def test_dropout_keeps_its_share_and_scales_as_torch() -> None:
    torch.manual_seed(0)
    with RankDraws(3):
        out = F.dropout(torch.ones(200, 200), 0.25)
        assert torch.equal(F.dropout(x, 0.5, training=False), x)
    kept = out != 0
    assert abs(float(kept.float().mean()) - 0.75) < 0.01
    torch.testing.assert_close(out[kept], torch.full_like(out[kept], 1 / 0.75))


@pytest.mark.parametrize(
    "masks",
    [
        dict(is_causal=True),
        dict(attn_mask=torch.rand(6, 6, generator=torch.Generator().manual_seed(3)) > 0.3),
        dict(attn_mask=torch.randn(2, 1, 6, 6, generator=torch.Generator().manual_seed(4))),
        dict(attn_mask=torch.zeros(6, 6, dtype=torch.bool)),  # every key masked: zeros
    ],
    ids=["causal", "bool", "float", "all-masked"],
)
def test_attention_with_stream_dropout_is_torchs_attention(masks: dict[str, object]) -> None:
    torch.manual_seed(0)  # dropout of 1e-12 keeps every probability, as none at all
    got = rank_dropout_attention(q, k, v, dropout_p=1e-12, rank=0, **masks)  # type: ignore[arg-type]
    want = F.scaled_dot_product_attention(q, k, v, **masks)  # type: ignore[arg-type]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    kv = k[:, :2], v[:, :2]  # two key heads for four query heads
    grouped = rank_dropout_attention(q, *kv, dropout_p=1e-12, enable_gqa=True, rank=0)
    reference = F.scaled_dot_product_attention(q, *kv, enable_gqa=True)
    torch.testing.assert_close(grouped, reference, rtol=1e-5, atol=1e-6)


def test_draws_it_cannot_reproduce_are_refused_by_name() -> None:
    refused = r"split across.*torch\.randint would draw"
    with RankDraws(0), pytest.raises(RuntimeError, match=refused):
        torch.randint(0, 5, (3,))
    lstm = nn.LSTM(4, 4, num_layers=2, dropout=0.5)
    with RankDraws(0), pytest.raises(RuntimeError, match="lstm with dropout between"):
        lstm(torch.ones(3, 2, 4))
    with RankDraws(0):
        lstm.eval()(torch.ones(3, 2, 4))  # no dropout in eval mode
    with RankDraws(0):  # the caller's own generator draws, as eagerly
        mine = torch.rand(3, generator=torch.Generator().manual_seed(1))
    assert torch.equal(mine, torch.rand(3, generator=torch.Generator().manual_seed(1)))


def test_answers_take_torchs_arguments_and_shapes() -> None:
    torch.manual_seed(0)
    with RankDraws(1):
        assert torch.rand(size=(2, 3)).shape == (2, 3)
        assert torch.randn([4], dtype=torch.float64).dtype == torch.float64
        assert torch.rand_like(x, requires_grad=True).requires_grad
        spread = x.new_empty(1000).uniform_(**{"from": 5.0, "to": 6.0})
        assert float(spread.min()) >= 5.0 and float(spread.max()) < 6.0
        assert float(torch.rand(4096, dtype=torch.bfloat16).max()) < 1.0
        # one draw per (N, C), as torch's dropout2d reads any input, also [N, C, L]
        mask = F.dropout2d(torch.ones(8, 6, 5), 0.5) != 0
        assert torch.equal(mask, mask[..., :1].expand_as(mask))
        assert len({tuple(row) for row in mask[..., 0].tolist()}) > 1
        unbatched = F.dropout1d(torch.ones(6, 5), 0.5) != 0  # [C, L]: one draw per channel
        assert torch.equal(unbatched, unbatched[:, :1].expand_as(unbatched))
        cube = F.dropout3d(torch.ones(6, 5, 4), 0.5) != 0  # read as one sample [C, ...]
        assert torch.equal(cube, cube[:, :1, :1].expand_as(cube))
        assert torch.rand(3, generator=None).shape == (3,)  # torch's own generator, named
        with pytest.raises(ValueError, match="between 0 and 1"):
            F.dropout(x, 1.5)
        with pytest.raises(RuntimeError, match="out="):
            torch.bernoulli(x, out=torch.empty_like(x))
        with pytest.raises(RuntimeError, match="attn_mask"):
            F.scaled_dot_product_attention(q, k, v, torch.ones(6, 6), 0.1, is_causal=True)
