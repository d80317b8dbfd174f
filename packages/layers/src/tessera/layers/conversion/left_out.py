"""The modules a plan leaves out compute under DTensor: no block is read as the whole tensor.

``parallelize`` converts the modules a plan names: their kernels compute on this rank's block
and know it. Everything else stays as the model wrote it. Elementwise modules (activations,
dropout) compute the same numbers on any block; a module of the model's own may not: a norm
without parameters over ``h/q`` of the features, a softmax over this rank's part of the
vocabulary, a pooling over a sequence chunk would each return a number, the wrong one, and
the model would train differently from one process without an error.

So each such module runs under ``torch.distributed.tensor``: its floating tensor inputs enter
as DTensors with this rank's layout as placements on the mode's mesh, its forward runs under
DTensor's propagation (a mean over split features becomes a sum across the feature group, an
operator it cannot place raises, naming itself and the placements), and every DTensor it
returns leaves as this rank's block of the layout it came in. tessera's own layers keep
computing on plain local blocks: only the code no plan covers pays DTensor's dispatch.

Which layout a tensor has is read from the converted modules around it. Each records the
layout it returns (a column layer's output, an activation between blocks, the head's logits:
the mode's ``ModeLayers`` cuts of each) with its local shape, and marks the tensor. A left-out
module's input takes its mark, or, made by the model's own code in between (``gelu(fc1(x))``),
the layout whose latest output had its shape; one no converted module has returned the shape
of stays a plain tensor, as before.

A module's floating buffers (a sinusoidal position table, a fixed gain) are the same on every
rank: while it computes on a split input they are ``Replicate`` DTensors, so the forward and
the backward that saved them mix no plain tensor with a DTensor, and what it makes itself
(``torch.arange(x.shape[1])``) is taken as whole too (``implicit_replication``). Not where
the module also takes a plain tensor of no known layout (position ids, a mask: this rank's
part where the mode splits the batch or the sequence): a rotary embedding computes its tables
from the ids and its buffer alone, and keeping both plain keeps that exact. Such a tensor
meeting a split one is torch's error, with a note naming the module: never a block read as
whole.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from tessera.context import ParallelContext, cut_placements, tensor_mesh_of

from ..comm.inflight import tracing
from ..shared.mode_layers import Cuts, find_mode_layers
from .drop_path import is_drop_path
from .plan import COLUMN_ROLES, inner_norms
from .structure import holds_torch_attention

__all__ = ["LAYOUT_MARK", "install_left_out", "left_out_modules", "output_layout"]

#: Set on a converted module's output tensor: the layout it is in.
LAYOUT_MARK = "_tessera_layout"
Layout = Literal["activation", "column", "logits"]

#: Roles whose module returns an activation in the layout between blocks.
_ACTIVATION_ROLES = (
    "row",
    "dense",
    "embedding",
    "attention",
    "patch_embedding",
    "experts",
)
#: How many (layout, local shape) pairs the trail keeps.
_TRAIL_LENGTH = 64
#: torch's activation modules that mix the features they are given (the rest are elementwise).
_MIXING = (nn.Softmax, nn.Softmin, nn.LogSoftmax, nn.Softmax2d, nn.GLU, nn.MultiheadAttention)


def _exact_on_any_block(module: nn.Module) -> bool:
    """Whether ``module`` computes the same numbers on a block as on the whole tensor.

    Dropout, identity and elementwise activations (torch's and transformers'), drop paths
    (each rank keeps its samples' numbers, ``drop_path.py``), and tessera's own modules,
    which know their layout.
    """
    where = type(module).__module__
    if isinstance(module, (nn.Identity, nn.modules.dropout._DropoutNd)) or is_drop_path(module):
        return True
    if where == "torch.nn.modules.activation":
        return not isinstance(module, _MIXING)
    return where.startswith(("transformers.activations", "tessera."))


def left_out_modules(model: nn.Module, roles: Mapping[str, str]) -> tuple[list[str], list[str]]:
    """The modules no role is at, above or below: those without and those with parameters.

    The outermost of each. Elementwise ones (:func:`_exact_on_any_block`) are not counted
    among the first. :func:`install_left_out` runs both kinds under DTensor, the parameters
    of the second as ``Replicate`` DTensors, but for those holding torch's
    ``nn.MultiheadAttention`` (:func:`holds_torch_attention`): refused where activations are
    split (``parallelize``), and where they are whole (1D) checked to take no split tensor.
    """
    free: list[str] = []
    holding: list[str] = []
    for name, module in model.named_modules():
        if not name or any(name.startswith(f"{f}.") for f in (*free, *holding)):
            continue
        if any(r == name or r.startswith(f"{name}.") or name.startswith(f"{r}.") for r in roles):
            continue
        if next(module.parameters(), None) is not None:
            holding.append(name)
        elif not _exact_on_any_block(module):
            free.append(name)
    return free, holding


def output_layout(role: str, name: str, inner: set[str]) -> Layout | None:
    """The layout a converted module of ``role`` returns.

    ``None``: not one a module left out could take (parts of attention, routers, tables, a
    position embedding's ``[s, h]`` without a batch dim).
    """
    if role in COLUMN_ROLES or (role == "norm" and name in inner):
        return "column"
    if role == "head":
        return "logits"
    if role == "norm" or role in _ACTIVATION_ROLES:
        return "activation"
    return None


@dataclass
class _Trail:
    """When each layout was last returned in each local shape by a converted module."""

    seen: dict[tuple[Layout, torch.Size], int] = field(default_factory=dict)
    clock: int = 0

    def note(self, layout: Layout, shape: torch.Size) -> None:
        self.clock += 1
        if len(self.seen) >= _TRAIL_LENGTH:  # generation's growing lengths: keep the latest
            oldest = min(self.seen, key=self.seen.__getitem__)
            del self.seen[oldest]
        self.seen[(layout, shape)] = self.clock

    def layout_of(self, x: torch.Tensor) -> Layout | None:
        """``x``'s mark, else the layout last returned in ``x``'s shape."""
        mark: Layout | None = getattr(x, LAYOUT_MARK, None)
        if mark is not None:
            return mark
        same = [(when, layout) for (layout, shape), when in self.seen.items() if shape == x.shape]
        return max(same)[1] if same else None


def _first_activation(output: Any) -> torch.Tensor | None:
    flat, _ = tree_flatten(output)
    return next((t for t in flat if _placeable(t)), None)


def _placeable(x: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return (
        isinstance(x, torch.Tensor)
        and not isinstance(x, DTensor)
        and x.is_floating_point()
        and x.dim() >= 2
    )


def _recorder(trail: _Trail, layout: Layout) -> Any:
    def record(module: nn.Module, args: Any, output: Any) -> None:
        x = _first_activation(output)
        if x is not None:
            trail.note(layout, x.shape)
            setattr(x, LAYOUT_MARK, layout)

    return record


def _add_note(error: BaseException, note: str) -> None:
    """``note`` under ``error``'s message (a hook cannot raise its own: torch re-raises)."""
    if hasattr(error, "add_note"):  # Python 3.11
        error.add_note(note)
    else:
        error.args = (f"{error.args[0] if error.args else ''}\n{note}", *error.args[1:])


#: A buffer or parameter held as a DTensor during a forward: its owner, its name, the plain
#: tensor and the DTensor standing for it.
_Swapped = tuple[nn.Module, str, torch.Tensor, torch.Tensor]


def _replicate(
    module: nn.Module, mesh: Any, slot: Literal["_buffers", "_parameters"]
) -> list[_Swapped]:
    """Hold ``module``'s floating buffers or parameters as ``Replicate`` DTensors.

    Each is whole on every tensor rank, which ``Replicate`` says; the DTensor stands for it
    during the call, as ``torch.func.functional_call``'s tensors do. ``from_local`` is
    differentiable: DTensor's backward makes a parameter's gradient ``Replicate`` too, summing
    the partial ones of a split input (the rows of a batch, a chunk of the tokens) over their
    ranks, so every rank accumulates the whole gradient, as one process computes it.

    Returns:
        What to put back (:func:`_restore_buffers`, :func:`_restore_parameters`).
    """
    from torch.distributed.tensor import DTensor, Replicate

    swapped: list[_Swapped] = []
    for owner in module.modules():
        held_here: dict[str, Any] = getattr(owner, slot)
        for key, tensor in held_here.items():
            if tensor is None or not tensor.is_floating_point() or isinstance(tensor, DTensor):
                continue
            whole = (Replicate(),) * mesh.ndim
            held = DTensor.from_local(tensor, mesh, whole, run_check=False)
            held_here[key] = held
            swapped.append((owner, key, tensor, held))
    return swapped


def _restore_parameters(swapped: list[_Swapped]) -> None:
    """Each parameter plain again."""
    for owner, key, param, held in swapped:
        if owner._parameters.get(key) is held:
            owner._parameters[key] = param  # type: ignore[assignment]  # the Parameter it was


def _restore_buffers(swapped: list[_Swapped]) -> None:
    """Each buffer plain again.

    One the forward replaced (a cache it rebuilt from a buffer) keeps its new value, made whole.
    """
    from torch.distributed.tensor import DTensor, Replicate

    for owner, key, buffer, held in swapped:
        now = owner._buffers.get(key)
        if now is held:
            owner._buffers[key] = buffer
        elif isinstance(now, DTensor):
            whole = (Replicate(),) * now.device_mesh.ndim
            owner._buffers[key] = now.redistribute(now.device_mesh, whole).to_local().detach()


@dataclass
class _Entered:
    """One call of a module left out, between its hooks.

    Attributes:
        layout: The layout of its first placed input.
        ndim: That input's ndim.
        raised_before: The exception being handled when it was called, if any (not its own).
        swapped: The buffers it holds as DTensors meanwhile.
        parameters: The parameters it holds as DTensors meanwhile.
        whole: The ``implicit_replication`` it runs under, where it took no plain tensor.
    """

    layout: Layout
    ndim: int
    raised_before: BaseException | None = None
    swapped: list[_Swapped] = field(default_factory=list)
    parameters: list[_Swapped] = field(default_factory=list)
    whole: Any = None


@dataclass
class _Placer:
    """The hooks of one module left out: its inputs in, its outputs out of DTensor."""

    name: str
    trail: _Trail
    context: ParallelContext
    cuts: dict[Layout, Cuts]
    #: per call in flight (``None``: nothing placed)
    entered: list[_Entered | None] = field(default_factory=list)
    cache: dict[tuple[Layout, int], tuple[Any, ...]] = field(default_factory=dict)

    def placements(self, layout: Layout, ndim: int) -> tuple[Any, ...]:
        key = (layout, ndim)
        if key not in self.cache:
            cuts = self.cuts[layout](self.context, ndim)
            self.cache[key] = cut_placements(cuts, ndim, self.context)
        return self.cache[key]

    def enter(self, module: nn.Module, args: Any, kwargs: Any) -> Any:
        from torch.distributed.tensor import DTensor

        flat, spec = tree_flatten((args, kwargs))
        mesh = tensor_mesh_of(self.context)
        first: tuple[Layout, int] | None = None
        unknown = False  # a plain tensor input of no known layout (ids, a mask)
        for i, x in enumerate(flat):
            layout = self.trail.layout_of(x) if _placeable(x) else None
            if layout is None:
                unknown = unknown or isinstance(x, torch.Tensor)
                continue
            placements = self.placements(layout, x.dim())
            if all(p.is_replicate() for p in placements):
                continue  # whole on every rank (1D between blocks): exact as it is
            shape = list(x.shape)  # the whole tensor's: tessera's blocks are equal
            for size, p in zip(mesh.shape, placements, strict=True):
                if p.is_shard():
                    shape[p.dim] *= size
            whole = torch.Size(shape)
            stride = torch.empty(whole, device="meta").stride()  # given, so Dynamo traces it
            flat[i] = DTensor.from_local(
                x, mesh, placements, run_check=False, shape=whole, stride=stride
            )
            first = first or (layout, x.dim())
        if first is None:
            self.entered.append(None)  # leave() pops it, also after the error below
            self._check_no_parameters_on_split_activations(module, args)
            return None
        from torch.distributed.tensor.experimental import implicit_replication

        entry = _Entered(*first, raised_before=sys.exc_info()[1])
        entry.parameters = _replicate(module, mesh, "_parameters")
        if not unknown:  # what the module makes itself is whole; put back in leave()
            entry.swapped = _replicate(module, mesh, "_buffers")
            entry.whole = implicit_replication()
            entry.whole.__enter__()
        self.entered.append(entry)
        return tree_unflatten(flat, spec)

    def _check_no_parameters_on_split_activations(self, module: nn.Module, args: Any) -> None:
        """Raise where a module holding parameters runs plain while activations are split.

        None of its inputs has a layout tessera knows (a view the model made of a split
        activation, or no input at all: a gate it returns for the model's own code to apply).
        Its parameters would then meet this rank's part of the activations as plain tensors,
        each rank computing a part of their gradient that nothing sums.
        """
        held = [p for p in module.parameters() if p.requires_grad]
        whole = all(p.is_replicate() for p in self.placements("activation", 3))
        if not held or whole:
            return
        shapes = [list(x.shape) for x in tree_flatten(args)[0] if isinstance(x, torch.Tensor)]
        raise ValueError(
            f"parallelize: {self.name!r} holds parameters but is not in the plan, and none of "
            f"its inputs {shapes} is a tensor whose layout tessera knows (an activation a "
            "converted module returned, as it returned it), so it cannot run under DTensor: "
            "its parameters would meet this rank's part of the split activations and each "
            "rank would compute a part of their gradient; call it on the activation itself, "
            "or give it a role"
        )

    def refuse_split(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        """Raise where torch's attention, left out of the plan, takes a split tensor."""
        flat, _ = tree_flatten((args, kwargs))
        for x in flat:
            layout = self.trail.layout_of(x) if _placeable(x) else None
            if layout is None:
                continue
            placements = self.placements(layout, x.dim())
            if not all(p.is_replicate() for p in placements):
                raise ValueError(
                    f"parallelize: {self.name!r} holds torch's nn.MultiheadAttention but is not "
                    f"in the plan, and it takes a {list(x.shape)} block of a {layout} tensor "
                    f"split over the tensor ranks ({', '.join(map(repr, placements))}), which "
                    "it would read as the whole one (and DTensor shards no backward of its CPU "
                    "kernel); give it the 'attention' role"
                )

    def leave(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> Any:
        """Each DTensor output back to this rank's block (called even if the forward raised).

        An output of the placed input's rank takes that input's layout, but for a dim of 1
        where the input's is cut, which is broadcast (a position table ``[1, s, h]`` the module
        makes from its buffers) and stays whole there. One of another rank
        (a pooling over the tokens or features) keeps the layout DTensor's propagation gave
        it, a pending sum (``Partial``) made whole: the whole pooled vector where the pooled
        dim was split, this rank's rows where the rows were.
        """
        from torch.distributed.tensor import DTensor, Partial, Replicate

        entry = self.entered.pop()
        if entry is None:
            return None
        layout, ndim = entry.layout, entry.ndim
        if entry.whole is not None:
            entry.whole.__exit__(None, None, None)
        _restore_buffers(entry.swapped)
        _restore_parameters(entry.parameters)
        raised = sys.exc_info()[1]  # the forward's error, re-raised by torch after this hook
        mixed = isinstance(raised, RuntimeError) and "mixed torch.Tensor and DTensor" in str(raised)
        if mixed and raised is not None and raised is not entry.raised_before:
            _add_note(
                raised,
                f"parallelize: {self.name!r} (a module the plan leaves out, run under DTensor "
                "on its split input) mixes it with a plain tensor it was given whose layout "
                "tessera does not know (a mask or position ids; where the mode splits the batch "
                "or the sequence, this rank's part of them); compute what mixes them in a "
                "module the plan names, or give this module a role",
            )

        split = [not p.is_replicate() for p in self.placements(layout, ndim)]

        def local(x: Any) -> Any:
            if not isinstance(x, DTensor):
                return x
            own = self.placements(layout, x.dim())
            if x.dim() == ndim:
                # a dim of 1 is broadcast (a table [1, s, h] made from buffers): kept whole
                placements = tuple(
                    Replicate() if p.is_shard() and x.shape[p.dim] == 1 else p for p in own
                )
            else:
                placements = tuple(Replicate() if p.is_partial() else p for p in x.placements)
            self._check_divisible(x, placements, layout)
            # made whole over an axis that splits the input: the code after it computes on
            # this rank's block, so its gradient is this rank's part of the whole one
            grads = tuple(
                Partial() if p.is_replicate() and cut else p
                for p, cut in zip(placements, split, strict=True)
            )
            block = x.redistribute(x.device_mesh, placements).to_local(grad_placements=grads)
            if tuple(placements) == tuple(own):
                setattr(block, LAYOUT_MARK, layout)
            return block

        return tree_map(local, output)

    def _check_divisible(self, x: Any, placements: tuple[Any, ...], layout: Layout) -> None:
        """Raise before any collective where ``x`` cannot be cut into equal blocks."""
        blocks: dict[int, int] = {}
        for size, p in zip(x.device_mesh.shape, placements, strict=True):
            if p.is_shard():
                blocks[p.dim] = blocks.get(p.dim, 1) * size
        for dim, n in blocks.items():
            if x.shape[dim] % n:
                raise ValueError(
                    f"parallelize: {self.name!r} (a module the plan leaves out, run under "
                    f"DTensor) returns a {list(x.shape)} tensor, whose dim {dim} cannot be cut "
                    f"into the {n} equal blocks of the {layout} layout the next layers take "
                    f"({x.shape[dim]} % {n} != 0); give the module a role in the plan"
                )


def install_left_out(
    model: nn.Module,
    roles: Mapping[str, str],
    context: ParallelContext,
    mode: str,
    span: set[str] | None = None,
) -> list[str]:
    """Run every module :func:`left_out_modules` finds under DTensor (see the module doc).

    Args:
        model: The converted model.
        roles: The plan's ``{module name: role}``.
        context: The ParallelContext.
        mode: Its tensor mode.
        span: Under 1D sequence parallelism, the modules whose activations are split along
            the sequence (``None``: every module's are laid out as the mode's).

    Returns:
        The names of the modules run under DTensor (none where the mode states no layout).
    """
    layers = find_mode_layers(mode)
    free, holding = left_out_modules(model, roles)
    kind = context.config.mode
    if kind is None or kind.splits_sequence:
        # 'sequence' keeps every weight whole, its modules computing token by token on their
        # chunk, their gradients summed by its handler
        holding = []
    attentions = [name for name in holding if holds_torch_attention(model.get_submodule(name))]
    if layers is None or layers.activation_cuts is None or not (free or holding):
        return []
    between = layers.activation_cuts
    trail = _Trail()
    inner = inner_norms(roles)
    for name, role in roles.items():
        layout = output_layout(role, name, inner)
        if layout is not None:
            model.get_submodule(name).register_forward_hook(_recorder(trail, layout))
    for name in (*free, *holding):
        cuts: dict[Layout, Cuts] = {
            "activation": between if span is None or name in span else _whole,
            "column": layers.column_cuts or between,
            "logits": layers.logits_cuts or between,
        }
        placer = _Placer(name, trail, context, cuts)
        module = model.get_submodule(name)
        if name in attentions:  # whole activations (1D): checked to take no split tensor
            module.register_forward_pre_hook(placer.refuse_split, with_kwargs=True)
            continue
        module.register_forward_pre_hook(placer.enter, with_kwargs=True)
        module.register_forward_hook(placer.leave, with_kwargs=True, always_call=True)
        if "forward" not in vars(module):  # a forward of the instance's own stays as it is
            # a bound method on the instance: a deep copy binds it to the copy
            module.forward = types.MethodType(_forward_returning_no_view, module)
    return [*free, *(name for name in holding if name not in attentions)]


def _forward_returning_no_view(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The module's forward; traced, an output that is a view (of a buffer) is copied.

    Dynamo compiles a left-out module's forward as a graph of its own (the hooks placing its
    inputs break the graph around it), and AOTAutograd rebuilds a graph output that views a
    graph input with ``as_strided``, which DTensor does not implement: a position table
    returning ``self.pe[None, :s]`` failed under ``torch.compile``. (``_base``, not
    ``_is_view()``, which Dynamo cannot answer.)
    """
    out = type(self).forward(self, *args, **kwargs)
    if not tracing():
        return out
    return tree_map(lambda y: y.clone() if _is_view(y) else y, out)


def _is_view(y: Any) -> bool:
    return isinstance(y, torch.Tensor) and y._base is not None


def _whole(context: ParallelContext, ndim: int) -> dict[int, tuple[str, ...]]:
    return {}
