"""The check of a model's own code (conversion/own_code.py), one process: which operators read
a split dim whole, and how split dims follow elementwise code.

A tensor is marked as a converted module's output would be ([b, s, h] with the batch and the
features cut, 2D's layout between blocks); the check runs as the converted model's first call
runs it. The layout tests (test_parallelize.py) run it on every model under every mode.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from tessera.layers.conversion.own_code import SPLIT_DIMS_MARK, _Check

#: Operators that read the features (dim 2) or the tokens (dim 1) of a [b, s, h] block whole.
READS_A_SPLIT_DIM: list[tuple[str, Callable[[torch.Tensor], object]]] = [
    ("torch.Tensor.mean", lambda x: x.pow(2).mean(-1, keepdim=True)),
    ("torch.Tensor.sum", lambda x: x.sum()),  # every dim
    ("torch.Tensor.softmax", lambda x: (x * 2.0).softmax(dim=-1)),
    ("torch.nn.functional.layer_norm", lambda x: F.layer_norm(x, x.shape[-1:])),
    ("torch.nn.functional.normalize", lambda x: F.normalize(x, dim=-1)),
    ("torch.Tensor.chunk", lambda x: x.chunk(2, -1)[0] * 2.0),  # refused where it is used
    ("torch.cat", lambda x: torch.cat([x, x], dim=2)),
    ("torch.Tensor.__getitem__", lambda x: x[..., :3] + 1.0),
    ("torch.Tensor.matmul", lambda x: x @ x.transpose(1, 2)),
    ("torch.Tensor.amax", lambda x: x.amax(dim=(1, 2))),
    ("torch.Tensor.var", lambda x: x.var(axis=-1)),  # numpy's spelling of dim
    ("torch.nn.functional.softmax", lambda x: F.softmax(x)),  # [b, s, h]: implicitly dim 0
    ("torch.Tensor.__getitem__", lambda x: x[0] + 1.0),  # one sample of the batch
]
#: Operators exact on any block of it.
EXACT = {
    "elementwise": lambda x: torch.tanh(x + 1.0) * x,
    "over the tokens": lambda x: x.mean(1),
    "a token": lambda x: x[:, 0],
    "the rank's own rows": lambda x: x[torch.arange(x.shape[0]), torch.zeros(4, dtype=torch.long)],
    "a whole tensor": lambda x: torch.ones(3, 5).softmax(-1),
    "a full slice": lambda x: x[:, :, : x.shape[2]],
    "the elementwise max": lambda x: torch.max(x, x * 2.0),
    "a part's shape only": lambda x: torch.zeros(x[..., -1].shape),  # BART's positions
    "a part's shape and dtype": lambda x: torch.ones_like(x[..., 0]).softmax(-1),
    "over the tokens, as numpy spells it": lambda x: x.mean(axis=1),
    "moved dims": lambda x: x.mT.softmax(-1),  # [b, h, s]: its last dim is whole
    "softmax's implicit dim": lambda x: F.softmax(_marked(torch.randn(4, 5), {0})),  # dim 1
}


def _marked(x: torch.Tensor, dims: set[int]) -> torch.Tensor:
    setattr(x, SPLIT_DIMS_MARK, frozenset(dims))
    return x


def _block() -> torch.Tensor:
    return _marked(torch.randn(4, 6, 8), {0, 2})  # [b/q, s, h/q]


@pytest.mark.parametrize(("name", "compute"), READS_A_SPLIT_DIM)
def test_an_operator_reading_a_split_dim_whole_is_refused_by_name(
    name: str, compute: Callable[[torch.Tensor], object]
) -> None:
    refused = rf"calls {name} over dim [02] of a \[4, 6, 8\] block"
    with pytest.raises(ValueError, match=refused), _Check("2d"):
        compute(_block())


@pytest.mark.filterwarnings("ignore:Implicit dimension choice for softmax")
def test_exact_code_passes_and_elementwise_outputs_keep_the_mark() -> None:
    with _Check("2d"):
        for compute in EXACT.values():
            compute(_block())  # no error
        y = torch.tanh(_block() + 1.0) * 3.0
        assert getattr(y, SPLIT_DIMS_MARK) == frozenset({0, 2})  # followed to the norm below
        with pytest.raises(ValueError, match=r"test_own_code\.py:\d+ \(test_exact_code"):
            y.var(-1)
    z = _block().transpose(1, 2)
    assert getattr(z, SPLIT_DIMS_MARK, None) is None  # no check outside the mode
