"""Which dims of its tensors a torch operator reads whole, and where a split dim goes in its output.

The tables behind :mod:`.own_code`, which follows the dims the tensor ranks cut (a converted
module's output: the batch and the features under 2D, the tokens between a span's ends, the
vocabulary of 1D's logits) through a model's own code. Two questions per operator:

- **Reads whole**: which dims of each tensor argument the operator needs whole to compute its
  number (a reduction, a softmax or norm over them, a contraction, a concatenation, roll or
  flip along them, a convolution or FFT over them). Read on a split dim, each rank computes a
  different number than one process would, without an error.
- **Follows**: which dims of its output are still cut, so the check goes on past it: the same
  dims for elementwise code (broadcast from the right), the dims left by a reduction over
  whole ones, moved by a transpose or permute, regrouped by a view or reshape (a cut of
  contiguous blocks, so of the outermost dim of a group: ``view(b, s, heads, head_dim)`` of
  split features cuts the heads), carried by indexing, a product or an einsum.

Both err towards passing: an operator absent from the tables is treated as elementwise, and a
reshape that cannot be told from an unsqueeze (``view(b, s, 1, h)`` of one local head) cuts the
size-1 dim. ``verify=`` checks the numbers themselves.
"""

from __future__ import annotations

import string
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F

__all__ = [
    "CONCATENATIONS",
    "DRAWN_MARK",
    "METADATA",
    "RANDOM_DRAWS",
    "RESHAPED_IN_PLACE",
    "SPLIT_DIMS_MARK",
    "TAKING_PART",
    "dims_followed",
    "dims_read_whole",
    "in_place_cut",
    "indexed_dims",
    "split_dims",
]

#: Set on a tensor the check follows: the dims of it the tensor ranks cut (a frozenset).
SPLIT_DIMS_MARK = "_tessera_split_dims"
#: Set on a tensor drawn at random in a split region, or computed from one: each rank drew
#: its own numbers (dropout.py forks the generator per rank there).
DRAWN_MARK = "_tessera_drawn_per_rank"
_DRAWS = "rand randn rand_like randn_like randint randint_like bernoulli normal poisson"
_IN_PLACE_DRAWS = "bernoulli uniform normal random exponential geometric cauchy log_normal"
#: Random draws from torch's global generator (a ``generator=`` of the caller's own is not).
RANDOM_DRAWS = {
    getattr(owner, name)
    for owner in (torch, torch.Tensor)
    for name in (*_DRAWS.split(), "multinomial", "randperm")
    if hasattr(owner, name)
} | {getattr(torch.Tensor, f"{name}_") for name in _IN_PLACE_DRAWS.split()}

Args = tuple[Any, ...]
Kwargs = Mapping[str, Any]
#: ``dims(args, kwargs, ndim)``: the dims of the first tensor argument an operator reads whole
#: (``None``: all of them).
DimsRead = Callable[[Args, Kwargs, int], "set[int] | None"]
#: ``follow(func, args, kwargs, y)``: the dims of an output ``y`` cut where the inputs were.
Follow = Callable[[Any, Args, Kwargs, torch.Tensor], "frozenset[int]"]


def split_dims(x: Any) -> frozenset[int]:
    """The dims of ``x`` the tensor ranks cut (empty for anything unmarked)."""
    if not isinstance(x, torch.Tensor):
        return frozenset()
    marked: frozenset[int] | None = getattr(x, SPLIT_DIMS_MARK, None)
    return frozenset() if marked is None else marked


def _dims(given: Any, ndim: int) -> set[int] | None:
    if isinstance(given, torch.Tensor):
        return set()  # torch.max(a, b): elementwise
    if given is None or isinstance(given, bool) or (isinstance(given, (tuple, list)) and not given):
        return None  # every dim (``x.sum()``, ``x.var(True)``, ``x.amax()``)
    dims = given if isinstance(given, (tuple, list, torch.Size)) else (given,)
    return {int(d) % max(ndim, 1) for d in dims}


def _dim_at(position: int, default: Any, name: str = "dim", varargs: bool = False) -> DimsRead:
    """The dims named by argument ``name`` (or at ``position``); ``default`` when not given.

    ``varargs``: the dims may be given one argument each (``x.flip(1, 2)``).
    """

    def read(args: Args, kwargs: Kwargs, ndim: int) -> set[int] | None:
        given = kwargs.get(
            name, kwargs.get("axis", args[position] if len(args) > position else default)
        )
        if varargs and isinstance(given, int) and len(args) > position + 1:
            given = args[position:]
        return _dims(given, ndim)

    return read


def _fixed(*dims: int) -> DimsRead:
    """Dims counted from the end when negative (a norm's last dim, a contraction)."""
    return lambda args, kwargs, ndim: {d % ndim for d in dims if -ndim <= d < ndim}


def _from(first: int) -> DimsRead:
    """Every dim from ``first`` on (a convolution's channels and positions)."""
    return lambda args, kwargs, ndim: set(range(first, ndim))


def _last_dims(position: int) -> DimsRead:
    """A norm over the last ``len(normalized_shape)`` dims (``F.layer_norm``, ``F.rms_norm``)."""

    def read(args: Args, kwargs: Kwargs, ndim: int) -> set[int] | None:
        shape = kwargs.get("normalized_shape", args[position] if len(args) > position else ())
        count = 1 if isinstance(shape, int) else len(shape)
        return set(range(ndim - count, ndim))

    return read


def _softmax_dim(args: Args, kwargs: Kwargs, ndim: int) -> set[int] | None:
    """``F.softmax``'s dim; without one, torch's implicit choice (0 for 0, 1 or 3 dims, else 1)."""
    read = _dim_at(1, None)(args, kwargs, ndim)
    return read if read is not None else {0 if ndim in (0, 1, 3) else 1}


def _batch_norm(args: Args, kwargs: Kwargs, ndim: int) -> set[int] | None:
    """Statistics over all dims but the channels (1); elementwise from running statistics.

    Running statistics are used in eval mode (``training=False``) where they are given.
    """
    running = args[1] if len(args) > 1 else kwargs.get("running_mean")
    training = args[5] if len(args) > 5 else kwargs.get("training", False)
    if running is not None and not training:
        return set()
    return {d for d in range(ndim) if d != 1}


def _channel_dropout(batched: int | None) -> DimsRead:
    """``F.dropout1d/2d/3d`` in training: the dims after the channel (one draw spans them).

    A rank holding a block of those dims would draw its own numbers for its part of a channel.
    ``batched``: the input rank read as ``[N, C, ...]`` (any other is one sample ``[C, ...]``);
    ``None``: every input, as dropout2d and feature_alpha_dropout read it.
    """

    def read(args: Args, kwargs: Kwargs, ndim: int) -> set[int] | None:
        p = args[1] if len(args) > 1 else kwargs.get("p", 0.5)
        training = args[2] if len(args) > 2 else kwargs.get("training", True)
        first = 2 if batched is None or ndim == batched else 1
        return set(range(first, ndim)) if training and p > 0 else set()

    return read


def _instance_norm(args: Args, kwargs: Kwargs, ndim: int) -> set[int] | None:
    """Statistics over each sample's positions (dims 2 on), unless from running statistics."""
    if not (args[5] if len(args) > 5 else kwargs.get("use_input_stats", True)):
        return set()
    return set(range(2, ndim))


def _picked(position: int, default: Any) -> DimsRead:
    """``index_select``, ``gather``: another dim than the batch is read as a whole.

    Rows of the batch (dim 0) picked by a tensor of indices are per sample: a rank picks from
    its own rows, as ``x[indices]`` does.
    """
    along = _dim_at(position, default)

    def read(args: Args, kwargs: Kwargs, ndim: int) -> set[int] | None:
        dims = along(args, kwargs, ndim)
        return None if dims is None else dims - {0}

    return read


def _padded(args: Args, kwargs: Kwargs, ndim: int) -> set[int] | None:
    """``F.pad``: the dims given a pad, from the last (a pad at a block's end is mid-tensor)."""
    pad = kwargs.get("pad", args[1] if len(args) > 1 else ())
    pairs = [tuple(pad[i : i + 2]) for i in range(0, len(pad), 2)]
    return {ndim - 1 - k for k, pair in enumerate(pairs) if any(int(p) != 0 for p in pair)}


def _loss(classes: bool) -> DimsRead:
    """A loss: over every dim unless ``reduction='none'``; the classes (dim 1) read whole."""

    def read(args: Args, kwargs: Kwargs, ndim: int) -> set[int] | None:
        if kwargs.get("reduction", "mean") != "none":
            return None
        return {1 if ndim >= 2 else 0} if classes else set()

    return read


def _fft(count: int | None) -> DimsRead:
    """``torch.fft``: the transformed dims.

    ``dim``; else the last ``len(s)``; else the last ``count``; else all of them.
    """

    def read(args: Args, kwargs: Kwargs, ndim: int) -> set[int] | None:
        given = kwargs.get("dim", args[2] if len(args) > 2 else None)
        if given is not None:
            return _dims(given, ndim)
        sizes = kwargs.get("s", kwargs.get("n", args[1] if len(args) > 1 else None))
        last = len(sizes) if isinstance(sizes, (tuple, list)) and count != 1 else count
        return None if last is None else set(range(max(ndim - last, 0), ndim))

    return read


def _repeated(args: Args, kwargs: Kwargs, ndim: int) -> set[int] | None:
    """``x.repeat(...)``: the dims tiled more than once (a block tiled is not the whole tiled)."""
    sizes = args[1:] if len(args) > 2 else kwargs.get("repeats", kwargs.get("dims", args[1:]))
    if len(sizes) == 1 and isinstance(sizes[0], (tuple, list, torch.Size)):
        sizes = sizes[0]
    offset = ndim - len(sizes)  # more sizes than dims: new leading dims
    return {offset + k for k, size in enumerate(sizes) if int(size) != 1 and offset + k >= 0}


#: Operators writing into their input along a dim, from a source: ``index_add_(dim, i, src)``.
_WRITERS = " ".join(
    f"{name}{suffix}"
    for name in ("scatter", "scatter_add", "scatter_reduce", "index_add", "index_copy")
    for suffix in ("", "_")
)


def _reads_whole() -> dict[Any, DimsRead]:
    """Operators that read dims of their first tensor argument whole, and which dims."""
    table: dict[Any, DimsRead] = {}

    def every(names: str, read: DimsRead, *owners: Any) -> None:  # torch.mean, Tensor.mean, ...
        for name in names.split():
            for owner in owners or (torch, torch.Tensor):
                if hasattr(owner, name):
                    table[getattr(owner, name)] = read

    every("sum mean nansum nanmean prod max min argmax argmin amax amin", _dim_at(1, None))
    every("var std var_mean std_mean logsumexp softmax log_softmax", _dim_at(1, None))
    every("cumsum cumprod cummax cummin logcumsumexp median nanmedian", _dim_at(1, None))
    every("unbind", _dim_at(1, 0))
    every("sort argsort mode", _dim_at(1, -1))
    every("chunk split tensor_split", _dim_at(2, 0))
    every("narrow select", _dim_at(1, 0))
    every("index_select gather", _picked(1, 0))
    # writes along a dim: rows of the batch by the rank's indices (an expert's rows added back)
    every(_WRITERS, _picked(1, 0))
    every("unfold", _dim_at(1, 0))  # windows along a dim: across a block's edge
    every("repeat tile", _repeated)
    every("topk kthvalue diff", _dim_at(2, -1))
    every("quantile nanquantile norm", _dim_at(2, None))
    every("take_along_dim", _picked(2, None))
    every("roll", _dim_at(2, None, "dims"))
    every("flip", _dim_at(1, None, "dims", varargs=True))
    every("rot90", _dim_at(2, (0, 1), "dims"))
    every("softmax log_softmax logsumexp", _dim_at(1, None), torch.special)
    every("vector_norm norm", _dim_at(2, None), torch.linalg)
    every("softmax log_softmax softmin", _softmax_dim, F)
    every("normalize cosine_similarity", _dim_at(2, 1), F, torch)
    every("pairwise_distance", _fixed(-1), F)
    every("glu", _dim_at(1, -1), F)
    every("layer_norm rms_norm", _last_dims(1), F, torch)
    every("group_norm local_response_norm", _from(1), F, torch)
    every("instance_norm", _instance_norm, F, torch)
    every("batch_norm", _batch_norm, F, torch)
    every("pad", _padded, F)
    every("dropout1d", _channel_dropout(batched=3), F)
    every("dropout2d feature_alpha_dropout", _channel_dropout(batched=None), F)
    every("dropout3d", _channel_dropout(batched=5), F)
    every("cross_entropy nll_loss", _loss(classes=True), F)
    every("mse_loss l1_loss smooth_l1_loss huber_loss kl_div", _loss(classes=False), F)
    every("binary_cross_entropy binary_cross_entropy_with_logits", _loss(classes=False), F)
    every("conv1d conv2d conv3d conv_transpose1d conv_transpose2d unfold", _from(1), F)
    every("avg_pool1d avg_pool2d max_pool1d max_pool2d interpolate", _from(2), F)
    every("adaptive_avg_pool1d adaptive_avg_pool2d", _from(2), F)
    every("fft ifft rfft irfft hfft", _fft(1), torch.fft)
    every("fft2 ifft2 rfft2 irfft2", _fft(2), torch.fft)
    every("fftn ifftn rfftn irfftn", _fft(None), torch.fft)
    return table


_READS_WHOLE = _reads_whole()

#: Operators taking a part along a dim (an index, a chunk): refused where what they return is
#: computed with, not where only its shape is read (BART's ``embed_positions(x[:, :, -1])``).
_PART_TAKERS = "chunk split tensor_split unbind narrow select index_select gather take_along_dim"
TAKING_PART = {torch.Tensor.__getitem__} | {
    getattr(owner, name)
    for owner in (torch, torch.Tensor)
    for name in _PART_TAKERS.split()
    if hasattr(owner, name)
}
#: Queries that read a tensor's metadata, not its values.
METADATA = {
    torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.ndimension,
    torch.Tensor.is_floating_point, torch.Tensor.__len__, torch.Tensor.get_device,
    torch.Tensor.stride, torch.Tensor.is_contiguous, torch.Tensor.new_zeros,
    torch.Tensor.new_ones, torch.Tensor.new_empty, torch.Tensor.new_full, torch.zeros_like,
    torch.ones_like, torch.empty_like, torch.full_like, torch.rand_like, torch.randn_like,
    *(
        getattr(torch.Tensor, name).__get__
        for name in ("shape", "dtype", "device", "ndim", "requires_grad", "is_cuda", "layout")
    ),
}  # fmt: skip
#: Concatenations, and the dim each reads of a tensor of ``ndim`` dims it is given.
CONCATENATIONS: dict[Any, Callable[[Args, Kwargs, int], set[int] | None]] = {
    torch.cat: _dim_at(1, 0),
    torch.concat: _dim_at(1, 0),
    torch.concatenate: _dim_at(1, 0, "axis"),
    torch.hstack: lambda args, kwargs, ndim: {1 if ndim >= 2 else 0},
    torch.vstack: lambda args, kwargs, ndim: {0} if ndim >= 2 else set(),
    torch.row_stack: lambda args, kwargs, ndim: {0} if ndim >= 2 else set(),
    torch.dstack: lambda args, kwargs, ndim: {2} if ndim >= 3 else set(),
    torch.column_stack: lambda args, kwargs, ndim: {1} if ndim >= 2 else set(),
}


def _einsum_letters(args: Args) -> tuple[list[torch.Tensor], list[str], str] | None:
    """``torch.einsum``'s operands, each one's letters (``...`` spelled out), the output's."""
    if not args or not isinstance(args[0], str):
        return None
    operands = list(args[1] if len(args) == 2 and isinstance(args[1], Sequence) else args[1:])
    equation = args[0].replace(" ", "")
    inputs, _, output = equation.partition("->")
    spare = [c for c in string.ascii_uppercase + string.ascii_lowercase if c not in equation]
    ellipsis = max(
        (
            t.dim() - len(s.replace("...", ""))
            for s, t in zip(inputs.split(","), operands, strict=True)
        ),
        default=0,
    )
    filler = "".join(spare[:ellipsis])
    letters = [
        s.replace("...", filler[len(filler) - (t.dim() - len(s.replace("...", ""))) :])
        for s, t in zip(inputs.split(","), operands, strict=True)
    ]
    if "->" in equation:
        output = output.replace("...", filler)
    else:  # implicit: the broadcast dims, then the letters that appear once, in order
        once = sorted(c for c in set("".join(letters)) if "".join(letters).count(c) == 1)
        output = filler + "".join(c for c in once if c not in filler)
    return operands, letters, output


def dims_read_whole(
    func: Any, args: Args, kwargs: Kwargs
) -> list[tuple[torch.Tensor, set[int] | None]]:
    """Each tensor argument of ``func`` with the dims of it the operator reads whole."""
    if func in CONCATENATIONS:
        tensors = kwargs.get("tensors", args[0] if args else ())
        return [(x, CONCATENATIONS[func](args, kwargs, x.dim())) for x in tensors]
    if func is torch.einsum:
        parsed = _einsum_letters(args)
        if parsed is None:
            return []
        operands, letters, output = parsed
        return [
            (x, {d for d, c in enumerate(s) if c not in output})
            for x, s in zip(operands, letters, strict=True)
        ]
    if func is torch.tensordot:
        return _tensordot(args, kwargs)
    if func in _CONTRACTIONS:
        return [
            (args[p], read(args[p].dim()))
            for p, read in _CONTRACTIONS[func]
            if len(args) > p and isinstance(args[p], torch.Tensor)
        ]
    if not args or not isinstance(args[0], torch.Tensor):
        return []
    first = args[0]
    second = args[1] if len(args) > 1 else _second_operand(kwargs)
    if func in _PRODUCTS:
        read: list[tuple[torch.Tensor, set[int] | None]] = [(first, {first.dim() - 1})]
        if isinstance(second, torch.Tensor):  # its rows (F.linear: its in_features) are summed
            inner = second.dim() - 1 if func is F.linear or second.dim() < 2 else second.dim() - 2
            read.append((second, {inner}))
        return read
    if func is F.scaled_dot_product_attention:  # queries' features; keys' and values' tokens
        key = args[1] if len(args) > 1 else kwargs.get("key")
        value = args[2] if len(args) > 2 else kwargs.get("value")
        read = [(first, {first.dim() - 1})]
        read += [(t, {t.dim() - 2, t.dim() - 1}) for t in (key,) if isinstance(t, torch.Tensor)]
        read += [(t, {t.dim() - 2}) for t in (value,) if isinstance(t, torch.Tensor)]
        return read
    if func in _READS_WHOLE:
        reads = _READS_WHOLE[func]
        read = [(first, reads(args, kwargs, first.dim()))]
        other = args[1] if len(args) > 1 else kwargs.get("target", kwargs.get("x2"))
        if func in _BOTH and isinstance(other, torch.Tensor):  # a loss's target, read alike
            read.append((other, reads(args, kwargs, other.dim())))
        return read
    return []


def _second_operand(kwargs: Kwargs) -> Any:
    """``other`` (matmul), ``mat2`` (mm, bmm) or ``weight`` (F.linear), given by keyword."""
    return next((kwargs[k] for k in ("other", "mat2", "weight") if k in kwargs), None)


_PRODUCTS = {torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.mm, torch.Tensor.mm}
_PRODUCTS |= {torch.bmm, torch.Tensor.bmm, F.linear}


def indexed_dims(index: Any, x: torch.Tensor) -> set[int]:
    """The dims of ``x`` that ``x[index]`` reads a part of (not a full ``:``).

    Rows of the batch (dim 0) picked by a tensor of indices are not counted: a rank computes
    them from its own rows (``h[torch.arange(b), last]``), per sample. A list or an int picks
    the same rows of every rank's block, which are other samples: counted. Neither are the dims a
    boolean mask selects from: each rank selects its own elements (the output's first dim is
    then cut, see :func:`dims_followed`).
    """
    dims: set[int] = set()
    for dim, item in _index_items(index, x):
        if isinstance(item, torch.Tensor) and item.dtype == torch.bool:
            continue
        if isinstance(item, slice) and item.indices(x.shape[dim]) == (0, x.shape[dim], 1):
            continue
        if dim > 0 or not isinstance(item, torch.Tensor) or item.dim() == 0:
            dims.add(dim)  # rows of the batch picked by the rank's own indices: per sample
    return dims


def _width(item: Any) -> int:
    """How many dims of the indexed tensor an item of an index consumes (a mask: its dims)."""
    if item is None or item is Ellipsis:
        return 0
    return item.dim() if isinstance(item, torch.Tensor) and item.dtype == torch.bool else 1


def _index_items(index: Any, x: torch.Tensor) -> list[tuple[int, Any]]:
    """Each item of ``index`` that consumes a dim, with the dim (a mask: its first dim)."""
    items = index if isinstance(index, tuple) else (index,)
    consuming = sum(_width(i) for i in items)
    found: list[tuple[int, Any]] = []
    dim = 0
    for item in items:
        if item is Ellipsis:
            dim += x.dim() - consuming
        elif dim < x.dim() and item is not None:
            found.append((dim, item))
            dim += _width(item)
    return found


def _indexed(func: Any, args: Args, kwargs: Kwargs, y: torch.Tensor) -> frozenset[int]:
    """``x[index]``: a kept dim keeps its cut.

    Rows picked from a cut dim (by indices or a mask) cut the dim they become: in place of the
    indices, or first where indices stand apart (``x[i, :, j]``, numpy's rule).
    """
    x, index = args[0], args[1]
    split = split_dims(x)
    items = index if isinstance(index, tuple) else (index,)
    advanced = [i for i, item in enumerate(items) if isinstance(item, (torch.Tensor, list))]
    apart = bool(advanced) and advanced != list(range(advanced[0], advanced[-1] + 1))
    made = 0  # the dims the indices make
    if advanced:
        picked = [items[i] for i in advanced]
        masks = [p for p in picked if isinstance(p, torch.Tensor) and p.dtype == torch.bool]
        if masks and len(picked) > 1:
            return frozenset()  # a mask beside indices: not followed
        shapes = [torch.as_tensor(p).shape for p in picked]
        made = 1 if masks else len(torch.broadcast_shapes(*shapes))  # type: ignore[no-untyped-call]
    consuming = sum(_width(i) for i in items)
    out: set[int] = set()
    dim, o = 0, made if apart else 0
    picked_at, picked_cut = 0, False
    for i, item in enumerate(items):
        width = x.dim() - consuming if item is Ellipsis else _width(item)
        if item is None:
            o += 1
        elif i in advanced:
            picked_cut |= any(d in split for d in range(dim, dim + width))
            if not apart and i == advanced[0]:
                picked_at, o = o, o + made
        elif item is Ellipsis or isinstance(item, slice):
            out |= {o + k for k in range(width) if dim + k in split}
            o += width
        dim += width  # an int: the dim goes
    out |= {o + k for k in range(x.dim() - dim) if dim + k in split}  # the dims after the index
    if made and picked_cut:
        out.add(picked_at)  # the rows picked from a cut dim are cut
    return frozenset(d for d in out if d < y.dim())


def _moved(func: Any, args: Args, kwargs: Kwargs, y: torch.Tensor) -> frozenset[int]:
    """A transpose, permute or movedim: each cut dim where it went."""
    x = args[0]
    n = x.dim()
    order = list(range(n))  # order[k]: the input dim at output dim k
    if func in _SWAPS:
        first = args[1] if len(args) > 1 else kwargs.get("dim0", kwargs.get("axis0"))
        second = args[2] if len(args) > 2 else kwargs.get("dim1", kwargs.get("axis1"))
        a, b = int(first) % n, int(second) % n
        order[a], order[b] = order[b], order[a]
    elif func in _PERMUTES:
        given = args[1:] if len(args) > 2 else (args[1] if len(args) > 1 else kwargs["dims"])
        order = [int(d) % n for d in (given if isinstance(given, Sequence) else (given,))]
    elif func in _MOVEDIMS:
        source: Any = args[1] if len(args) > 1 else kwargs["source"]
        target: Any = args[2] if len(args) > 2 else kwargs["destination"]
        sources = [int(d) % n for d in (source if isinstance(source, Sequence) else (source,))]
        targets = [int(d) % n for d in (target if isinstance(target, Sequence) else (target,))]
        rest = iter(d for d in range(n) if d not in sources)
        placed = dict(zip(targets, sources, strict=True))
        order = [placed[k] if k in placed else next(rest) for k in range(n)]
    elif func in _LAST_TWO and n >= 2:
        order[-2], order[-1] = order[-1], order[-2]
    else:  # .t(), .T: every dim reversed
        order.reverse()
    split = split_dims(x)
    return frozenset(k for k, d in enumerate(order) if d in split)


def _owned(names: str) -> set[Any]:
    """``torch.transpose`` and ``torch.Tensor.transpose``, for each name either has."""
    owners = (torch, torch.Tensor)
    return {getattr(o, name) for name in names.split() for o in owners if hasattr(o, name)}


_SWAPS = _owned("transpose swapaxes swapdims transpose_ swapaxes_ swapdims_")
_PERMUTES = _owned("permute")
_MOVEDIMS = _owned("movedim moveaxis")
_LAST_TWO = {getattr(torch.Tensor, name).__get__ for name in ("mT", "mH")}
_REVERSED = {torch.t, torch.Tensor.t, torch.Tensor.t_}
_REVERSED |= {getattr(torch.Tensor, name).__get__ for name in ("T", "H")}
#: In-place changes of shape whose input is gone when the output is seen: followed from the
#: shape before (``in_place_cut``), by their out-of-place forms where they have one.
_RESHAPED_IN_PLACE = _owned("squeeze_ unsqueeze_ resize_ resize_as_ as_strided_ set_")
_OUT_OF_PLACE = {
    getattr(torch.Tensor, f"{name}_"): getattr(torch.Tensor, name)
    for name in ("squeeze", "unsqueeze")
}
RESHAPED_IN_PLACE = frozenset(_RESHAPED_IN_PLACE)


def in_place_cut(func: Any, args: Args, kwargs: Kwargs) -> frozenset[int] | None:
    """The cut dims ``args[0]`` will have after ``func`` changes its shape in place.

    Computed before the call, on a meta tensor of the shape before (``squeeze_`` needs to
    know which dims were of size 1). ``None`` for a change no table follows (``resize_``,
    ``as_strided_``, ``set_``: memory reinterpreted).
    """
    plain = _OUT_OF_PLACE.get(func)
    if plain is None:
        return None
    x = args[0]
    probe = torch.empty(x.shape, device="meta")
    setattr(probe, SPLIT_DIMS_MARK, split_dims(x))
    y = plain(probe, *args[1:], **kwargs)
    return dims_followed(plain, (probe, *args[1:]), kwargs, y)


def _squeezed(func: Any, args: Args, kwargs: Kwargs, y: torch.Tensor) -> frozenset[int]:
    """``squeeze``/``unsqueeze``: the cut dims renumbered around the dims gone or made."""
    x = args[0]
    split = split_dims(x)
    given: Any = args[1] if len(args) > 1 else kwargs.get("dim")
    if func in (torch.unsqueeze, torch.Tensor.unsqueeze):
        new = int(given) % y.dim()
        return frozenset(d if d < new else d + 1 for d in split)
    gone = {d for d in range(x.dim()) if x.shape[d] == 1}
    if given is not None:
        gone &= _dims(given, x.dim()) or set()
    return frozenset(d - sum(g < d for g in gone) for d in split if d not in gone)


_VIEWS = _owned("view reshape")
_UNFLATTENS = _owned("unflatten")


def _inferred(func: Any, args: Args, kwargs: Kwargs, y: torch.Tensor) -> int | None:
    """The output dim a view, reshape or unflatten was asked to infer (its ``-1``), if any."""
    if func not in _VIEWS and func not in _UNFLATTENS:
        return None
    if func in _UNFLATTENS:
        given: Any = args[1:3] if len(args) > 2 else (kwargs.get("dim"), kwargs.get("sizes"))
        dim, sizes = given
        if isinstance(dim, int) and isinstance(sizes, (tuple, list, torch.Size)):
            sizes = list(sizes)
            return dim % (y.dim() - len(sizes) + 1) + sizes.index(-1) if -1 in sizes else None
        return None
    shape: Any = args[1:] if len(args) > 1 else (kwargs.get("shape") or kwargs.get("size") or ())
    if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)):
        shape = shape[0]
    asked = [int(d) if isinstance(d, int) else None for d in shape]
    return asked.index(-1) if len(asked) == y.dim() and -1 in asked else None


def _regrouped(func: Any, args: Args, kwargs: Kwargs, y: torch.Tensor) -> frozenset[int]:
    """A view or reshape: each cut dim to the output dim of its group the split falls in.

    A rank's block of a cut dim is contiguous. Of ``[h/q] -> [heads, head_dim]`` the dim the
    model asked to infer (``view(b, s, -1, head_dim)``: a count of heads this rank's block
    holds) is cut and each head's features are whole; ``view(b, s, n_head, -1)`` with the
    model's own head count cuts the features instead (each local "head" is a part of the
    block, not a head), and so does ``view(b, s, 1, -1)`` (one group of all features). Without
    a ``-1`` the outermost dim of more than one element past the cut's start is cut; of
    ``[b, s] -> [b * s]`` the merged dim is.
    """
    x = args[0]
    a, b, split = list(x.shape), list(y.shape), split_dims(x)
    try:
        inferred = _inferred(func, args, kwargs, y)
    except Exception:  # a form not read: no dim inferred
        inferred = None
    out: set[int] = set()
    i = j = 0
    while i < len(a) and j < len(b):
        if a[i] == 1 and b[j] == 1:
            if i in split:
                out.add(j)
            i, j = i + 1, j + 1
            continue
        if b[j] == 1:  # a size-1 dim made
            if j == inferred and i in split:  # [b, s, h/q] as [b, s, -1, h/q]: one local head
                out.add(j)
                split = split - {i}
            j += 1
            continue
        group_in, group_out = [i], [j]
        size_in, size_out = a[i], b[j]
        i, j = i + 1, j + 1
        while size_in != size_out and i <= len(a) and j <= len(b):
            if size_in < size_out and i < len(a):
                group_in.append(i)
                size_in, i = size_in * a[i], i + 1
            elif size_out < size_in and j < len(b):
                group_out.append(j)
                size_out, j = size_out * b[j], j + 1
            else:
                return frozenset(out)  # sizes that do not line up: not followed
        cut = [d for d in group_in if d in split]
        if cut and inferred in group_out:
            # the outermost inferred: a count of this rank's blocks (heads); an inner one
            # (the model's own count outside it) makes every dim of the group a part
            out.update({inferred} if inferred == group_out[0] else group_out)
        elif cut:
            outer = 1
            for d in group_in:
                if d == cut[0]:
                    break
                outer *= a[d]
            reach = 1
            for d in group_out:  # the first output dim reaching past the cut dim's start
                reach *= b[d]
                if reach > outer and b[d] > 1:
                    out.add(d)
                    break
    return frozenset(out)


def _product(func: Any, args: Args, kwargs: Kwargs, y: torch.Tensor) -> frozenset[int]:
    """``a @ b`` (``[..., n, k] @ [..., k, m]``): a's batch and rows, b's batch and columns."""
    a = args[0]
    b = args[1] if len(args) > 1 else _second_operand(kwargs)
    cut: set[int] = set()
    if func is F.linear:  # x @ weight.T: x's dims but its last; weight's rows become columns
        cut = {d for d in split_dims(a) if d < a.dim() - 1}
        if isinstance(b, torch.Tensor) and 0 in split_dims(b) and b.dim() == 2:
            cut.add(y.dim() - 1)
        return frozenset(cut)
    if not isinstance(b, torch.Tensor):
        return frozenset()
    rows, columns = int(a.dim() >= 2), int(b.dim() >= 2)
    batch_end = y.dim() - rows - columns
    for x in (a, b):
        batch = x.dim() - 2 if x.dim() >= 2 else 0
        cut |= {batch_end - batch + d for d in split_dims(x) if d < batch}
    if rows and a.dim() - 2 in split_dims(a):
        cut.add(batch_end)
    if columns and b.dim() - 1 in split_dims(b):
        cut.add(y.dim() - 1)
    return frozenset(cut)


def _einsum(func: Any, args: Args, kwargs: Kwargs, y: torch.Tensor) -> frozenset[int]:
    """An einsum: the output's letters cut in any operand."""
    parsed = _einsum_letters(args)
    if parsed is None:
        return frozenset()
    operands, letters, output = parsed
    cut = {s[d] for x, s in zip(operands, letters, strict=True) for d in split_dims(x)}
    return frozenset(k for k, c in enumerate(output) if c in cut)


def _written(func: Any, args: Args, kwargs: Kwargs, y: torch.Tensor) -> frozenset[int]:
    """``x.index_add_(dim, index, source)``: x's cut dims, and the source's (same dims)."""
    source = args[3] if len(args) > 3 else kwargs.get("source", kwargs.get("src"))
    cut = split_dims(args[0])
    if isinstance(source, torch.Tensor) and source.dim() == y.dim():
        cut |= split_dims(source)
    return cut


def _stacked(func: Any, args: Args, kwargs: Kwargs, y: torch.Tensor) -> frozenset[int]:
    """``torch.stack``: each tensor's cut dims around the new one."""
    tensors = kwargs.get("tensors", args[0] if args else ())
    new = int(kwargs.get("dim", args[1] if len(args) > 1 else 0)) % y.dim()
    return frozenset(d if d < new else d + 1 for x in tensors for d in split_dims(x))


def _concatenated(func: Any, args: Args, kwargs: Kwargs, y: torch.Tensor) -> frozenset[int]:
    """A concatenation along whole dims: each tensor's cut dims where they were."""
    tensors = kwargs.get("tensors", args[0] if args else ())
    return frozenset(d for x in tensors if x.dim() == y.dim() for d in split_dims(x))


def _last(ndim: int) -> set[int]:
    return {ndim - 1}


def _rows(ndim: int) -> set[int]:
    return {max(ndim - 2, 0)}


#: Contractions given their operands at fixed positions: each position, and the dims of the
#: tensor there summed over (``addmm(input, a, b)`` sums a's columns and b's rows).
_CONTRACTIONS: dict[Any, tuple[tuple[int, Callable[[int], set[int]]], ...]] = {}
for _names, _reads in (
    ("addmm", ((1, _last), (2, _rows))),
    ("baddbmm", ((1, _last), (2, _rows))),
    ("addbmm", ((1, lambda n: {0, n - 1}), (2, lambda n: {0, n - 2}))),
    ("addmv", ((1, _last), (2, _last))),
    ("mv", ((0, _last), (1, _last))),
    ("dot vdot inner", ((0, _last), (1, _last))),
):
    for _func in _owned(_names):
        _CONTRACTIONS[_func] = _reads
_CONTRACTIONS[F.bilinear] = ((0, _last), (1, _last))
_CONTRACTIONS[torch.cdist] = ((0, _last), (1, _last))
#: Their outputs: the first operand's dims left, then the second's (``inner``, ``mv``).
_FREE_THEN = _owned("mv dot vdot inner")
#: Operators reading their second tensor argument as their first (a loss's target).
_BOTH = {
    *(getattr(F, name) for name in ("cosine_similarity", "pairwise_distance", "kl_div")),
    *(getattr(F, name) for name in ("mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss")),
    *(getattr(F, name) for name in ("binary_cross_entropy", "binary_cross_entropy_with_logits")),
    torch.cosine_similarity,
}


def _tensordot(args: Args, kwargs: Kwargs) -> list[tuple[torch.Tensor, set[int] | None]]:
    """``torch.tensordot(a, b, dims)``: a's last ``dims`` and b's first, or the dims listed."""
    a, b = args[0], args[1] if len(args) > 1 else kwargs["b"]
    dims = args[2] if len(args) > 2 else kwargs.get("dims", 2)
    if isinstance(dims, int):
        return [(a, set(range(a.dim() - dims, a.dim()))), (b, set(range(dims)))]
    first, second = ((d,) if isinstance(d, int) else d for d in dims)
    return [(a, {int(d) % a.dim() for d in first}), (b, {int(d) % b.dim() for d in second})]


def _free_then(func: Any, args: Args, kwargs: Kwargs, y: torch.Tensor) -> frozenset[int]:
    """A contraction's output: the first operand's dims left, then the second's."""
    read = dims_read_whole(func, args, kwargs)
    cut: set[int] = set()
    offset = 0
    for x, dims in read:
        free = [d for d in range(x.dim()) if d not in (dims or set())]
        cut |= {offset + k for k, d in enumerate(free) if d in split_dims(x)}
        offset += len(free)
    return frozenset(d for d in cut if d < y.dim())


_FOLLOWS: dict[Any, Follow] = {torch.Tensor.__getitem__: _indexed, torch.einsum: _einsum}
_FOLLOWS |= dict.fromkeys(_SWAPS | _PERMUTES | _MOVEDIMS | _LAST_TWO | _REVERSED, _moved)
_FOLLOWS |= dict.fromkeys(_owned("squeeze unsqueeze"), _squeezed)
_FOLLOWS |= dict.fromkeys(_owned("view reshape view_as reshape_as flatten unflatten"), _regrouped)
_FOLLOWS |= dict.fromkeys(_PRODUCTS, _product)
_FOLLOWS |= dict.fromkeys(CONCATENATIONS, _concatenated)
_FOLLOWS[torch.stack] = _stacked
_FOLLOWS |= dict.fromkeys(_owned(_WRITERS), _written)
_FOLLOWS |= dict.fromkeys(_FREE_THEN | {torch.tensordot}, _free_then)


def _reduced(x: torch.Tensor, read: set[int] | None, y: torch.Tensor) -> frozenset[int]:
    """The cut dims after an operator read ``read`` whole, none of them cut.

    Where they were for an output of as many dims (a softmax, a sort, ``keepdim``), else
    renumbered past the reduced dims.
    """
    split = split_dims(x)
    if y.dim() == x.dim():
        return split
    if read is not None and y.dim() == x.dim() - len(read):
        return frozenset(d - sum(r < d for r in read) for d in split if d not in read)
    return frozenset()


def _broadcast(inputs: list[torch.Tensor], y: torch.Tensor) -> frozenset[int]:
    """Elementwise code: each input's cut dims, aligned from the right, where ``y`` has them."""
    cut: set[int] = set()
    for x in inputs:
        offset = y.dim() - x.dim()
        if offset < 0 or any(x.shape[d] not in (1, y.shape[d + offset]) for d in range(x.dim())):
            continue
        cut |= {d + offset for d in split_dims(x) if x.shape[d] == y.shape[d + offset]}
    return frozenset(cut)


def dims_followed(func: Any, args: Args, kwargs: Kwargs, y: torch.Tensor) -> frozenset[int]:
    """The dims of ``func``'s output ``y`` the tensor ranks cut, from its inputs' cuts."""
    if func in _RESHAPED_IN_PLACE:
        return frozenset()
    if func in _FOLLOWS:
        dtype = args[1] if len(args) > 1 else kwargs.get("dtype")
        if func is torch.Tensor.view and isinstance(dtype, torch.dtype):  # another dtype
            return split_dims(args[0]) if y.dim() == args[0].dim() else frozenset()
        return _FOLLOWS[func](func, args, kwargs, y)
    read = [(x, dims) for x, dims in dims_read_whole(func, args, kwargs) if split_dims(x)]
    if func in _QUANTILES and isinstance(
        args[1] if len(args) > 1 else kwargs.get("q"), torch.Tensor
    ):
        return frozenset()  # a dim of quantiles first: not followed
    if any(dims != set() for _, dims in read):  # not the elementwise form (torch.max(a, b))
        return frozenset().union(*(_reduced(x, dims, y) for x, dims in read))
    inputs = [x for x in _flat_tensors(args, kwargs) if split_dims(x)]
    return _broadcast(inputs, y)


_QUANTILES = _owned("quantile nanquantile")


def _flat_tensors(args: Args, kwargs: Kwargs) -> list[torch.Tensor]:
    from torch.utils._pytree import tree_flatten

    return [x for x in tree_flatten((args, dict(kwargs)))[0] if isinstance(x, torch.Tensor)]
