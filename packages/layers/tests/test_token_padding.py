"""The padding of a sequence its ranks do not divide (one process: the holder's rules)."""

from __future__ import annotations

import pytest
import torch

from tessera.layers.conversion.token_padding import TokenCount, pad_tokens, strip_tokens


def test_padding_is_stripped_only_where_its_count_says() -> None:
    count = TokenCount()
    x = torch.arange(2 * 7 * 3, dtype=torch.float32).reshape(2, 7, 3)
    padded = pad_tokens(x, 4, count)  # 7 tokens -> 8, zeros at the end
    assert padded.shape == (2, 8, 3) and not padded[:, 7:].any()
    assert (count.tokens, count.padded) == (7, 8)
    assert torch.equal(strip_tokens(padded, count), x)
    assert strip_tokens(x, count) is x  # already whole
    # a tensor of another forward's length (a replay across batches): an error, never a guess
    with pytest.raises(ValueError, match="recorded 7 tokens, padded to 8, but gathered 12"):
        strip_tokens(torch.zeros(2, 12, 3), count)


def test_pipeline_stages_neither_pad_nor_strip() -> None:
    """A later stage's process never sees the first stage's count (a whole-model probe there
    left another): staged, a padding is refused and a gathered sequence left as it is."""
    count = TokenCount()
    pad_tokens(torch.zeros(1, 4, 2), 2, count)  # the probe: 4 tokens, no padding
    count.staged = True
    whole = torch.zeros(1, 32, 2)
    assert strip_tokens(whole, count) is whole
    with pytest.raises(ValueError, match="7 tokens do not divide into 2 equal chunks"):
        pad_tokens(torch.zeros(1, 7, 2), 2, count)
