"""Random draws of one tensor rank's block, traceable: dropout and friends from counter streams.

Eagerly a split region forks torch's generator per tensor rank (``conversion/dropout.py``,
``ParallelContext.seed``). Under ``torch.compile`` that fork would break the graph, so there
the region's draws come from :mod:`counter_random` instead: a key drawn from the global
generator (alike on every rank) and the tensor rank as the stream. :class:`RankDraws` is a
``TorchFunctionMode`` that a split region enters while it is traced; it answers the draws of
the code in the region (the model's own dropout modules, ``F.dropout`` in its attention, the
dropout inside ``F.scaled_dot_product_attention``, ``bernoulli_``, ``rand``) and
refuses by name the random functions it does not reproduce, rather than let every rank draw
the same numbers for its own block.

Masks differ from eager's (another generator), as Inductor's own random numbers do; what
holds in both is the rule: independent across the blocks of a split tensor, alike where the
ranks hold the same tensor.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ..comm.inflight import tracing
from .counter_random import below_one, draw_key, uniform

__all__ = ["RankDraws", "rank_dropout", "rank_dropout_attention", "take_off_stack"]


def _uniform(shape: tuple[int, ...] | torch.Size, rank: int, like: torch.Tensor) -> torch.Tensor:
    """Float32 uniforms of ``shape`` on ``like``'s device: a fresh key, ``rank``'s stream."""
    return uniform(shape, draw_key(like.device), rank, torch.float32, like.device)


def _masked(x: torch.Tensor, keep: torch.Tensor, p: float, inplace: bool) -> torch.Tensor:
    """``x * keep / (1 - p)`` (torch's dropout scaling), in place if asked."""
    scale = keep.to(x.dtype) * (1.0 / (1.0 - p)) if p < 1.0 else keep.to(x.dtype) * 0.0
    return x.mul_(scale) if inplace else x * scale


def _check_probability(p: float) -> None:
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")


def rank_dropout(
    x: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False, *, rank: int
) -> torch.Tensor:
    """``F.dropout`` with the mask from ``rank``'s counter stream (any shape)."""
    _check_probability(p)
    if not training or p == 0.0:
        return x
    return _masked(x, _uniform(x.shape, rank, x) >= p, p, inplace)


def _channel_dropout(batched: int | None) -> Callable[..., torch.Tensor]:
    """``F.dropout1d/2d/3d``: one draw per channel, ``[N, C, 1, ...]`` (else ``[C, 1, ...]``).

    Args:
        batched: The input rank torch reads as ``[N, C, ...]`` (dropout1d's 3, dropout3d's
            5; any other is one sample); ``None`` for dropout2d, which reads every input so.
    """

    def dropout(
        x: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False, *, rank: int
    ) -> torch.Tensor:
        _check_probability(p)
        if not training or p == 0.0:
            return x
        kept = 2 if batched is None or x.dim() == batched else 1
        shape = (*x.shape[:kept], *(1,) * (x.dim() - kept))
        return _masked(x, _uniform(shape, rank, x) >= p, p, inplace)

    return dropout


def rank_dropout_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    rank: int,
) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` whose dropout draws from ``rank``'s counter stream.

    Without dropout it is torch's own call. With it, torch's math: the fused kernels draw
    inside the kernel from the generator, which a counter stream cannot reach.
    Shapes: q ``[..., L, E]``, k ``[..., S, E]``, v ``[..., S, Ev]`` -> ``[..., L, Ev]``.
    """
    if dropout_p == 0.0:
        return F.scaled_dot_product_attention(
            query, key, value, attn_mask, 0.0, is_causal, scale=scale, enable_gqa=enable_gqa
        )
    if attn_mask is not None and is_causal:
        raise RuntimeError("_scaled_dot_product_attention: Explicit attn_mask should not be set "
                           "when is_causal=True")  # fmt: skip
    if enable_gqa:  # [.., Hkv, S, E] -> [.., Hq, S, E]: each key head serves a group of queries
        repeat = query.shape[-3] // key.shape[-3]
        key, value = (t.repeat_interleave(repeat, dim=-3) for t in (key, value))
    factor = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    scores = query @ key.transpose(-2, -1) * factor  # [..., L, S]
    if is_causal:
        future = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(attn_mask.logical_not(), float("-inf"))
        else:
            scores = scores + attn_mask
    probs = torch.ops.aten._safe_softmax(scores, -1)  # a row masked whole: zeros, as torch's
    return rank_dropout(probs, dropout_p, rank=rank) @ value


def _bernoulli(x: torch.Tensor, p: Any = None, *, rank: int) -> torch.Tensor:
    """``torch.bernoulli(x)`` (``x`` the probabilities) or ``torch.bernoulli(x, p)``."""
    chance = x if p is None else p if isinstance(p, torch.Tensor) else torch.full_like(x, p)
    return (_uniform(x.shape, rank, x) < chance).to(x.dtype)


def _bernoulli_(x: torch.Tensor, p: Any = 0.5, *, rank: int) -> torch.Tensor:
    """``x.bernoulli_(p)``."""
    return x.copy_(_bernoulli(x, p, rank=rank))


def _uniform_(
    x: torch.Tensor, low: float = 0.0, high: float = 1.0, *, rank: int, **bounds: float
) -> torch.Tensor:
    """``x.uniform_(low, high)`` (or torch's keywords ``from=``, ``to=``)."""
    low, high = bounds.get("from", low), bounds.get("to", high)
    return x.copy_(_uniform(x.shape, rank, x) * (high - low) + low)


def _normal(shape: tuple[int, ...] | torch.Size, rank: int, like: torch.Tensor) -> torch.Tensor:
    """Standard normal numbers (Box-Muller on two uniform draws), float32."""
    u1, u2 = (_uniform(shape, rank, like) for _ in range(2))
    return torch.sqrt(-2.0 * torch.log1p(-u1)) * torch.cos(2.0 * math.pi * u2)


def _normal_(x: torch.Tensor, mean: float = 0.0, std: float = 1.0, *, rank: int) -> torch.Tensor:
    """``x.normal_(mean, std)``."""
    return x.copy_(_normal(x.shape, rank, x) * std + mean)


def _factory(normal: bool) -> Callable[..., torch.Tensor]:
    """``torch.rand`` / ``torch.randn``: ``*size`` or a size sequence, dtype and device."""

    def make(*size: Any, rank: int, **kwargs: Any) -> torch.Tensor:
        func = torch.randn if normal else torch.rand
        if "size" in kwargs:
            size = (kwargs.pop("size"),)
        if len(size) == 1 and not isinstance(size[0], (int, torch.SymInt)):
            size = tuple(size[0])  # one sequence of sizes
        shape = tuple(int(n) for n in size)
        like = torch.empty((), dtype=kwargs.pop("dtype", None), device=kwargs.pop("device", None))
        grad = bool(kwargs.pop("requires_grad", False))
        kwargs.pop("layout", None), kwargs.pop("pin_memory", None)
        if kwargs or not like.is_floating_point():
            why = f"with {sorted(kwargs)}" if kwargs else f"of dtype {like.dtype}"
            raise _refused(func, why)
        if normal:
            numbers = _normal(shape, rank, like).to(like.dtype)
        else:
            numbers = below_one(_uniform(shape, rank, like), like.dtype)
        return numbers.requires_grad_(grad)

    return make


def _factory_like(normal: bool) -> Callable[..., torch.Tensor]:
    """``torch.rand_like`` / ``torch.randn_like``."""

    def make(x: torch.Tensor, *, rank: int, **kwargs: Any) -> torch.Tensor:
        kwargs.pop("memory_format", None)
        kwargs.setdefault("dtype", x.dtype)
        kwargs["dtype"] = kwargs["dtype"] or x.dtype
        kwargs["device"] = kwargs.get("device") or x.device
        return _factory(normal)(tuple(x.shape), rank=rank, **kwargs)

    return make


#: The functions answered from the rank's counter stream, each as torch spells it.
_ANSWERED: dict[Any, Callable[..., torch.Tensor]] = {
    F.dropout: rank_dropout,
    F.dropout1d: _channel_dropout(batched=3),
    F.dropout2d: _channel_dropout(batched=None),
    F.dropout3d: _channel_dropout(batched=5),
    F.scaled_dot_product_attention: rank_dropout_attention,
    torch.bernoulli: _bernoulli,
    torch.Tensor.bernoulli: _bernoulli,
    torch.Tensor.bernoulli_: _bernoulli_,
    torch.Tensor.uniform_: _uniform_,
    torch.Tensor.normal_: _normal_,
    torch.rand: _factory(normal=False),
    torch.randn: _factory(normal=True),
    torch.rand_like: _factory_like(normal=False),
    torch.randn_like: _factory_like(normal=True),
}

#: Random functions the streams do not reproduce: refused inside a traced split region.
_REFUSED: tuple[Any, ...] = (
    torch.randint,
    torch.randint_like,
    torch.randperm,
    torch.multinomial,
    torch.normal,
    torch.poisson,
    torch.dropout,
    torch.feature_dropout,
    torch.alpha_dropout,
    torch.feature_alpha_dropout,
    F.alpha_dropout,
    F.feature_alpha_dropout,
    F.rrelu,
    torch.native_dropout,
    torch.rrelu,
    torch.rrelu_,
    F.rrelu_,
    torch.binomial,
    torch._standard_gamma,
    torch.Tensor.random_,
    torch.Tensor.exponential_,
    torch.Tensor.geometric_,
    torch.Tensor.cauchy_,
    torch.Tensor.log_normal_,
    torch.Tensor.multinomial,
)


_RRELU = (F.rrelu, F.rrelu_, torch.rrelu, torch.rrelu_)
#: The recurrent layers' functions (``nn.LSTM`` and friends), whose ``dropout`` between
#: layers draws inside the kernel.
_RECURRENT = (torch.lstm, torch.gru, torch.rnn_tanh, torch.rnn_relu)


def _recurrent_dropout(args: tuple[Any, ...]) -> bool:
    """Whether a recurrent function's call drops between layers (``dropout > 0, train``).

    Its one float argument is ``dropout``, followed by ``train``, in either signature (padded
    or packed input).
    """
    for i, arg in enumerate(args[:-1]):
        if isinstance(arg, float):
            return arg > 0.0 and bool(args[i + 1])
    return False


def _refused(func: Any, why: str = "") -> RuntimeError:
    name = f"{getattr(func, '__module__', None) or 'torch'}.{getattr(func, '__name__', func)}"
    return RuntimeError(
        f"torch.compile of a region whose activations are split across the tensor ranks: "
        f"{name}{' ' + why if why else ''} would draw the same numbers on every rank for "
        "each rank's own block, and tessera answers only dropout, rand/randn (and their "
        "_like), bernoulli, uniform_ and normal_ there. Draw with one of those, or from a "
        "generator= of your own (seeded per rank where the blocks must differ), or run the "
        "model uncompiled (eagerly tessera forks torch's generator per rank)."
    )


class RankDraws(TorchFunctionMode):
    """While entered, the random draws above come from ``rank``'s counter stream.

    A draw from the caller's own ``generator=`` is the caller's, as in eager runs; tensors with
    placements (DTensor, in a module a plan leaves out) keep DTensor's own random rules.

    Args:
        rank: The stream, this rank's index in its tensor group.
    """

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank

    def enter_region(self) -> None:
        """Enter (a region's hooks enter and leave: no ``with`` block spans a region)."""
        self.__enter__()  # type: ignore[no-untyped-call]

    def leave_region(self) -> None:
        """Leave what :meth:`enter_region` entered, wherever it is on the stack.

        Eagerly a mode entered after it and not left yet stays; traced, it is on top.
        """
        if tracing():
            self.__exit__(None, None, None)  # type: ignore[no-untyped-call]
        else:
            take_off_stack(self)

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = dict(kwargs or {})
        if kwargs.get("generator") is not None or _has_placements(args, kwargs):
            return func(*args, **kwargs)  # the caller's own generator, or DTensor's rules
        kwargs.pop("generator", None)  # given as None: torch's own
        answer = _ANSWERED.get(func)
        if answer is not None:
            if kwargs.pop("out", None) is not None:
                raise _refused(func, "with out=")
            return answer(*args, rank=self.rank, **kwargs)
        if func in _REFUSED:
            if func in _RRELU and not kwargs.get("training", args[3] if len(args) > 3 else False):
                return func(*args, **kwargs)  # rrelu in eval mode draws nothing
            raise _refused(func)
        if func in _RECURRENT and _recurrent_dropout(args):
            raise _refused(func, "with dropout between its layers")
        return func(*args, **kwargs)


def take_off_stack(mode: TorchFunctionMode) -> None:
    """Pop ``mode`` off torch's function-mode stack, the modes above it put back in order."""
    stack = torch.overrides._get_current_function_mode_stack()  # type: ignore[no-untyped-call]
    if not any(entry is mode for entry in stack):
        return
    above = []
    while (top := torch.overrides._pop_mode()) is not mode:  # type: ignore[no-untyped-call]
        above.append(top)
    for entry in reversed(above):
        torch.overrides._push_mode(entry)  # type: ignore[no-untyped-call]


def _has_placements(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a tensor argument is a DTensor (its own random ops keep its layout rules)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(a, DTensor) for a in (*args, *kwargs.values()))
