"""torch's ``nn.MultiheadAttention`` split by heads, under every tensor mode.

``nn.MultiheadAttention`` keeps q, k and v in one fused ``in_proj_weight [3E, E]`` (and
``in_proj_bias [3E]``) beside an ``out_proj`` linear layer, and computes attention in one
functional call that reads the whole weights (``F.multi_head_attention_forward``); in eval
mode ``nn.TransformerEncoderLayer`` even skips it for one fused kernel
(``torch._transformer_encoder_layer_fwd``) that reads every weight of the block. Neither can
run on a rank's shards. So ``parallelize`` puts a :class:`HeadsAttention` in its place: the
same computation written out (the fused projection, scaled dot-product attention of each head,
the output projection), whose fused projection the converter makes the mode's ``qkv`` column
layer (q, k and v each split by heads, Megatron-LM's split, Shoeybi et al. 2019) and whose
``out_proj`` the mode's ``row`` layer. Its parameters keep ``nn.MultiheadAttention``'s names
(``in_proj_weight``, ``in_proj_bias``, ``out_proj.weight``, ``out_proj.bias``), and the fused
weight's :class:`~tessera.context.FullForm` gives its original form, so full state dicts and
checkpoints are the original model's.

Masks are those of ``nn.MultiheadAttention``: ``attn_mask`` ``[L, S]`` or ``[N * heads, L,
S]`` (bool True or ``-inf``: not attended), ``key_padding_mask`` ``[N, S]`` (True: padding),
``is_causal``. Each rank takes its rows of the batch (the rows attention runs on: under 3D
layout ``"z"``'s) and its heads. ``need_weights=True`` (the default of a direct call) is
refused by name: the weights averaged over heads would need every rank's heads.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tessera.context import ParallelContext, ParallelMode, find_tensor_mode

from ..comm.ops import gather_along_dim
from ..sequence.attention import additive_mask, attend_over_sequence
from ..shared.mode_layers import find_mode_layers
from .token_padding import TOKEN_COUNT_ATTR, strip_tokens

__all__ = ["HeadsAttention", "install_heads_attention", "install_memory_split"]

#: An attribute telling the boundary that a module gathers its own sequence under 1D
#: sequence parallelism (its key and value are not its first argument).
GATHERS_OWN_SEQUENCE = "_tessera_gathers_own_sequence"


def _refusal(name: str, module: nn.MultiheadAttention) -> str:
    """Why ``module`` cannot be split by heads, or empty."""
    if not module._qkv_same_embed_dim:
        return "keys and values of other sizes (kdim / vdim) than the queries"
    if module.bias_k is not None or module.bias_v is not None:
        return "add_bias_kv=True"
    if module.add_zero_attn:
        return "add_zero_attn=True"
    return ""


class HeadsAttention(nn.Module):
    """``nn.MultiheadAttention``'s forward on this rank's heads, under its parameter names.

    Built from the module whole (:func:`install_heads_attention`); the converter then makes its
    projections the mode's layers (:meth:`split`). Under tensor mode ``'sequence'`` the
    weights stay whole and the attention goes over every rank's tokens (:meth:`take_sequence`).

    Args:
        module: The ``nn.MultiheadAttention`` it replaces (its parameters are taken over).
    """

    def __init__(self, module: nn.MultiheadAttention) -> None:
        super().__init__()
        self.embed_dim, self.num_heads = module.embed_dim, module.num_heads
        self.head_dim = module.head_dim
        self.dropout = module.dropout
        self.batch_first = module.batch_first
        # torch's fast paths (TransformerEncoderLayer's fused kernel, the encoder's nested
        # tensors) read whole weights from ``self_attn``: this flag turns them off.
        self._qkv_same_embed_dim = False
        self.in_proj_weight = module.in_proj_weight
        self.in_proj_bias = module.in_proj_bias
        self.out_proj: nn.Module = module.out_proj
        setattr(self, GATHERS_OWN_SEQUENCE, True)
        self._in_proj: list[nn.Module] = []  # the mode's fused column layer (not a child)
        self._context: ParallelContext | None = None
        self._mode = ""
        self._sequence_parallel = False
        self._heads = (0, 1)  # this rank's block of the heads: (index, count of blocks)
        self._sequence: Any = None  # the SequenceAttention under tensor mode 'sequence'
        # 1D keeps torch's generator alike on every rank outside column-to-row regions: the
        # attention dropout of this rank's heads draws from a fork of its own (dropout.py)
        self._fork: list[Any] = []
        self.train(module.training)

    def split(
        self,
        in_proj: nn.Module,
        out_proj: nn.Module,
        context: ParallelContext,
        mode: str,
        sequence_parallel: bool,
        head_block: int,
        share: int,
    ) -> None:
        """Compute with the mode's fused column layer ``in_proj`` and row layer ``out_proj``.

        ``head_block`` of ``share``: this rank's block of the heads.
        """
        self._in_proj = [in_proj]
        self.in_proj_weight = in_proj.get_parameter("weight")
        self.in_proj_bias = in_proj.get_parameter("bias") if self.in_proj_bias is not None else None
        self.out_proj = out_proj
        self._context, self._mode = context, mode
        self._sequence_parallel = sequence_parallel
        self._heads = (head_block, share)
        kind = context.config.mode
        if kind is not None and kind.replicated_activations and not sequence_parallel:
            # its probabilities are split by heads: each rank draws its own heads' masks
            from .dropout import RankFork

            self._fork = [RankFork(context)]

    def take_sequence(self, spec: Any) -> None:
        """Tensor mode ``'sequence'``: attend over every rank's tokens.

        ``spec``: its ``SequenceAttention``; the SDPA call is not taken over.
        """
        self._sequence = spec
        self._mode = str(spec.context.config.tensor_mode)

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``[b, s, h']`` -> this rank's q, k and v ``[b, s, E']`` each."""
        bias = self.get_parameter("in_proj_bias") if self.in_proj_bias is not None else None
        if self._in_proj:  # the adapter's current parameters (FSDP2 swaps them here)
            params: dict[str, torch.Tensor] = {"weight": self.get_parameter("in_proj_weight")}
            if bias is not None:
                params["bias"] = bias
            fused: torch.Tensor = torch.func.functional_call(self._in_proj[0], params, (x,))
        else:
            fused = F.linear(x, self.get_parameter("in_proj_weight"), bias)
        q, k, v = fused.chunk(3, -1)
        return q, k, v

    def _rows(self, mask: torch.Tensor, batch: int, what: str) -> torch.Tensor:
        """This rank's rows of a mask over the whole batch (``[N, ...]``), where attention runs.

        A mask of ``batch`` rows is this rank's already (the boundary split it, or the mode
        keeps the batch whole); a model of one's own holds it in its hidden states' rows, which
        the mode moves to attention's (mask_rows.py).
        """
        if mask.shape[0] == batch:
            to_attention = getattr(self, "_tessera_rows_to_attention", None)
            return mask if to_attention is None else to_attention(mask)
        ctx = self._context
        layers = None if ctx is None else find_mode_layers(ctx.config.tensor_mode)
        mine = mask
        if ctx is not None and layers is not None and layers.attention_rows is not None:
            mine = layers.attention_rows(mask, ctx)
        if mine.shape[0] != batch:
            raise ValueError(
                f"nn.MultiheadAttention (parallelized, tensor mode {self._mode!r}): {what} of "
                f"shape {list(mask.shape)} holds neither the whole batch nor this rank's "
                f"{batch} rows"
            )
        return mine

    def _mask(
        self,
        attn_mask: torch.Tensor | None,
        key_padding_mask: torch.Tensor | None,
        batch: int,
        dtype: torch.dtype,
    ) -> torch.Tensor | None:
        """One additive mask ``[b or 1, heads' or 1, L, S]`` of this rank's rows and heads."""
        mask: torch.Tensor | None = None
        if attn_mask is not None:
            m = _additive(attn_mask, dtype)
            if m.dim() == 3:  # [N * heads, L, S]: this rank's rows, then its heads
                m = m.view(-1, self.num_heads, *m.shape[1:])
                m = self._rows(m, batch, "attn_mask")
                block, share = self._heads
                m = m.chunk(share, 1)[block]
            mask = m
        if key_padding_mask is not None:
            kpm = self._rows(key_padding_mask, batch, "key_padding_mask")
            kpm = _additive(kpm, dtype)[:, None, None, :]  # [b, 1, 1, S]
            mask = kpm if mask is None else mask + kpm
        return mask

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = True,
        attn_mask: torch.Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[torch.Tensor, None]:
        """``nn.MultiheadAttention.forward``, without the attention weights.

        Raises:
            ValueError: ``need_weights=True``, an unbatched input, or a mask that is not
                the whole batch's or this rank's.
        """
        if need_weights:
            raise ValueError(
                "nn.MultiheadAttention parallelized by tessera splits its heads over the "
                "tensor ranks, so it cannot return the attention weights averaged over all "
                "heads: call it with need_weights=False (nn.TransformerEncoderLayer and "
                "DecoderLayer do)"
            )
        if query.dim() != 3:
            raise ValueError(
                "nn.MultiheadAttention parallelized by tessera takes batched inputs "
                f"[b, s, h] (or [s, b, h]), got {list(query.shape)}"
            )
        self_attention, shared_kv = key is query and value is query, value is key
        if self._sequence_parallel:  # the span split dim 1: attention needs it whole
            group = self._group()
            query = gather_along_dim(query, 1, group)
            count = getattr(self, TOKEN_COUNT_ATTR, None)  # the span's padding (token_padding)
            if count is not None:
                query = strip_tokens(query, count)
            if self_attention:  # cross-attention's keys (an encoder's output) come whole
                key = value = query
        if not self.batch_first:  # [s, b, h] -> [b, s, h]
            query, key, value = (t.transpose(0, 1) for t in (query, key, value))
        if self_attention:
            q, k, v = self._project(query)
        else:
            q = self._project(query)[0]
            if shared_kv:
                _, k, v = self._project(key)
            else:
                k, v = self._project(key)[1], self._project(value)[2]
        batch, length = q.shape[0], q.shape[1]
        heads = q.shape[-1] // self.head_dim  # this rank's
        q, k, v = (
            t.reshape(t.shape[0], t.shape[1], heads, self.head_dim).transpose(1, 2)
            for t in (q, k, v)
        )
        dropout = self.dropout if self.training else 0.0
        if self._sequence is not None:
            out = self._over_sequence(q, k, v, attn_mask, key_padding_mask, is_causal, dropout)
        else:
            # as torch: the hint alone without padding, else the mask (built if not given)
            causal = is_causal and key_padding_mask is None
            if causal:
                attn_mask = None
            elif is_causal and attn_mask is None:
                attn_mask = _causal(length, k.shape[2], q.dtype, q.device)
            mask = self._mask(attn_mask, key_padding_mask, batch, q.dtype)
            fork = self._fork[0] if self._fork and dropout > 0 else None
            if fork is not None:
                fork.enter()
            try:
                out = F.scaled_dot_product_attention(
                    q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=causal
                )  # [b, heads', L, d]
            finally:
                if fork is not None:
                    fork.leave()
        out = out.transpose(1, 2).reshape(batch, length, heads * self.head_dim)
        if not self.batch_first:
            out = out.transpose(0, 1)  # the layout it came in: the row layer splits dim 1 back
        result: torch.Tensor = self.out_proj(out)
        return result, None

    def _group(self) -> Any:
        assert self._context is not None
        return self._context.get_group(ParallelMode.PARALLEL_1D)

    def _over_sequence(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attn_mask: torch.Tensor | None,
        key_padding_mask: torch.Tensor | None,
        is_causal: bool,
        dropout: float,
    ) -> torch.Tensor:
        """Tensor mode ``'sequence'``: this rank's queries over every rank's keys.

        Raises:
            ValueError: an ``attn_mask`` other than the causal mask of the whole sequence
                (each rank holds a chunk of the queries; only causality is computed from
                global positions), or a ``key_padding_mask`` of another length.
        """
        spec = self._sequence
        batch, chunk = q.shape[0], q.shape[2]
        length = chunk * spec.sequence.world_size
        causal = is_causal
        if attn_mask is not None and not is_causal:
            if not _is_causal(attn_mask, length):
                raise ValueError(
                    "nn.MultiheadAttention under tensor mode 'sequence' got an attn_mask of "
                    f"shape {list(attn_mask.shape)} that is not the causal mask of the whole "
                    f"sequence of {length}: each rank holds a chunk of the queries, and only "
                    "causality (is_causal, or that mask) and key_padding_mask are computed over "
                    "every rank's keys; use tensor mode '1d', '2d', '2.5d' or '3d'"
                )
            causal = True
        key_mask = spec.padding.whole(batch, chunk, q.dtype)  # a tokens plan's attention_mask
        if key_padding_mask is not None:
            if tuple(key_padding_mask.shape) != (batch, length):
                raise ValueError(
                    "nn.MultiheadAttention under tensor mode 'sequence' takes the whole "
                    f"sequence's key_padding_mask [b, s] = [{batch}, {length}], got "
                    f"{list(key_padding_mask.shape)}"
                )
            own = _additive(key_padding_mask, q.dtype)[:, None, None, :]
            key_mask = own if key_mask is None else key_mask + own
        return attend_over_sequence(
            q,
            k,
            v,
            impl=spec.impl,
            sequence=spec.sequence,
            causal=causal,
            scale=self.head_dim**-0.5,
            dropout=dropout,
            context=spec.context,
            key_mask=key_mask,
            dropout_stream=False,  # parallelize forked the generator per rank (dropout.py)
        )


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``nn.MultiheadAttention``'s mask (bool True: not attended; or additive) as additive."""
    if mask.dtype == torch.bool:
        return additive_mask(~mask, dtype)
    return mask.to(dtype)


def _is_causal(mask: torch.Tensor, length: int) -> bool:
    """Whether ``mask`` is the causal mask of ``length`` tokens (bool, or additive ``-inf``)."""
    if tuple(mask.shape) != (length, length):
        return False
    above = torch.ones(length, length, dtype=torch.bool, device=mask.device).triu(1)
    if mask.dtype == torch.bool:
        return bool((mask == above).all())
    return bool((mask == _causal(length, length, mask.dtype, mask.device)).all())


def _causal(rows: int, cols: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``[rows, cols]`` additive causal mask (``-inf`` above the diagonal), as torch builds it."""
    return torch.triu(torch.full((rows, cols), float("-inf"), dtype=dtype, device=device), 1)


def install_heads_attention(model: nn.Module, names: list[str], mode: str) -> list[str]:
    """Put a :class:`HeadsAttention` in place of each ``nn.MultiheadAttention`` in ``names``.

    Encoders holding one stop making nested tensors from padded batches in eval mode (torch's
    fast path, which reads whole weights).

    Returns:
        The names replaced.

    Raises:
        ValueError: a module computes what ``HeadsAttention`` does not (keys of another size,
            ``add_bias_kv``, ``add_zero_attn``), or takes ``[s, b, h]`` (``batch_first=False``)
            under a mode that splits dim 0 of activations or their sequence.
    """
    replaced: list[str] = []
    kind = find_tensor_mode(mode)
    if kind is None:
        raise ValueError(f"parallelize: tensor mode {mode!r} is not registered")
    for name in names:
        module = model.get_submodule(name)
        if not isinstance(module, nn.MultiheadAttention):
            continue
        why = _refusal(name, module)
        if why:
            raise ValueError(
                f"parallelize: {name!r} (nn.MultiheadAttention) has {why}, which tessera does "
                "not split by heads; leave it out of the plan (tensor mode '1d' keeps it whole)"
            )
        if not module.batch_first and (kind.splits_activations or kind.splits_sequence):
            raise ValueError(
                f"parallelize under tensor mode {mode!r}: {name!r} (nn.MultiheadAttention) "
                "takes [s, b, h] (batch_first=False), but the mode splits dim 0 of every "
                "activation as the batch ('sequence': dim 1 as the sequence); build the model "
                "with batch_first=True, or use tensor mode '1d'"
            )
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        cross = isinstance(parent, nn.TransformerDecoderLayer) and child == "multihead_attn"
        if kind.splits_sequence and cross:
            raise ValueError(
                f"parallelize under tensor mode 'sequence': {name!r} is the "
                "cross-attention of an nn.TransformerDecoderLayer, which reads every token "
                "of the memory (a sequence of its own length) that the ring and all-to-all "
                "attention do not split; use tensor mode '1d' (with sequence_parallel for "
                "long sequences), '2d', '2.5d' or '3d'"
            )
        setattr(parent, child, HeadsAttention(module))
        replaced.append(name)
    if replaced:
        for module in model.modules():
            if isinstance(module, nn.TransformerEncoder):
                module.use_nested_tensor = False
    return replaced


def install_memory_split(model: nn.Module, context: ParallelContext, mode: str) -> None:
    """A bare ``nn.TransformerDecoder`` (or ``DecoderLayer``) takes its memory in the mode's layout.

    ``nn.Transformer`` takes ``tgt`` (its second argument) in it; its decoder reads the
    encoder's output as the memory, in the mode's layout already. Under 1D sequence
    parallelism that output is split along the sequence, which cross-attention cannot read:
    refused.

    Its features plan's boundary splits the first argument (``tgt``); the memory, the second
    (``[b, S, h]``, another length), is what cross-attention's keys and values are projected
    from, by the mode's column layer: under 2D, 2.5D and 3D it is split likewise here. 1D keeps
    it whole (also under sequence parallelism: cross-attention reads every memory token).
    """
    from ..shared.context_access import sequence_parallel_default

    whole = isinstance(model, nn.Transformer)
    kind = context.config.mode
    if whole and sequence_parallel_default(context):
        raise ValueError(
            "parallelize under tensor mode '1d' with sequence_parallel: nn.Transformer's "
            "decoder reads its encoder's output (split along the sequence there) as the keys "
            "of cross-attention, which needs them whole; use sequence_parallel=False, or "
            "tensor mode '2d', '2.5d' or '3d'"
        )
    if kind is None or not kind.splits_activations:
        return
    if not isinstance(model, nn.TransformerDecoder | nn.TransformerDecoderLayer | nn.Transformer):
        return
    from ..dispatch.activations import split_activation

    if isinstance(model, nn.Transformer):  # its forward checks the features against d_model
        share = context.config.tensor_dim  # the hidden blocks of an activation: the mesh's q
        model.d_model = int(model.d_model) // share  # this rank's share of the features

        def split_tgt(
            module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
        ) -> tuple[tuple[Any, ...], dict[str, Any]]:
            if len(args) > 1 and isinstance(args[1], torch.Tensor):
                args = (args[0], split_activation(args[1], context), *args[2:])
            elif isinstance(kwargs.get("tgt"), torch.Tensor):
                kwargs = {**kwargs, "tgt": split_activation(kwargs["tgt"], context)}
            return args, kwargs

        model.register_forward_pre_hook(split_tgt, with_kwargs=True)
        return

    def split_memory(
        module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if len(args) > 1 and isinstance(args[1], torch.Tensor):
            args = (args[0], split_activation(args[1], context), *args[2:])
        elif isinstance(kwargs.get("memory"), torch.Tensor):
            kwargs = {**kwargs, "memory": split_activation(kwargs["memory"], context)}
        return args, kwargs

    model.register_forward_pre_hook(split_memory, with_kwargs=True)
