"""Measuring instruments shared by the memory / communication benchmarks (not a benchmark itself).

* :class:`TrafficCounter` wraps ``torch.distributed``'s collective and point-to-point functions
  with a counting shim, in the process that installs it only (a benchmark worker). It counts
  the bytes *this rank contributes* to each call, i.e. the bytes of its own data that enter the
  call:

  - ``all_reduce``, ``reduce``: the whole buffer (every rank's buffer is summed);
  - ``all_gather``, ``all_gather_into_tensor`` / ``all_gather_single``: the input chunk;
  - ``reduce_scatter``, ``reduce_scatter_tensor`` / ``reduce_scatter_single``: the whole input;
  - ``broadcast``, ``scatter``: the buffer on the source rank, nothing elsewhere;
  - ``all_to_all``, ``all_to_all_single``: the chunks addressed to other ranks (the own
    chunk never leaves the rank);
  - ``send``, ``isend``, ``gather``: the tensor; ``batch_isend_irecv``: the tensors of its
    ``isend`` operations; receives count nothing;
  - ``exchange``: one block exchange of tessera's layers on gloo, posted on a process group
    itself (``tessera.layers.comm.inflight``'s ``post_exchange``, sends and receives posted
    together, ``post_all_to_all`` and ``post_peer_exchange``): the tensors it sends to other
  ranks.

  This is the algorithmic volume, independent of how gloo implements a collective (a ring
  all-reduce moves about ``2 (P - 1) / P`` times its buffer over the wire).
  A call made from inside another counted call (torch's old collective names forward to the
  new ones, ``batch_isend_irecv`` calls ``isend``) is counted once, by the outermost call.

* :class:`SavedTensorMeter` records the tensors autograd saves for backward through
  ``torch.autograd.graph.saved_tensors_hooks``. Views share their base's storage, so it sums
  ``untyped_storage().nbytes()`` once per distinct storage (keyed by the storage's data
  pointer, which cannot be reused while the graph holds the storage); storages of parameters
  (a weight, its transpose, its ``view_as`` through a comm op) are not activations and are left
  out. A small view of a large storage counts the whole storage: that is what stays allocated.
"""

from __future__ import annotations

import functools
import inspect
import socket
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from queue import Empty
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
import torch.multiprocessing as mp

__all__ = ["SavedTensorMeter", "TrafficCounter", "free_port", "run_ranks"]

Fn = Callable[..., Any]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _sum(tensors: Iterable[torch.Tensor] | None) -> int:
    return sum(_nbytes(t) for t in tensors or ())


def _is_source(args: dict[str, Any], global_key: str, group_key: str) -> bool:
    """Whether this rank is the ``src`` of a broadcast / scatter (global or group-local)."""
    if args.get(group_key) is not None:
        return bool(dist.get_rank(args.get("group")) == args[group_key])
    return bool(dist.get_rank() == args.get(global_key))


def _to_others(args: dict[str, Any]) -> int:
    """``all_to_all_single``'s input less the chunk this rank addresses to itself."""
    x: torch.Tensor = args["input"]
    group = args.get("group")
    me, world = dist.get_rank(group), dist.get_world_size(group)
    splits = args.get("input_split_sizes")
    rows = x.shape[0] // world if not splits else splits[me]
    return _nbytes(x) - rows * (_nbytes(x) // max(x.shape[0], 1))


def _sends(ops: Iterable[dist.P2POp]) -> int:
    return sum(_nbytes(op.tensor) for op in ops if getattr(op.op, "__name__", "") == "isend")


#: name -> bytes this rank contributes, from the call's bound arguments.
_CONTRIBUTED: dict[str, Callable[[dict[str, Any]], int]] = {
    "all_reduce": lambda a: _nbytes(a["tensor"]),
    "reduce": lambda a: _nbytes(a["tensor"]),
    "all_gather": lambda a: _nbytes(a["tensor"]),
    "all_gather_into_tensor": lambda a: _nbytes(a["input_tensor"]),
    "all_gather_single": lambda a: _nbytes(a["input_tensor"]),
    "reduce_scatter": lambda a: _sum(a["input_list"]),
    "reduce_scatter_tensor": lambda a: _nbytes(a["input"]),
    "reduce_scatter_single": lambda a: _nbytes(a["input"]),
    "broadcast": lambda a: _nbytes(a["tensor"]) if _is_source(a, "src", "group_src") else 0,
    "scatter": lambda a: _sum(a.get("scatter_list")) if _is_source(a, "src", "group_src") else 0,
    "gather": lambda a: _nbytes(a["tensor"]),
    "all_to_all": lambda a: _sum(
        t for i, t in enumerate(a["input_tensor_list"]) if i != dist.get_rank(a.get("group"))
    ),
    "all_to_all_single": _to_others,
    "send": lambda a: _nbytes(a["tensor"]),
    "isend": lambda a: _nbytes(a["tensor"]),
    "batch_isend_irecv": lambda a: _sends(a["p2p_op_list"]),
}


@dataclass
class TrafficCounter:
    """Bytes this rank contributes to collectives while :attr:`enabled`, per function name."""

    enabled: bool = False
    calls: dict[str, int] = field(default_factory=dict)
    bytes: dict[str, int] = field(default_factory=dict)
    _depth: threading.local = field(default_factory=threading.local)

    @property
    def total(self) -> int:
        """Bytes over every function since the last :meth:`reset`."""
        return sum(self.bytes.values())

    def reset(self) -> None:
        """Forget everything counted so far."""
        self.calls.clear()
        self.bytes.clear()

    def install(self) -> None:
        """Wrap torch.distributed's functions (in this process); call before importing tessera.

        Raises:
            RuntimeError: tessera.layers is already imported (it binds some collectives at
                import time, which would then bypass the shim).
        """
        if "tessera.layers" in sys.modules:
            raise RuntimeError("install the traffic counter before importing tessera.layers")
        for name, contributed in _CONTRIBUTED.items():
            original = getattr(c10d, name, None)
            if original is None or getattr(original, "_counted", False):
                continue
            wrapper = self._wrap(name, original, contributed)
            # Both namespaces: P2POp checks ``op is c10d.isend`` against what the caller passes.
            setattr(c10d, name, wrapper)
            if getattr(dist, name, None) is original:
                setattr(dist, name, wrapper)
        # tessera's layers post their gloo block exchanges on the process group itself
        from tessera.layers.comm import inflight  # after the patches above: it binds some

        if not getattr(inflight.post_exchange, "_counted", False):
            sent = lambda a: _sum(t for _, t in a["sends"])  # noqa: E731
            inflight.post_exchange = self._wrap("exchange", inflight.post_exchange, sent)
        if not getattr(inflight.post_all_to_all, "_counted", False):
            to_others = lambda a: _nbytes(a["blocks"]) - _nbytes(a["blocks"][a["group"].rank()])  # noqa: E731
            inflight.post_all_to_all = self._wrap("exchange", inflight.post_all_to_all, to_others)
        if not getattr(inflight.post_peer_exchange, "_counted", False):
            to_peer = lambda a: _nbytes(a["block"])  # noqa: E731
            wrapped = self._wrap("exchange", inflight.post_peer_exchange, to_peer)
            inflight.post_peer_exchange = wrapped

    def _wrap(self, name: str, original: Fn, contributed: Callable[[dict[str, Any]], int]) -> Fn:
        signature = inspect.signature(original)

        @functools.wraps(original)
        def counted(*args: Any, **kwargs: Any) -> Any:
            depth = getattr(self._depth, "value", 0)
            if self.enabled and depth == 0:
                bound = signature.bind(*args, **kwargs)
                bound.apply_defaults()
                self.calls[name] = self.calls.get(name, 0) + 1
                self.bytes[name] = self.bytes.get(name, 0) + contributed(dict(bound.arguments))
            self._depth.value = depth + 1
            try:
                return original(*args, **kwargs)
            finally:
                self._depth.value = depth

        counted._counted = True  # type: ignore[attr-defined]
        return counted


class SavedTensorMeter:
    """Bytes of distinct non-parameter storages autograd saves inside :meth:`record`.

    Args:
        exclude: Tensors whose storages are not counted (the model's parameters).
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self._excluded = {t.untyped_storage().data_ptr() for t in exclude}
        self._storages: dict[int, int] = {}

    @property
    def total(self) -> int:
        """Bytes recorded so far."""
        return sum(self._storages.values())

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in self._excluded and ptr not in self._storages:
            self._storages[ptr] = storage.nbytes()
        return tensor  # autograd keeps it exactly as without the hook

    @contextmanager
    def record(self) -> Iterator[SavedTensorMeter]:
        """Count what the forward run inside this block saves for backward."""
        with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
            yield self


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (for MASTER_PORT)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(rank: int, fn: Fn, world: int, port: int, queue: Any, args: tuple[Any, ...]) -> None:
    queue.put((rank, fn(rank, world, port, *args)))


def run_ranks(fn: Fn, world: int, *args: Any) -> list[Any]:
    """Run ``fn(rank, world, port, *args)`` in ``world`` spawned processes; results by rank.

    ``fn`` is a module-level function; ``port`` is a free MASTER_PORT for its process group.
    If a rank fails, torch terminates the others and raises its traceback here. The results
    are read while the ranks run: a process that has put a large result in the queue does not
    exit until it is read, so joining first would wait forever.
    """
    queue = mp.get_context("spawn").Queue()
    ranks = mp.start_processes(  # type: ignore[attr-defined,no-untyped-call]
        _entry,
        args=(fn, world, free_port(), queue, args),
        nprocs=world,
        join=False,
        start_method="spawn",
    )
    results: dict[int, Any] = {}
    while len(results) < world:
        try:
            rank, value = queue.get(timeout=1.0)
            results[rank] = value
        except Empty:
            # raises the traceback of a rank that failed; all done with results missing:
            # a rank returned nothing the queue could carry
            if ranks.join(timeout=0) and queue.empty():
                missing = sorted(set(range(world)) - set(results))
                raise RuntimeError(f"run_ranks: ranks {missing} exited without a result") from None
    while not ranks.join():
        pass
    return [results[rank] for rank in range(world)]
