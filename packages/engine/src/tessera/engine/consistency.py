"""Ranks that must agree, checked: configuration, model metadata, and (debug) values and batches.

A model built differently on one rank, a configuration edited on one node, or a data rank
reading a different batch size does not fail loudly in a data- or tensor-parallel job: a
broadcast or all-reduce of tensors whose sizes differ either hangs, reads past a buffer, or
silently mixes unrelated numbers (gloo receives a short message into a longer buffer without
complaint). These checks compare small fingerprints over the *cpu* groups, where objects are
cheap to gather, and raise the same ``ValueError`` on every rank of the group (every rank sees
the same gathered data), so no rank is left waiting in a collective.

Always on (``initialize``, once): the engine and pipeline keys of the configuration across all
ranks; parameter and buffer names, shapes and dtypes across data replicas (DATA, or
SEQUENCE_DP under sequence parallelism) and names, global shapes (``ShardInfo``) and dtypes
across tensor ranks. One ``all_gather_object`` of a hash per group; the detailed lists are
gathered only when the hashes differ, to say what differs.

Also always, but once: after initialize has synchronized the replicas, checksums of every
parameter across the ranks holding the same values (data replicas, and tensor ranks over which
a parameter is replicated: a tensor rank seeded differently would otherwise train its own
model). On the first step (and every ``check_agreement`` steps): the batch's structure, shapes
and dtypes across all ranks (every data, pipeline and tensor rank reads a batch of the same
shapes). Every ``check_agreement`` steps, after the optimizer: the replicated parameters still
agree (:func:`check_replicas_in_step`, to a relative 1e-5: replicas that drift apart, from a
gradient summed on some ranks only or a parameter updated on one, train different models).
Debug mode (``debug=True`` in the configuration or ``TESSERA_DEBUG=1``) compares the batch on
every step.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import math
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from tessera.context import ModeLike, ParallelContext, ParallelMode, get_shard_info

from .context_lookup import replica_mode

__all__ = [
    "DEBUG_ENV",
    "agree_on_batch",
    "agree_on_call",
    "check_config_agreement",
    "check_replicas_in_step",
    "check_model_agreement",
    "check_parameter_checksums",
    "checks_batch",
    "debug_enabled",
]

#: Environment variable that turns the debug checks on (``1``, ``true``, ``yes``).
DEBUG_ENV = "TESSERA_DEBUG"

#: Most differing entries named in an error.
_MAX_SHOWN = 5


def debug_enabled(config: Mapping[str, Any] | None = None) -> bool:
    """Whether the debug checks run: ``config["debug"]`` if set, else ``$TESSERA_DEBUG``."""
    if config is not None and config.get("debug") is not None:
        return bool(config.get("debug"))
    return os.environ.get(DEBUG_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def _canonical(value: Any) -> Any:
    """A rank-independent, picklable description: plain data kept, objects by type name."""
    if isinstance(value, Mapping):
        return sorted(((str(k), _canonical(v)) for k, v in value.items()), key=lambda kv: kv[0])
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.dtype):
        return str(value)
    return f"<{type(value).__qualname__}>"


def _digest(value: Any) -> str:
    return hashlib.sha256(repr(value).encode()).hexdigest()


def _gather(value: Any, group: dist.ProcessGroup) -> list[Any]:
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, value, group=group)
    return gathered


def _cpu_group(ctx: ParallelContext, mode: ModeLike) -> dist.ProcessGroup | None:
    if not ctx.is_initialized(mode) or ctx.get_world_size(mode) < 2:
        return None
    return ctx.get_cpu_group(mode)


def _agree(
    entries: Sequence[tuple[str, Any]],
    ctx: ParallelContext,
    mode: ModeLike,
    what: str,
    hint: str,
) -> None:
    """Raise the same ValueError on every rank of ``mode``'s group unless all ``entries`` agree.

    ``entries`` is this rank's list of (key, description); only a hash travels unless the
    hashes differ.
    """
    group = _cpu_group(ctx, mode)
    if group is None:
        return
    ranks = ctx.get_ranks_in_group(mode)
    digests = _gather(_digest(entries), group)
    if len(set(digests)) == 1:
        return
    lists = [dict(e) for e in _gather(list(entries), group)]
    reference = lists[0]
    lines: list[str] = []
    for rank, found in zip(ranks[1:], lists[1:], strict=True):
        if found == reference:
            continue
        keys = list(dict.fromkeys([*reference, *found]))
        diffs = [k for k in keys if reference.get(k) != found.get(k)]
        for key in diffs[:_MAX_SHOWN]:
            lines.append(
                f"  {key}: rank {ranks[0]} has {reference.get(key, 'nothing')}, "
                f"rank {rank} has {found.get(key, 'nothing')}"
            )
        if len(diffs) > _MAX_SHOWN:
            lines.append(f"  ... and {len(diffs) - _MAX_SHOWN} more differences on rank {rank}")
    raise ValueError(
        f"the {mode} ranks {ranks} disagree on the {what}; {hint}:\n" + "\n".join(lines)
    )


# -- configuration ---------------------------------------------------------------------------------


def check_config_agreement(
    config: Mapping[str, Any], keys: Sequence[str], ctx: ParallelContext
) -> None:
    """Every rank read the same values for ``keys`` (and ``parallel``) of the configuration.

    A ``TENSOR_SHAPE`` or ``NUM_MICRO_BATCHES`` edited on one node would otherwise make the
    pipeline ranks send and receive messages of different sizes.
    """
    entries = [(key, _canonical(config.get(key))) for key in ("parallel", *keys) if key in config]
    _agree(
        entries,
        ctx,
        ParallelMode.GLOBAL,
        "configuration",
        "every rank must be launched with the same configuration",
    )


# -- model metadata ----------------------------------------------------------------------------


def _named_tensors(modules: Sequence[nn.Module]) -> Iterator[tuple[str, torch.Tensor, bool]]:
    for chunk, module in enumerate(modules):
        prefix = f"chunk{chunk}." if len(modules) > 1 else ""
        for name, param in module.named_parameters():
            yield prefix + name, param, True
        for name, buffer in module.named_buffers():
            yield prefix + name, buffer, False


def check_model_agreement(modules: Sequence[nn.Module], ctx: ParallelContext) -> None:
    """Data replicas hold the same tensors; tensor ranks the same tensors up to sharding.

    Run before the first broadcast of parameters: broadcasting tensors of different sizes
    would hang or mix values.
    """
    local: list[tuple[str, Any]] = []
    full: list[tuple[str, Any]] = []
    for name, tensor, is_param in _named_tensors(modules):
        kind = "parameter" if is_param else "buffer"
        dtype = str(tensor.dtype).replace("torch.", "")
        local.append((name, f"{kind} {list(tensor.shape)} {dtype}"))
        info = get_shard_info(tensor) if is_param else None
        shape = list(info.global_shape) if info is not None else list(tensor.shape)
        full.append((name, f"{kind} of full shape {shape} {dtype}"))
    hint = "build the same model on every rank"
    _agree(local, ctx, replica_mode(ctx), "model", f"{hint} (same layers, sizes and dtypes)")
    _agree(full, ctx, ParallelMode.TENSOR, "model", f"{hint} (same full shapes and dtypes)")


# -- debug: values and batches -------------------------------------------------------------------


def _checksum(tensor: torch.Tensor) -> tuple[float, float]:
    """Two float64 fingerprints: equal tensors give bitwise-equal values on the same device."""
    flat = tensor.detach().flatten().to(torch.float64)
    if flat.numel() == 0:
        return (0.0, 0.0)
    weights = torch.arange(1, flat.numel() + 1, dtype=torch.float64, device=flat.device)
    return (float(flat.sum()), float((flat * weights).sum()))


def _replicated_modes(ctx: ParallelContext, tensor: torch.Tensor) -> list[str]:
    """The modes, besides the data replicas, over which ``tensor`` holds equal values."""
    info = get_shard_info(tensor)
    if info is None:
        return [ParallelMode.TENSOR.value]
    return [m for m in info.replicated_modes if m not in info.partial_grad_modes]


def check_parameter_checksums(modules: Sequence[nn.Module], ctx: ParallelContext) -> None:
    """Parameters and buffers are equal wherever they are replicated (debug mode).

    Over the data replicas every tensor; over the tensor ranks (or a ShardInfo's replicated
    modes) every parameter that is not split there. Catches a replica that was not
    synchronized, or layers that initialize replicated weights from a per-rank RNG stream.
    """
    # meta tensors (ZeRO-3 built on meta, loaded after initialize) hold no values yet
    tensors = [entry for entry in _named_tensors(modules) if not entry[1].is_meta]
    sums = {name: _checksum(t) for name, t, _ in tensors}
    entries = [(name, sums[name]) for name, _, _ in tensors]
    hint = "replicated tensors must be equal (synchronize them, or seed them alike)"
    _agree(entries, ctx, replica_mode(ctx), "parameter values", hint)
    by_mode: dict[str, list[tuple[str, Any]]] = {}
    for name, tensor, is_param in tensors:
        if not is_param:
            continue
        for mode in _replicated_modes(ctx, tensor):
            by_mode.setdefault(mode, []).append((name, sums[name]))
    for mode_name in sorted(by_mode):
        try:
            mode = ParallelMode(mode_name)
        except ValueError:  # a custom mode: its groups are not DATA-like, skip it
            continue
        # Every rank must take part in each gather: the list of modes is the same on every
        # rank of a replica (same model), and a mode with no group here is skipped everywhere.
        _agree(by_mode[mode_name], ctx, mode, "parameter values", hint)


#: How far apart (relative) the checksums of replicas may be after training steps: replicas
#: stay bitwise equal on deterministic kernels, and nondeterministic ones (atomics on GPU)
#: differ by rounding, far below this.
REPLICA_RTOL = 1e-5


def check_replicas_in_step(
    modules: Sequence[nn.Module], ctx: ParallelContext, step: int, rtol: float = REPLICA_RTOL
) -> None:
    """Replicated parameters still hold equal values after optimizer step ``step``.

    The same groups as :func:`check_parameter_checksums` (data replicas; tensor ranks over
    which a parameter is replicated), parameters only (a buffer such as BatchNorm's running
    mean may differ per data replica by design), compared to a relative ``rtol``. Every rank
    of a group gathers every rank's checksums, so all raise the same error.

    Raises:
        ValueError: naming the group, the step and the first parameters that differ.
    """
    tensors = [(name, t) for name, t, is_param in _named_tensors(modules) if is_param]
    sums = {name: _checksum(t) for name, t in tensors}
    groups: dict[str, list[str]] = {replica_mode(ctx): [name for name, _ in tensors]}
    for name, tensor in tensors:
        for mode in _replicated_modes(ctx, tensor):
            groups.setdefault(mode, []).append(name)
    for mode_name in sorted(groups):
        try:
            mode = ParallelMode(mode_name)
        except ValueError:  # a custom mode: its groups are not DATA-like, skip it
            continue
        group = _cpu_group(ctx, mode)
        if group is None:
            continue
        mine = [(name, sums[name]) for name in groups[mode_name]]
        everyone = _gather(mine, group)
        lines = _drifted(everyone, ctx.get_ranks_in_group(mode), rtol)
        if lines:
            raise ValueError(
                f"after optimizer step {step} the {mode.value} ranks "
                f"{ctx.get_ranks_in_group(mode)} hold different values of replicated "
                "parameters (a gradient summed on some ranks only, or a parameter updated on "
                "one: each rank now trains its own model):\n" + "\n".join(lines)
            )


def _drifted(
    everyone: Sequence[Sequence[tuple[str, tuple[float, float]]]], ranks: Sequence[int], rtol: float
) -> list[str]:
    """Lines naming the parameters whose checksums differ from the first rank's."""
    reference = dict(everyone[0])
    lines: list[str] = []
    for rank, found in zip(ranks[1:], everyone[1:], strict=True):
        for name, sums in found:
            want = reference.get(name)
            if want is not None and all(
                math.isclose(a, b, rel_tol=rtol, abs_tol=1e-12)
                for a, b in zip(want, sums, strict=True)
            ):
                continue
            if len(lines) < _MAX_SHOWN:
                lines.append(f"  {name}: rank {ranks[0]} has {want}, rank {rank} has {sums}")
    return lines


def _signature(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return f"tensor {list(value.shape)} {str(value.dtype).replace('torch.', '')}"
    if isinstance(value, Mapping):
        return {str(k): _signature(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_signature(v) for v in value]
    return type(value).__qualname__


def agree_on_batch(data_iter: Iterator[Any], ctx: ParallelContext) -> Iterator[Any]:
    """Peek at the next batch and check its shapes agree on every rank (debug mode).

    Every data, pipeline and tensor rank reads a batch of the same structure and shapes: a
    different batch size on one data rank weights its gradients wrongly, a different one on a
    pipeline rank breaks the microbatch split. Returns an iterator that yields the batch again.
    """
    try:
        first = next(data_iter)
    except StopIteration:
        entries: list[tuple[str, Any]] = [("batch", "no batch (data exhausted)")]
        _agree(entries, ctx, ParallelMode.GLOBAL, "batch", "every rank must read alike")
        return iter(())
    entries = [("batch", repr(_signature(first)))]
    _agree(
        entries,
        ctx,
        ParallelMode.GLOBAL,
        "batch",
        "every rank must read batches of the same shapes (same batch size, sequence length "
        "and dtype; use get_dataloader so data ranks get equal shards)",
    )
    return itertools.chain([first], data_iter)


def agree_on_call(
    args: Sequence[Any], kwargs: Mapping[str, Any], ctx: ParallelContext | None
) -> None:
    """Check that the ranks of one stage call the model with arguments of the same shapes.

    The ``out = engine(x)`` loop's counterpart of ``agree_on_batch``, over the data replicas
    and over the tensor ranks, never across pipeline stages: a hand-written pipeline feeds
    each stage its own shapes, and its stages reach their first forward at different times
    (a later stage first receives), so a collective spanning them would deadlock.
    """
    if ctx is None or ctx.world_size < 2:
        return
    entries = [("arguments", repr(_signature([list(args), dict(kwargs)])))]
    hint = (
        "every rank must feed batches of the same shapes (same batch size, sequence length "
        "and dtype; use get_dataloader so data ranks get equal shards)"
    )
    for mode in (ParallelMode.DATA, ParallelMode.TENSOR):
        _agree(entries, ctx, mode, "model inputs", hint)


class _CheckingEngine(Protocol):
    def _batch_check_due(self) -> bool: ...

    @property
    def context(self) -> ParallelContext | None: ...


F = TypeVar("F", bound=Callable[..., Any])


def checks_batch(method: F) -> F:
    """Decorate ``execute_schedule(data_iter, ...)``: ``agree_on_batch`` first when it is due.

    Due on the first step and every ``check_agreement_every`` steps, and in debug mode always.
    """

    @functools.wraps(method)
    def wrapper(self: _CheckingEngine, data_iter: Iterator[Any], *args: Any, **kwargs: Any) -> Any:
        context = self.context
        if self._batch_check_due() and context is not None and context.world_size > 1:
            data_iter = agree_on_batch(data_iter, context)
        return method(self, data_iter, *args, **kwargs)

    return wrapper  # type: ignore[return-value]
