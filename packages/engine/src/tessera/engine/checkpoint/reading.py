"""Reading what a checkpoint holds so that every failure is a CheckpointCorruptError naming a file.

torch reports a file that does not decode in its own terms: ``torch.load(weights_only=True)``
raises ``UnpicklingError`` for a type it refuses, and DCP wraps every rank's read error in its
``CheckpointException``, a ``BaseException`` that ``except Exception`` does not catch. Callers
handle one error, so these helpers translate both, naming the file. Only errors about the data
are translated: a failed collective propagates unchanged, for the context's guard to diagnose.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

from .blocks import Block
from .comm import Comm
from .errors import CheckpointCorruptError, describe
from .planners import BlockLoadPlanner, JsonMetadataReader

__all__ = ["quiet_single_process", "read_blocks", "read_rank_file"]


@contextlib.contextmanager
def quiet_single_process(comm: Comm) -> Iterator[None]:
    """Silence DCP's warning that it runs in one process when that is what we asked for."""
    with warnings.catch_warnings():
        if not comm.distributed:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def read_blocks(directory: Path, blocks: Mapping[str, Block], comm: Comm) -> None:
    """Fill ``blocks`` in place from the checkpoint's tensor data (collective, through DCP).

    Raises:
        CheckpointCorruptError: a data file does not decode on some rank (named; DCP raises
            it on every rank).
    """
    try:
        with torch.no_grad(), quiet_single_process(comm):
            dcp_load(
                {key: b.local for key, b in blocks.items()},
                storage_reader=JsonMetadataReader(directory),
                planner=BlockLoadPlanner(blocks),
                process_group=comm.group,
                no_dist=not comm.distributed,
            )
    except CheckpointException as exc:
        found = []
        for rank, (error, _) in sorted(exc.failures.items()):
            text = str(error) if isinstance(error, CheckpointCorruptError) else describe(error)
            found.append(f"rank {rank}: {text}" if comm.distributed else text)
        unique = list(dict.fromkeys(found))
        raise CheckpointCorruptError(
            f"the tensors of {directory} cannot be read: " + "; ".join(unique)
        ) from exc


def read_rank_file(path: Path) -> dict[str, Any]:
    """A rank's own file, loaded with ``weights_only=True`` (nothing else is unpickled).

    Raises:
        CheckpointCorruptError: missing, unreadable, refused by the weights-only unpickler, or
            not a dict (named).
    """
    try:
        loaded = torch.load(path, weights_only=True, map_location="cpu")
    except Exception as exc:
        raise CheckpointCorruptError(f"{path} cannot be read: {describe(exc)}") from exc
    if not isinstance(loaded, dict):
        raise CheckpointCorruptError(f"{path} holds a {type(loaded).__name__}, not a dict")
    return loaded
