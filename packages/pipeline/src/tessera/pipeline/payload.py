"""Payloads: what flows between stages, and how a batch becomes microbatches.

A stage's input or output may be a tensor, or a tuple, list or dict of them (nested freely).
Point-to-point communication moves flat lists of tensors, so a payload is flattened into its
tensors plus a :data:`Spec` (its structure), sent, and rebuilt on the other side from the same
spec. The spec is plain data (nested tuples of strings and keys), small enough to travel in
the metadata message that precedes the first transfer (:mod:`tessera.pipeline.p2p`).

Batches from the data iterator are split along dim 0 into microbatches by
:func:`split_microbatches`; non-tensor leaves (``None``, ints, strings) are handed unchanged to
every microbatch. :func:`concat_microbatches` is the inverse for the outputs the last stage
returns.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypeAlias

import torch

__all__ = [
    "Spec",
    "flatten_payload",
    "unflatten_payload",
    "batch_size_of",
    "split_microbatches",
    "concat_microbatches",
    "payload_signature",
]

#: The structure of a payload: ``("tensor",)``, ``("tuple", (spec, ...))``,
#: ``("list", (spec, ...))`` or ``("dict", ((key, spec), ...))``.
Spec: TypeAlias = tuple[Any, ...]

_TENSOR: Spec = ("tensor",)


def flatten_payload(payload: Any, *, where: str = "payload") -> tuple[list[torch.Tensor], Spec]:
    """The tensors of ``payload`` in a fixed order, and its structure.

    Dicts are walked in insertion order (both ends build the dict from the same spec, so the
    order is the same on both sides).

    Raises:
        TypeError: a leaf is not a tensor (naming its path, e.g. ``payload['mask'][1]``).
    """
    tensors: list[torch.Tensor] = []
    spec = _flatten(payload, tensors, where)
    return tensors, spec


def _flatten(obj: Any, out: list[torch.Tensor], path: str) -> Spec:
    if isinstance(obj, torch.Tensor):
        out.append(obj)
        return _TENSOR
    if isinstance(obj, tuple | list):
        kind = "tuple" if isinstance(obj, tuple) else "list"
        return (kind, tuple(_flatten(item, out, f"{path}[{i}]") for i, item in enumerate(obj)))
    if isinstance(obj, Mapping):
        return ("dict", tuple((key, _flatten(obj[key], out, f"{path}[{key!r}]")) for key in obj))
    raise TypeError(
        f"{path} is a {type(obj).__name__}; what passes between pipeline stages must be a "
        "tensor or a tuple, list or dict of tensors"
    )


def unflatten_payload(tensors: Sequence[torch.Tensor], spec: Spec) -> Any:
    """Rebuild a payload from its tensors and the spec :func:`flatten_payload` gave.

    Raises:
        ValueError: the number of tensors does not match the spec.
    """
    position = [0]
    payload = _unflatten(tensors, spec, position)
    if position[0] != len(tensors):
        raise ValueError(f"spec holds {position[0]} tensors, got {len(tensors)}")
    return payload


def _unflatten(tensors: Sequence[torch.Tensor], spec: Spec, position: list[int]) -> Any:
    kind = spec[0]
    if kind == "tensor":
        if position[0] >= len(tensors):
            raise ValueError(f"spec needs more than the {len(tensors)} tensors given")
        tensor = tensors[position[0]]
        position[0] += 1
        return tensor
    if kind == "tuple":
        return tuple(_unflatten(tensors, item, position) for item in spec[1])
    if kind == "list":
        return [_unflatten(tensors, item, position) for item in spec[1]]
    if kind == "dict":
        return {key: _unflatten(tensors, item, position) for key, item in spec[1]}
    raise ValueError(f"unknown payload spec kind {kind!r}")


def _tensor_leaves(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, tuple | list):
        return [t for item in obj for t in _tensor_leaves(item)]
    if isinstance(obj, Mapping):
        return [t for key in obj for t in _tensor_leaves(obj[key])]
    return []


def batch_size_of(batch: Any, *, what: str = "inputs") -> int | None:
    """The common size of dim 0 of the tensors in ``batch``; None when it holds no tensor.

    Raises:
        ValueError: a tensor is 0-dimensional or the tensors disagree on dim 0.
    """
    sizes = set()
    for tensor in _tensor_leaves(batch):
        if tensor.dim() == 0:
            raise ValueError(
                f"{what} holds a 0-dimensional tensor; every tensor of a batch needs a batch "
                "dimension (dim 0) to be split into microbatches"
            )
        sizes.add(int(tensor.shape[0]))
    if len(sizes) > 1:
        raise ValueError(
            f"the tensors of {what} disagree on the batch size (dim 0): {sorted(sizes)}"
        )
    return sizes.pop() if sizes else None


def split_microbatches(batch: Any, num_microbatches: int, *, what: str = "inputs") -> list[Any]:
    """Split every tensor of ``batch`` into ``num_microbatches`` equal parts along dim 0.

    Args:
        batch: a tensor, or a tuple, list or dict of tensors (non-tensor leaves are copied to
            every microbatch).
        num_microbatches: how many parts.
        what: how errors name the batch.

    Returns:
        ``num_microbatches`` payloads of the same structure; the tensors are views of
        ``batch``'s.

    Raises:
        ValueError: the batch size is not a multiple of ``num_microbatches`` (naming both).
    """
    size = batch_size_of(batch, what=what)
    if size is not None and size % num_microbatches:
        raise ValueError(
            f"the batch size of {what} ({size}) is not divisible by num_microbatches "
            f"({num_microbatches}): {size} % {num_microbatches} = {size % num_microbatches}"
        )
    micro = 0 if size is None else size // num_microbatches
    return [_slice(batch, i * micro, (i + 1) * micro) for i in range(num_microbatches)]


def _slice(obj: Any, start: int, stop: int) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj[start:stop]
    if isinstance(obj, tuple | list):
        items = [_slice(item, start, stop) for item in obj]
        return tuple(items) if isinstance(obj, tuple) else items
    if isinstance(obj, Mapping):
        return {key: _slice(obj[key], start, stop) for key in obj}
    return obj


def concat_microbatches(parts: Sequence[Any]) -> Any:
    """Inverse of :func:`split_microbatches`: concatenate the tensors along dim 0.

    Non-tensor leaves are taken from the first part. Returns None for no parts.
    """
    if not parts:
        return None
    first = parts[0]
    if isinstance(first, torch.Tensor):
        if first.dim() == 0:
            return torch.stack(list(parts))
        return torch.cat(list(parts), dim=0)
    if isinstance(first, tuple | list):
        items = [concat_microbatches([part[i] for part in parts]) for i in range(len(first))]
        return tuple(items) if isinstance(first, tuple) else items
    if isinstance(first, Mapping):
        return {key: concat_microbatches([part[key] for part in parts]) for key in first}
    return first


def payload_signature(payload: Any) -> tuple[Any, ...]:
    """Structure, shapes and dtypes of ``payload``'s tensors (hashable; values are ignored).

    Every pipeline rank reads the same batch, so every rank computes the same signature: the
    executor uses it to decide, identically on all ranks, whether the shapes exchanged on an
    earlier step still hold.
    """
    if isinstance(payload, torch.Tensor):
        return ("tensor", tuple(payload.shape), str(payload.dtype))
    if isinstance(payload, tuple | list):
        return (type(payload).__name__, tuple(payload_signature(item) for item in payload))
    if isinstance(payload, Mapping):
        return ("dict", tuple((key, payload_signature(payload[key])) for key in payload))
    return ("value", type(payload).__name__)
