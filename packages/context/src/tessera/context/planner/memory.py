"""Per-rank bytes: parameters, gradients, optimizer state and saved activations.

Parameters and their gradients and Adam state follow Rajbhandari et al. 2020 (ZeRO, section
3.1 and 5: stage 1 shards the optimizer state over the ``N`` data-parallel ranks, stage 2 also
the gradients, stage 3 also the parameters). A block's parameters per rank follow each mode's
paper (see :func:`block_parameters`).

Saved activations follow Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
Transformer Models", section 4): per block ``T (8h + 2F) + A`` elements with ``T = b s`` tokens
and ``A = b a s^2`` attention scores (``34 s b h + 5 a s^2 b`` bytes in their fp16 count with
dropout), of which 1d keeps the ``4 T h`` outside its column/row-parallel regions whole on
every rank, while 2d, 2.5d and 3d cut every activation over all ``P`` ranks. With activation
checkpointing (their "full recomputation") a block keeps only its input, and one block's
activations exist again while it is recomputed. Under a 1F1B pipeline the first stage holds
``min(p, m)`` microbatches in flight (Narayanan et al. 2021).

Divisions round up, so a layout that does not divide evenly (reported by
:func:`~tessera.context.planner.layouts.layout_problems`) still gets a figure.
"""

from __future__ import annotations

from dataclasses import dataclass

from .comm import cube_algorithm
from .layouts import Layout, microbatch_samples, microbatches
from .precision import FP32, Precision
from .shapes import ModelShape
from .workspace import (
    attention_workspace_bytes,
    head_workspace_bytes,
    linear_workspace_bytes,
)

__all__ = [
    "MemoryBreakdown",
    "block_activation_bytes",
    "block_parameters",
    "checkpointed_block_bytes",
    "embedding_parameters",
    "freed_before_attention",
    "head_activation_bytes",
    "late_bytes",
    "rank_memory",
    "stage_blocks",
]


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes one rank holds at its peak, by kind.

    Attributes:
        parameters: The model's parameters on this rank (under ZeRO stage 3 its shard; the
            blocks FSDP2 gathers are in ``workspace`` and ``late``, the moments they exist).
        gradients: Their gradients.
        optimizer: Adam's state (and fp32 masters under mixed precision).
        activations: Tensors saved for the backward, at the peak of a step.
        workspace: What the layer running at that moment holds beyond them
            (:mod:`~tessera.context.planner.workspace`), and in a block the gradients
            flowing into and out of it; under ZeRO stage 3 the block FSDP2 gathered for it and
            the next one, prefetched (not at the head's backward: FSDP2 freed the blocks
            after their forward and gathers the last one again after the loss's backward,
            once the logits' copies are gone), and under ZeRO-2/3 the head's gradients, whole
            until their reduce-scatter.
        update: What the optimizer step holds beyond the optimizer state: torch's Adam
            computes the denominator ``sqrt(v) + eps`` of every tensor it updates at once
            (its ``foreach`` implementation), one fp32 copy of this rank's optimized elements.
        late: What the backward of the first block, the last one the step runs, holds beyond
            parameters and optimizer state: the gradients of every layer after it, its
            activations (recomputed, under checkpointing) and working memory, and under
            ZeRO-2/3 FSDP2's buffers for the gradients; under ZeRO-3 the parameters FSDP2
            gathered, and the second block's backward where it holds more
            (:func:`late_bytes`).
        runtime: What the rank's runtime holds beyond its tensors, the same at every
            moment (:func:`rank_memory`'s ``runtime`` and ``runtime_per_block``: 0 unless
            the machine's is known).
    """

    parameters: int
    gradients: int
    optimizer: int
    activations: int
    workspace: int = 0
    update: int = 0
    late: int = 0
    runtime: int = 0

    @property
    def total(self) -> int:
        """The step's peak: parameters, optimizer state, runtime, and the largest of three moments.

        At the start of the backward every activation is saved and no gradient exists yet
        (the engine's ``zero_grad`` frees them): the head's backward, then the last block's,
        whose widest linear layer runs first and whose attention runs once its MLP's
        activations are gone; at the optimizer step every gradient exists, with the update's
        temporaries, and no activation; in between, the first block's backward meets nearly
        every gradient with one block's activations (``late``), the peak of a checkpointed
        step, whose recomputed block is as large as everything it kept. Measured on every
        layout (``benchmarks/bench_largest_model.py``), the peak is one of the three, never a
        sum of two.
        """
        peak = max(self.gradients + self.update, self.activations + self.workspace, self.late)
        return self.parameters + self.optimizer + self.runtime + peak


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def block_parameters(shape: ModelShape, layout: Layout) -> int:
    """Parameter elements of one block on one rank.

    * none: ``4h^2 + 2hF`` weights and ``9h + F`` vectors (``12h^2 + 13h`` for ``F = 4h``).
    * 1d: qkv and fc1 split by output features with their biases, proj and fc2 by input
      features, their biases and both LayerNorms whole on every rank: ``(4h^2 + 2hF)/p +
      (3h + F)/p + 6h`` (Shoeybi et al. 2019, "Megatron-LM", section 3).
    * 2d: every weight in ``q x q`` blocks, the ``[h]`` vectors split over the mesh row and
      replicated over its column: ``(4h^2 + 2hF)/q^2 + (9h + F)/q`` (Xu et al. 2021, "An
      Efficient 2D Method for Training Super-Large Deep Learning Models", section 3).
    * 2.5d: the same on each of the ``d`` layers, which hold copies (Wang et al. 2021,
      "Tesseract: Parallelize the Tensor Parallelism Efficiently", section 3).
    * 3d: weights ``[out/q^2, in/q]``, a distinct ``1/q^3`` on every rank, vectors ``/q``
      (Bian et al. 2021, "Maximizing Parallelism in Distributed Training for Huge Neural
      Networks", section 3).

    The formulas are GPT's; other blocks sum their own layers the same way
    (:meth:`ModelShape.block_linears`). Key/value heads fewer than the ranks splitting heads
    (``p`` in 1d, ``q`` on the meshes) are repeated: ``k`` and ``v`` stay whole on every rank.
    """
    if layout.mode == "none":
        return shape.block_weights + shape.block_vectors
    linears = shape.block_linears(layout.side)
    cut = [linear for linear in linears if not linear.repeated]
    weights = sum(linear.weights for linear in cut)
    biases = [linear for linear in cut if linear.bias]
    # repeated key/value heads: the weight and bias whole on every rank
    whole = sum(x.held + (x.held // x.n_in if x.bias else 0) for x in linears if x.repeated)
    if layout.whole_between_blocks:
        p = layout.tensor
        split = sum(linear.n_out for linear in biases if linear.column)
        whole += sum(linear.n_out for linear in biases if not linear.column)
        return _ceil(weights, p) + _ceil(split, p) + whole + 2 * shape.norm_vectors
    vectors = sum(linear.n_out for linear in biases) + 2 * shape.norm_vectors
    return _ceil(weights, layout.weight_split) + _ceil(vectors, layout.side) + whole


def embedding_parameters(
    shape: ModelShape, layout: Layout, *, tables: int = 2, head: bool = True
) -> int:
    """Elements of the token (and position) table, an untied head and the final norm on one rank.

    The token table is split as the mode splits a vocabulary (1d: rows over ``p``,
    Megatron-LM's vocab-parallel embedding; 2d and 2.5d: like a weight, over ``q^2``; 3d: over
    the ``q^2`` ranks of one face of the cube, replicated over the third axis, as tessera's
    ``Embedding3D`` holds it), and so is an untied head. A learned position table is split
    like the token table except in 1d, which keeps it whole.

    Args:
        shape: The model.
        layout: The layout.
        tables: 2 for the first stage (token and position tables), 1 for the last stage of a
            pipeline, which holds only its head (a copy of the tied token table, or the
            untied head: as many elements).
        head: Whether the first stage also holds the head (no pipeline).
    """
    if shape.vocab == 0:
        return 0
    h = shape.hidden
    split = layout.side**2 if layout.on_cube else layout.weight_split  # a table's blocks
    token = _ceil(shape.vocab * h, split)
    position = 0
    if tables == 2:
        rows = shape.position_rows
        position = rows * h if layout.whole_between_blocks else _ceil(rows * h, split)
    untied = token if tables == 2 and head and not shape.tied_head else 0
    norm = shape.norm_vectors
    norm = _ceil(norm, layout.side) if layout.activation_split > 1 else norm
    return token + position + untied + norm


def block_activation_bytes(
    shape: ModelShape, layout: Layout, samples: int, precision: Precision
) -> int:
    """Bytes one block saves for its backward on one rank, for ``samples`` sequences.

    ``samples`` is the microbatch of one replica (before the tensor mode splits it). In
    elements, with ``T = samples * s`` and ``A = samples * heads * s^2``:

    * none: ``T (8h + 2F) + A``: LayerNorm inputs ``2Th``, qkv and fc1 inputs ``2Th``,
      contiguous q, k, v ``3Th``, proj input ``Th``, GeLU and fc2 inputs ``2TF``, softmax
      output ``A``; plus LayerNorm mean and rstd ``4T`` in fp32;
    * 1d: ``4Th + 4T`` whole on every rank, ``(4Th + 2TF + A)/p`` split (Korthikanti et al.
      2022, section 4.2.1, "tensor parallel");
    * 2d, 2.5d, 3d: ``(T (8h + 2F) + A)/P``, every activation in ``[T/r, h/q]`` blocks with
      ``r`` the mode's batch split; tessera's LayerNorm saves ``x_hat`` and its rstd ``[T/r]``
      (``2T/r`` fp32 for the two); 3d keeping its gathered operands adds them
      (:func:`_kept_operands`).

    Other blocks count the same tensors at their sizes: q, k and v ``T (h + 2 kv d)`` with
    ``kv`` key/value heads of ``d`` features (repeated up to the ranks splitting heads); a
    gated MLP saves ``4TF`` (the gate's output, its activation, the up projection and their
    product) where GeLU saves ``2TF``; an RMSNorm keeps one statistic, not two. Rotary
    positions add only their ``[s, d]`` tables, left out.

    With ``shape.dropout`` the masks (one byte per element: ``A`` and ``2Th``, split as
    their activations) and the attention dropout's output (``A``) are added, which gives
    Korthikanti et al.'s ``34 s b h + 5 a s^2 b`` bytes in fp16.
    """
    h, e = shape.hidden, precision.activation
    tokens = samples * shape.seq
    scores = samples * shape.heads * shape.seq * shape.seq
    masks = scores + 2 * tokens * h if shape.dropout else 0  # bytes, one per element
    dropped = scores if shape.dropout else 0  # elements: the attention dropout's output
    qkv = sum(x.n_out for x in shape.block_linears(layout.side) if x.name in _QKV)
    mlp = (4 if shape.gated_mlp else 2) * shape.ffn
    # per token: q, k, v, the proj input and the MLP's inner tensors, which 1d splits
    inner = qkv + h + mlp
    statistics = FP32 * (2 if shape.norm == "layernorm" else 1) * 2 * tokens
    if layout.tensor_mode is None:
        elements = tokens * (4 * h + inner) + scores + dropped
        return e * elements + masks + statistics
    if layout.whole_between_blocks:
        p = layout.tensor
        split = _ceil(tokens * inner + scores + dropped, p)
        mask_bytes = _ceil(scores, p) + 2 * tokens * h if shape.dropout else 0
        return e * (4 * tokens * h + split) + mask_bytes + statistics
    p = layout.activation_split
    elements = _ceil(tokens * (4 * h + inner) + scores + dropped, p)
    rows = _ceil(tokens, layout.row_split)
    if layout.keeps_gathered:
        elements += _kept_operands(shape, layout, rows)
    return e * elements + _ceil(masks, p) + FP32 * 2 * rows


def _kept_operands(shape: ModelShape, layout: Layout, rows: int) -> int:
    """Elements 3d's ``Linear3D`` layers also save when they keep their gathered operands.

    With ``n = rows``, ``k = in/q`` and ``o = out/q^2`` per rank: the weights staying, the
    input plane's rows ``q^2 n k``; the operands travelling, the gathered rows and weight
    ``q (n k + o k)`` (``tessera.layers.cube_linear(keep=True)``).
    """
    q, found = layout.side, 0
    for linear in shape.block_linears(q):
        k, o = _ceil(linear.n_in, q), _ceil(linear.n_out, q * q)
        if cube_algorithm(rows, k, o, q, keep=True) == "stationary":
            found += q * q * rows * k
        else:
            found += q * (rows * k + o * k)
    return found


#: The attention's input projections, whose outputs attention saves.
_QKV = ("qkv", "q", "k", "v")


def freed_before_attention(
    shape: ModelShape, layout: Layout, samples: int, precision: Precision
) -> int:
    """Bytes of a block's saved activations its backward frees before attention's backward.

    A block's backward runs its MLP first, then the attention's output projection: by the
    time attention's working memory exists (:func:`.workspace.attention_workspace_bytes`) the
    second LayerNorm's and the first MLP layer's inputs ``2Th``, the MLP's inner tensors and
    the projection's input ``Th`` are gone, split as :func:`block_activation_bytes` splits
    them (1d keeps the first two whole). Their statistics and dropout masks are left in.
    """
    tokens = samples * shape.seq
    h, e = shape.hidden, precision.activation
    mlp = (4 if shape.gated_mlp else 2) * shape.ffn
    if layout.tensor_mode is None:
        return e * tokens * (3 * h + mlp)
    if layout.activation_split == 1:  # 1d: the norm's and the MLP's inputs whole on every rank
        return e * (2 * tokens * h + _ceil(tokens * (h + mlp), layout.tensor))
    return e * _ceil(tokens * (3 * h + mlp), layout.activation_split)


def checkpointed_block_bytes(
    shape: ModelShape, layout: Layout, samples: int, precision: Precision
) -> int:
    """Bytes a checkpointed block keeps: its input ``[T, h]`` (``/P`` on the meshes)."""
    return precision.activation * _ceil(samples * shape.seq * shape.hidden, layout.activation_split)


def head_activation_bytes(
    shape: ModelShape, layout: Layout, samples: int, precision: Precision
) -> int:
    """Bytes the final LayerNorm, the head and the loss save, for ``samples`` sequences.

    The inputs of the final LayerNorm and of the head (``2Th``, split as a block's), the
    LayerNorm statistics, and the logits kept in fp32 for the cross-entropy, ``4 T V / t``
    bytes with the vocabulary split over the tensor ranks (the output layer's term of
    Korthikanti et al. 2022's total activation memory). 0 with ``vocab=0``.
    """
    if shape.vocab == 0:
        return 0
    tokens = samples * shape.seq
    split = layout.activation_split
    inputs = precision.activation * _ceil(2 * tokens * shape.hidden, split)
    stats = FP32 * 2 * _ceil(tokens, layout.row_split)
    vocab_split = layout.tensor if layout.mode != "none" else 1
    return inputs + stats + FP32 * _ceil(tokens * shape.vocab, vocab_split)


def stage_blocks(shape: ModelShape, layout: Layout) -> tuple[int, int]:
    """Blocks on the first and on the last pipeline stage.

    tessera's ``partition_uniform`` gives the first ``layers % p`` stages one block more.
    """
    p = layout.pipeline
    first = _ceil(shape.layers, p)
    last = shape.layers // p if p > 1 and shape.layers % p else first
    return first, last


def rank_memory(
    shape: ModelShape,
    layout: Layout,
    precision: Precision,
    backend: str = "nccl",
    runtime: int = 0,
    runtime_per_block: int = 0,
) -> MemoryBreakdown:
    """The peak bytes of the fullest rank: the first or the last pipeline stage.

    The first stage holds the embedding and, under 1F1B, ``min(p, m)`` microbatches of
    activations; the last holds the head (a copy of the tied token table when ``p > 1``) and
    one microbatch, plus the logits. Without a pipeline one rank holds everything.
    ``backend`` decides how many blocks a gather holds (:mod:`.workspace`).

    ``runtime`` and ``runtime_per_block``: bytes the rank's runtime holds beyond its tensors
    once it has trained a step, ``runtime + runtime_per_block * blocks`` for the ``blocks`` of
    the stage, a property of the machine and its libraries, not of the layout: on a CPU the
    math library's cached product buffers (MKL's) and the allocator's heap, a base, and the
    framework's objects and the heap's small blocks of every tensor, which grow with the
    blocks; on a GPU its BLAS workspace. ``benchmarks/memory_trial.py`` measures it (resident
    bytes no tensor holds).

    Under checkpointing the last block's backward recomputes it from the input its
    checkpoint kept: the block's first activation, counted once. Under ZeRO-3 the blocks
    FSDP2 holds gathered (the one running and the next, prefetched) meet the blocks'
    moments, not the head's backward nor the optimizer step.
    """
    m = microbatches(shape, layout)
    samples = microbatch_samples(shape, layout)
    first_blocks, last_blocks = stage_blocks(shape, layout)
    single = layout.pipeline == 1
    stages = [
        (first_blocks, 2, min(layout.pipeline, m), single),
        *([] if single else [(last_blocks, 1, 1, True)]),
    ]
    worst: MemoryBreakdown | None = None
    own = block_parameters(shape, layout)
    block = block_activation_bytes(shape, layout, samples, precision)
    block_input = checkpointed_block_bytes(shape, layout, samples, precision)
    # the block's input and the incoming gradient: the gradient of each, [T, h] per rank
    flowing = 2 * block_input
    # a block's backward: the widest linear's first, every activation of the block still
    # saved; attention's once the MLP and the projection have freed theirs
    freed = freed_before_attention(shape, layout, samples, precision)
    linear_work = linear_workspace_bytes(shape, layout, samples, precision, backend) + flowing
    attention_work = attention_workspace_bytes(shape, layout, samples, precision) + flowing
    linear, attention = block + linear_work, block - freed + attention_work
    # what a block holds of its own when its backward begins, before it computes: its
    # activations, or under checkpointing the input it recomputes them from
    waiting = block_input if layout.checkpoint else block
    for blocks, tables, in_flight, has_head in stages:
        params = blocks * own + embedding_parameters(shape, layout, tables=tables, head=has_head)
        # the stem's tables get their gradients after the first block's backward
        stem = embedding_parameters(shape, layout, tables=2, head=False) if tables == 2 else 0
        head_unit = params - blocks * own - stem  # the final norm and the head
        head, head_work = 0, 0
        if has_head:
            head = head_activation_bytes(shape, layout, samples, precision)
            head_work = head_workspace_bytes(shape, layout, samples, backend)
        # ZeRO-3: the parameters FSDP2 holds gathered while the last block computes, and when
        # its backward begins (it prefetches the block before it, or the stem)
        computing, beginning = _fsdp_gathered(
            layout, precision, own, own if blocks > 1 else stem, backend
        )
        # ZeRO-2/3: the head's gradients, whole until their reduce-scatter, which FSDP2 waits
        # for at the next unit's
        pending = precision.gradient * head_unit if layout.zero >= 2 else 0
        # every activation saved, or under checkpointing the blocks' inputs; the head's are
        # freed before the last block's backward, which recomputes its activations from its
        # input (among the activations it saves again, counted once)
        kept = blocks * in_flight * waiting
        others = kept - waiting
        activations, workspace = max(
            [
                (kept + head, head_work),
                (kept, block_input + beginning + pending),
                (others + block, linear_work + computing + pending),
                (others + block - freed, attention_work + computing + pending),
            ],
            key=sum,
        )
        computing, beginning = _fsdp_gathered(layout, precision, own, stem, backend)
        late = late_bytes(
            shape,
            layout,
            precision,
            params - stem,
            linear + computing,
            attention + computing,
            waiting + block_input + beginning,
        )
        if layout.zero >= 3 and blocks > 1:
            # the second block's backward prefetches a whole block where the first's prefetches
            # the stem; the first still holds its input (checkpointed) or every activation,
            # and FSDP2 the next unit's unsharded gradients: a block's, or the head's
            computing, beginning = _fsdp_gathered(layout, precision, own, own, backend)
            second = late_bytes(
                shape,
                layout,
                precision,
                params - stem - own,
                waiting + linear + computing,
                waiting + attention + computing,
                2 * waiting + block_input + beginning,
                previous=own if blocks > 2 else head_unit,
            )
            late = max(late, second)
        held = runtime + runtime_per_block * blocks
        breakdown = _sharded(layout, precision, params, activations, workspace, late, held)
        if worst is None or breakdown.total > worst.total:
            worst = breakdown
    assert worst is not None
    return worst


def late_bytes(
    shape: ModelShape,
    layout: Layout,
    precision: Precision,
    gradients: int,
    linear: int,
    attention: int,
    beginning: int = 0,
    previous: int | None = None,
) -> int:
    """What a block's backward at the end of the step holds beyond parameters and optimizer state.

    The first block's runs last: every later layer's gradient exists by then, and the block's
    activations (recomputed under checkpointing: as large as all the inputs the step kept, or
    larger), its working memory, the gradient arriving from the next block and the one it
    passes down the residual stream are held at once. Its own gradients appear as its backward
    runs: none at its widest linear layer's (the MLP's second, the first its backward
    reaches), every one but the attention's input projections' at its attention's. Under
    ZeRO-2/3 the later gradients are sharded over the ``data`` ranks, and FSDP2 still holds
    the previous unit's unsharded, the input of the reduce-scatter it waits for at the
    following unit.

    Traced with torch's profiler of CPU allocations in ``benchmarks/bench_largest_model.py``'s
    runs: a checkpointed ZeRO-3 step peaks in the first or the second block's backward (the
    first prefetches the stem, the second a whole block), where counting two blocks of the
    block's own gradients overstated it by a quarter of a block's parameters.

    Args:
        shape: The model.
        layout: The layout.
        precision: Bytes per element.
        gradients: Elements whose gradients exist when the block's backward begins (the
            stage's parameters but the stem's tables, and for the second block the first's).
        linear: Bytes the step holds beyond gradients at the block's widest linear layer's
            backward: the block's activations, that layer's working memory, the gradients
            flowing through the block, what an earlier block keeps, parameters gathered.
        attention: The same at its attention's backward.
        beginning: The same when its backward begins, before it computes (ZeRO-3's
            prefetch in flight); 0 when it is not a moment of its own.
        previous: Elements of the unit whose unsharded gradients ZeRO-2/3 still holds (the
            one whose backward ran before); default a block.
    """
    own = block_parameters(shape, layout)
    later = max(gradients - own, 0)
    if layout.zero >= 2:
        later = _ceil(later, layout.data) + (own if previous is None else previous)
    linears = shape.block_linears(layout.side)
    projections = sum(x.weights for x in linears if x.name in _QKV)
    done = own - own * projections // max(sum(x.weights for x in linears), 1)
    g = precision.gradient
    return g * later + max(linear, attention + g * done, beginning)


def _fsdp_gathered(
    layout: Layout, precision: Precision, own: int, prefetched: int, backend: str
) -> tuple[int, int]:
    """Bytes of parameters ZeRO-3 holds gathered in a block's backward: (computing, beginning).

    FSDP2 gathers the block and prefetches the unit its backward reaches next (``prefetched``
    elements): both are held while the block computes. When the backward begins the
    prefetch's all-gather is in flight, and gloo's fills a buffer of its own beside FSDP2's
    output (``c10d::_allgather_base_`` allocates the whole unit again, traced with torch's
    profiler): on gloo the prefetched unit is held twice then. 0 and 0 below stage 3.
    """
    if layout.zero < 3:
        return 0, 0
    copies = 2 if backend == "gloo" else 1
    return precision.parameter * (own + prefetched), precision.parameter * (
        own + copies * prefetched
    )


def _sharded(
    layout: Layout,
    precision: Precision,
    params: int,
    activations: int,
    workspace: int,
    late: int = 0,
    runtime: int = 0,
) -> MemoryBreakdown:
    """Apply ZeRO's sharding over the ``data`` ranks to a stage's ``params`` elements."""
    n, zero = layout.data, layout.zero
    held = _ceil(params, n) if zero >= 3 else params
    updated = _ceil(params, n) if zero >= 1 else params  # the optimizer's elements here
    return MemoryBreakdown(
        parameters=precision.parameter * held,
        gradients=precision.gradient * (_ceil(params, n) if zero >= 2 else params),
        optimizer=precision.optimizer * updated,
        activations=activations,
        workspace=workspace,
        update=FP32 * updated,
        late=late,
        runtime=runtime,
    )
