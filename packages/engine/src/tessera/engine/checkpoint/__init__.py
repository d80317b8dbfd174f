"""Checkpoints that load under any parallel layout, survive crashes and resume exactly.

``save_checkpoint`` / ``load_checkpoint`` save the model, the optimizer (also ZeRO-split), the
lr scheduler, every RNG stream, the counters and the data position; tensors go through
torch.distributed.checkpoint keyed by the full model's names, placed by ShardInfo offsets.
"""

from .api import (
    CheckpointInfo,
    CheckpointParts,
    load_checkpoint,
    save_checkpoint,
)
from .blocks import Block, block_of
from .discovery import checkpoint_dirs, latest_checkpoint, prune_checkpoints, step_dir
from .errors import CheckpointCorruptError, CheckpointError
from .export import export_pretrained, export_torch_state_dict
from .files import verify_checkpoint
from .storage import prepare_checkpoint_dir, sweep_leftovers

__all__ = [
    "save_checkpoint",
    "load_checkpoint",
    "CheckpointParts",
    "CheckpointInfo",
    "CheckpointError",
    "CheckpointCorruptError",
    "export_torch_state_dict",
    "export_pretrained",
    "verify_checkpoint",
    "latest_checkpoint",
    "checkpoint_dirs",
    "prune_checkpoints",
    "prepare_checkpoint_dir",
    "sweep_leftovers",
    "step_dir",
    "Block",
    "block_of",
]
