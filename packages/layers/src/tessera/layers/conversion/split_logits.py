"""Split logits handed to the caller: code reading a split dim whole raises.

Under 1D the head returns each rank's ``V/p`` of every token's logits ``[b, s, V/p]`` (a
classifier's ``[b, C/p]``): the vocabulary-parallel losses read them so, and no rank ever holds
``[b, s, V]``. A loop of one's own that reads them as whole logits computes another number
than one process without an error: ``logits.argmax(-1)`` is an index into this rank's slice,
read as a token id; ``F.cross_entropy(logits.view(-1, V/p), labels)`` is the loss of a part of
the vocabulary (an error only where a label falls outside it); ``logits.softmax(-1)`` sums to 1
on each rank; ``logits[..., token_id]`` reads another token's logit. Under ``'sequence'`` a
causal or masked LM returns each rank's chunk of the tokens ``[b, s/N, V]``:
``logits[:, -1]`` is the last token of this rank's chunk (the padding's on the last rank,
where the ranks do not divide the length), ``logits.mean()`` a part's mean.

So the head's output is a :class:`SplitLogits`: the same storage and autograd history,
with a ``__torch_function__`` that follows the split dim through what the caller computes
(elementwise code, dtype casts, indexing of the batch and tokens, views; the tables of
:mod:`.operator_dims`, as the model's own code is checked by :mod:`.own_code`) and raises where
an operator reads it whole (a reduction, softmax, sort, top-k or loss over it, a part of it
taken or written, its values read out of torch), naming the operator, the line and what to do:
:func:`~.boundary.causal_lm_loss` / :func:`~.boundary.token_loss` for the loss,
:func:`~.boundary.gather_logits` for whole logits, :func:`local_logits` for this rank's part as
a plain tensor, on purpose. tessera's own code (its losses, gathers, the model's own loss
function) reads them as it laid them out and is not checked.

It costs a Python call per operator on the logits (a few per step), nothing on the model's
hot path; under ``torch.compile`` the head returns plain tensors (the check is not traced).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from tessera.context import ParallelContext

from ..sequence.replicated import TOKENS_BEFORE_PADDING
from ..shared.mode_layers import Cuts, find_mode_layers
from .operator_dims import (
    METADATA,
    SPLIT_DIMS_MARK,
    TAKING_PART,
    dims_followed,
    indexed_dims,
    split_dims,
)
from .own_code import bookkept, callers_line, operator_name, split_dim_read_whole

__all__ = ["SplitLogits", "install_split_logits", "local_logits", "token_split_logits"]

#: Reading a tensor's values out of torch: each rank would read its own part of the vocabulary.
_READ_OUT = {
    torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.item, torch.Tensor.__array__,
    torch.Tensor.__float__, torch.Tensor.__int__, torch.Tensor.__bool__, torch.Tensor.__index__,
}  # fmt: skip
#: Computed as for a plain tensor, the result plain: printing, copying, pickling.
_PLAIN = {
    torch.Tensor.__repr__, torch.Tensor.__format__, torch.Tensor.__reduce_ex__,
    torch.Tensor.__deepcopy__, torch.Tensor.__setstate__, torch.Tensor.__hash__,
}  # fmt: skip


class SplitLogits(torch.Tensor):
    """This rank's part of logits split by vocabulary (1D) or by tokens (``'sequence'``).

    Operators reading a split dim whole raise. Its ``_tessera_split_dims`` mark holds the cut
    dims (the last one, or the tokens' dim 1), as :mod:`.own_code`'s tensors do.
    """

    @classmethod
    def __torch_function__(
        cls,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        kwargs = dict(kwargs or {})
        with torch._C.DisableTorchFunctionSubclass():
            if func in METADATA or func in _PLAIN or torch.compiler.is_compiling():
                return func(*args, **kwargs)
            called = (kwargs["input"], *args) if not args and "input" in kwargs else args
            module, line = callers_line()
            if not module.startswith("tessera.layers."):  # the layers laid them out
                _refuse_reading_whole(func, called, kwargs, line)
            owner = getattr(func, "__self__", None)
            if isinstance(owner, type) and issubclass(owner, torch.autograd.Function):
                # its forward may save them for a backward run outside this block
                args, kwargs = tree_map(local_logits, (args, kwargs))
            out = func(*args, **kwargs)
            return tree_map(lambda y: _followed(func, called, kwargs, y), out)


def _refuse_reading_whole(
    func: Any, called: tuple[Any, ...], kwargs: Mapping[str, Any], line: str
) -> None:
    """Raise where ``func`` reads a split dim of its arguments whole.

    ``called``: its positional arguments, ``input=`` first where it was given by name.
    """
    flat = [x for x in tree_flatten((called, dict(kwargs)))[0] if isinstance(x, torch.Tensor)]
    if not any(isinstance(x, SplitLogits) for x in flat):
        return
    block = flat[0]
    what: str | None = None
    if func in _READ_OUT:
        what = "reads the values"
    elif func is torch.Tensor.__setitem__ and isinstance(called[0], SplitLogits):
        none: set[int] = set()
        written = bookkept(none, indexed_dims, called[1], called[0]) & split_dims(called[0])
        if written:  # logits[..., token_id] = -inf: this rank's column, not that token's
            block, what = called[0], f"writes a part of dim {min(written)}"
    else:
        read = split_dim_read_whole(func, called, kwargs)
        if read is not None:
            block, dim = read
            taking = func in TAKING_PART or func is torch.Tensor.__getitem__
            what = f"{'takes a part of' if taking else 'reads'} dim {dim}"
    if what is None:
        return
    ranks = getattr(block, _RANKS_ATTR, None)
    share = "this rank's part" if ranks is None else f"this rank's 1/{ranks}"
    split = getattr(block, _SPLIT_ATTR, VOCABULARY)
    raise ValueError(
        f"{operator_name(func)} {what} of {list(block.shape)} logits, which hold {share} of "
        f"{split}, at {line}: on this part it computes another number than on the whole "
        "logits, without an error. Use tessera.layers.causal_lm_loss or token_loss for the "
        "loss (they read the split logits), gather_logits(logits) for whole logits (the "
        "last token's, argmax, sampling, metrics), or local_logits(logits) for this rank's "
        "part as a plain tensor, on purpose"
    )


#: Set on a :class:`SplitLogits`: how many ranks split it (for the message).
_RANKS_ATTR = "_tessera_split_ranks"
#: Set on a :class:`SplitLogits`: what is split (for the message).
_SPLIT_ATTR = "_tessera_split_what"
#: What 1D's logits split.
VOCABULARY = "the vocabulary (split by the parallelized head)"
#: What ``'sequence'``'s logits split.
TOKENS = "the tokens (tensor mode 'sequence' splits the sequence)"


def _followed(func: Any, called: tuple[Any, ...], kwargs: Mapping[str, Any], y: Any) -> Any:
    """``y`` as :class:`SplitLogits` where the operator's output still holds the cut dim."""
    if not isinstance(y, torch.Tensor) or not y.is_floating_point():
        return y
    if isinstance(y, SplitLogits):  # changed in place: its mark stays
        return y
    none: frozenset[int] = frozenset()
    cut = bookkept(none, dims_followed, func, called, kwargs, y)
    if not cut:
        return y
    source = next((x for x in called if isinstance(x, SplitLogits)), None)
    out = _wrap(y, cut, getattr(source, _RANKS_ATTR, None), getattr(source, _SPLIT_ATTR, None))
    tokens = getattr(source, TOKENS_BEFORE_PADDING, None)
    if tokens is not None and 1 in cut and source is not None and y.shape[1] == source.shape[1]:
        setattr(out, TOKENS_BEFORE_PADDING, tokens)  # gather_logits(logits.float()) strips it
    return out


def _wrap(
    x: torch.Tensor, cut: frozenset[int], ranks: int | None, split: str | None = VOCABULARY
) -> SplitLogits:
    wrapped = x.as_subclass(SplitLogits)
    setattr(wrapped, SPLIT_DIMS_MARK, cut)
    setattr(wrapped, _RANKS_ATTR, ranks)
    setattr(wrapped, _SPLIT_ATTR, split or VOCABULARY)
    return wrapped


def token_split_logits(logits: torch.Tensor, ranks: int) -> torch.Tensor:
    """``[b, s/N, V]`` logits of this rank's chunk of the tokens, checked as :class:`SplitLogits`.

    Plain under ``torch.compile`` (the check is not traced) and for a plain ``ranks < 2``.
    """
    if ranks < 2 or logits.dim() != 3 or torch.compiler.is_compiling():
        return logits
    return _wrap(logits, frozenset({1}), ranks, TOKENS)


def local_logits(logits: torch.Tensor) -> torch.Tensor:
    """This rank's part of split logits as a plain tensor, read on purpose.

    For a vocabulary-parallel computation of one's own (the part of a loss this rank holds,
    compared with the same slice of one process's logits). Autograd flows through it; a
    plain tensor is returned as it is.
    """
    if not isinstance(logits, SplitLogits):
        return logits
    with torch._C.DisableTorchFunctionSubclass():
        plain = logits.as_subclass(torch.Tensor)
    tokens = getattr(logits, TOKENS_BEFORE_PADDING, None)  # 'sequence': the padding's start
    if tokens is not None:
        setattr(plain, TOKENS_BEFORE_PADDING, tokens)
    return plain


def install_split_logits(
    model: nn.Module, heads: list[str], mode: str, context: ParallelContext
) -> None:
    """Make the heads return :class:`SplitLogits` where their vocabulary is split.

    That is where the mode's logits cuts split a head's last dim over more than one rank
    (1D's vocabulary): the caller's code is then checked.

    Args:
        model: The converted model.
        heads: Its modules of role ``'head'``.
        mode: The tensor mode (its ``ModeLayers.logits_cuts`` say what its heads split).
        context: The ParallelContext.
    """
    layers = find_mode_layers(mode)
    cuts = None if layers is None else layers.logits_cuts
    if cuts is None:
        return
    for name in heads:
        model.get_submodule(name).register_forward_hook(_marking(cuts, context))


def _marking(cuts: Cuts, context: ParallelContext) -> Callable[..., Any]:
    def mark(module: nn.Module, args: Any, output: Any) -> Any:
        if not isinstance(output, torch.Tensor) or torch.compiler.is_compiling():
            return None
        if not output.is_floating_point() or output.dim() < 2:
            return None
        last = output.dim() - 1
        groups = {d % output.dim(): g for d, g in cuts(context, output.dim()).items()}.get(last, ())
        ranks = max((context.get_world_size(g) for g in groups), default=1)
        if ranks < 2:
            return None
        return _wrap(output, frozenset({last}), ranks)

    return mark
