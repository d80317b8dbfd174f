"""Self-attention on a sequence split over the SEQUENCE group: ring or all-to-all.

Each rank holds the sub-sequence ``[b, c, h]`` (``c = s / N``, chunk ``r`` on rank ``r``,
what ``split_activation`` returns under ``tensor=dict(size=N, mode="sequence")``) and all of
the weights. Two ways to attend over the whole sequence:

* ``impl="ring"`` (Li et al. 2021, "Sequence Parallelism: Long Sequence Training from System
  Perspective", ring self-attention): keys and values travel the ring (:func:`ring_qk`,
  :func:`ring_av`); each rank keeps the scores of its own queries, ``[b, heads, c, s]``. Any
  head count; communication ``2 (N - 1)`` chunk transfers forward, twice that backward.
* ``impl="all_to_all"`` (Jacobs et al. 2023, DeepSpeed-Ulysses): one all-to-all turns the
  sequence split of q, k, v into a head split (``[b, heads/N, s, d]``), attention runs
  locally on whole sequences, one all-to-all turns the output back. Needs ``heads % N == 0``;
  communication ``4`` all-to-alls of ``1/N`` of the activation each way, cheaper than the
  ring when there are enough heads.

Causal masking uses global positions: query ``r c + i`` sees keys ``<= r c + i``, across
chunks; the future is ``-inf`` and a padded key the dtype's lowest finite value, so a query
that sees only padding (the first tokens of a left-padded sample) attends to its padding, never
to the future, under both implementations. A padding mask (which keys exist, per sample:
``[b, c]`` on each rank, split with the sequence like the activations) is gathered whole over
the group, ``[b, 1, 1, s]``, a few bytes per token, since every rank's queries look at every
key.

The parameters (``qkv``, ``proj``: ``torch.nn.Linear``, so the full state dict is a
plain attention's) are replicated over SEQUENCE and each rank's gradient is the partial
gradient of its own tokens: their ``ShardInfo`` says so (``partial_grad_modes``), and the
engine's sequence-parallel gradient handler sums them.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tessera.context import ParallelContext, ParallelMode

from ..comm.inflight import tracing
from ..comm.ops import all_to_all
from ..shared.base import ParallelModule
from ..shared.context_access import GroupInfo, group_info
from ..shared.rank_draws import rank_dropout, rank_dropout_attention
from .replicated import mark_sequence_replicated
from .ring_ops import ring_av, ring_of, ring_qk

__all__ = [
    "AttentionImpl",
    "RingSelfAttention",
    "additive_mask",
    "attend_over_sequence",
    "gather_key_mask",
    "sequence_group",
]

AttentionImpl = Literal["ring", "all_to_all"]
_IMPLS: tuple[AttentionImpl, ...] = ("ring", "all_to_all")


def sequence_group(context: ParallelContext, owner: str) -> GroupInfo:
    """The SEQUENCE group of a context with tensor mode ``'sequence'``."""
    if context.config.tensor_mode != "sequence":
        raise ValueError(
            f"{owner} needs a context with tensor mode 'sequence' (tensor=dict(size=N, "
            f"mode='sequence')), but its tensor mode is {context.config.tensor_mode!r}"
        )
    return group_info(context, ParallelMode.SEQUENCE)


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A keep-mask (bool True or integer nonzero: attend) or an additive one, as additive.

    A masked key gets the dtype's lowest finite value rather than ``-inf``, so a row whose keys
    are all masked softmaxes to a uniform row, not to NaN.
    """
    if mask.is_floating_point():
        return mask.to(dtype)
    keep = mask if mask.dtype == torch.bool else mask != 0
    zero = torch.zeros((), dtype=dtype, device=mask.device)
    return torch.where(keep, zero, torch.finfo(dtype).min)


def gather_key_mask(
    mask: torch.Tensor, batch: int, chunk: int, sequence: GroupInfo, dtype: torch.dtype
) -> torch.Tensor:
    """This rank's key padding mask, whole: ``[b, c]`` or ``[b, 1, 1, c]`` -> ``[b, 1, 1, s]``.

    Args:
        mask: Broadcastable to ``[b, 1, 1, c]`` (a ``[b, c]`` mask is read as ``[b, 1, 1, c]``):
            bool (True: attend), integer (nonzero: attend, transformers' padding masks) or
            float (added to the scores).
        batch: ``b``.
        chunk: ``c``, this rank's tokens.
        sequence: The SEQUENCE group (chunk ``r`` on rank ``r``).
        dtype: The scores' dtype.

    Raises:
        ValueError: the mask does not broadcast to ``[b, 1, 1, c]``.
    """
    local = mask[:, None, None, :] if mask.dim() == 2 else mask
    try:
        local = torch.broadcast_to(local, (batch, 1, 1, chunk))
    except RuntimeError:
        raise ValueError(
            f"attention_mask of shape {list(mask.shape)} does not broadcast to this rank's "
            f"[b, 1, 1, c] = [{batch}, 1, 1, {chunk}]: pass the mask of this rank's chunk of "
            "the sequence (split like the activations), one value per key"
        ) from None
    local = additive_mask(local.detach(), dtype).contiguous()
    if sequence.world_size == 1:
        return local
    parts = [torch.empty_like(local) for _ in range(sequence.world_size)]
    dist.all_gather(parts, local, group=sequence.group)
    return torch.cat(parts, dim=-1)  # [b, 1, 1, s], chunk r at r c


def attend_over_sequence(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    impl: AttentionImpl,
    sequence: GroupInfo,
    causal: bool,
    scale: float,
    dropout: float = 0.0,
    context: ParallelContext | None = None,
    key_mask: torch.Tensor | None = None,
    dropout_stream: bool = True,
) -> torch.Tensor:
    """Attention of this rank's queries over the whole sequence split across ``sequence``.

    Args:
        q: ``[b, heads, c, d]`` this rank's chunk of the queries (chunk ``r`` on rank ``r``).
        k: ``[b, heads, c, d]`` this rank's keys.
        v: ``[b, heads, c, d]`` this rank's values.
        impl: ``"ring"`` or ``"all_to_all"`` (see the module docstring).
        sequence: The SEQUENCE group.
        causal: Query ``r c + i`` sees only keys ``<= r c + i`` (global positions).
        scale: Multiplies the scores (``1 / sqrt(d)`` usually).
        dropout: Dropout probability on the attention weights (training only).
        context: Supplies the TENSOR seed for dropout (needed when ``dropout > 0``).
        key_mask: ``[b, 1, 1, s]`` additive mask over the whole sequence's keys
            (:func:`gather_key_mask`), or ``None``.
        dropout_stream: Draw the dropout mask from the context's TENSOR stream (different on
            every rank). ``False``: from torch's generator as it is, for a caller that forked
            it per rank already (``parallelize``), so that checkpointing replays the mask.

    Returns:
        ``[b, heads, c, d]``.
    """
    if impl == "ring":
        ring = ring_of(sequence)
        c = q.shape[-2]
        scores = ring_qk(q * scale, k, ring)  # [b, n, c, s]
        if key_mask is not None:
            scores = scores + key_mask
        if causal:
            start = sequence.rank * c
            rows = torch.arange(start, start + c, device=q.device).unsqueeze(-1)  # [c, 1]
            cols = torch.arange(scores.shape[-1], device=q.device)  # [s]
            scores = scores.masked_fill(cols > rows, float("-inf"))
        probs = scores.softmax(dim=-1)
        if dropout > 0.0 and not dropout_stream:
            probs = F.dropout(probs, dropout, True)
        elif dropout > 0.0 and tracing():  # a generator's state cannot be traced
            assert context is not None, "dropout needs the context's tensor rank"
            probs = rank_dropout(probs, dropout, rank=context.get_local_rank(ParallelMode.TENSOR))
        elif dropout > 0.0:
            assert context is not None, "dropout needs the context's TENSOR seed"
            with context.seed(ParallelMode.TENSOR):
                probs = F.dropout(probs, dropout, True)
        return ring_av(probs, v, ring)  # [b, n, c, d]
    group = sequence.group
    # [b, heads, c, d] -> [b, heads/N, s, d]: scatter heads, gather the sequence
    q, k, v = (all_to_all(t, 1, 2, group) for t in (q, k, v))
    mask = key_mask
    if mask is not None and causal:  # SDPA takes a mask or is_causal, not both
        s = q.shape[-2]
        future = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)  # [s, s]
        # -inf, as the ring's: a padded key holds the lowest finite value, so a query that
        # sees only padding (left padding) must still never see the future.
        mask = mask.masked_fill(future, float("-inf"))  # [b, 1, s, s]
    is_causal = causal and mask is None
    if dropout > 0.0 and dropout_stream and tracing():  # a generator cannot be traced
        assert context is not None, "dropout needs the context's tensor rank"
        out = rank_dropout_attention(
            q, k, v, mask, dropout, is_causal, scale,
            rank=context.get_local_rank(ParallelMode.TENSOR),
        )  # fmt: skip
    elif dropout > 0.0 and dropout_stream:
        assert context is not None, "dropout needs the context's TENSOR seed"
        with context.seed(ParallelMode.TENSOR):
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=is_causal, scale=scale
            )
    else:  # no dropout, or the caller's generator (forked per rank) draws it
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=is_causal, scale=scale
        )
    return all_to_all(out, 2, 1, group)  # [b, heads, c, d]


class RingSelfAttention(ParallelModule):
    """Multi-head self-attention over a sequence split across the SEQUENCE group.

    Input ``[b, s/N, hidden]`` (this rank's chunk) and optionally a padding mask of this
    rank's chunk, ``[b, s/N]`` or ``[b, 1, 1, s/N]`` (bool True / nonzero: attend; float:
    added to the scores), as an encoder's padded batch needs; output ``[b, s/N, hidden]``.
    Parameters, full on every rank, as a plain attention's: ``qkv.weight [3 hidden, hidden]``,
    ``qkv.bias [3 hidden]`` (the output is q, k, v concatenated, each ``[heads, head_dim]``
    with heads contiguous), ``proj.weight [hidden, hidden]``, ``proj.bias [hidden]``.

    Args:
        hidden_size: The model width, divisible by ``num_heads``.
        num_heads: Attention heads (divisible by N for ``impl="all_to_all"``).
        dropout: On the attention probabilities (drawn from the TENSOR stream: every rank
            holds other queries).
        causal: Each token attends only to itself and earlier tokens of the whole sequence.
        impl: ``"ring"`` (Li et al. 2021) or ``"all_to_all"`` (DeepSpeed-Ulysses).
        bias: Learn the biases of ``qkv`` and ``proj``.
        dtype: Parameter dtype.
        device: Parameter device (default the context's).
        context: The ParallelContext, tensor mode ``'sequence'`` (default the current one).
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        dropout: float = 0.0,
        causal: bool = False,
        *,
        impl: AttentionImpl = "ring",
        bias: bool = True,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        context: ParallelContext | None = None,
    ) -> None:
        super().__init__(context, device)
        owner = type(self).__name__
        self.sequence = sequence_group(self.context, owner)
        if impl not in _IMPLS:
            raise ValueError(f"{owner}: impl must be one of {_IMPLS}, got {impl!r}")
        if hidden_size % num_heads != 0:
            raise ValueError(
                f"{owner}: hidden_size {hidden_size} is not divisible by num_heads {num_heads} "
                f"({hidden_size} % {num_heads} = {hidden_size % num_heads})"
            )
        n = self.sequence.world_size
        if impl == "all_to_all" and num_heads % n != 0:
            raise ValueError(
                f"{owner}(impl='all_to_all'): num_heads {num_heads} is not divisible by the "
                f"sequence size {n} ({num_heads} % {n} = {num_heads % n}); use impl='ring'"
            )
        if not 0.0 <= dropout <= 1.0:
            raise ValueError(f"dropout probability has to be between 0 and 1, but got {dropout}")
        self.hidden_size, self.num_heads = hidden_size, num_heads
        self.head_dim = hidden_size // num_heads
        self.dropout, self.causal, self.impl = dropout, causal, impl
        self.qkv = nn.Linear(hidden_size, 3 * hidden_size, bias, device=self.device, dtype=dtype)
        self.proj = nn.Linear(hidden_size, hidden_size, bias, device=self.device, dtype=dtype)
        mark_sequence_replicated(self, self.context)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """See the class docstring for shapes."""
        if x.dim() != 3 or x.shape[-1] != self.hidden_size:
            raise ValueError(
                f"{type(self).__name__}: expected the local chunk [b, s/N, {self.hidden_size}], "
                f"got {list(x.shape)}"
            )
        b, c, _ = x.shape
        qkv = self.qkv(x).view(b, c, 3, self.num_heads, self.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each [b, heads, c, d]
        key_mask = None
        if attention_mask is not None:
            key_mask = gather_key_mask(attention_mask, b, c, self.sequence, q.dtype)
        out = attend_over_sequence(
            q,
            k,
            v,
            impl=self.impl,
            sequence=self.sequence,
            causal=self.causal,
            scale=1.0 / math.sqrt(self.head_dim),
            dropout=self.dropout if self.training else 0.0,
            context=self.context,
            key_mask=key_mask,
        )  # [b, heads, c, d]
        y: torch.Tensor = self.proj(out.transpose(1, 2).reshape(b, c, self.hidden_size))
        return y

    def extra_repr(self) -> str:
        """The summary shown by ``print(module)``."""
        return (
            f"hidden_size={self.hidden_size}, num_heads={self.num_heads}, "
            f"dropout={self.dropout}, causal={self.causal}, impl={self.impl!r}, "
            f"sequence={self.sequence.world_size}"
        )
