"""``TensorMode``: what a name in ``parallel.tensor.mode`` means, as one object.

Every tensor mode, tessera's five and a user's own, is a subclass registered under its name in
``TENSOR_MODE_PLUGINS``. The rest of tessera-context and tessera-engine asks the mode object
what it needs (its keys and their checks, the side of its mesh, its groups, the group its
replicated parameters are averaged over) instead of comparing the mode's name, so a new mode
is a new subclass and nothing else.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

from tessera.registry import ConfigError

if TYPE_CHECKING:
    from ..initializers import ProcessGroupInitializer

__all__ = ["TensorMode", "check_positive"]


def check_positive(key: str, value: object) -> int:
    """``value`` as a positive int, or a ``ConfigError`` naming ``key``."""
    # bool is an int subclass; ``depth=True`` is a typo, not a size.
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{key} must be a positive int, got {value!r} ({type(value).__name__})")
    return value


class TensorMode:
    """A tensor mode: its name, the config keys it reads and checks, its groups.

    Subclass it, set the class attributes and override :meth:`check` where a size does not
    fit (2D's perfect square, say) and :meth:`side` where the mode's mesh is not a line.

    Attributes:
        name: The name the config gives in ``parallel.tensor.mode``.
        arguments: The keys of ``parallel.tensor`` it reads besides ``size`` and ``mode``
            (they reach ``ParallelConfig.tensor_args``).
        open_arguments: Keys no mode declares are kept in ``tensor_args`` too, for the
            implementations others register for the mode (``register_implementation``);
            ``False`` makes any other key an error. A near miss of a declared key, or a key
            another mode reads, is an error either way.
        initializer: Builds its groups (a ``ProcessGroupInitializer`` declaring their names),
            or ``None`` for a mode that uses only the TENSOR group.
        replica_group: The group over which a whole parameter is replicated, where that is
            more than DATA (sequence parallelism: data x sequence ranks), or ``None``. The
            engine syncs and checks replicas over it.
        gradient_handler: The name of the gradient handler (tessera-engine's
            ``GRADIENT_HANDLERS``) that sums gradients over ``replica_group``, or ``None``;
            ``initialize`` builds it as ``Handler(model, optimizer, context,
            broadcast_buffers=...)`` where the config names no handler.
        replicated_activations: The tensor ranks hold the same whole activations between the
            split layers (1D's replicated regions): dropout there must draw the same mask on
            every tensor rank, so ``initialize`` gives them one generator state.
        token_loss_spans_ranks: The mode's token loss already averages over every token of
            its ranks (a sequence split), so the engine's ``per_token_loss`` would count the
            tokens twice and is refused.
        splits_weights: Each rank holds a part of each weight (not sequence parallelism,
            whose weights are whole on every rank).
        splits_sequence: Each rank holds a chunk of every sequence's tokens.
        splits_activations: Between blocks a rank holds a block of every activation, cut over
            all the tensor ranks (the grid modes), rather than the whole of it (its hidden
            vector split, so a token's whole vector is on no single rank).
        keeps_gathered: Its linears can keep the operands their forward gathered for the
            backward (3D's ``keep_gathered_operands``).
        planned: The planner (``tessera.context.planner``) has a cost model for the mode.
        sizes_in_words: The tensor sizes the mode accepts, for messages
            (``"2d needs q*q ranks (4, 9, 16, ...)"``).
        combined_axes: Groups spanning two axes of the mode's mesh (``mesh_axes``), by name:
            the axes they vary, outermost first (3D's ``parallel_3d_input_x_weight``).
    """

    name: ClassVar[str]
    arguments: ClassVar[tuple[str, ...]] = ()
    open_arguments: ClassVar[bool] = False
    initializer: ClassVar[type[ProcessGroupInitializer] | None] = None
    replica_group: ClassVar[str | None] = None
    gradient_handler: ClassVar[str | None] = None
    replicated_activations: ClassVar[bool] = False
    token_loss_spans_ranks: ClassVar[bool] = False
    splits_weights: ClassVar[bool] = False
    splits_sequence: ClassVar[bool] = False
    splits_activations: ClassVar[bool] = False
    keeps_gathered: ClassVar[bool] = False
    planned: ClassVar[bool] = False
    sizes_in_words: ClassVar[str] = "any number of ranks"
    combined_axes: ClassVar[Mapping[str, tuple[str, ...]]] = {}

    def check(self, size: int, args: Mapping[str, Any]) -> None:
        """Raise ``ConfigError`` where ``size`` tensor ranks or ``args`` do not fit the mode.

        Args:
            size: ``parallel.tensor.size``.
            args: The mode's keys of ``parallel.tensor`` (see ``arguments``).
        """

    def side(self, size: int, args: Mapping[str, Any]) -> int:
        """The side ``q`` of the mode's mesh of ``size`` ranks (a line: ``size`` itself)."""
        return size

    def mesh_axes(self, size: int, args: Mapping[str, Any]) -> tuple[tuple[str, int], ...]:
        """The axes of the mode's mesh of one block of tensor ranks, outermost first.

        Each is the group whose ranks vary along it and its size; the tensor rank is the
        mixed-radix number of a rank's coordinates. ``()``: the mode names none (the
        placements of its tensors cannot be told, see ``tessera.context.placements``).
        """
        return ()

    def row_blocks(self, size: int, args: Mapping[str, Any]) -> int:
        """The blocks a replica's batch is cut into (the rows of its activations): 1 here."""
        return 1

    def weight_blocks(self, size: int, args: Mapping[str, Any]) -> int:
        """The ranks one weight matrix is cut over (a line: every rank)."""
        return size

    def hidden_blocks(self, size: int, args: Mapping[str, Any]) -> int:
        """The ranks the hidden dim of a weight or an embedding is cut over."""
        return self.side(size, args)

    def label(self, size: int, args: Mapping[str, Any]) -> str:
        """The short name of the mode on ``size`` ranks: ``1d(4)``, ``2.5d(8,d=2)``."""
        return f"{self.name}({size})"

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"
