"""The names of the process groups a ParallelContext can hold."""

from __future__ import annotations

from enum import Enum

__all__ = ["ModeLike", "ParallelMode", "mode_key"]


class ParallelMode(str, Enum):
    """A kind of process group, named once for the whole system.

    Members are strings (``ParallelMode.DATA == "data"``) and hash like their value, so a dict
    keyed by members can be read with the plain string and vice versa. That is what lets a user's
    own mode, which is just a string such as ``"embedding"``, sit in the same tables as the
    built-in ones.

    Global modes (every configuration has them):

    * ``GLOBAL``: all ranks.
    * ``DATA``: ranks that hold the same model shard and see different batches.
    * ``PIPELINE``: the stages of one pipeline.
    * ``TENSOR``: the ranks that split one stage's tensors (any tensor mode, also sequence).
    * ``MODEL``: pipeline x tensor: every rank that holds a piece of one model replica.

    Tensor modes (only the one the configuration chooses), see the package README for the
    coordinates: ``PARALLEL_1D``; ``PARALLEL_2D_ROW/COL``; ``PARALLEL_2P5D_ROW/COL/DEP/XZ``;
    ``PARALLEL_3D_INPUT/WEIGHT/OUTPUT/INPUT_X_WEIGHT/OUTPUT_X_WEIGHT``; ``SEQUENCE`` and
    ``SEQUENCE_DP`` (data x sequence: the ranks over which a sequence-parallel model's
    parameters are replicated).
    """

    GLOBAL = "global"
    DATA = "data"
    PIPELINE = "pipeline"
    TENSOR = "tensor"
    MODEL = "model"
    SEQUENCE = "sequence"
    SEQUENCE_DP = "sequence_dp"
    PARALLEL_1D = "parallel_1d"
    PARALLEL_2D_ROW = "parallel_2d_row"
    PARALLEL_2D_COL = "parallel_2d_col"
    PARALLEL_2P5D_ROW = "parallel_2p5d_row"
    PARALLEL_2P5D_COL = "parallel_2p5d_col"
    PARALLEL_2P5D_DEP = "parallel_2p5d_dep"
    PARALLEL_2P5D_XZ = "parallel_2p5d_xz"
    PARALLEL_3D_INPUT = "parallel_3d_input"
    PARALLEL_3D_WEIGHT = "parallel_3d_weight"
    PARALLEL_3D_OUTPUT = "parallel_3d_output"
    PARALLEL_3D_INPUT_X_WEIGHT = "parallel_3d_input_x_weight"
    PARALLEL_3D_OUTPUT_X_WEIGHT = "parallel_3d_output_x_weight"

    # Hash and print like the plain string, so members and strings are interchangeable keys.
    __hash__ = str.__hash__

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


#: What every API that takes a mode accepts: a member or the name of any mode (also a custom one).
ModeLike = ParallelMode | str


def mode_key(mode: ModeLike) -> str:
    """Return the plain string that names ``mode`` in every table of this package.

    Raises:
        TypeError: ``mode`` is neither a ParallelMode nor a str.
    """
    if isinstance(mode, ParallelMode):
        return mode.value
    if isinstance(mode, str):
        return str(mode)
    raise TypeError(f"a parallel mode must be a ParallelMode or a str, got {mode!r}")
