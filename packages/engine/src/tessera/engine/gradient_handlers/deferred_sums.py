"""Sums of gradients that tensor-parallel layers left to the training loop, once per step.

A layer whose weight is replicated over ranks that each compute part of its gradient (2.5D's
depth layers, Wang et al. 2021) sums the parts inside autograd: one all-reduce per layer and
per backward. Under the engine, which knows when the optimizer steps, that sum can wait for the
step: one bucketed all-reduce per group for every layer together, and with gradient
accumulation or pipeline microbatches once per step instead of once per backward. Sums are
linear, so the result is the same (tessera.context.gradient_sums).

In the last backward before a step the buckets need not wait for the step either: as PyTorch
DDP does for data parallelism (Li et al. 2020, "PyTorch Distributed", section 3.2.3), a bucket
is sent (asynchronously) as soon as every gradient in it is final, while autograd goes on with
the layers below, and the step only waits for it. Buckets are sent in one fixed order on every
rank, whatever order their gradients arrive in, and whatever a rank sent early, every rank
sends all the others before it waits for any (:meth:`DeferredSumGradientHandler.after_backward`):
the collectives of a group always match, also where a parameter has a gradient on one rank only.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from tessera.context import ParallelContext, defer_gradient_sums

from ..buckets import DEFAULT_BUCKET_BYTES
from ..context_lookup import group_if_parallel
from .base import BaseGradientHandler, ModelLike

__all__ = ["DeferredSumGradientHandler"]

#: The attribute under which a parameter keeps its gradient hook: a later handler of the same
#: model (a second ``initialize``) removes the earlier one's.
_HOOK_ATTR = "_tessera_deferred_sum_hook"


def _is_dtensor(param: nn.Parameter) -> bool:
    """Whether FSDP2 sharded ``param`` (a DTensor carries its device mesh)."""
    return hasattr(param, "device_mesh")


@dataclass(eq=False)
class _Bucket:
    """Gradients of one mode, dtype and device, summed by one all-reduce.

    ``flat`` is ``[the gradients' numel..., one usage flag per parameter]``: a flag is 1 where
    this rank had the gradient, so after the sum a parameter no rank used gets ``None`` back
    (as DDP leaves it, so the optimizer skips it), at no extra collective.
    """

    params: list[nn.Parameter]
    group: dist.ProcessGroup | None
    hooked: int = 0  # how many of ``params`` announce their gradient (trainable when built)
    unhooked: list[nn.Parameter] = field(default_factory=list)  # frozen when built
    arrived: set[int] = field(default_factory=set)  # ids of params whose gradient is final
    flat: torch.Tensor | None = None  # sent, not yet written back
    work: dist.Work | None = None
    sent_grads: list[tuple[int, int] | None] = field(default_factory=list)  # (id, _version)

    @property
    def sent(self) -> bool:
        return self.flat is not None

    @property
    def ready(self) -> bool:
        """Every parameter that announces its gradient has, and none unfrozen since is left.

        A parameter frozen when the hooks were made never announces one: once unfrozen, its
        bucket waits for the step.
        """
        if self.hooked == 0 or len(self.arrived) < self.hooked:
            return False
        return not any(p.requires_grad for p in self.unhooked)

    def send(self) -> None:
        """Pack this rank's gradients (zeros where it has none) and start their sum."""
        parts: list[torch.Tensor] = []
        used: list[float] = []
        for p in self.params:
            parts.append((p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1))
            used.append(0.0 if p.grad is None else 1.0)
        self.sent_grads = [None if p.grad is None else _identity(p.grad) for p in self.params]
        flags = torch.tensor(used, dtype=parts[0].dtype, device=parts[0].device)  # [n params]
        self.flat = torch.cat([*parts, flags]).detach()  # [sum of numel + n params]
        if self.group is not None:
            self.work = dist.all_reduce(self.flat, group=self.group, async_op=True)

    def changed_since_sent(self) -> nn.Parameter | None:
        """A parameter whose ``.grad`` was replaced or modified after it was sent, if any."""
        for p, sent in zip(self.params, self.sent_grads, strict=True):
            if sent != (None if p.grad is None else _identity(p.grad)):
                return p
        return None

    def write_back(self) -> None:
        """Wait for the sum; put it into ``.grad`` (``None`` where no rank had a gradient)."""
        assert self.flat is not None
        if self.work is not None:
            self.work.wait()
        flat, offset = self.flat, 0
        usage = flat[-len(self.params) :].tolist()
        with torch.no_grad():
            for p, count in zip(self.params, usage, strict=True):
                summed = flat[offset : offset + p.numel()].view_as(p)
                offset += p.numel()
                if count == 0:
                    p.grad = None
                elif p.grad is None:
                    p.grad = summed.clone()
                else:
                    p.grad.copy_(summed)
        self.reset()

    def reset(self) -> None:
        if self.work is not None:
            self.work.wait()  # a sum in flight still holds its buffer
        self.flat, self.work, self.sent_grads = None, None, []
        self.arrived.clear()


def _identity(grad: torch.Tensor) -> tuple[int, int]:
    """Which tensor ``grad`` is, and how often it was modified in place."""
    return id(grad), grad._version


def _buckets(
    sums: dict[str, list[nn.Parameter]],
    groups: dict[str, dist.ProcessGroup | None],
    registered: Sequence[nn.Parameter],
    bucket_bytes: int,
) -> list[_Bucket]:
    """Every deferred parameter in buckets, in the order they are sent.

    Parameters are taken last registered first (autograd finishes the last layers' gradients
    first), each into the open bucket of its mode, dtype and device, which closes at
    ``bucket_bytes``; the order depends only on the model, so it is the same on every rank.
    """
    mode_of = {id(p): mode for mode, params in sums.items() for p in params}
    ordered = [p for p in reversed(registered) if id(p) in mode_of]
    open_buckets: dict[tuple[str, torch.dtype, torch.device], tuple[list[nn.Parameter], int]] = {}
    done: list[_Bucket] = []
    for p in ordered:
        key = (mode_of[id(p)], p.dtype, p.device)
        params, size = open_buckets.get(key, ([], 0))
        params.append(p)
        size += p.numel() * p.element_size()
        if size >= bucket_bytes:
            done.append(_Bucket(params, groups[key[0]]))
            params, size = [], 0
        open_buckets[key] = (params, size)
    done.extend(
        _Bucket(params, groups[key[0]]) for key, (params, _) in open_buckets.items() if params
    )
    return done


class DeferredSumGradientHandler(BaseGradientHandler):
    """Take over the gradient sums of the model's deferring layers; sum them at each step.

    Building the handler switches every layer of ``model`` that implements
    :class:`tessera.context.DefersGradientSum` to leave its sums out of autograd, so from then
    on the model's gradients are complete only after :meth:`after_backward` or
    :meth:`handle_gradient` (the engine calls both before clipping and the optimizer step). A
    loop that reads ``.grad`` between backward and step sees each rank's part.

    With ``overlap`` the sums of the last backward before a step start during that backward,
    bucket by bucket, when the engine says which backward that is (:meth:`before_backward`:
    one backward per micro-step, no DDP or FSDP wrapper); otherwise, and for anything not
    sent by then, they run in :meth:`after_backward`. The result is the same either way.

    Args:
        model: The module or chunks.
        optimizer: Unused.
        context: The ParallelContext (default: the current one).
        bucket_size_mb: Size of one coalesced all-reduce.
        overlap: Start each bucket's sum as soon as its gradients are final.

    Raises:
        ValueError: the layers leave sums over a mode the context does not hold.
    """

    def __init__(
        self,
        model: ModelLike,
        optimizer: torch.optim.Optimizer | None = None,
        context: ParallelContext | None = None,
        bucket_size_mb: float = DEFAULT_BUCKET_BYTES / 2**20,
        overlap: bool = True,
    ) -> None:
        super().__init__(model, optimizer, context)
        modules = [model] if isinstance(model, nn.Module) else list(model)
        sharded = [n for m in modules for n, p in m.named_parameters() if _is_dtensor(p)]
        if sharded:  # checked before any layer is switched
            raise ValueError(
                f"DeferredSumGradientHandler: the model's parameters ({sharded[0]}, ...) are "
                "sharded by FSDP2 (zero.stage 2 or 3), which sums gradients over DATA only; the "
                "layers' own sums (over TENSOR, DEP, ...) must then stay in autograd, as the "
                "engine keeps them by default: leave DeferredSumGradientHandler out of "
                "gradient_handlers"
            )
        #: ``{mode: parameters}`` whose gradients this handler sums over the mode's group.
        self.sums = defer_gradient_sums(modules)
        ctx = self._context
        missing = [m for m in self.sums if ctx is None or not ctx.is_initialized(m)]
        if missing:
            # the layers were built in another context: nothing here could sum them
            raise ValueError(
                f"DeferredSumGradientHandler: the model's layers leave gradient sums over "
                f"{missing} to the handler, but its context holds no such group "
                f"({'no context' if ctx is None else f'modes {ctx.modes}'}); pass the "
                "context the layers were built in"
            )
        groups = {mode: group_if_parallel(ctx, mode) for mode in self.sums}
        # a frozen parameter stays in its bucket (it may be unfrozen later), sent with its
        # bucket but never awaited by a hook
        registered = list(dict.fromkeys(self.parameters()))  # a tied weight once
        self._buckets = _buckets(self.sums, groups, registered, int(bucket_size_mb * 2**20))
        self._bucket_of = {id(p): b for b in self._buckets for p in b.params}
        self._next = 0  # the first bucket not sent yet
        self._armed = False  # the coming backward is the last before a step: send early
        self._summed = False  # after_backward summed this step's gradients already
        #: Buckets whose sum started inside a backward (not at the step), since construction.
        self.sent_during_backward = 0
        self.overlap = overlap
        if overlap:
            self._hook_parameters()

    def _hook_parameters(self) -> None:
        """Announce each trainable parameter's final gradient; replace an earlier handler's."""
        announce = weakref.WeakMethod(self._on_gradient)

        def hook(param: torch.Tensor) -> None:
            method = announce()
            if method is not None:
                method(param)

        for bucket in self._buckets:
            for p in bucket.params:
                if not p.requires_grad:  # torch refuses a hook on it
                    bucket.unhooked.append(p)
                    continue
                earlier = getattr(p, _HOOK_ATTR, None)
                if earlier is not None:
                    earlier.remove()
                handle = p.register_post_accumulate_grad_hook(hook)  # type: ignore[no-untyped-call]  # torch leaves it untyped
                setattr(p, _HOOK_ATTR, handle)
                bucket.hooked += 1

    def before_backward(self, final: bool) -> None:
        """The engine's next backward is the last before a step (``final``) or not.

        A forward without gradients (evaluation) changes nothing. A forward while armed (a
        second forward before the step: several backwards will follow, or one the step does
        not wait for) disarms until the step, after every rank sends what it has not sent
        yet and drops the sums (``.grad`` still holds this rank's part; the step sends it
        again). The armed state follows the engine's calls, the same on every rank, so every
        rank takes the same branch, whichever gradients it had.
        """
        if not torch.is_grad_enabled():
            return
        if self._armed:
            self._send_rest()
            for bucket in self._buckets:
                bucket.reset()
            self._next, self._armed = 0, False
            return
        self._armed = final and self.overlap
        self._summed = False

    def after_backward(self) -> None:
        """Finish every sum: send what the backward did not, wait, write into ``.grad``.

        Every rank sends every bucket not yet sent, in the fixed order, before it waits for
        any: what one rank sent early another sends now, so the sums match up whichever
        gradients each rank had.

        Raises:
            RuntimeError: a gradient sent early was modified or replaced before the step.
        """
        if self._summed:
            return
        self._armed = False
        self._send_rest()
        for bucket in self._buckets:
            if bucket.sent:
                changed = bucket.changed_since_sent()
                if changed is not None:
                    bucket.reset()
                    raise RuntimeError(
                        f"DeferredSumGradientHandler: the gradient of {self._name_of(changed)} "
                        "changed between the backward, which had started its sum, and the "
                        "step; change gradients after the engine's step begins (a handler), "
                        "or configure the handler with overlap=False"
                    )
                bucket.write_back()
        self._next = 0
        self._summed = True

    def handle_gradient(self) -> None:
        """Sum every deferred gradient over its group, in buckets (no division)."""
        self.after_backward()
        self._summed = False  # the next step sums again

    def _send_rest(self) -> None:
        for bucket in self._buckets[self._next :]:
            bucket.send()
        self._next = len(self._buckets)

    def _on_gradient(self, param: torch.Tensor) -> None:
        """Autograd hook: ``param.grad`` is final for this backward; send what is ready."""
        if not self._armed:
            return
        bucket = self._bucket_of[id(param)]
        if bucket.sent:
            raise RuntimeError(
                f"DeferredSumGradientHandler: {self._name_of(param)} got a second gradient "
                "after its sum had started in this backward (two backwards of one forward, "
                "or a weight used by two reentrant checkpointed regions); run one backward "
                "per engine(...) call, or configure the handler with overlap=False: "
                "gradient_handlers=[dict(type='DeferredSumGradientHandler', overlap=False), ...]"
            )
        bucket.arrived.add(id(param))
        while self._next < len(self._buckets) and self._buckets[self._next].ready:
            self._buckets[self._next].send()
            self.sent_during_backward += 1
            self._next += 1

    def _name_of(self, param: torch.Tensor) -> str:
        for name, p in self._named_parameters():
            if p is param:
                return f"parameter {name!r}"
        return f"a parameter {list(param.shape)}"

    def _named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        modules: Sequence[nn.Module] = (
            [self._model] if isinstance(self._model, nn.Module) else list(self._model)
        )
        for m in modules:
            yield from m.named_parameters()
