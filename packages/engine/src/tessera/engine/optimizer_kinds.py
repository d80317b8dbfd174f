"""Optimizers whose update of a parameter reads more than each element's own history.

Tensor parallelism hands the optimizer this rank's block of a split parameter. An optimizer
whose update is elementwise (SGD, Adam, AdamW, RMSprop, Adagrad, Lion: each element from its
own gradient and state) computes on the block what it computes on the whole tensor. One that
reads a statistic of the whole parameter does not: Adafactor factors a matrix's second moment
into its row and column means and clips the update by its RMS, LAMB and LARS scale it by the
ratio of the weight's and the update's norms, Shampoo and Muon precondition the whole matrix,
L-BFGS reads the whole gradient. On a block each would compute this rank's statistic: the
model would train differently from one process, without an error. So they are refused where
a parameter is split.
"""

from __future__ import annotations

import torch

from tessera.context import get_shard_info

__all__ = ["NOT_ELEMENTWISE", "check_elementwise_optimizer"]

#: Class names of optimizers (torch's, transformers', apex's, torch-optimizer's and others)
#: whose update reads a statistic of the whole parameter, and what it reads.
NOT_ELEMENTWISE = {
    "Adafactor": "the row and column means of a matrix's squared gradient, the update's RMS",
    "LBFGS": "the whole gradient (its history of steps and norms)",
    "Lamb": "the norms of the whole weight and update",
    "LAMB": "the norms of the whole weight and update",
    "FusedLAMB": "the norms of the whole weight and update",
    "LARS": "the norms of the whole weight and gradient",
    "Shampoo": "the whole matrix's preconditioners",
    "DistributedShampoo": "the whole matrix's preconditioners",
    "Muon": "the whole matrix's orthogonalized update",
}


def check_elementwise_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Raise where ``optimizer`` is of :data:`NOT_ELEMENTWISE` and steps a split parameter.

    Raises:
        ValueError: naming the optimizer, what it reads and a split parameter's shapes.
    """
    reads = NOT_ELEMENTWISE.get(type(optimizer).__name__)
    if reads is None:
        return
    for group in optimizer.param_groups:
        for param in group["params"]:
            info = get_shard_info(param)
            if info is not None and info.sharded_modes:
                raise ValueError(
                    f"{type(optimizer).__name__} computes each parameter's update from {reads}, "
                    f"but this rank holds only a {list(info.local_shape)} block of a "
                    f"{list(info.global_shape)} parameter (split over {list(info.sharded_modes)}): "
                    "it would compute this block's statistics and train differently from one "
                    "process. Use an optimizer whose update is elementwise (SGD, Adam, AdamW, "
                    "RMSprop, Adagrad, Lion), or keep such parameters whole"
                )
