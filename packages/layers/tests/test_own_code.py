"""The check of a model's own code (conversion/own_code.py), one process: which operators read
a split dim whole, and how split dims follow elementwise code.

A tensor is marked as a converted module's output would be ([b, s, h] with the batch and the
features cut, 2D's layout between blocks); the check runs as the converted model's first call
runs it. The layout tests (test_parallelize.py) run it on every model under every mode.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from types import SimpleNamespace
from typing import cast

import pytest
import torch
import torch.nn.functional as F

from tessera.context import ParallelContext
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
    # after the split dims were followed through indexing, reductions, moves and reshapes
    ("torch.nn.functional.normalize", lambda x: F.normalize(x[:, 0], dim=-1)),
    ("torch.Tensor.softmax", lambda x: x.mean(1).softmax(-1)),
    ("torch.Tensor.sum", lambda x: x.view(4, 6, 2, 4).sum(-2)),  # over the heads
    ("torch.Tensor.mean", lambda x: x.view(4, 6, 1, 8).pow(2).mean(-1)),  # one group: h/q
    ("torch.Tensor.mean", lambda x: x.clone().unsqueeze_(-2).mean(-1)),  # reshaped in place
    ("torch.Tensor.mean", lambda x: x.view(4, 6, 2, -1).mean(-1)),  # the model's head count
    ("torch.Tensor.sum", lambda x: x.view(4, 6, 2, -1).sum(2)),  # over those "heads"
    ("torch.Tensor.amax", lambda x: x.unflatten(-1, (2, -1)).amax(-2)),
    ("torch.Tensor.mean", lambda x: x.unsqueeze(-2).mean(-1)),
    ("torch.Tensor.mean", lambda x: x.reshape(4, 48).mean(-1)),
    ("torch.Tensor.sum", lambda x: x.reshape(24, 8).sum(0)),  # the batch merged with the tokens
    ("torch.Tensor.softmax", lambda x: x.transpose(1, 2).softmax(1)),
    ("torch.nn.functional.batch_norm", lambda x: F.batch_norm(x.mT, None, None, training=True)),
    # operators of every kind, each reading the features or the batch
    ("torch.einsum", lambda x: torch.einsum("bsh,bth->bst", x, x)),
    ("torch.nn.functional.linear", lambda x: F.linear(x, torch.ones(3, 8))),
    ("torch.matmul", lambda x: torch.matmul(torch.ones(5, 4), x[:, 0])),  # b's rows: the batch
    ("torch.nn.functional.pad", lambda x: F.pad(x, (0, 1))),
    ("torch.nn.functional.dropout1d", lambda x: F.dropout1d(x, 0.5)),  # a token's mask, per block
    ("torch.nn.functional.glu", lambda x: F.glu(x)),
    ("torch.nn.functional.cross_entropy", lambda x: F.cross_entropy(x.flatten(0, 1), _zeros(24))),
    ("torch.Tensor.narrow", lambda x: x.narrow(2, 0, 3) * 2.0),  # refused where it is used
    ("torch.dstack", lambda x: torch.dstack([x, x])),
    ("torch.Tensor.flip", lambda x: x.flip(1, 2)),  # dims given one argument each
    ("torch.fft.fft", lambda x: torch.fft.fft(x)),
    ("torch.sum", lambda x: torch.sum(input=x, dim=-1)),
    ("torch.conv1d", lambda x: F.conv1d(x, torch.ones(3, 6, 1))),
    ("torch.nn.functional.scaled_dot_product_attention", lambda x: _attention(x, x, x)),
    ("torch.Tensor.__getitem__", lambda x: x[[0, 1]] + 1.0),  # the same rows of every block
    ("torch.nn.functional.glu", lambda x: F.glu(x.mT, dim=1)),
    ("torch.mm", lambda x: torch.mm(x[:, 0], mat2=torch.ones(8, 3))),
    ("torch.addmm", lambda x: torch.addmm(torch.ones(3), x[:, 0], torch.ones(8, 3))),
    ("torch.tensordot", lambda x: torch.tensordot(x, torch.ones(8, 3), dims=1)),
    ("torch.inner", lambda x: torch.inner(x, torch.ones(8))),
    ("torch.nn.functional.mse_loss", lambda x: F.mse_loss(torch.zeros(4, 6, 8), x)),  # target
    ("torch.cdist", lambda x: torch.cdist(x, x)),
    ("torch.Tensor.scatter_add", lambda x: x.scatter_add(2, torch.zeros(4, 6, 8).long(), x)),
    ("torch.Tensor.unfold", lambda x: x.unfold(2, 2, 1)),
    ("torch.Tensor.repeat", lambda x: x.repeat(1, 1, 2)),
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
    "a norm of each head's features": lambda x: x.view(4, 6, 2, 4).pow(2).mean(-1),
    "a softmax over the tokens": lambda x: x.transpose(1, 2).softmax(-1),
    "a product over the tokens": lambda x: x.transpose(1, 2) @ torch.ones(6, 2),
    "an einsum keeping the features": lambda x: torch.einsum("bsh,h->bsh", x, torch.ones(8)),
    "a sum over a new dim": lambda x: x.unsqueeze(1).sum(1),
    "a stack": lambda x: torch.stack([x, x]).sum(0),
    "masked tokens": lambda x: x[torch.ones(4, 6, dtype=torch.bool)] * 2.0,
    "rows of the batch selected": lambda x: x.index_select(0, torch.tensor([3, 0])) * 2.0,
    "rows of the batch gathered": lambda x: torch.gather(x, 0, torch.zeros(2, 6, 8).long()) * 2,
    "a token viewed and prepended": lambda x: torch.cat([x[:, 0].view(4, 1, 8), x], 1),
    "a glu over the tokens": lambda x: F.glu(x, dim=1),
    "an fft of the last two dims": lambda x: torch.fft.fft2(_marked(torch.randn(4, 2, 6, 8), {0})),
    "a batch norm in eval mode": lambda x: F.batch_norm(x.mT, torch.zeros(8), torch.ones(8)),
    "a channel dropout in eval mode": lambda x: F.dropout1d(x, 0.5, training=False),
    "a mask per sample and token": lambda x: F.dropout1d(x.mT, 0.5),  # [b, h, s]: s whole
    "a tensordot over the tokens": lambda x: torch.tensordot(x, torch.ones(6, 3), ([1], [0])),
    "a loss of each element": lambda x: F.mse_loss(x, x * 2.0, reduction="none"),
    "a repeat of the tokens": lambda x: x.repeat(1, 2, 1),
}

#: Where the split dims of the [b, s, h] block (cut: 0 and 2) go through each operator.
FOLLOWED: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], set[int]]] = {
    "a token": (lambda x: x[:, 0], {0, 1}),
    "heads": (lambda x: x.view(4, 6, 2, 4), {0, 2}),
    "one local head": (lambda x: x.view(4, 6, -1, 8), {0, 2}),
    "the features as one group": (lambda x: x.view(4, 6, 1, -1), {0, 3}),
    "the features as one group, every size given": (lambda x: x.view(4, 6, 1, 8), {0, 3}),
    "the model's own head count": (lambda x: x.reshape((4, 6, 2, -1)), {0, 2, 3}),
    "heads unflattened": (lambda x: x.unflatten(-1, (-1, 4)), {0, 2}),
    "a head count unflattened": (lambda x: x.unflatten(2, (2, -1)), {0, 2, 3}),
    "tokens of the batch merged": (lambda x: x.reshape(24, 8), {0, 1}),
    "moved": (lambda x: x.transpose(1, 2), {0, 1}),
    "permuted": (lambda x: x.permute(2, 0, 1), {0, 1}),
    "reduced": (lambda x: x.mean(1), {0, 1}),
    "reduced, dims kept": (lambda x: x.mean(1, keepdim=True), {0, 2}),
    "a dim made": (lambda x: x.unsqueeze(1), {0, 3}),
    "a product": (lambda x: x.transpose(1, 2) @ torch.ones(6, 2), {0, 1}),
    "an einsum": (lambda x: torch.einsum("bsh,st->bth", x, torch.ones(6, 3)), {0, 2}),
    "the last token of each row": (lambda x: x[torch.arange(4), _zeros(4)], {0, 1}),
    "stacked": (lambda x: torch.stack([x, x], 1), {0, 3}),
    "broadcast": (lambda x: torch.ones(3, 1, 1, 1) * x, {1, 3}),
    "scaled": (lambda x: x * torch.ones(8), {0, 2}),
    "the elementwise max": (lambda x: torch.max(torch.zeros(4, 6, 8), x), {0, 2}),
    "swapped by keyword": (lambda x: x.swapaxes(axis0=1, axis1=2), {0, 1}),
    "a token viewed as a sequence of one": (lambda x: x[:, 0].view(4, 1, 8), {0, 2}),
    "moved in place": (lambda x: x.clone().transpose_(1, 2), {0, 1}),
    "a dim made in place": (lambda x: x.clone().unsqueeze_(1), {0, 3}),
    "a dim dropped in place": (lambda x: x.unsqueeze(1).squeeze_(1), {0, 2}),
    "a tensordot": (lambda x: torch.tensordot(x, torch.ones(6, 3), ([1], [0])), {0, 1}),
    "an inner product": (lambda x: torch.inner(x.mT, torch.ones(6)), {0, 1}),
    "rows and features picked apart": (lambda x: _marked(x.mT, {0})[_rows(), :, _rows()], {0}),
    "rows picked beside a token": (lambda x: x[_rows(), 0], {0, 1}),
    "rows added back": (
        lambda x: torch.zeros(4, 8).index_add(0, _rows(), x[:, 0][_rows()]),
        {0, 1},
    ),
}


def _rows() -> torch.Tensor:
    return torch.tensor([0, 3])


_attention = F.scaled_dot_product_attention


def _zeros(n: int) -> torch.Tensor:
    return torch.zeros(n, dtype=torch.long)


def _marked(x: torch.Tensor, dims: set[int]) -> torch.Tensor:
    setattr(x, SPLIT_DIMS_MARK, frozenset(dims))
    return x


def _block() -> torch.Tensor:
    return _marked(torch.randn(4, 6, 8), {0, 2})  # [b/q, s, h/q]


@pytest.mark.parametrize(("name", "compute"), READS_A_SPLIT_DIM)
def test_an_operator_reading_a_split_dim_whole_is_refused_by_name(
    name: str, compute: Callable[[torch.Tensor], object]
) -> None:
    refused = rf"calls {re.escape(name)} over dim \d of a \[[\d, ]+\] block"
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


@pytest.mark.parametrize("name", list(FOLLOWED))
def test_split_dims_follow_indexing_reductions_moves_reshapes_and_products(name: str) -> None:
    compute, cut = FOLLOWED[name]
    with _Check("2d"):
        y = compute(_block())
    assert getattr(y, SPLIT_DIMS_MARK) == frozenset(cut)


def test_tokens_flattened_into_rows_are_cut_on_their_rows() -> None:
    """Under 'sequence' (and 1D sequence parallelism) a module's output ``[b, s/p, h]`` is cut
    on its tokens; ``[b * s/p, h]`` (the rows an expert takes) on its rows, not its features."""
    from tessera.layers.conversion.own_code import _marker
    from tessera.layers.sequence.mode import LAYERS_SEQUENCE

    assert LAYERS_SEQUENCE.activation_cuts is not None
    two_ranks = cast(ParallelContext, SimpleNamespace(get_world_size=lambda group: 2))
    mark = _marker(LAYERS_SEQUENCE.activation_cuts, two_ranks)
    for shape, cut in (((2, 6, 8), {1}), ((12, 8), {0})):
        y = torch.randn(shape)
        mark(torch.nn.Identity(), (), y)
        assert getattr(y, SPLIT_DIMS_MARK) == frozenset(cut)


class _TrainingBranch(torch.nn.Module):
    """A converted module's output, then code of the model's own that differs in training
    (unless ``exact``)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)
        self.exact = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)  # [b, s/p, h] under 'sequence'
        if self.training and not self.exact:
            return h.softmax(1)  # a softmax over the cut tokens
        return h * 2.0


def test_the_first_call_in_training_and_in_eval_mode_are_checked() -> None:
    from tessera.layers.conversion.own_code import install_own_code_check

    model = _TrainingBranch()
    two_ranks = cast(ParallelContext, SimpleNamespace(get_world_size=lambda group: 2))
    install_own_code_check(model, {"proj": "row"}, [], two_ranks, "sequence")
    x = torch.randn(2, 6, 8)
    model.eval()
    model(x)  # eval first (as verify= calls): its path is exact
    assert model._forward_pre_hooks  # training's first call is still to be checked
    model.train()
    with pytest.raises(ValueError, match=r"torch\.Tensor\.softmax over dim 1 of a \[2, 6, 8\]"):
        model(x)
    model.exact = True
    model(x)
    assert not model._forward_pre_hooks and not model._forward_hooks  # both checked: gone


def test_a_draw_broadcast_over_a_cut_dim_is_refused() -> None:
    """Each rank draws its own numbers in a split region: a mask per sample ``[b, 1, 1]``
    would drop a sample in one feature block and keep it in another."""
    with _Check("2d", forked=lambda: True):
        block = _block()  # [b/q, s, h/q]
        kept = block.new_empty(4, 1, 1).bernoulli_(0.8)
        refused = r"random draw of shape \[4, 1, 1\] and a \[4, 6, 8\] block, .* over dim 2"
        with pytest.raises(ValueError, match=refused):
            block * (kept / 0.8)
        with pytest.raises(ValueError, match=r"draw of shape \[6, 1\] .* over dim 0"):
            torch.where(torch.rand(6, 1) < 0.5, block, 0.0)  # per token, shared by the batch
        block * (torch.rand_like(block) < 0.5)  # a mask of the block's own shape
        block * torch.rand(4, 1, 1, generator=torch.Generator())  # the caller's own generator

    with _Check("2d", forked=lambda: True), pytest.raises(ValueError, match="different branches"):
        if torch.rand([]) < 0.1:  # transformers' layerdrop
            pass
    with _Check("2d"):  # outside a forked region every rank draws alike
        if torch.rand([]) < 0.1:
            pass
        _block() * torch.rand(4, 1, 1)


def test_memory_of_a_block_reshaped_in_place_is_refused() -> None:
    """``resize_`` (or ``as_strided_``, ``set_``) of a block reads its memory in another
    shape, which the check cannot follow: refused, where the mark used to be dropped."""
    refused = r"calls torch\.Tensor\.resize_ on a \[4, 6, 8\] block"
    with pytest.raises(ValueError, match=refused), _Check("2d"):
        _block().clone().resize_(4, 48)
