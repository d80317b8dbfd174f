"""The padding mask of each batch in flight, for attention over a split sequence and its replay.

Under tensor mode ``'sequence'`` the boundary takes a batch's padding mask out of the model's
call (transformers would build it from the local chunk) and leaves it here; every attention
layer reads it, gathered whole once per batch (conversion/sequence.py).

The mask is state beside the activations, not one of them, so activation checkpointing does not
carry it: attention recomputed during a backward would read whatever batch ran last. Mostly that
is the batch being backpropagated, but not after an evaluation between the forward and the
backward (``torch.no_grad()``, another padding), nor when two forwards build graphs that one
backward runs (their losses summed). So :class:`KeyPadding` keeps every batch whose graph still
awaits its backward:

- a batch whose output needs a gradient is *pending* from its forward until the end of the
  first backward through that output (a hook on the output queues the end, which the autograd engine
  runs once the whole backward is done, after every recompute it triggered), or until its graph
  is freed unused (the hook holding it goes with the graph);
- attention recomputed during a backward masks the pending batches' mask; when they do not
  share one, it cannot tell which batch it replays and raises (a wrong gradient is worse);
- attention outside a backward masks the latest batch's, as before.

Batches whose output needs no gradient (evaluation) stop pending at their forward's end, so
they change nothing.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import Any

import torch

from ..sequence.attention import gather_key_mask
from ..shared.context_access import GroupInfo

__all__ = ["KeyPadding"]

#: Batches kept pending at most: a loop of forwards with gradients and no backward (inference
#: without ``torch.no_grad()``) would otherwise keep every mask alive.
MAX_PENDING = 64


class _Batch:
    """One forward's key padding: this rank's chunk, and the whole mask once gathered."""

    def __init__(self, local: torch.Tensor | None) -> None:
        self.local = local  # [b, c], nonzero / True: a real token; None: no padding
        self._whole: torch.Tensor | None = None

    def whole(
        self, batch: int, chunk: int, dtype: torch.dtype, sequence: GroupInfo
    ) -> torch.Tensor | None:
        """``[b, 1, 1, s]`` additive mask over every key (a collective on first use)."""
        if self.local is None:
            return None
        if self._whole is None or self._whole.dtype != dtype:
            self._whole = gather_key_mask(self.local, batch, chunk, sequence, dtype)
        return self._whole


class _Alive:
    """Held only by the hook on a batch's output: dies with the graph that output ends."""


class KeyPadding:
    """The padding masks of the batches a model is running, for its attention layers.

    The boundary calls :meth:`set` on every forward (``None`` without padding); the model's
    forward hook :meth:`watch_output` ties a batch run with gradients to its graph.
    """

    def __init__(self, sequence: GroupInfo) -> None:
        self._sequence = sequence
        self._current = _Batch(None)
        # batches awaiting their backward, oldest first, each alive while its graph is
        self._pending: list[tuple[_Batch, weakref.ref[_Alive] | None]] = []
        self._last_replayed: _Batch | None = None

    def set(self, local: torch.Tensor | None) -> None:
        """This rank's chunk of the mask, ``[b, c]`` (nonzero / True: a real token).

        A recompute during a backward replays a forward whose batch is kept already: its call
        changes nothing.
        """
        if _in_backward():
            return
        if torch.compiler.is_compiling():  # a traced graph's backward replays no Python
            self._current = _Batch(local)
            return
        # a batch still unwatched never finished its forward (it raised): no graph awaits it
        self._pending = [(b, r) for b, r in self._pending if r is not None]
        self._current = _Batch(local)
        self._pending.append((self._current, None))
        del self._pending[:-MAX_PENDING]

    def watch_output(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        """Forward hook: tie the latest batch to the graph of the first output needing a grad.

        Its backward ends the batch's wait (at the end of that backward, after every
        recompute); a graph freed unused ends it too. A batch whose output needs no gradient
        (an evaluation under ``torch.no_grad()``) has no graph to backpropagate and stops
        waiting at once. Decided here, at the model's end, and not by the grad mode at
        :meth:`set`: reentrant checkpointing runs its blocks' forward without gradients.
        """
        if torch.compiler.is_compiling():
            return
        batch = self._current
        index = next((i for i, (b, _) in enumerate(self._pending) if b is batch), None)
        if index is None:
            return
        anchor = next((t for t in _tensors(output) if t.requires_grad), None)
        if anchor is None:
            del self._pending[index]
            return
        alive = _Alive()
        self._pending[index] = (batch, weakref.ref(alive))

        def backward_reached(grad: torch.Tensor, alive: _Alive = alive) -> None:
            engine = torch.autograd.Variable._execution_engine
            engine.queue_callback(lambda: self._done(alive))

        anchor.register_hook(backward_reached)  # type: ignore[no-untyped-call]

    def _done(self, alive: _Alive) -> None:
        for i, (batch, ref) in enumerate(self._pending):
            if ref is not None and ref() is alive:
                self._last_replayed = batch
                del self._pending[i]
                return

    def _waiting(self) -> list[_Batch]:
        self._pending = [(b, r) for b, r in self._pending if r is None or r() is not None]
        return [b for b, _ in self._pending]

    def whole(self, batch: int, chunk: int, dtype: torch.dtype) -> torch.Tensor | None:
        """``[b, 1, 1, s]`` additive mask over every key of the batch attention runs.

        Raises:
            ValueError: attention replayed in a backward (activation checkpointing) while
                batches of different padding await their backward.
        """
        if not _in_backward():
            return self._current.whole(batch, chunk, dtype, self._sequence)
        waiting = self._waiting() or [self._last_replayed or self._current]
        shapes = {None if b.local is None else tuple(b.local.shape) for b in waiting}
        masks = (
            []
            if len(shapes) > 1
            else [b.whole(batch, chunk, dtype, self._sequence) for b in waiting]
        )
        if not masks or any(not _same(masks[0], m) for m in masks[1:]):
            raise ValueError(
                f"tensor mode 'sequence': attention recomputed by activation checkpointing "
                f"cannot tell which of the {len(waiting)} batches awaiting their backward it "
                "replays, and their padding masks differ (each masks its own padding as keys; "
                "the mask is not one of the saved activations). Call backward after each "
                "forward, run forwards whose graph is dropped under torch.no_grad(), or give "
                "the batches the same padding"
            )
        first = masks[0]
        return first


def _in_backward() -> bool:
    """Whether autograd is running a backward here (activation checkpointing's recompute)."""
    if torch.compiler.is_compiling():
        return False
    return bool(torch._C._current_graph_task_id() != -1)


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is b
    return a.shape == b.shape and bool(torch.equal(a, b))


def _tensors(output: Any) -> Iterator[torch.Tensor]:
    """The tensors of a model's output: itself, a tuple's or a dict's (a ModelOutput) values."""
    if isinstance(output, torch.Tensor):
        yield output
    elif isinstance(output, (tuple, list)):
        for item in output:
            yield from _tensors(item)
    elif isinstance(output, dict):
        for item in output.values():
            yield from _tensors(item)
