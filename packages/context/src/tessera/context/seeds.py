"""Seeding and per-mode RNG streams.

Why streams: dropout on an activation that every tensor rank holds whole (replicated) must
draw the same mask on every tensor rank, while dropout on a sharded activation must draw a
different mask on each shard, or the shards would be correlated (Megatron-LM, Shoeybi et al.
2019, section 3). A stream is a saved state of torch's global generators (the CPU one and the
CUDA one of the context's device); ``RngStreams.use(name)`` swaps it in for the duration of a
``with`` block and saves it back afterwards, so each stream continues where it stopped.
"""

from __future__ import annotations

import hashlib
import importlib
import random
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch

__all__ = [
    "DEFAULT_STREAM",
    "RngStreams",
    "derive_seed",
    "stream_seed",
    "get_host_rng_state",
    "set_host_rng_state",
    "set_seed",
]

#: The name of the stream that is live outside every ``with ctx.seed(...)`` block.
DEFAULT_STREAM = "__default__"

_SEED_MASK = (1 << 63) - 1


def _numpy() -> Any | None:
    try:
        return importlib.import_module("numpy")
    except ImportError:
        return None


def get_host_rng_state() -> dict[str, Any]:
    """Python's ``random`` and numpy's (if installed) global states, as plain data.

    Tensors, ints, floats and strings only, so a checkpoint holding them loads with
    ``weights_only=True``; :func:`set_host_rng_state` restores them.
    """
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {
        "python": {"version": version, "state": list(internal), "gauss": gauss}
    }
    np = _numpy()
    if np is not None:
        kind, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = {
            "kind": str(kind),
            "keys": torch.from_numpy(keys.astype("int64")),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        }
    return state


def set_host_rng_state(state: Mapping[str, Any]) -> None:
    """Restore what :func:`get_host_rng_state` returned (a missing entry is left alone)."""
    py = state.get("python")
    if py is not None:
        random.setstate((py["version"], tuple(py["state"]), py["gauss"]))
    np_state = state.get("numpy")
    np = _numpy()
    if np_state is not None and np is not None:
        np.random.set_state(
            (
                np_state["kind"],
                np_state["keys"].numpy().astype("uint32"),
                np_state["pos"],
                np_state["has_gauss"],
                np_state["cached_gaussian"],
            )
        )


def set_seed(seed: int) -> None:
    """Seed python's ``random``, numpy (if installed) and torch (CPU and every CUDA device)."""
    random.seed(seed)
    np = _numpy()
    if np is not None:
        np.random.seed(seed % 2**32)  # numpy's legacy seeding takes 32 bits
    torch.manual_seed(seed)  # also seeds every CUDA device


def derive_seed(seed: int, *parts: object) -> int:
    """A 63-bit seed determined by ``seed`` and ``parts``, identical in every process.

    Uses a cryptographic hash rather than ``hash()`` (randomized per process) or a sum (where
    ``seed + 1`` for one stream could equal another stream's seed).
    """
    text = repr((seed, *parts)).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") & _SEED_MASK


def stream_seed(
    base_seed: int, pipeline_rank: int, local_rank_of: Callable[[str], int], name: str
) -> int:
    """The initial seed of stream ``name`` on a rank of a context.

    The default stream: ``base_seed + pipeline_rank`` (equal across data and tensor ranks, so
    replicated parameters and activations agree; different per stage, whose layers differ). A
    mode's stream: derived from (base_seed, mode, pipeline_rank, local rank in the mode):
    different across the ranks of one group, equal between ranks with the same local rank on
    the same stage (e.g. the TENSOR stream agrees across data replicas).

    Args:
        base_seed: the context's seed.
        pipeline_rank: this rank's pipeline coordinate.
        local_rank_of: this rank's local rank in a mode's group, by mode name.
        name: ``DEFAULT_STREAM`` or a mode's name.
    """
    if name == DEFAULT_STREAM:
        return base_seed + pipeline_rank
    return derive_seed(base_seed, name, pipeline_rank, local_rank_of(name))


class RngStreams:
    """The named RNG streams of one context.

    Args:
        device: The context's device; for a CUDA device its generator is switched along with
            the CPU one.
        stream_seed: Returns the initial seed of a named stream; called on the stream's first
            use, so unused streams cost nothing.
    """

    def __init__(self, device: torch.device, stream_seed: Callable[[str], int]) -> None:
        self._device = device
        self._stream_seed = stream_seed
        self._saved: dict[str, dict[str, torch.Tensor]] = {}
        self._stack: list[str] = [DEFAULT_STREAM]

    @property
    def active(self) -> str:
        """The name of the live stream."""
        return self._stack[-1]

    def _cuda(self) -> bool:
        return self._device.type == "cuda" and torch.cuda.is_available()

    def _capture(self) -> dict[str, torch.Tensor]:
        state = {"cpu": torch.get_rng_state()}
        if self._cuda():
            state["cuda"] = torch.cuda.get_rng_state(self._device)
        return state

    def _load(self, state: Mapping[str, torch.Tensor]) -> None:
        torch.set_rng_state(state["cpu"])
        if "cuda" in state and self._cuda():
            torch.cuda.set_rng_state(state["cuda"], self._device)

    def _fresh(self, name: str) -> dict[str, torch.Tensor]:
        seed = self._stream_seed(name)
        state = {"cpu": torch.Generator().manual_seed(seed).get_state()}
        if self._cuda():
            previous = torch.cuda.get_rng_state(self._device)
            with torch.cuda.device(self._device):
                torch.cuda.manual_seed(seed)
            state["cuda"] = torch.cuda.get_rng_state(self._device)
            torch.cuda.set_rng_state(previous, self._device)
        return state

    def reset(self) -> None:
        """Forget every saved stream; each restarts from its seed on its next use."""
        if self.active != DEFAULT_STREAM:
            raise RuntimeError(f"cannot reset the RNG streams inside `with seed({self.active!r})`")
        self._saved.clear()

    @contextmanager
    def use(self, name: str) -> Iterator[None]:
        """Make stream ``name`` live inside the block; restore the previous stream after it."""
        previous = self.active
        if name == previous:
            yield
            return
        self._saved[previous] = self._capture()
        saved = self._saved.pop(name, None)
        self._load(saved if saved is not None else self._fresh(name))
        self._stack.append(name)
        try:
            yield
        finally:
            self._stack.pop()
            self._saved[name] = self._capture()
            self._load(self._saved.pop(previous))

    def get_state(self) -> dict[str, Any]:
        """All streams' states, python's and numpy's, as tensors, ints and dicts.

        The result loads with ``torch.load(..., weights_only=True)``. Streams never used are
        absent (they restart from their seed).
        """
        streams = {name: dict(state) for name, state in self._saved.items()}
        streams[self.active] = self._capture()
        return {"streams": streams, **get_host_rng_state()}

    def set_state(self, state: Mapping[str, Any]) -> None:
        """Restore what ``get_state`` returned (streams absent from it restart from their seed)."""
        streams: Mapping[str, Mapping[str, torch.Tensor]] = state["streams"]
        self._saved = {name: dict(s) for name, s in streams.items() if name != self.active}
        self._load(streams[self.active] if self.active in streams else self._fresh(self.active))
        set_host_rng_state(state)
