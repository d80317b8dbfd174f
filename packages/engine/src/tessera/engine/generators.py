"""The generator replicated dropout draws from, made alike on every tensor rank.

Under 1D (Megatron-LM, Shoeybi et al. 2019, section 3) the activations outside the column- and
row-parallel regions are whole on every tensor rank, and a dropout there must draw the same
mask on each: it draws from torch's global generator, which the launcher seeds alike on every
tensor rank (:mod:`tessera.context.seeds`). Random work that a script does on some ranks only
after launching (building a stand-in model on rank 0, sampling a batch on one rank) leaves the
generators apart; the masks then differ, the replicated weights receive different gradients
and drift apart, and the job trains a different model on each tensor rank without an error.
``initialize`` therefore hands the first tensor rank's global generator to the others, once.
"""

from __future__ import annotations

import torch

from tessera.context import ParallelContext, ParallelMode

from .buckets import broadcast_coalesced
from .context_lookup import group_if_parallel

__all__ = ["align_replicated_generator"]


def align_replicated_generator(ctx: ParallelContext) -> None:
    """Give every tensor rank the first tensor rank's global generator state, where needed.

    Needed where the tensor ranks hold the same whole activations between split layers
    (1D's replicated regions), so dropout there draws one mask.

    The CPU generator's, and the CUDA one of the context's device on a GPU job. One broadcast
    over the tensor group; nothing under the other modes, whose dropout draws from the
    per-rank TENSOR stream (their activations are split everywhere).
    """
    mode = ctx.config.mode
    if mode is None or not mode.replicated_activations:
        return
    group = group_if_parallel(ctx, ParallelMode.TENSOR)
    if group is None:
        return
    states = [torch.get_rng_state()]
    if ctx.device.type == "cuda":
        states.append(torch.cuda.get_rng_state(ctx.device))
    moved = [s.to(ctx.device) for s in states]  # NCCL sends device tensors only
    broadcast_coalesced(moved, ctx.get_ranks_in_group(ParallelMode.TENSOR)[0], group)
    torch.set_rng_state(moved[0].cpu())
    if ctx.device.type == "cuda":
        torch.cuda.set_rng_state(moved[1].cpu(), ctx.device)
