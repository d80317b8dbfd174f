"""Communication of one training step, as the collectives each rank takes part in.

Every collective is described once (:class:`Collective`) and read two ways:

* ``contributed``: the bytes of this rank's own data entering the calls (the whole buffer of
  an all-reduce, reduce or reduce-scatter, the input chunk of an all-gather, the source's
  buffer of a broadcast, the payload of a send). That is what ``benchmarks/meters.py`` counts,
  so the planner's figures can be checked against a measurement to the byte;
* ``wire``: the bytes a rank sends under the usual bandwidth-optimal algorithms (Thakur,
  Rabenseifner and Gropp 2005, "Optimization of Collective Communication Operations in
  MPICH"): ``2 (n-1)/n S`` for an all-reduce, a broadcast (scatter, then all-gather) and a
  reduce (reduce-scatter, then gather), ``(n-1)/n S`` for a reduce-scatter or all-gather of an
  ``S``-byte buffer, the payload of a send. The machine model prices these (``machine.py``).

The collectives of each tensor mode are those of the algorithms tessera-layers runs, after
the mode's paper; see :func:`block_collectives`. Two exchanges carry most of the tensor-parallel
traffic, and how they travel depends on the backend (``tessera.layers.comm.inflight``): *gather
blocks* (every rank gets every rank's block) and *scatter blocks* (rank ``l`` gets the sum of
every rank's block ``l``), and 3d's weights-stay variant adds *all-to-all blocks* (rank ``l``
gets every rank's block ``l``). NCCL runs them as an all-gather, a reduce-scatter and an
all-to-all; gloo sends each of the other ``n - 1`` ranks its block, in one exchange (one gloo
all-to-all of per-peer blocks, or point-to-point sends posted together: a ``send`` here).
The bytes on the wire are the same ``n - 1`` blocks either way; the bytes contributed and the
kinds of call differ.
"""

from __future__ import annotations

from dataclasses import dataclass

from .layouts import Layout
from .precision import FP32, Precision
from .shapes import ModelShape

__all__ = [
    "BACKENDS",
    "KINDS",
    "Collective",
    "block_collectives",
    "contributed_bytes",
    "cube_algorithm",
    "data_collectives",
    "head_collectives",
    "linear_collectives",
    "mesh_algorithm",
    "pipeline_collectives",
    "sums_once_per_step",
]

#: The kinds of collective (and point-to-point send) the planner counts.
KINDS: tuple[str, ...] = (
    "all_reduce",
    "reduce_scatter",
    "all_gather",
    "all_to_all",
    "broadcast",
    "reduce",
    "send",
)

#: How a group's blocks travel: ``"nccl"`` (all-gathers and reduce-scatters) or ``"gloo"``
#: (pairwise sends); see the module docstring.
BACKENDS: tuple[str, ...] = ("nccl", "gloo")

#: torch's DistributedDataParallel fills gradient buckets of 25 MiB (``bucket_cap_mb``).
BUCKET_BYTES = 25 * 1024 * 1024


@dataclass(frozen=True)
class Collective:
    """``calls`` equal collectives over ``group`` ranks, each on an ``nbytes`` buffer.

    Attributes:
        kind: One of ``KINDS``; ``"send"`` is a batch of point-to-point sends posted together
            (one ``batch_isend_irecv``).
        group: Ranks in the group (for ``send``: 2, a sender and a receiver at a time).
        nbytes: One call's buffer: the all-reduce / reduce / broadcast buffer, the input of a
            reduce-scatter or an all-to-all, the output of an all-gather, every tensor one
            batch of sends sends.
        calls: How many such calls a rank makes.
        phase: ``"forward"``, ``"backward"`` or ``"step"`` (gradient synchronization).
        sum_over: For the sum of a gradient's parts that a layer may leave to the training
            loop (``tessera.context.gradient_sums``), the group it sums over (``"depth"``:
            2.5D's depth layers, ``"batch"``: a LayerNorm's batch blocks, ``"tensor"``:
            repeated key/value heads' whole weights); ``""`` otherwise.
            Under the engine these run once per step, bucketed (:func:`sums_once_per_step`).
    """

    kind: str
    group: int
    nbytes: int
    calls: int = 1
    phase: str = "forward"
    sum_over: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"Collective.kind {self.kind!r} is not one of {', '.join(KINDS)}")
        if self.group < 2:
            raise ValueError(f"Collective.group {self.group}: a collective needs 2 or more ranks")

    @property
    def contributed(self) -> int:
        """Bytes of this rank's own data entering the calls (``meters.py``'s convention).

        A broadcast counts only where this rank is the source: the planner's broadcasts
        rotate the source through the group (SUMMA's panels), so ``calls / group`` of them.
        An all-to-all counts the blocks addressed to the other ranks, ``(n-1)/n`` of its input.
        """
        if self.kind == "all_gather":
            return self.calls * self.nbytes // self.group
        if self.kind == "broadcast":
            return self.calls * self.nbytes // self.group
        if self.kind == "all_to_all":
            return self.calls * self.nbytes * (self.group - 1) // self.group
        return self.calls * self.nbytes

    @property
    def wire(self) -> float:
        """Bytes this rank sends over all the calls, bandwidth-optimal algorithms."""
        n = self.group
        if self.kind == "send":
            factor = 1.0
        elif self.kind in ("reduce_scatter", "all_gather", "all_to_all"):
            factor = (n - 1) / n
        else:  # all_reduce, broadcast, reduce
            factor = 2 * (n - 1) / n
        return self.calls * factor * self.nbytes


def contributed_bytes(collectives: list[Collective], phase: str | None = None) -> int:
    """The contributed bytes of ``collectives`` (of one ``phase`` only, if given)."""
    return sum(c.contributed for c in collectives if phase in (None, c.phase))


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _gather(backend: str, group: int, block: int, phase: str = "forward") -> Collective:
    """Every rank's ``block`` bytes to every rank of ``group`` (gather blocks)."""
    if backend == "gloo":
        return Collective("send", 2, (group - 1) * block, phase=phase)
    return Collective("all_gather", group, group * block, phase=phase)


def _scatter(backend: str, group: int, block: int, phase: str = "forward") -> Collective:
    """``group`` blocks of ``block`` bytes summed over ``group``, rank ``l`` keeping block ``l``."""
    if backend == "gloo":
        return Collective("send", 2, (group - 1) * block, phase=phase)
    return Collective("reduce_scatter", group, group * block, phase=phase)


def _all_to_all(backend: str, group: int, block: int, phase: str = "forward") -> Collective:
    """``group`` blocks of ``block`` bytes, block ``l`` to rank ``l`` of ``group`` (all-to-all)."""
    if backend == "gloo":
        return Collective("send", 2, (group - 1) * block, phase=phase)
    return Collective("all_to_all", group, group * block, phase=phase)


def mesh_algorithm(rows: int, in_block: int) -> str:
    """The variant a 2d / 2.5d ``Linear`` runs in training on ``rows`` rows, ``in/q`` features.

    ``"stationary"`` (the weights stay) when ``2 rows < 3 in_block``, else ``"summa"`` (the
    weights travel): ``tessera.layers.choose_algorithm`` with a backward, which compares the
    elements each variant sends (``2 Y < 3 W`` with ``Y = rows n_out/q`` and ``W = n_in
    n_out/q^2``).
    """
    return "stationary" if 2 * rows < 3 * in_block else "summa"


def cube_algorithm(rows: int, in_block: int, out_block: int, q: int, keep: bool = False) -> str:
    """The variant a 3d ``Linear`` runs in training on ``rows`` rows (``tessera.layers``' rule).

    ``"stationary"`` (the weights stay) when ``3 q n k + 2 n o < 3 o k``, else ``"gathered"``
    (the operands travel), with ``n = rows``, ``k = in/q`` (``in_block``) and ``o = out/q^2``
    (``out_block``): ``tessera.layers.choose_cube_algorithm`` with a backward, which compares
    the elements each variant sends in a step, ``(q^2 - 1)(3 n k + 2 n o)`` against ``(q -
    1)(3 n k + 2 n o q + 3 o k)`` (the bias gradient's ``(q - 1) o`` or ``(q - 1) q o``
    aside). Keeping the gathered operands (``keep``): ``q n k + n o < o k``.
    """
    n, k, o = rows, in_block, out_block
    if keep:
        return "stationary" if q * n * k + n * o < o * k else "gathered"
    return "stationary" if 3 * q * n * k + 2 * n * o < 3 * o * k else "gathered"


def linear_collectives(
    layout: Layout,
    rows: int,
    n_in: int,
    n_out: int,
    precision: Precision,
    backend: str = "nccl",
    *,
    bias: bool = True,
) -> list[Collective]:
    """One ``Linear(n_in, n_out)`` of a 2d, 2.5d or 3d layout on ``rows`` local rows.

    2d and 2.5d (``q x q`` mesh; ``tessera.layers.mesh_linear()``): with blocks ``X = rows
    n_in/q`` (input), ``Y = rows n_out/q`` (output), ``W = n_in n_out/q^2`` (weight) and ``b =
    n_out/q`` (bias), the variant of SUMMA (van de Geijn and Watts 1997) that sends less
    (:func:`mesh_algorithm`):

    * the weights stay: forward, the input block sent to the ``q`` ranks of a mesh row that
      multiply it (``q X``, one send fewer on the diagonal; the planner counts the busiest
      rank), the partial outputs ``[q, rows, n_out/q]`` scattered over the column; backward,
      the output gradient gathered over the column, the input sent again and the partial
      input gradients sent back (``q X`` each); the weight and bias gradients are complete;
    * the weights travel (SUMMA, Xu et al. 2021, section 3): forward, the input gathered along
      the row and the weight along the column; backward, both gathered again, the weight
      gradient (each chunk carrying the partial bias gradient) scattered over the column and
      the input gradient over the row;
    * 2.5d (Wang et al. 2021, section 3): the weight and bias gradients also summed over the
      ``d`` layers in one all-reduce.

    3d (``q^3`` cube; ``tessera.layers.cube_linear()``), with ``n = rows`` rows, ``k =
    n_in/q`` input features and ``o = n_out/q^2`` weight rows per rank, the variant that sends
    less (:func:`cube_algorithm`):

    * the operands travel (Bian et al. 2021, section 3): forward, the input ``[n, k]``
      gathered over the ``q`` ranks of the other batch axis and the weight ``[o, k]`` over the
      weight axis, the partial product ``[q n, n_out/q]`` scattered over the hidden axis;
      backward, the output gradient, the weight and the input gathered again, ``dX``
      scattered over the batch axis and ``dW`` over the weight axis, each chunk carrying the
      partial bias gradient ``[n_out/q]``;
    * the weights stay: forward, the input gathered over the input plane (the ``q^2`` ranks
      of its batch group) and the partial outputs ``[q^2, n, o]`` sent all-to-all over the
      output plane; backward, the output gradient all-to-all back, the input gathered again,
      the partial ``dX`` ``[q^2, n, k]`` scattered over the input plane, ``dW`` complete, and
      the complete bias slices ``[o]`` gathered over the weight axis.

    Gathers and scatters are all-gathers and reduce-scatters under ``backend="nccl"``, sends
    to each other rank under ``"gloo"`` (see the module docstring). Gradients inside these
    products are in the compute dtype (``precision.activation``). Without ``bias`` no bias
    gradient rides along.
    """
    q, e = layout.side, precision.activation
    if layout.on_cube:
        keep = layout.keep_gathered
        return _cube_linear_collectives(q, rows, n_in, n_out, e, backend, bias, keep)
    x, y = _ceil(rows * n_in, q), _ceil(rows * n_out, q)
    w, b = _ceil(n_in * n_out, q * q), _ceil(n_out, q) if bias else 0
    if mesh_algorithm(rows, n_in // q) == "stationary":
        found = [
            Collective("send", 2, e * q * x),
            _scatter(backend, q, e * y),
            _gather(backend, q, e * y, "backward"),
            Collective("send", 2, e * q * x, phase="backward"),
            Collective("send", 2, e * q * x, phase="backward"),
        ]
    else:
        found = [
            _gather(backend, q, e * x),
            _gather(backend, q, e * w),
            _gather(backend, q, e * w, "backward"),
            _gather(backend, q, e * x, "backward"),
            _scatter(backend, q, e * (w + b), "backward"),
            _scatter(backend, q, e * x, "backward"),
        ]
    if layout.depth > 1:
        found.append(Collective("all_reduce", layout.depth, e * (w + b), 1, "backward", "depth"))
    return found


def _cube_linear_collectives(
    q: int, rows: int, n_in: int, n_out: int, e: int, backend: str, bias: bool, keep: bool
) -> list[Collective]:
    """A 3d ``Linear(n_in, n_out)`` on ``rows`` rows, ``e`` bytes per element (see above).

    ``keep``: the backward reuses what the forward gathered instead of gathering it again.
    """
    k, o, plane = _ceil(n_in, q), _ceil(n_out, q * q), q * q
    x, w = rows * k, o * k  # [n, k] input block, [o, k] weight block
    if cube_algorithm(rows, k, o, q, keep) == "stationary":
        return [
            _gather(backend, plane, e * x),
            _all_to_all(backend, plane, e * rows * o),
            _all_to_all(backend, plane, e * rows * o, "backward"),
            *([] if keep else [_gather(backend, plane, e * x, "backward")]),
            *([_gather(backend, q, e * o, "backward")] if bias else []),
            _scatter(backend, plane, e * x, "backward"),
        ]
    y, b = rows * q * o, q * o if bias else 0  # [n, n_out/q] output block, [n_out/q] bias
    again = [_gather(backend, q, e * w, "backward"), _gather(backend, q, e * x, "backward")]
    return [
        _gather(backend, q, e * x),
        _gather(backend, q, e * w),
        _scatter(backend, q, e * y),
        _gather(backend, q, e * y, "backward"),
        *([] if keep else again),
        _scatter(backend, q, e * x, "backward"),
        _scatter(backend, q, e * (w + b), "backward"),
    ]


def _layer_norm_collectives(
    layout: Layout, rows: int, vectors: int, precision: Precision, backend: str
) -> list[Collective]:
    """A LayerNorm (or RMSNorm) whose hidden dim is split over ``q`` ranks (2d, 2.5d, 3d).

    Forward: each slice's mean and sum of squared deviations ``[rows, 2]`` gathered over the
    row (merged as Chan et al. 1979); backward: the two sums ``[rows, 2]`` of the input
    gradient all-reduced over the row, and the affine gradients (``vectors``: weight and bias
    ``2h``, an RMSNorm's weight ``h``), ``/q`` of them, all-reduced together over the batch
    group (the ``tensor / q`` ranks holding the same hidden block).
    """
    q = layout.side
    batch_group = layout.tensor // q
    return [
        _gather(backend, q, FP32 * 2 * rows),
        Collective("all_reduce", q, FP32 * 2 * rows, phase="backward"),
        Collective(
            "all_reduce",
            batch_group,
            precision.gradient * _ceil(vectors, q),
            1,
            "backward",
            "batch",
        ),
    ]


def block_collectives(
    shape: ModelShape,
    layout: Layout,
    samples: int,
    precision: Precision,
    backend: str = "nccl",
) -> list[Collective]:
    """The collectives of one block's forward and backward on ``samples`` sequences.

    * none: nothing (data parallelism synchronizes once per step: :func:`data_collectives`);
    * 1d: ``g`` all-reduces ``[T, h]`` after proj and fc2 in the forward and ``f``
      all-reduces of the qkv and fc1 input gradients in the backward (Shoeybi et al. 2019,
      section 3, figure 4);
    * 2d, 2.5d, 3d: the four linear layers (:func:`linear_collectives`) and the two
      LayerNorms, on ``T / r`` local rows, their blocks moved as ``backend`` moves them.

    Key/value heads repeated over the ranks (fewer than the ranks splitting heads) add the
    sum over TENSOR of their whole weights' gradient parts, one all-reduce each per backward
    (tessera's ``RepeatedHeads``; a sum the engine defers to the step).

    With activation checkpointing the forward's collectives run again in the backward's
    recomputation; that is added by the caller.
    """
    tokens = samples * shape.seq
    if layout.mode == "none":
        return []
    repeats = [
        Collective(
            "all_reduce",
            layout.tensor,
            precision.gradient * (x.held + (x.held // x.n_in if x.bias else 0)),
            1,
            "backward",
            "tensor",
        )
        for x in shape.block_linears(layout.side)
        if x.repeated
    ]
    if layout.whole_between_blocks:
        size = precision.activation * tokens * shape.hidden
        return [
            Collective("all_reduce", layout.tensor, size, 2),
            Collective("all_reduce", layout.tensor, size, 2, "backward"),
            *repeats,
        ]
    rows = _ceil(tokens, layout.row_split)
    found: list[Collective] = list(repeats)
    for linear in shape.block_linears(layout.side):  # qkv (or q, k, v), proj, fc1, fc2
        found += linear_collectives(
            layout, rows, linear.n_in, linear.n_out, precision, backend, bias=linear.bias
        )
    for _ in range(2):
        found += _layer_norm_collectives(layout, rows, shape.norm_vectors, precision, backend)
    return found


def head_collectives(
    shape: ModelShape,
    layout: Layout,
    samples: int,
    precision: Precision,
    backend: str = "nccl",
) -> list[Collective]:
    """The embedding, final LayerNorm, head and loss of one microbatch (0 with ``vocab=0``).

    1d (Megatron-LM): the vocab-parallel embedding's output all-reduced ``[T, h]``, the
    head's input gradient all-reduced in the backward, and the loss's three ``[T]``
    all-reduces (max, sum of exponentials, target logit). The meshes: the head is priced as
    one more ``Linear(h, V)`` of the mode (tessera's classifiers gather their tied table
    instead), the final LayerNorm as one more LayerNorm, and the loss's statistics are
    all-reduced over the row.
    """
    if shape.vocab == 0 or layout.mode == "none":
        return []
    tokens = samples * shape.seq
    if layout.whole_between_blocks:
        p, size = layout.tensor, precision.activation * tokens * shape.hidden
        return [
            Collective("all_reduce", p, size),
            Collective("all_reduce", p, FP32 * tokens, 3),
            Collective("all_reduce", p, size, phase="backward"),
        ]
    rows = _ceil(tokens, layout.row_split)
    return [
        *linear_collectives(layout, rows, shape.hidden, shape.vocab, precision, backend),
        *_layer_norm_collectives(layout, rows, shape.norm_vectors, precision, backend),
        Collective("all_reduce", layout.side, FP32 * rows, 3),
    ]


def pipeline_collectives(
    shape: ModelShape, layout: Layout, samples: int, precision: Precision
) -> list[Collective]:
    """The sends of a middle pipeline stage for one microbatch of ``samples`` sequences.

    Each tensor rank sends its own block of the activation ``[samples, s, h]`` forward and of
    its gradient back (1d: the whole activation, which it holds replicated; GPipe, Huang et
    al. 2019). The first and last stages send half of this.
    """
    if layout.pipeline == 1:
        return []
    size = precision.activation * _ceil(samples * shape.seq * shape.hidden, layout.activation_split)
    return [
        Collective("send", 2, size),
        Collective("send", 2, size, phase="backward"),
    ]


def sums_once_per_step(
    per_microbatch: list[Collective],
) -> tuple[list[Collective], list[Collective]]:
    """Move the gradient sums a layer may defer out of the microbatch, as the engine runs them.

    tessera-engine's ``DeferredSumGradientHandler`` takes over every such sum (2.5D's depth
    all-reduce of weight and bias gradients, the LayerNorms' affine gradients over their batch
    blocks) and runs it once per optimizer step, in 25 MiB buckets per group: the bytes of
    one microbatch's sums, in ``ceil(bytes / bucket)`` calls, whatever the number of
    microbatches.

    Returns:
        ``(the microbatch's other collectives, the sums once per step)``.
    """
    kept = [c for c in per_microbatch if not c.sum_over]
    totals: dict[tuple[str, int], int] = {}
    for c in per_microbatch:
        if c.sum_over:
            key = (c.sum_over, c.group)
            totals[key] = totals.get(key, 0) + c.calls * c.nbytes
    step = []
    for (over, group), total in totals.items():
        buckets = max(1, _ceil(total, BUCKET_BYTES))
        step.append(Collective("all_reduce", group, _ceil(total, buckets), buckets, "step", over))
    return kept, step


def data_collectives(
    layout: Layout, parameters: int, blocks: int, precision: Precision
) -> list[Collective]:
    """Gradient synchronization over the ``data`` replicas of a stage's ``parameters``.

    Rajbhandari et al. 2020 (ZeRO, section 7): plain data parallelism and stage 2 move
    ``2 Psi`` (an all-reduce; or a reduce-scatter of the gradients and an all-gather of the
    parameters), stage 3 ``3 Psi`` (the parameters gathered for the forward and again for the
    backward). Stage 1 follows torch's ``ZeroRedundancyOptimizer``, which tessera uses: the
    all-reduce, then every rank's updated shard sent to the others (an all-gather's volume).
    All-reduces go in 25 MiB buckets (DDP's default); FSDP2 (stages 2, 3) gathers per block.
    """
    n = layout.data
    if n == 1:
        return []
    grads, params = precision.gradient * parameters, precision.parameter * parameters
    buckets = max(1, _ceil(grads, BUCKET_BYTES))
    units = blocks + 1  # one FSDP2 unit per block, and the root
    if layout.zero == 0:
        return [Collective("all_reduce", n, _ceil(grads, buckets), buckets, "step")]
    if layout.zero == 1:
        return [
            Collective("all_reduce", n, _ceil(grads, buckets), buckets, "step"),
            Collective("all_gather", n, _ceil(params, buckets), buckets, "step"),
        ]
    found = [
        Collective("all_gather", n, _ceil(params, units), units, "forward"),
        Collective("reduce_scatter", n, _ceil(grads, units), units, "backward"),
    ]
    if layout.zero == 3:
        found.append(Collective("all_gather", n, _ceil(params, units), units, "backward"))
    return found
