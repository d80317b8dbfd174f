"""Random numbers as a function of (key, counter): Philox4x32-10 written in tensor operations.

Why: a tensor rank needs dropout masks of its own wherever its activations are a block of a
bigger tensor (Megatron-LM, Shoeybi et al. 2019, section 3). Eagerly, tessera forks torch's
generator per rank (``conversion/dropout.py``, ``ParallelContext.seed``). A generator's state
cannot be traced, so under ``torch.compile`` each fork breaks the graph. A counter-based
generator has no state: the numbers are a pure function of a key and of each element's index
(Salmon et al. 2011, "Parallel random numbers: as easy as 1, 2, 3"), so they trace into the
graph like any elementwise arithmetic, and Inductor fuses them into the dropout's kernel.

The key is drawn from torch's global generator (two 32-bit words; every tensor rank draws the
same, so the global stream advances alike everywhere and activation checkpointing that replays
it replays the masks), and the tensor rank is a word of the counter: the ranks' numbers are
independent streams of one key.

The words are 32-bit values held in ``int64`` tensors. Products are split into 16-bit halves
so no intermediate exceeds 2**49 (a signed 64-bit overflow is never relied on), which keeps the
numbers the same on every backend and device.
"""

from __future__ import annotations

import torch

__all__ = ["below_one", "draw_key", "philox4x32", "uniform", "uniform_like"]

_LOW = 0xFFFFFFFF
_MULTIPLIERS = (0xD2511F53, 0xCD9E8D57)
_KEY_BUMPS = (0x9E3779B9, 0xBB67AE85)  # golden ratio, sqrt(3) - 1
_ROUNDS = 10


def _mul_hi_lo(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The high and low 32-bit words of ``a * b`` (``a`` a 32-bit constant, ``b`` words)."""
    low_half = b * (a & 0xFFFF)  # < 2**48
    high_half = b * (a >> 16)  # < 2**48; a * b = high_half * 2**16 + low_half
    middle = low_half + ((high_half & 0xFFFF) << 16)  # < 2**49
    return (high_half >> 16) + (middle >> 32), middle & _LOW


def philox4x32(
    counter: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    key: tuple[torch.Tensor, torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Philox4x32-10 (Salmon et al. 2011): four 32-bit words out per four-word counter.

    Args:
        counter: Four ``int64`` tensors of 32-bit words (broadcastable to one shape).
        key: Two ``int64`` tensors of 32-bit words (0-dim or broadcastable).

    Returns:
        Four ``int64`` tensors of 32-bit words, the counters' shape.
    """
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for round_ in range(_ROUNDS):
        if round_:
            k0, k1 = (k0 + _KEY_BUMPS[0]) & _LOW, (k1 + _KEY_BUMPS[1]) & _LOW
        hi0, lo0 = _mul_hi_lo(_MULTIPLIERS[0], c0)
        hi1, lo1 = _mul_hi_lo(_MULTIPLIERS[1], c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


def draw_key(device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """Two 32-bit key words from torch's global generator (the same draw on every rank).

    Drawn past any ``TorchFunctionMode`` (``rank_draws.RankDraws`` refuses ``randint``).
    """
    with torch._C.DisableTorchFunction():
        words = torch.randint(0, 2**32, (2,), dtype=torch.int64, device=device)
    return words[0], words[1]


def uniform(
    shape: tuple[int, ...] | torch.Size,
    key: tuple[torch.Tensor, torch.Tensor],
    stream: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Uniform numbers in ``[0, 1)`` of ``shape``: element ``i`` from counter ``(i / 4, stream)``.

    Args:
        shape: The output's shape.
        key: From :func:`draw_key`.
        stream: This caller's stream (a tensor rank): other streams are independent.
        dtype: A floating dtype; the numbers have 24 random bits (float32's mantissa), and
            below float32 the largest are rounded down, not to 1.
        device: Where to make them.
    """
    n = 1
    for size in shape:
        n *= int(size)
    blocks = torch.arange((n + 3) // 4, dtype=torch.int64, device=device)  # [n/4]
    zero = torch.zeros_like(blocks)
    words = philox4x32((blocks & _LOW, blocks >> 32, zero + stream, zero), key)
    bits = torch.stack(words, dim=-1).reshape(-1)[:n] >> 8  # [n], 24 random bits each
    return below_one((bits.to(torch.float32) * 2.0**-24).reshape(shape), dtype)


def below_one(numbers: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Float32 numbers in ``[0, 1)`` as ``dtype``, still below 1.

    Half and bfloat16 would round ``1 - 2**-24`` up to 1.
    """
    out = numbers.to(dtype)
    if torch.finfo(dtype).bits < 32:
        out = out.clamp(max=1.0 - torch.finfo(dtype).eps / 2)
    return out


def uniform_like(
    x: torch.Tensor, key: tuple[torch.Tensor, torch.Tensor], stream: int
) -> torch.Tensor:
    """:func:`uniform` of ``x``'s shape, dtype and device."""
    return uniform(x.shape, key, stream, x.dtype, x.device)
