"""scikit-learn's digits (Alpaydin & Kaynak 1998): 1,797 real 8x8 grey images, no download.

The split is deterministic: a permutation drawn with a fixed seed, the first 384 images for
test, the next 1,408 (22 batches of 64) for training. The 5 images left over are not used, so
every batch splits evenly over up to 16 ranks (data x pipeline microbatches x tensor blocks).
"""

from __future__ import annotations

import torch
from torch.utils.data import TensorDataset

__all__ = ["NUM_TEST", "NUM_TRAIN", "digits"]

NUM_TEST = 384
NUM_TRAIN = 1408


def digits(seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """``(train, test)``: images ``[n, 1, 8, 8]`` scaled to [-1, 1], labels ``[n]`` (int64)."""
    from sklearn.datasets import load_digits

    data = load_digits()
    images = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 8.0 - 1.0
    labels = torch.tensor(data.target, dtype=torch.int64)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    test, train = order[:NUM_TEST], order[NUM_TEST : NUM_TEST + NUM_TRAIN]
    return TensorDataset(images[train], labels[train]), TensorDataset(images[test], labels[test])
