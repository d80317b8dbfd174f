"""A character corpus that is on every machine: the Python standard library's own source.

A fixed list of long-lived modules is read from ``sysconfig.get_paths()["stdlib"]`` (the ones
that exist in this Python), concatenated in that order and reduced to printable ASCII and
newlines (about 250,000 characters, 96 symbols). It is cut into non-overlapping windows of
``seq_len + 1`` characters: inputs are the first ``seq_len``, targets the last ``seq_len``.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import torch
from torch.utils.data import TensorDataset

__all__ = ["MODULES", "CharVocab", "corpus", "windows"]

#: Read in this order (those missing from this Python are skipped).
MODULES = (
    "textwrap.py",
    "argparse.py",
    "difflib.py",
    "shlex.py",
    "fnmatch.py",
    "heapq.py",
    "bisect.py",
)


def corpus() -> str:
    """The concatenated text of :data:`MODULES`, printable ASCII and newlines only."""
    root = Path(sysconfig.get_paths()["stdlib"])
    texts = [
        (root / name).read_text(encoding="utf-8") for name in MODULES if (root / name).exists()
    ]
    if not texts:
        raise FileNotFoundError(f"none of {MODULES} found under {root}")
    text = "\n".join(texts)
    return "".join(c for c in text if c == "\n" or " " <= c <= "~")


class CharVocab:
    """Characters <-> ids; the size is padded to a multiple of ``multiple``.

    Vocab-parallel layers split the vocabulary evenly over the tensor ranks, so the padded
    size must divide by their number; padding ids never occur in the data.
    """

    def __init__(self, text: str, multiple: int = 16) -> None:
        self.chars = sorted(set(text))
        self.index = {c: i for i, c in enumerate(self.chars)}
        self.size = -(-len(self.chars) // multiple) * multiple

    def encode(self, text: str) -> torch.Tensor:
        return torch.tensor([self.index[c] for c in text], dtype=torch.int64)

    def decode(self, ids: torch.Tensor) -> str:
        return "".join(self.chars[i] if i < len(self.chars) else "?" for i in ids.tolist())


def windows(ids: torch.Tensor, seq_len: int, num_test: int) -> tuple[TensorDataset, TensorDataset]:
    """``(train, test)`` of ``(inputs [n, s], targets [n, s])``; the last ``num_test`` test."""
    n = (len(ids) - 1) // seq_len
    x = ids[: n * seq_len].view(n, seq_len)
    y = ids[1 : n * seq_len + 1].view(n, seq_len)
    return TensorDataset(x[:-num_test], y[:-num_test]), TensorDataset(x[-num_test:], y[-num_test:])
