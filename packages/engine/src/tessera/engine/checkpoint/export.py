"""Turn a checkpoint into the plain ``torch.save`` state dict of the unparallel model.

Any layout's checkpoint assembles into full tensors (DCP reads every chunk into a tensor of
the global shape) in one process, without a process group. The result is what
``model.state_dict()`` of the single-process model returns, so ``load_state_dict`` takes it.
"""

from __future__ import annotations

import argparse
import os
import sys
import uuid
from collections.abc import Sequence
from pathlib import Path

import torch

from .api import MODEL_PREFIX, STATE_JSON
from .blocks import Block
from .comm import Comm
from .errors import CheckpointError
from .files import fsync_dir, read_json, verify_checkpoint
from .planners import METADATA_JSON, metadata_from_json
from .reading import read_blocks

__all__ = ["export_torch_state_dict", "main"]


def export_torch_state_dict(
    path: str | os.PathLike[str], out_file: str | os.PathLike[str] | None = None
) -> dict[str, torch.Tensor]:
    """The full model state dict of a checkpoint (and ``torch.save`` it to ``out_file``).

    Runs in this process alone (no collective), whatever layout saved the checkpoint.

    Args:
        path: A checkpoint directory.
        out_file: Where to write it (atomically: a temporary file renamed), or ``None``.

    Returns:
        ``{name: full tensor}`` in the dtype it was saved in.

    Raises:
        CheckpointCorruptError: a file of the checkpoint is missing, altered or does not
            decode (named).
        CheckpointError: the checkpoint holds tensors in a form of tessera's
            (``tessera.context.set_stored_form``: a model converted by ``parallelize``).
    """
    directory = Path(path).absolute()
    verify_checkpoint(directory, Comm.local())
    forms = read_json(directory / STATE_JSON).get("stored_forms", {})
    if forms:
        names = sorted(forms)
        raise CheckpointError(
            f"{directory}: {len(names)} tensors are held in tessera's form, not their original "
            f"module's ({names[0]}: {forms[names[0]]}; all: {names[:8]}"
            f"{' ...' if len(names) > 8 else ''}), so no plain module would take them as they "
            "are; load the checkpoint into the converted model (load_checkpoint, any layout) "
            "and take the original state dict from tessera.layers.gather_full_state_dict"
        )
    metadata = metadata_from_json(read_json(directory / METADATA_JSON), directory / METADATA_JSON)
    blocks: dict[str, Block] = {}
    for key, md in metadata.state_dict_metadata.items():
        if not key.startswith(MODEL_PREFIX):
            continue
        assert hasattr(md, "properties") and hasattr(md, "size")
        shape = tuple(int(s) for s in md.size)
        blocks[key] = Block(torch.empty(shape, dtype=md.properties.dtype), shape, (0,) * len(shape))
    read_blocks(directory, blocks, Comm.local())
    state = {key[len(MODEL_PREFIX) :]: b.local for key, b in blocks.items()}
    if out_file is not None:
        out = Path(out_file).absolute()
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
        with tmp.open("wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out)
        fsync_dir(out.parent)
    return state


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m tessera.engine.export CHECKPOINT OUT``."""
    parser = argparse.ArgumentParser(
        prog="python -m tessera.engine.export",
        description="Write a tessera checkpoint (any parallel layout) as the plain torch state "
        "dict of the unparallel model (model.load_state_dict(torch.load(OUT))).",
    )
    parser.add_argument("checkpoint", help="checkpoint directory (written by save_checkpoint)")
    parser.add_argument("out", help="output file (torch.save of {name: tensor})")
    args = parser.parse_args(argv)
    state = export_torch_state_dict(args.checkpoint, args.out)
    numel = sum(t.numel() for t in state.values())
    print(f"wrote {len(state)} tensors ({numel} values) to {args.out}", file=sys.stderr)
    return 0
