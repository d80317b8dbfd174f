"""Layouts: data x pipeline x tensor mode x ZeRO stage x checkpointing, and which are possible.

A layout is possible when tessera would build it: the tensor size fits the mode's mesh (checked
by ``ParallelConfig`` itself, so the planner can never disagree with the launcher), the shape
splits as the mode's layers split it, and the engine accepts the ZeRO stage. The divisibility
each mode needs follows from how tessera-layers cuts the tensors:

======  =========================================  =========================================
mode    splits                                     so needs
======  =========================================  =========================================
1d      weights by rows or columns over ``p``      hidden, heads, vocab divisible by ``p``
        (Megatron-LM, Shoeybi et al. 2019)
2d      weights in ``q x q`` blocks, activations   hidden, heads, vocab divisible by ``q``;
        ``[b/q, s, h/q]`` (Xu et al. 2021)         batch per replica by ``q``
2.5d    the 2d mesh on ``d`` layers, activations   hidden, heads, vocab by ``q``; batch per
        ``[b/(dq), s, h/q]`` (Wang et al. 2021)    replica by ``d q``
3d      weights ``[out/q^2, in/q]``, activations   hidden and vocab by ``q^2``, heads by ``q``,
        ``[b/q^2, s, h/q]`` (Bian et al. 2021)     batch per replica by ``q^2``
======  =========================================  =========================================

Every layout also needs ``batch`` divisible by ``data`` and ``pipeline <= layers`` (each stage
holds at least one block), and ZeRO stages 2 and 3 (FSDP2) run only without a pipeline.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from tessera.registry import ConfigError

from ..config import ParallelConfig
from ..tensor_modes import TENSOR_MODES, TensorMode, find_tensor_mode
from .shapes import ModelShape

__all__ = [
    "MODES",
    "Layout",
    "check_world",
    "enumerate_layouts",
    "layout_problems",
    "microbatch_samples",
    "microbatches",
    "tensor_shapes",
]


def _planned(name: str) -> bool:
    found = find_tensor_mode(name)
    return found is not None and found.planned


#: The planner's name for no tensor parallelism.
NONE = "none"
#: The tensor modes the planner considers (those it has a cost model for), and ``"none"``.
MODES: tuple[str, ...] = (NONE, *(m for m in TENSOR_MODES if _planned(m)))


@dataclass(frozen=True)
class Layout:
    """One way to run the model on ``data * pipeline * tensor`` ranks.

    Attributes:
        data: Data-parallel replicas.
        pipeline: Pipeline stages.
        tensor: Ranks splitting each stage's tensors.
        mode: ``"none"``, ``"1d"``, ``"2d"``, ``"2.5d"`` or ``"3d"``.
        depth: 2.5d's depth ``d`` (``tensor = q * q * d``); 1 otherwise.
        zero: ZeRO stage over the data-parallel ranks, 0 (off) to 3.
        checkpoint: Whether every block's activations are recomputed in the backward.
        keep_gathered: 3d only: every ``Linear3D`` keeps what its forward gathered for its
            backward (``tessera.layers.keep_gathered_operands``): fewer gathers, more saved.
    """

    data: int
    pipeline: int
    tensor: int
    mode: str
    depth: int = 1
    zero: int = 0
    checkpoint: bool = False
    keep_gathered: bool = False

    @property
    def world(self) -> int:
        """``data * pipeline * tensor``."""
        return self.data * self.pipeline * self.tensor

    @property
    def tensor_mode(self) -> TensorMode | None:
        """The :class:`TensorMode` called ``mode`` (``None`` for ``"none"``)."""
        return find_tensor_mode(self.mode)

    @property
    def tensor_args(self) -> dict[str, Any]:
        """The mode's keys of ``parallel.tensor`` this layout sets (2.5d's ``depth``)."""
        mode = self.tensor_mode
        return {"depth": self.depth} if mode is not None and "depth" in mode.arguments else {}

    @property
    def side(self) -> int:
        """The side ``q`` of the mode's mesh (2d ``q^2``, 2.5d ``q^2 d``, 3d ``q^3`` ranks).

        For 1d it is the tensor size, for no tensor parallelism 1.
        """
        mode = self.tensor_mode
        return self.tensor if mode is None else mode.side(self.tensor, self.tensor_args)

    @property
    def row_split(self) -> int:
        """Blocks a replica's batch is cut into by the tensor mode (its activations' rows)."""
        mode = self.tensor_mode
        return 1 if mode is None else mode.row_blocks(self.tensor, self.tensor_args)

    @property
    def weight_split(self) -> int:
        """Ranks one weight matrix is cut over (2.5d keeps ``d`` copies of a ``q^2`` cut)."""
        mode = self.tensor_mode
        return 1 if mode is None else mode.weight_blocks(self.tensor, self.tensor_args)

    @property
    def hidden_split(self) -> int:
        """Ranks the hidden dim of a weight or the embedding is cut over (3d: ``q^2``)."""
        mode = self.tensor_mode
        return 1 if mode is None else mode.hidden_blocks(self.tensor, self.tensor_args)

    @property
    def activation_split(self) -> int:
        """Ranks a block's activations are cut over: 1 for 1d (replicated between blocks)."""
        mode = self.tensor_mode
        return self.tensor if mode is not None and mode.splits_activations else 1

    @property
    def whole_between_blocks(self) -> bool:
        """Activations are whole between blocks, split inside column-to-row pairs (1d)."""
        mode = self.tensor_mode
        return mode is not None and mode.replicated_activations

    @property
    def on_grid(self) -> bool:
        """Every activation is a block of rows and features (2d, 2.5d, 3d)."""
        mode = self.tensor_mode
        return mode is not None and mode.splits_activations

    @property
    def on_cube(self) -> bool:
        """A weight's output features are cut over ``q^2`` ranks, ``[out/q^2, in/q]`` (3d)."""
        return self.on_grid and self.hidden_split > self.side

    @property
    def keeps_gathered(self) -> bool:
        """Every linear keeps what its forward gathered (``keep_gathered`` where it can)."""
        mode = self.tensor_mode
        return self.keep_gathered and mode is not None and mode.keeps_gathered

    @property
    def tensor_name(self) -> str:
        """``none``, ``1d(4)``, ``2d(4)``, ``2.5d(8,d=2)``, ``3d(8)``, ``3d(8)+kept``."""
        mode = self.tensor_mode
        if mode is None:
            return NONE
        kept = "+kept" if self.keeps_gathered else ""
        return mode.label(self.tensor, self.tensor_args) + kept

    @property
    def name(self) -> str:
        """A short label: ``data 2 x pipe 1 x 2d(4), zero 1, ckpt``."""
        text = f"data {self.data} x pipe {self.pipeline} x {self.tensor_name}, zero {self.zero}"
        return text + (", ckpt" if self.checkpoint else "")

    def parallel(self) -> dict[str, Any]:
        """The ``parallel = dict(...)`` block that asks tessera for this layout.

        ``keep_gathered`` is no part of it: call ``tessera.layers.keep_gathered_operands(model)``.
        """
        block: dict[str, Any] = {"data": self.data, "pipeline": self.pipeline}
        if self.tensor_mode is None:
            block["tensor"] = 1
        else:
            block["tensor"] = {"size": self.tensor, "mode": self.mode, **self.tensor_args}
        return block


def tensor_shapes(size: int, mode: str | None = None) -> list[tuple[str, int]]:
    """The ``(mode, depth)`` pairs tessera accepts for ``size`` tensor ranks.

    Asks ``ParallelConfig`` itself, so the rules are the launcher's. Degenerate meshes that
    repeat a smaller layout are left out: a 1 x 1 mesh, 2.5d with depth 1 (that is 2d) or
    with ``q = 1`` (a stack of single ranks).

    Args:
        size: Tensor ranks.
        mode: Only this mode (default: every mode of ``MODES``).
    """
    if size == 1:
        return [(NONE, 1)] if mode in (None, NONE) else []
    found: list[tuple[str, int]] = []
    for kind in MODES[1:] if mode is None else (mode,):
        tensor_mode = find_tensor_mode(kind)
        takes_depth = tensor_mode is not None and "depth" in tensor_mode.arguments
        depths = [d for d in range(2, size // 4 + 1) if size % d == 0] if takes_depth else [1]
        for depth in depths:
            try:
                ParallelConfig(tensor_size=size, tensor_mode=kind, tensor_depth=depth)
            except ConfigError:
                continue
            found.append((kind, depth))
    return found


def microbatches(shape: ModelShape, layout: Layout) -> int:
    """Microbatches per step: one without a pipeline, else as many as the tensor mode allows.

    A pipeline's bubble is ``(p - 1) / (m + p - 1)`` of the step (GPipe, Huang et al. 2019;
    1F1B, Narayanan et al. 2021), so the planner cuts a replica's batch into the smallest
    microbatches the tensor mode can split: ``row_split`` samples each.
    """
    if layout.pipeline == 1:
        return 1
    return max(1, shape.batch // layout.data // layout.row_split)


def microbatch_samples(shape: ModelShape, layout: Layout) -> int:
    """Samples in one microbatch of one replica (before the tensor mode splits it)."""
    replica = -(-shape.batch // layout.data)
    return -(-replica // microbatches(shape, layout))


def layout_problems(shape: ModelShape, layout: Layout) -> list[str]:
    """Why tessera could not run ``shape`` under ``layout`` (empty when it could).

    Each problem names the quantity and shows the arithmetic, e.g. ``"hidden 2050 % 4 = 2:
    1d(4) splits hidden over 4 ranks"``.
    """
    problems: list[str] = []
    name = layout.tensor_name

    def need(what: str, value: int, divisor: int, why: str) -> None:
        if value % divisor != 0:
            problems.append(f"{what} {value} % {divisor} = {value % divisor}: {why}")

    need("batch", shape.batch, layout.data, f"{layout.data} replicas need equal shares")
    if layout.pipeline > shape.layers:
        problems.append(
            f"pipeline {layout.pipeline} > layers {shape.layers}: every stage needs a block"
        )
    q = layout.side
    mode = layout.tensor_mode
    if mode is not None:
        problems += _key_value_problems(shape, q, name, cube=layout.hidden_split > q)
    if mode is not None and not mode.splits_activations:
        for what, value in (("hidden", shape.hidden), ("heads", shape.heads)):
            need(what, value, q, f"{name} splits {what} over {q} ranks")
        if shape.vocab:
            need("vocab", shape.vocab, q, f"{name}'s vocab-parallel embedding splits it by {q}")
    elif mode is not None:
        hidden_divisor = layout.hidden_split
        need(
            "hidden",
            shape.hidden,
            hidden_divisor,
            f"{name} splits hidden over {hidden_divisor} ranks"
            + (" (weights [out/q^2, in/q])" if hidden_divisor > q else ""),
        )
        need("heads", shape.heads, q, f"{name} gives each of {q} hidden blocks whole heads")
        if shape.vocab:
            why = f"{name}'s embedding splits the vocabulary over {hidden_divisor} ranks"
            need("vocab", shape.vocab, hidden_divisor, why)
        if shape.batch % layout.data == 0:
            per_replica = shape.batch // layout.data
            need(
                "batch per replica",
                per_replica,
                layout.row_split,
                f"{name} splits each replica's batch into {layout.row_split} blocks",
            )
    if layout.keep_gathered and not layout.keeps_gathered:
        problems.append(
            f"keep_gathered with {name}: only 3d's Linear3D keeps its gathered operands"
        )
    if layout.zero >= 2 and layout.pipeline > 1:
        problems.append(
            f"zero stage {layout.zero} with pipeline {layout.pipeline}: tessera.engine shards "
            "with FSDP2 only without a pipeline (use zero stage 1)"
        )
    return problems


def _key_value_problems(shape: ModelShape, ranks: int, name: str, *, cube: bool) -> list[str]:
    """Grouped-query attention over ``ranks`` ranks splitting heads, as tessera runs it.

    ``kv_heads`` at least ``ranks`` are split like the query heads; fewer are repeated, one on
    each rank, which needs every rank's query heads to share one key/value head (``kv_heads``
    divides ``ranks``) and, on the ``cube`` (3d), a head's features split over the ``ranks``
    as its rows are.
    """
    kv = shape.key_value_heads
    if kv == shape.heads:  # split with the query heads (their own check)
        return []
    if kv >= ranks:
        if kv % ranks:
            return [
                f"kv_heads {kv} % {ranks} = {kv % ranks}: {name} splits them over {ranks} ranks"
            ]
        return []
    if ranks % kv:
        return [
            f"kv_heads {kv} do not divide {ranks} ({ranks} % {kv} = {ranks % kv}): {name} "
            "repeats fewer key/value heads than ranks, one per rank, for whole groups of heads"
        ]
    d = shape.head_dim
    if cube and d % ranks:
        return [
            f"head_dim {d} % {ranks} = {d % ranks}: {name} repeats kv_heads {kv} < {ranks}, "
            f"each head's features split over {ranks} ranks"
        ]
    return []


def enumerate_layouts(
    shape: ModelShape,
    world: int,
    *,
    mode: str | None = None,
    tensor: int | None = None,
    pipeline: int | None = None,
) -> Iterator[Layout]:
    """Every layout of ``world`` ranks, possible or not (see :func:`layout_problems`).

    Pipelines longer than the model are never listed. ZeRO stages 1-3 are listed only with
    more than one replica: with one they shard nothing and equal stage 0.

    Args:
        shape: The model (only its ``layers`` limit the pipeline here).
        world: Ranks in the job.
        mode: Only this tensor mode.
        tensor: Only this tensor size.
        pipeline: Only this pipeline size.

    Raises:
        ConfigError: the filters leave no data x pipeline x tensor product equal to ``world``,
            or ask for more stages than blocks; the message names the key and shows the
            arithmetic.
    """
    check_world(world, mode=mode, tensor=tensor, pipeline=pipeline)
    if pipeline is not None and pipeline > shape.layers:
        raise ConfigError(
            f"pipeline {pipeline} > layers {shape.layers}: every stage needs at least one block"
        )
    for stages in _divisors(world):
        if stages > shape.layers or pipeline not in (None, stages):
            continue
        for size in _divisors(world // stages):
            if tensor not in (None, size):
                continue
            data = world // (stages * size)
            for kind, depth in tensor_shapes(size, mode):
                for zero in (0, 1, 2, 3) if data > 1 else (0,):
                    for checkpoint in (False, True):
                        kept = (False, True) if _keeps_gathered(kind) else (False,)
                        for keep in kept:
                            yield Layout(data, stages, size, kind, depth, zero, checkpoint, keep)


def check_world(
    world: int, *, mode: str | None = None, tensor: int | None = None, pipeline: int | None = None
) -> None:
    """Check that ``world`` and the filters allow at least one data x pipeline x tensor split.

    Raises:
        ConfigError: the message starts with the offending key and shows the arithmetic, e.g.
            ``"world 12 is not data x pipeline x tensor for any layout with tensor 8 ..."``.
    """
    for key, value in (("world", world), ("tensor", tensor), ("pipeline", pipeline)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise ConfigError(f"{key} must be a positive int, got {value!r}")
        if value is not None and value < 1:
            raise ConfigError(f"{key} must be a positive int, got {value!r}")
    if mode is not None and mode not in MODES:
        raise ConfigError(f"mode {mode!r} is not one of {', '.join(MODES)}")
    model = (tensor or 1) * (pipeline or 1)
    if world % model != 0:
        parts = [f"{k} {v}" for k, v in (("pipeline", pipeline), ("tensor", tensor)) if v]
        raise ConfigError(
            f"world {world} is not data x pipeline x tensor for any layout with "
            f"{' and '.join(parts)}: {world} % {model} = {world % model}"
        )
    if tensor is not None and mode is not None and not tensor_shapes(tensor, mode):
        raise ConfigError(f"tensor {tensor} does not fit mode {mode}: {_mode_sizes(mode)}")
    if mode is not None and tensor is None:
        sizes = [t for t in _divisors(world // (pipeline or 1)) if tensor_shapes(t, mode)]
        if not sizes:
            raise ConfigError(
                f"world {world} has no tensor size for mode {mode}"
                + (f" with pipeline {pipeline}" if pipeline else "")
                + f": {_mode_sizes(mode)}, dividing {world // (pipeline or 1)}"
            )


def _mode_sizes(mode: str) -> str:
    """The tensor sizes a mode accepts, in words."""
    found = find_tensor_mode(mode)
    return "no tensor parallelism needs tensor 1" if found is None else found.sizes_in_words


def _keeps_gathered(mode: str) -> bool:
    found = find_tensor_mode(mode)
    return found is not None and found.keeps_gathered


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
