"""Turn a checkpoint into the plain ``torch.save`` state dict of the unparallel model.

Any layout's checkpoint assembles into full tensors (DCP reads every chunk into a tensor of
the global shape) in one process, without a process group. The result is what
``model.state_dict()`` of the single-process model returns, so ``load_state_dict`` takes it:
a tensor held in another form than its original module's (``tessera.context.FullForm``: a
transformers ``Conv1D`` transposed, fused q/k/v) is turned back into that module's form, and
a tensor of layers that restate a model (``pipeline_layers``' stages,
``tessera.context.set_original_names``) is named as that model names it.
"""

from __future__ import annotations

import argparse
import os
import sys
import uuid
from collections.abc import Sequence
from pathlib import Path

import torch

from tessera.context import FullForm

from .api import MODEL_PREFIX, STATE_JSON
from .blocks import Block
from .comm import Comm
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
    """
    directory = Path(path).absolute()
    verify_checkpoint(directory, Comm.local())
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
    # tensors of modules converted by parallelize: back to the form the original module held
    saved = read_json(directory / STATE_JSON)
    for name, form in saved.get("stored_forms", {}).items():
        state[name] = FullForm.from_json(form).to_original(state[name])
    # tensors of layers that restate a model (pipeline stages): under the model's names
    originals: dict[str, str] = saved.get("original_names", {})
    state = {originals.get(name, name): tensor for name, tensor in state.items()}
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
