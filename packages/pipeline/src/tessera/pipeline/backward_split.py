"""The backward of a stage split into B (input gradient) and W (weight gradient).

Zero bubble (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", section 2) runs B as soon as the
next stage's gradient arrives, because the previous stage waits for it, and W later, in a bubble.
W must not redo B's work, or the split costs a whole extra backward.

How. After the forward, the autograd graph between the stage's outputs and its leaves is walked
once. A node is *on the input path* when a stage input is reachable from it: exactly the nodes
that ``torch.autograd.grad(outputs, inputs)`` runs in B. A weight's gradient flows from the
outputs down the input path and leaves it at a *split node* (for ``x @ W.T + b``: the addmm
node, whose edge to ``W.T`` and ``b`` leads only to weights). During B a pre-hook on every split
node records the gradient arriving there. W then starts the autograd engine AT the split nodes
(``torch.autograd.graph.GradientEdge``) with those recorded gradients and asks only for the
weights reached through them, so it computes exactly the weight-gradient matmuls and nothing of
the input path again. Split nodes whose weights overlap form one group (one engine call); a
group whose split nodes could also reach its weights through the input path (a weight used at
two depths) would be counted twice, so then the whole stage falls back to W =
``autograd.grad(outputs, weights)`` (exact, but it recomputes the input path). A stage without
inputs that require grad (the first stage) does everything in W.

Fused linear layers (:mod:`tessera.pipeline.weight_grad_fusion`) take no part in that walk:
their weight edges carry no gradient. In B they compute the input gradient and keep ``(x, g)`` in
the microbatch's store (mode DEFER); W adds ``g^T x`` to ``.grad``. When the stage falls back to
the unsplit form, B drops their weight gradient (SKIP) and W runs one full backward that adds it
(ACCUMULATE). A fused layer off the input path (its input does not depend on the stage's inputs)
is not reached by B, so it also makes the stage fall back. So does a fused weight (or bias) that
another op uses too, above the fused layer on the input path (``lin(x) @ lin.weight``): the
fused node still has an edge to it, so W started at that op would run the fused layer again.

Numerics: B and W run the same kernels as one ``backward()`` on the same tensors, so the split
gives the unsplit gradients.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.autograd.graph import GradientEdge

from tessera.pipeline.weight_grad_fusion import StoreMode, WeightGradStore, is_fused_linear_node

__all__ = ["WeightGradWork", "backward_input", "backward_weight", "full_backward"]


@dataclass
class WeightGradWork:
    """What :func:`backward_weight` needs: one engine call per group, or the fallback.

    Attributes:
        groups: per group, the starting edges, their gradients, and the leaves to differentiate.
        fallback: ``(outputs, grads, leaves)`` for one plain ``autograd.grad`` call, or None.
        split: whether the weight gradients start at split nodes (False: fallback or nothing).
        store: the fused linear layers' store: W flushes it (split) or runs the fallback as a
            full backward that accumulates into it.
    """

    groups: list[tuple[list[GradientEdge], list[torch.Tensor], list[torch.Tensor]]] = field(
        default_factory=list
    )
    fallback: tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]] | None = None
    split: bool = False
    store: WeightGradStore | None = None


def _is_leaf_node(node: Any) -> bool:
    return hasattr(node, "variable")


def _walk(roots: Sequence[Any]) -> tuple[list[Any], dict[Any, list[Any]]]:
    """Every node reachable from ``roots``, children first, and each node's children."""
    children: dict[Any, list[Any]] = {}
    order: list[Any] = []
    stack: list[tuple[Any, bool]] = [(root, False) for root in roots]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            order.append(node)
            continue
        if node in children:
            continue
        edges = node.next_functions
        if is_fused_linear_node(node):
            edges = edges[:1]  # the input; the weight and bias edges carry no gradient
        kids = [child for child, _ in edges if child is not None]
        children[node] = kids
        stack.append((node, True))
        stack.extend((child, False) for child in kids if child not in children)
    # A node may be appended twice when reached through two parents before expansion ended.
    seen: set[Any] = set()
    unique = []
    for node in order:
        if node not in seen:
            seen.add(node)
            unique.append(node)
    return unique, children


def _prepare(
    outputs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    kept = [(o, g) for o, g in zip(outputs, grads, strict=True) if o.requires_grad]
    return [o for o, _ in kept], [g for _, g in kept]


def full_backward(
    outputs: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    inputs: Sequence[torch.Tensor],
) -> list[torch.Tensor]:
    """The unsplit backward: weights accumulate into ``.grad``; returns the input gradients.

    ``inputs`` are leaves made by the executor; an input the outputs do not depend on gets
    zeros (its peer still expects a tensor).
    """
    outs, gs = _prepare(outputs, grads)
    if outs:
        torch.autograd.backward(outs, gs)
    return [
        t.grad if t.grad is not None else torch.zeros_like(t, requires_grad=False) for t in inputs
    ]


def backward_input(
    outputs: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    inputs: Sequence[torch.Tensor],
    store: WeightGradStore | None = None,
) -> tuple[list[torch.Tensor], WeightGradWork]:
    """B: the gradients of ``inputs`` only; returns them and the work left for W.

    Args:
        outputs: the stage outputs that receive a gradient (the loss on the last stage).
        grads: their gradients (``ones`` for the loss).
        inputs: the stage's input leaves that require grad (empty on the first stage).
        store: the store of the forward's fused linear layers, if any.
    """
    outs, gs = _prepare(outputs, grads)
    if store is not None and not store.fused:
        store = None
    if not outs:
        return [torch.zeros_like(t, requires_grad=False) for t in inputs], WeightGradWork()
    roots = [o.grad_fn for o in outs]
    order, children = _walk([r for r in roots if r is not None])
    input_ids = {id(t) for t in inputs}
    leaves: list[torch.Tensor] = []
    leaf_bit: dict[Any, int] = {}
    on_input: dict[Any, bool] = {}
    reach: dict[Any, int] = {}  # bitmask of weight leaves reachable from the node
    for node in order:
        if _is_leaf_node(node) and id(node.variable) not in input_ids:
            leaf_bit[node] = len(leaves)
            leaves.append(node.variable)
    for node in order:  # children before parents
        if _is_leaf_node(node):
            on_input[node] = node not in leaf_bit
            reach[node] = 1 << leaf_bit[node] if node in leaf_bit else 0
            continue
        kids = children[node]
        on_input[node] = any(on_input[k] for k in kids)
        mask = 0
        for k in kids:
            mask |= reach[k]
        if is_fused_linear_node(node):
            # Its weight and bias edges carry no gradient, but the engine still runs the node
            # when a W call asks for that weight (tied to a non-fused use): count them, so that
            # a split node above this one on the input path makes the stage fall back.
            for child, _ in node.next_functions[1:]:
                if child in leaf_bit:
                    mask |= 1 << leaf_bit[child]
        reach[node] = mask
    plain_outputs = any(o.grad_fn is None for o in outs)
    # An output that is itself a weight (a parameter passed on as it is) gets its gradient in W.
    known = {id(t) for t in leaves}
    for o in outs:
        if o.grad_fn is None and id(o) not in input_ids and id(o) not in known:
            known.add(id(o))
            leaves.append(o)
    fused_off_input = any(is_fused_linear_node(n) and not on_input[n] for n in order)
    if not inputs or plain_outputs or fused_off_input or not (leaves or store):
        return _unsplit(outs, gs, inputs, leaves, store)

    # Split nodes: on the input path, with a child off it that reaches weights.
    split_weights: dict[Any, int] = {}
    split_input_side: dict[Any, int] = {}
    for node in order:
        if _is_leaf_node(node) or not on_input[node]:
            continue
        off = 0
        through = 0
        for k in children[node]:
            if on_input[k]:
                through |= reach[k]
            else:
                off |= reach[k]
        if off:
            split_weights[node] = off
            split_input_side[node] = through
    # Roots off the input path start W themselves, with the output gradient.
    root_edges: dict[tuple[Any, int], torch.Tensor] = {}
    for out, grad in zip(outs, gs, strict=True):
        if not on_input[out.grad_fn]:
            key = (out.grad_fn, out.output_nr)
            root_edges[key] = root_edges[key] + grad if key in root_edges else grad
    # Group the starting points whose weights overlap.
    starts: list[tuple[list[Any], int]] = []
    for node, mask in split_weights.items():
        starts.append(([("split", node)], mask))
    for key in root_edges:
        starts.append(([("root", key)], reach[key[0]]))
    # Merging each start with every group it overlaps keeps the groups pairwise disjoint.
    groups: list[tuple[list[Any], int]] = []
    for members, mask in starts:
        merged_members, merged_mask = list(members), mask
        rest = []
        for other_members, other_mask in groups:
            if other_mask & mask:
                merged_members += other_members
                merged_mask |= other_mask
            else:
                rest.append((other_members, other_mask))
        groups = [*rest, (merged_members, merged_mask)]
    for members, mask in groups:
        for kind, item in members:
            if kind == "split" and split_input_side[item] & mask:
                return _unsplit(outs, gs, inputs, leaves, store)

    captured: dict[Any, tuple[torch.Tensor | None, ...]] = {}
    handles = []
    for node in split_weights:

        def record(grad_outputs: tuple[torch.Tensor | None, ...], node: Any = node) -> None:
            captured[node] = tuple(grad_outputs)

        handles.append(node.register_prehook(record))
    if store is not None:
        store.mode = StoreMode.DEFER
    try:
        input_grads = torch.autograd.grad(
            outs,
            list(inputs),
            gs,
            retain_graph=bool(split_weights or root_edges),
            allow_unused=True,
        )
    finally:
        for handle in handles:
            handle.remove()
    work = WeightGradWork(split=True, store=store)
    for members, mask in groups:
        edges: list[GradientEdge] = []
        edge_grads: list[torch.Tensor] = []
        for kind, item in members:
            if kind == "root":
                edges.append(GradientEdge(item[0], item[1]))
                edge_grads.append(root_edges[item])
                continue
            for output_nr, maybe in enumerate(captured.get(item, ())):
                if maybe is not None:
                    edges.append(GradientEdge(item, output_nr))
                    edge_grads.append(maybe)
        weights = [leaves[i] for i in range(len(leaves)) if mask >> i & 1]
        if edges:
            work.groups.append((edges, edge_grads, weights))
    return _zeros_for_none(input_grads, inputs), work


def _unsplit(
    outs: list[torch.Tensor],
    gs: list[torch.Tensor],
    inputs: Sequence[torch.Tensor],
    leaves: list[torch.Tensor],
    store: WeightGradStore | None,
) -> tuple[list[torch.Tensor], WeightGradWork]:
    """B as autograd.grad w.r.t. the inputs; W recomputes from the outputs (always exact)."""
    has_weights = bool(leaves) or store is not None
    if inputs:
        if store is not None:
            store.mode = StoreMode.SKIP  # W's full backward adds the fused weight gradients
        input_grads = torch.autograd.grad(
            outs, list(inputs), gs, retain_graph=has_weights, allow_unused=True
        )
        in_grads = _zeros_for_none(input_grads, inputs)
    else:
        in_grads = []
    work = WeightGradWork(fallback=(outs, gs, leaves) if has_weights else None, store=store)
    return in_grads, work


def _zeros_for_none(
    grads: Sequence[torch.Tensor | None], inputs: Sequence[torch.Tensor]
) -> list[torch.Tensor]:
    return [
        g if g is not None else torch.zeros_like(t, requires_grad=False)
        for g, t in zip(grads, inputs, strict=True)
    ]


def _accumulate(leaves: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None]) -> None:
    with torch.no_grad():
        for leaf, grad in zip(leaves, grads, strict=True):
            if grad is None:
                continue
            if leaf.grad is None:
                # a sparse gradient (nn.Embedding(sparse=True)) stays sparse, as autograd keeps it
                leaf.grad = grad.clone() if grad.is_sparse else torch.empty_like(leaf).copy_(grad)
            elif leaf.grad.is_sparse and not grad.is_sparse:
                leaf.grad = grad + leaf.grad  # dense
            else:
                leaf.grad.add_(grad)


def backward_weight(work: WeightGradWork) -> None:
    """W: accumulate the weight gradients into ``.grad`` and release the graph."""
    store, work.store = work.store, None
    if work.fallback is not None:
        outs, gs, leaves = work.fallback
        work.fallback = None
        if store is None:
            grads = torch.autograd.grad(outs, leaves, gs, allow_unused=True)
            _accumulate(leaves, grads)
        else:
            # Fused layers are reached only by running their nodes: one full backward, which
            # adds every weight gradient to .grad (fused ones through the store). The stage's
            # input leaves get a .grad too; nothing reads it (B sent the input gradients).
            store.mode = StoreMode.ACCUMULATE
            torch.autograd.backward(outs, gs)
        return
    groups, work.groups = work.groups, []
    for edges, edge_grads, weights in groups:
        grads = torch.autograd.grad(edges, weights, edge_grads, allow_unused=True)
        _accumulate(weights, grads)
    if store is not None:
        store.flush()
