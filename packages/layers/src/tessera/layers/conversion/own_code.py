"""The model's own code between converted modules, checked once: no split dim read whole.

``parallelize`` converts the modules a plan names and runs the modules it leaves out under
DTensor (:mod:`.left_out`). What is left is code in a forward of the model's own, between
them, with no module a plan could name: ``x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True))``
written inline in a block, ``h[:, 0]`` to pool the first token, ``logits.softmax(-1)``. On a
block of a split tensor each computes a number, the wrong one (a mean over ``h/q`` of the
features, this rank's first token of its sequence chunk), and the model would train
differently from one process without an error.

So the first call of a converted model runs under a ``TorchFunctionMode`` that follows the
split dims of the tensors tessera's modules return (each converted module's output is marked
with the dims its layout cuts: the mode's activation, column or logits cuts) through the
model's own code, and refuses an operator that reads part of a split dim as if it were whole: a
reduction, softmax or norm over it, a contraction of it (``@``, ``F.linear``, an einsum), a
concatenation, pad, roll or flip along it, a convolution, FFT or loss over it. The split dims
are followed through elementwise code, indexing, reductions over whole dims, transposes, views
and reshapes, products and einsums (:mod:`.operator_dims` holds the tables), so
``F.normalize(h[:, 0], dim=-1)`` under 2D is refused as ``F.normalize(h, dim=-1)`` is. A part
taken along a split dim (an index, a chunk, a narrow) is refused where its values are used in
the model's own code, where the model returns it or gives it to a converted module computing
with it, not where only its shape is read (BART passes ``x[:, :, -1]`` to its position
embedding for the shape). The error names the operator, the dim, the block's shape, the line of
the model's code that called it, and what to do (a module of its own, which tessera runs under
DTensor, or a role). The first call in training mode and the first in eval mode are checked
(``verify=`` or a first evaluation may call in eval mode, where a branch on ``self.training``
or a dropout takes another path); then the check is removed: later calls and
``torch.compile`` pay nothing.

What it does not see: an operator absent from the tables (taken as elementwise), a split
tensor the model makes from a marked one in a way not followed, paths the first call does not
take, and a deep copy of the converted model (an EMA copy: the hooks act only on the model
they were installed on). ``verify=`` checks the numbers themselves (:mod:`.verify`). Indexing
the batch (dim 0) with a tensor of the rank's own row indices, or selecting with a mask, is
per sample and allowed; ``x[0]`` or a reduction over the batch is not. The outputs of fused
layers (``qkv``, ``gate_up``) are not marked: they are laid out for the model to chunk
locally.
"""

from __future__ import annotations

import functools
import sys
import traceback
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from tessera.context import ParallelContext

from ..shared.mode_layers import Cuts, find_mode_layers
from ..shared.rank_draws import take_off_stack
from .converters import COLUMN_PARTS
from .dropout import RANK_FORK_ATTR, RankFork
from .left_out import output_layout
from .operator_dims import (
    DRAWN_MARK,
    METADATA,
    RANDOM_DRAWS,
    RESHAPED_IN_PLACE,
    SPLIT_DIMS_MARK,
    TAKING_PART,
    dims_followed,
    dims_read_whole,
    in_place_cut,
    indexed_dims,
    split_dims,
)
from .plan import inner_norms

__all__ = ["PART_MARK", "SPLIT_DIMS_MARK", "install_own_code_check"]

_T = TypeVar("_T")

#: Roles whose module reads only the shape of a floating tensor it is given, or takes ids.
_READING_SHAPES = ("embedding", "position_embedding", "patch_embedding")

#: Set on what an operator taking a part along a split dim returns: the error to raise where
#: its values are used.
PART_MARK = "_tessera_part_of_split_dim"


def _passes_through(module: str) -> bool:
    """Whether a frame of ``module`` only relays the operator (torch, this check)."""
    return module in ("torch", "contextlib", "functools", __name__) or module.startswith("torch.")


def callers_line() -> tuple[str, str]:
    """The module and the line of the first frame outside torch: who called the operator."""
    frame = sys._getframe(2)
    while frame is not None and _passes_through(frame.f_globals.get("__name__", "")):
        frame = frame.f_back  # type: ignore[assignment]
    if frame is None:
        return "", "an unknown line"
    where = traceback.extract_stack(frame, limit=1)[-1]
    module = frame.f_globals.get("__name__", "")
    return module, f"{where.filename}:{where.lineno} ({where.name}: {where.line})"


@functools.cache
def _public_names() -> dict[int, str]:
    """The public spelling of torch's functions defined in C (``torch._C._nn.linear``)."""
    names: dict[int, str] = {}
    for prefix, space in (
        ("torch", torch),
        ("torch.nn.functional", torch.nn.functional),
        ("torch.fft", torch.fft),
        ("torch.linalg", torch.linalg),
        ("torch.special", torch.special),
    ):
        for attribute in dir(space):
            names.setdefault(id(getattr(space, attribute, None)), f"{prefix}.{attribute}")
    return names


def operator_name(func: Any) -> str:
    """``torch.Tensor.mean``, ``torch.cat``, ``torch.nn.functional.linear``."""
    name = getattr(func, "__name__", repr(func))
    owner = getattr(func, "__module__", None)
    if owner is None:  # a method of torch's tensor class (TensorBase, from C)
        return f"torch.Tensor.{name}"
    return _public_names().get(id(func), f"{owner}.{name}")


def bookkept(otherwise: _T, compute: Callable[..., _T], *args: Any) -> _T:
    """``compute(*args)``, or ``otherwise`` where the tables cannot read a call.

    A form of a call the tables do not know: the check errs towards passing, and never breaks
    the model's forward.
    """
    try:
        return compute(*args)
    except Exception:
        return otherwise


class _Check(TorchFunctionMode):
    """Follows split dims through the model's own code; refuses an operator reading one whole.

    Attributes:
        mode: The tensor mode, for the message.
        inside: How many converted or left-out modules the call is in (their own code knows
            its layout, or runs under DTensor): nothing is checked there.
        handles: The hooks of the call being checked (empty between calls).
        enabled: Whether a call is being checked (a mode left on torch's stack under another
            one, by an interrupted call, only passes operators through).
        raised_before: The error being handled when the call began, if any (not its own).
    """

    def __init__(self, mode: str, forked: Callable[[], bool] = lambda: False) -> None:
        super().__init__()
        self.mode = mode
        #: Whether the region running now draws each rank's own numbers (dropout.py's fork).
        self.forked = forked
        self.inside = 0
        self.handles: list[Any] = []
        self.enabled = True
        self.raised_before: BaseException | None = None
        #: The module left out of the plan the call is in (outermost), run under DTensor.
        self.left_out: str | None = None

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        in_left_out = self.inside and self.enabled and self.left_out is not None
        if in_left_out and func in RANDOM_DRAWS and self.forked():
            self._refuse_plain_draw(func, args, kwargs)
        if self.inside or not self.enabled or torch.compiler.is_compiling():
            return func(*args, **kwargs)
        flat, _ = tree_flatten((args, dict(kwargs)))
        drawn = [x for x in flat if isinstance(x, torch.Tensor) and hasattr(x, DRAWN_MARK)]
        draws_own = func in RANDOM_DRAWS and kwargs.get("generator") is None and self.forked()
        if drawn or draws_own:
            passed = self._follow_draws(func, args, kwargs, flat, drawn)
            if passed is not None:
                return passed[0]
        parts = [getattr(x, PART_MARK) for x in flat if hasattr(x, PART_MARK)]
        if func in METADATA or not (parts or any(split_dims(x) for x in flat)):
            return func(*args, **kwargs)
        module, line = callers_line()
        if module.startswith("tessera."):  # tessera's own hooks know their layouts
            return func(*args, **kwargs)
        if parts:
            raise ValueError(f"{parts[0]}; its values are used at {line}")
        called = (kwargs["input"], *args) if not args and "input" in kwargs else args
        error = bookkept(None, self._reading_whole, func, called, kwargs, line)
        if error is not None and func not in TAKING_PART:
            raise ValueError(error)
        reshaped: frozenset[int] | None = None
        if func in RESHAPED_IN_PLACE and split_dims(called[0]):
            unread: frozenset[int] | None = frozenset()  # a form not read: the cut dropped
            reshaped = bookkept(unread, in_place_cut, func, called, kwargs)
            if reshaped is None:
                raise ValueError(
                    f"parallelize under tensor mode {self.mode!r}: the model's own code calls "
                    f"{operator_name(func)} on a {list(called[0].shape)} block whose dims "
                    f"{sorted(split_dims(called[0]))} the tensor ranks split, at {line}; its "
                    "memory read in another shape holds this rank's block, not the whole "
                    "tensor. Use view or reshape, which the check follows"
                )
        out = func(*args, **kwargs)
        if reshaped is not None:  # the same tensor, its shape changed in place
            setattr(called[0], SPLIT_DIMS_MARK, reshaped)
            return out
        for y in tree_flatten(out)[0]:
            if not isinstance(y, torch.Tensor):
                continue
            if error is not None:  # a part: refused where its values are used
                setattr(y, PART_MARK, error)
            elif y.is_floating_point():
                none: frozenset[int] = frozenset()
                cut = bookkept(none, dims_followed, func, called, kwargs, y)
                if cut or hasattr(y, SPLIT_DIMS_MARK):  # an input changed in place: its new cut
                    setattr(y, SPLIT_DIMS_MARK, cut)
        return out

    def _refuse_plain_draw(
        self, func: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]
    ) -> None:
        """Raise where a module left out of the plan draws a plain tensor at random.

        DTensor takes a plain tensor as alike on every rank (``implicit_replication``), and in
        a split region each rank draws its own numbers: a sample's noise would differ between
        the blocks of it (torchvision's ``StochasticDepth``).
        """
        from torch.distributed.tensor import DTensor

        flat, _ = tree_flatten((args, dict(kwargs)))
        if kwargs.get("generator") is not None or any(isinstance(x, DTensor) for x in flat):
            return
        raise ValueError(
            f"parallelize under tensor mode {self.mode!r}: {self.left_out!r}, a module the plan "
            "leaves out (run under DTensor on its split input), calls "
            f"{operator_name(func)} for a plain tensor: DTensor takes it as the same on every "
            "rank, but inside a split region each rank draws its own numbers, so the blocks "
            "of one sample would get other noise, "
            "without an error. Name it ...DropPath with a float drop_prob if it is stochastic "
            "depth (tessera draws those per sample, as torchvision's StochasticDepth), draw "
            "with a generator= seeded alike on "
            "every rank, or draw at the input's shape (torch.rand_like)"
        )

    def _follow_draws(
        self,
        func: Any,
        args: tuple[Any, ...],
        kwargs: Mapping[str, Any],
        flat: list[Any],
        drawn: list[torch.Tensor],
    ) -> tuple[Any] | None:
        """A draw of each rank's own numbers, followed; refused broadcast over a cut dim.

        As a mask per sample ``[b, 1, 1]`` times a block ``[b, s, h/q]``.

        Returns:
            ``(output,)`` where no block is among the arguments (the output is a draw too),
            ``None`` where the split dims are followed as for any operator.
        """
        blocks = [x for x in flat if isinstance(x, torch.Tensor) and split_dims(x)]
        module, line = callers_line()
        if module.startswith("tessera."):  # a drop path's numbers, made alike (drop_path.py)
            return None if blocks else (func(*args, **kwargs),)
        if drawn and func in _BRANCHING:
            raise ValueError(
                f"parallelize under tensor mode {self.mode!r}: the model's own code reads a "
                f"random draw as a Python value ({operator_name(func)}) at {line}, inside a region "
                "whose activations are split, where each rank draws its own numbers: the "
                "ranks would take different branches (a layer skipped on some ranks: their "
                "collectives no longer match). Draw it before the forward, alike on every rank "
                "(a layerdrop of 0, or a generator= seeded alike), or outside the split region"
            )
        for draw in drawn:
            for block in blocks:
                dim = _broadcast_over_cut(draw, block)
                if dim is not None:
                    raise ValueError(
                        f"parallelize under tensor mode {self.mode!r}: the model's own code "
                        f"calls {operator_name(func)} on a random draw of shape "
                        f"{list(draw.shape)} and a {list(block.shape)} block, broadcasting "
                        f"the draw over dim {dim}, "
                        f"which the tensor ranks split, at {line}; inside a split region each "
                        "rank draws its own numbers (as dropout must), so one sample or token "
                        "would get other numbers in each block, without an error. Draw a mask "
                        "of the block's own shape (torch.rand_like), or draw per sample in a "
                        "module named ...DropPath with a float drop_prob (tessera draws its "
                        "numbers alike on a sample's ranks)"
                    )
        if blocks:
            return None
        out = func(*args, **kwargs)
        for y in tree_flatten(out)[0]:
            if isinstance(y, torch.Tensor):
                setattr(y, DRAWN_MARK, True)
        return (out,)

    def _reading_whole(
        self, func: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any], line: str
    ) -> str | None:
        """The error of ``func`` reading a split dim of a tensor it is given whole, if it does."""
        read = split_dim_read_whole(func, args, kwargs)
        if read is None:
            return None
        x, dim = read
        return (
            f"parallelize under tensor mode {self.mode!r}: the model's own code calls "
            f"{operator_name(func)} over dim {dim} of a {list(x.shape)} block, which the "
            f"tensor ranks split (dims {sorted(split_dims(x))} of this tensor are cut), at "
            f"{line}; on this rank's block it would compute a different number than on the "
            "whole tensor, without an error. Put that code in a module of its own (parallelize "
            "runs the modules a plan leaves out under DTensor, exactly), or give the module "
            "that computes it a role ('norm' for a norm, 'gate_up' for a layer chunked in two)"
        )


def split_dim_read_whole(
    func: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]
) -> tuple[torch.Tensor, int] | None:
    """The first tensor argument of ``func`` whose split dim it reads whole, with that dim.

    ``None`` where it reads none (or its call is a form the tables cannot read).
    """

    def first_hit() -> tuple[torch.Tensor, int] | None:
        read: list[tuple[torch.Tensor, set[int] | None]]
        if func is torch.Tensor.__getitem__:
            read = [(args[0], indexed_dims(args[1], args[0]))]
        else:
            read = dims_read_whole(func, args, kwargs)
        for x, dims in read:
            split = split_dims(x)
            hit = sorted(split if dims is None else split & dims)
            if hit:
                return x, hit[0]
        return None

    return bookkept(None, first_hit)


#: Reading a tensor as a Python value: a branch taken on it.
_BRANCHING = {
    torch.Tensor.__bool__, torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__int__,
    torch.Tensor.__float__, torch.Tensor.__index__,
}  # fmt: skip


def _broadcast_over_cut(draw: torch.Tensor, block: torch.Tensor) -> int | None:
    """A cut dim of ``block`` that ``draw`` is broadcast over (right-aligned), if any."""
    offset = block.dim() - draw.dim()
    for dim in sorted(split_dims(block)):
        mine = dim - offset
        if block.shape[dim] > 1 and (mine < 0 or draw.shape[mine] == 1):
            return dim
    return None


def _marker(cuts: Cuts, context: ParallelContext) -> Any:
    """A forward hook marking a converted module's first floating output with ``cuts``' dims."""

    def mark(module: nn.Module, args: Any, output: Any) -> None:
        x = next(
            (t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor)),
            None,
        )
        if x is None or not x.is_floating_point() or x.dim() < 2:
            return
        if torch.compiler.is_compiling():
            return
        cut = cuts(context, x.dim()).items()  # a group of one rank cuts nothing
        dims = frozenset(
            d % x.dim() for d, groups in cut if any(context.get_world_size(g) > 1 for g in groups)
        )
        if dims:
            setattr(x, SPLIT_DIMS_MARK, dims)

    return mark


def install_own_code_check(
    model: nn.Module,
    roles: Mapping[str, str],
    left_out: list[str],
    context: ParallelContext,
    mode: str,
    span: set[str] | None = None,
) -> None:
    """Check the model's own code on its first call (see the module doc).

    Args:
        model: The converted model.
        roles: The plan's ``{module name: role}``.
        left_out: The modules run under DTensor (:func:`.left_out.install_left_out`).
        context: The ParallelContext.
        mode: Its tensor mode.
        span: Under 1D sequence parallelism, the modules whose activations are split along
            the sequence (``None``: every module's are laid out as the mode's).
    """
    layers = find_mode_layers(mode)
    if layers is None or layers.activation_cuts is None:
        return
    between = layers.activation_cuts
    inner = inner_norms(roles)
    fork = getattr(model, RANK_FORK_ATTR, None)
    check = _Check(mode, lambda: isinstance(fork, RankFork) and fork.active)
    # converted modules computing with what they are given (a position table reads its shape)
    # and the modules left out, which DTensor runs on what its layout trail says they hold
    computing = {
        id(model.get_submodule(name)): name
        for name, role in roles.items()
        if role not in _READING_SHAPES
    }
    computing |= {id(model.get_submodule(name)): name for name in left_out}
    run_under_dtensor = {id(model.get_submodule(name)): name for name in left_out}

    def whole(context: ParallelContext, ndim: int) -> dict[int, tuple[str, ...]]:
        return {}

    def enter(module: nn.Module, args: Any, kwargs: Any) -> None:
        if torch.compiler.is_compiling():
            return
        name = computing.get(id(module))
        if name is not None and not check.inside and check.enabled:  # called by the model
            flat = tree_flatten((args, kwargs))[0]
            parts = [getattr(x, PART_MARK) for x in flat if hasattr(x, PART_MARK)]
            if parts:
                raise ValueError(f"{parts[0]}; it is given to {name!r}, which computes with it")
        if not check.inside:  # run under DTensor now: its input was placed (left_out.py)
            from torch.distributed.tensor import DTensor

            placed = any(isinstance(x, DTensor) for x in tree_flatten((args, kwargs))[0])
            check.left_out = run_under_dtensor.get(id(module)) if placed else None
        check.inside += 1

    def leave(module: nn.Module, args: Any, output: Any) -> None:
        if not torch.compiler.is_compiling():
            check.inside -= 1
            if not check.inside:
                check.left_out = None

    def clear() -> None:
        """The mode off (taken off the stack wherever it is) and the per-call hooks removed.

        Not always on top: the dropout fork's traceable draws (``RankDraws``), entered by a
        hook after ``start`` and left by one after ``stop``, sit above it then.
        """
        check.enabled = False
        take_off_stack(check)
        for handle in check.handles:
            handle.remove()
        check.handles.clear()
        check.inside = 0
        check.left_out = None

    checked: set[bool] = set()  # the modes (training or not) whose first call was checked

    def start(module: nn.Module, args: Any) -> None:
        # a deep copy of the model calls these hooks with itself: it is not checked
        if module is not model or torch.compiler.is_compiling() or model.training in checked:
            return
        if check.handles:  # a first call interrupted (KeyboardInterrupt skips `stop`)
            clear()
        for name, role in roles.items():
            if COLUMN_PARTS.get(role, 1) > 1:
                continue  # a fused layer's output is laid out to be chunked by the model
            layout = output_layout(role, name, inner)
            # outside a span split by tokens the tokens are whole again; 1D's column outputs
            # and logits stay split by features
            tokens = between if span is None or name in span else whole
            cuts = {
                None: None,
                "activation": tokens,
                "column": layers.column_cuts or tokens,
                "logits": layers.logits_cuts or tokens,
            }[layout]
            sub = model.get_submodule(name)
            if cuts is not None:
                # first among its hooks: a span's end gathers its output after the mark
                marker = _marker(cuts, context)
                check.handles.append(sub.register_forward_hook(marker, prepend=True))
        for name in {*roles, *left_out}:
            sub = model.get_submodule(name)
            check.handles.append(sub.register_forward_pre_hook(enter, with_kwargs=True))
            check.handles.append(sub.register_forward_hook(leave, always_call=True))
        check.raised_before = sys.exc_info()[1]  # called while the caller handles an error
        check.enabled = True
        check.__enter__()  # type: ignore[no-untyped-call]

    def stop(module: nn.Module, args: Any, output: Any) -> None:
        if module is not model or not check.handles:
            return
        clear()
        if sys.exc_info()[1] not in (None, check.raised_before):
            return  # the call failed: the next one is checked
        parts = [getattr(y, PART_MARK) for y in tree_flatten(output)[0] if hasattr(y, PART_MARK)]
        if parts:  # its caller computes with it, unchecked
            raise ValueError(f"{parts[0]}; the model returns it")
        checked.add(model.training)
        if len(checked) == 2:  # a call in training and one in eval mode checked: the hooks go
            first.remove()
            last.remove()

    first = model.register_forward_pre_hook(start, prepend=True)
    last = model.register_forward_hook(stop, prepend=True, always_call=True)
