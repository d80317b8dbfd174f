"""``lent``: run a plain module on tensors its converted replacement holds.

A converted module sometimes keeps the plain one to run its forward unchanged (transformers'
experts pick an implementation at every call; a router returns three things) while holding the
parameters itself, under the plain module's names, so that state dicts keep the model's names.
At each call it lends the plain module the tensors to use (a block of a whole weight, a
parameter routed so that its gradient is summed), as plain attributes that shadow whatever the
plain module registered, and takes them back afterwards, so no graph outlives the call.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import torch
from torch import nn

__all__ = ["lent"]


@contextmanager
def lent(module: nn.Module, tensors: Mapping[str, torch.Tensor]) -> Iterator[nn.Module]:
    """``module`` with each of ``tensors`` set as the attribute of its name, for one call."""
    for name, tensor in tensors.items():
        object.__setattr__(module, name, tensor)  # found before the registered ones
    try:
        yield module
    finally:
        for name in tensors:
            object.__delattr__(module, name)
