"""Working memory: what one layer allocates beyond the tensors the step keeps, at the peak.

Saved activations, parameters, gradients and optimizer state are what a step *keeps*. The peak
of a step is higher by what the layer running at that moment holds only while it runs. Measured
per rank (``benchmarks/bench_largest_model.py``, every layout on gloo), the largest of these
comes from one of three places, and the planner counts the largest:

* **the loss and the head**: the cross-entropy holds the logits and a copy of them (the shifted
  logits in the forward, the gradient beside the saved softmax in the backward), two logits
  blocks ``L`` (fp32, ``[T/r, V/t]``); the 2D / 2.5D head (SUMMA's ``A B^T``, Xu et al. 2021)
  also holds the ``q`` partial products of its forward, and its backward the ``q`` gathered
  panels of the output gradient: ``(1 + g) L``;
* **the widest linear layer** (the MLP's second, whose input is ``F`` wide): a 2D / 2.5D / 3D
  linear gathers ``q`` blocks of its input ``X`` (``[T/r, F/q]``) and, in its backward, holds
  ``q`` partial blocks of the input's gradient before they are reduce-scattered: ``(g + 1)
  X``; it also holds the ``q`` panels of its weight block ``W`` (``h F / q^2`` elements in 2D
  and 2.5D, ``h F / q^3`` in 3D) for ``dx`` while ``dW``'s ``q`` partial blocks and the block
  that receives their sum are in flight, ``(2 g + 1) W`` more, and a 3D layer the ``q``
  gathered row blocks of its output gradient; when its weights stay in place
  (``cube_algorithm`` says ``"stationary"``) a 3D layer gathers the whole input plane, ``q``
  times more;
* **attention**: the raw scores beside the masked ones and the probabilities (forward), the
  probabilities' gradient beside the scores' (backward): two score blocks.

``g`` counts the gathered blocks a collective holds: ``q`` with NCCL, ``2 q`` on gloo with
``q > 2``, whose pairwise exchanges send each peer its block from a ``[q, *block]`` copy
(``tessera.layers.comm.inflight``; two ranks exchange without one). 1D and a single process
gather nothing: their widest linear layer's working memory is its input's gradient, ``[T, F]``
cut as the mode cuts that input.

The three do not meet, nor meet every activation: the head's backward is done (its logits
freed) before the last block's starts, with or without checkpointing; a block's backward runs
its widest linear layer with every activation of the block still saved, and its attention
once the MLP and the projection have freed theirs
(:func:`~tessera.context.planner.memory.freed_before_attention`). Where activations dominate
(the benchmark's whole step at sequence 256) a step peaks in the last block's attention
backward, up to 7 % below every activation plus the largest working memory.
:func:`~tessera.context.planner.memory.rank_memory` takes the largest moment.
"""

from __future__ import annotations

from .comm import cube_algorithm
from .layouts import Layout
from .precision import FP32, Precision
from .shapes import ModelShape

__all__ = [
    "attention_workspace_bytes",
    "block_workspace_bytes",
    "gathered_blocks",
    "head_workspace_bytes",
    "linear_workspace_bytes",
]


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def gathered_blocks(layout: Layout, backend: str) -> int:
    """Blocks one gather holds on this rank: ``q``, twice that on gloo past ``q = 2``.

    gloo's pairwise exchange sends from a ``[q, *block]`` copy, except between two ranks,
    where the block travels as it is (``tessera.layers.comm.inflight``).
    """
    q = layout.side
    return q * (2 if backend == "gloo" and q > 2 else 1)


def block_workspace_bytes(
    shape: ModelShape, layout: Layout, samples: int, precision: Precision, backend: str = "nccl"
) -> int:
    """The larger of a block's two working memories on one rank: attention's, the widest linear's.

    Args:
        shape: The model.
        layout: The layout.
        samples: Sequences in one microbatch of one replica.
        precision: Bytes per element.
        backend: ``"nccl"`` or ``"gloo"``.
    """
    return max(
        attention_workspace_bytes(shape, layout, samples, precision),
        linear_workspace_bytes(shape, layout, samples, precision, backend),
    )


def attention_workspace_bytes(
    shape: ModelShape, layout: Layout, samples: int, precision: Precision
) -> int:
    """Attention's working memory on one rank: two blocks of scores.

    The raw scores beside the masked ones and the probabilities in the forward; in the
    backward, the probabilities' gradient beside the scores'. In the backward it comes after
    the block's MLP and projection are done (:func:`~.memory.freed_before_attention`).
    """
    # heads over the tensor ranks (1D), batch and heads over the mesh or cube: 1/t either way
    scores = _ceil(samples * shape.heads * shape.seq * shape.seq, layout.tensor)
    return 2 * precision.activation * scores


def linear_workspace_bytes(
    shape: ModelShape, layout: Layout, samples: int, precision: Precision, backend: str = "nccl"
) -> int:
    """The widest linear layer's working memory on one rank.

    The MLP's second layer, the first a block's backward runs: the gradient of its input
    (``[T, F]``, cut as the mode cuts that input), and where the mode gathers, its gathered
    input panels and partial input gradients, its weight's panels and ``dW``'s partials
    (module docstring).
    """
    e = precision.activation
    if not layout.on_grid:
        # 1D splits F, a sequence mode the tokens, a single process or data ranks nothing
        return e * _ceil(samples * shape.seq * shape.ffn, layout.tensor)
    q, k = layout.side, _ceil(shape.ffn, layout.side)
    rows = _ceil(samples * shape.seq, layout.row_split)
    widest = e * rows * k  # the input block of the MLP's second layer
    plane = 1  # a 3D layer whose weights stay gathers its whole input plane
    if layout.on_cube:
        o = _ceil(shape.hidden, q * q)
        if cube_algorithm(rows, k, o, q, layout.keep_gathered) == "stationary":
            plane = q
    g = gathered_blocks(layout, backend)
    # the weight's gathered panels, and dW's partials with the block receiving their sum
    weight = _ceil(shape.hidden * shape.ffn, layout.weight_split)
    others = (2 * g + 1) * precision.gradient * weight
    if layout.on_cube:  # and the output gradient's q gathered row blocks
        others += g * e * rows * _ceil(shape.hidden, q)
    return (g * plane + 1) * widest + others


def head_workspace_bytes(
    shape: ModelShape, layout: Layout, samples: int, backend: str = "nccl"
) -> int:
    """The loss's and the head's working memory on one rank (0 without a vocabulary).

    Args:
        shape: The model.
        layout: The layout.
        samples: Sequences in one microbatch of one replica.
        backend: ``"nccl"`` or ``"gloo"``.
    """
    if not shape.vocab:
        return 0
    # [T/r, V/c] in fp32: T V / t elements in every mode
    logits = FP32 * _ceil(samples * shape.seq * shape.vocab, layout.tensor)
    on_mesh = layout.on_grid and not layout.on_cube  # the head's SUMMA panels
    copies = 1 + gathered_blocks(layout, backend) if on_mesh else 2
    return copies * logits
