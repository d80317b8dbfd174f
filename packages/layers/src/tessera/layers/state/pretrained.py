"""transformers checkpoint folders in and out of a parallelized model, a rank's slices at a time.

A model too large for one rank is built on the meta device (:func:`~tessera.layers.
meta_parameters`), parallelized (only this rank's shards are allocated), then loaded here:
from the checkpoint's ``model.safetensors`` (or the files its ``model.safetensors.index.json``
lists) each rank reads only the slices of each tensor that make up its own block
(``safe_open(...).get_slice(name)[rows, cols]``), copied straight into its parameter. Which
slices is decided by :func:`shard_reads`, the layout arithmetic :func:`shard_of_full` (and so
:func:`~tessera.layers.load_full_state_dict`) uses too: the ShardInfo's block of tessera's
form mapped back through the FullForm to boxes of the stored tensor -- one box for a plain
split, GPT-2's ``Conv1D`` read in its stored ``[in, out]`` orientation and transposed, one box
per part for fused q/k/v (the parts sit side by side in the file, and interleaved by group in
tessera's form). A rank's peak is its shards plus one slice (two while a slice is scattered
into q/k/v rows of another dtype).

Read whole, still: what a rank holds whole (norms, biases of row-split layers, position
tables, the weights of key/value heads repeated over the ranks splitting heads), which is its
block; and a tensor whose forms no box relates (a FullForm that is not a transpose and splits
of dimensions; no tessera layer writes one today), converted by ``FullForm.from_original``.

Saving walks the other way: every rank gathers one tensor at a time
(:func:`gather_full_tensors`, collective over TENSOR), and rank 0 streams it into a
safetensors file whose header it wrote first (every full shape is known from the ShardInfo and
FullForm without communication). The files are written to a temporary folder renamed into
place at the end, so a reader never sees half a checkpoint.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import struct
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import torch
import torch.distributed as dist
from torch import nn

from tessera.context import ParallelContext, ParallelMode

from ..shared.context_access import current_or_none
from .state_dict import (
    _find_context,
    full_shape,
    gather_full_tensors,
    shard_of_full,
    shard_reads,
)

__all__ = ["PretrainedKeys", "load_pretrained", "save_pretrained"]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

#: safetensors' names of the dtypes (its header's ``dtype`` field).
_DTYPE_CODES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS |= {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


@dataclass(frozen=True)
class PretrainedKeys:
    """What :func:`load_pretrained` left aside (empty lists under ``strict=True``).

    Attributes:
        missing: The model's keys the checkpoint lacks (left as they were initialized).
        unexpected: The checkpoint's keys the model lacks (not read).
    """

    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)


def load_pretrained(
    model: nn.Module, folder: str | os.PathLike[str], *, strict: bool = True
) -> PretrainedKeys:
    """Load a transformers checkpoint folder into ``model``, each rank reading its slices.

    No communication: every rank reads, of each tensor its model holds, only the slices that
    make up its block (:func:`shard_reads`; a plain split is one slice, a fused q/k/v one per
    part, a GPT-2 ``Conv1D`` is sliced as stored and transposed), and copies them into its
    parameter: its peak is its shards plus one slice. Read whole are only the tensors the rank
    holds whole (norms, replicated biases, key/value heads repeated over the ranks splitting
    heads) and any tensor whose form no slice arithmetic relates to the stored one (none of
    tessera's layers makes one today). A parameter that cannot be written in place (a DTensor
    under ZeRO-3 / FSDP2) gets its block assembled first, then copied.
    Keys, shapes and the files themselves are checked (headers only) before any tensor is
    read. Each slice is converted to the dtype of the model's tensor (a bf16 or fp16
    checkpoint into an fp32 model). Tied parameters (a head sharing the token embedding) are
    read once, under whichever of their names the checkpoint holds. A checkpoint of the base
    model (GPT-2's ``h.0...``) loads into a model with a head (``transformer.h.0...``), and the
    reverse, through the model's ``base_model_prefix``; keys matching the model's
    ``_keys_to_ignore_on_load_unexpected`` / ``_missing`` patterns are passed over, as
    transformers' ``from_pretrained`` does.

    Args:
        model: The model, parallelized or not; built on the meta device is fine once
            ``parallelize`` has allocated its shards.
        folder: Holds ``model.safetensors`` or ``model.safetensors.index.json`` and the files
            it lists (``config.json`` is not read: build the model from it first).
        strict: Require every key of the model in the checkpoint and every key of the
            checkpoint in the model. A pipeline stage, which holds part of the model, passes
            ``False`` and checks the returned missing keys.

    Returns:
        The missing and unexpected keys (both empty under ``strict``).

    Raises:
        FileNotFoundError: the folder holds no safetensors checkpoint, or the index names a
            file that is not there.
        KeyError: ``strict`` and keys are missing or unexpected (naming them and their file).
        ValueError: tensors have other shapes than the model's full ones (naming the key, the
            file and both shapes), or model tensors are still on the meta device.
    """
    from safetensors import safe_open

    folder = Path(folder)
    files = _checkpoint_files(folder)
    own = model.state_dict(keep_vars=True)
    files = _renamed_to_model(files, own, getattr(model, "base_model_prefix", ""))
    aliases = _aliases(own)

    ignore_missing = _patterns(model, "_keys_to_ignore_on_load_missing")
    ignore_unexpected = _patterns(model, "_keys_to_ignore_on_load_unexpected")
    to_load: list[str] = []  # one key per tensor of the model
    missing: list[str] = []
    for names in aliases:
        present = [n for n in names if n in files]
        if present:
            to_load.append(present[0])
        elif not all(_matches(n, ignore_missing) for n in names):
            missing.append(names[0])
    unexpected = [k for k in files if k not in own and not _matches(k, ignore_unexpected)]
    if strict and (missing or unexpected):
        where = {k: files[k][0].name for k in unexpected}
        raise KeyError(
            f"load_pretrained: {folder} does not match the model: missing keys "
            f"{_few(missing)}, unexpected keys {_few([f'{k} ({where[k]})' for k in unexpected])}"
        )
    on_meta = [n for n in to_load if own[n].is_meta]
    if on_meta:
        raise ValueError(
            f"load_pretrained: {_few(on_meta)} are on the meta device: parallelize the model "
            "built inside meta_parameters() first (it allocates this rank's shards), then load"
        )

    by_file: dict[Path, list[str]] = {}
    for key in to_load:
        by_file.setdefault(files[key][0], []).append(key)
    wrong: list[str] = []
    for path, keys in by_file.items():  # headers only: every shape before any tensor
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for key in keys:
                shape = tuple(f.get_slice(files[key][1]).get_shape())
                expected = list(full_shape(own[key]))
                if list(shape) != expected:
                    wrong.append(f"{key!r} in {path.name}: {list(shape)}, expected {expected}")
    if wrong:
        raise ValueError(
            f"load_pretrained: {len(wrong)} tensors of {folder} have other shapes than the "
            f"model's full ones: {'; '.join(wrong[:8])}{' ...' if len(wrong) > 8 else ''}"
        )

    with torch.no_grad():
        for path, keys in by_file.items():
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for key in keys:
                    try:
                        _load_block(f, files[key][1], key, own[key])
                    except ValueError as err:
                        raise ValueError(f"load_pretrained: {path}: {err}") from None
    return PretrainedKeys(missing=missing, unexpected=unexpected)


def _load_block(f: Any, stored: str, key: str, target: torch.Tensor) -> None:
    """Read ``target``'s block of the tensor ``stored`` in the open file ``f``, box by box.

    The boxes are :func:`shard_reads`' (the layout arithmetic :func:`shard_of_full` uses
    too), each read with ``get_slice`` and copied (converting its dtype) straight into
    ``target``: this rank's share of the file is all it reads. A tensor whose forms no box
    relates is read whole and converted (:func:`shard_of_full`).
    """
    plan = shard_reads(target)
    if plan is None:
        full = f.get_tensor(stored)  # the whole tensor: its forms need it
        target.copy_(shard_of_full(key, target, full.to(target.dtype)))
        return
    in_place = type(target) in (torch.Tensor, nn.Parameter) and target.is_contiguous()
    block = (
        target.view(plan.shape)
        if in_place
        else torch.empty(plan.shape, dtype=target.dtype, device=target.device)
    )
    stored_slice = f.get_slice(stored)
    shape = tuple(stored_slice.get_shape())
    for read in plan.reads:
        whole = all((s.start, s.stop) == (0, n) for s, n in zip(read.source, shape, strict=True))
        piece = f.get_tensor(stored) if whole else stored_slice[read.source]
        plan.place(block, read, piece)
        del piece
    if not in_place:
        target.copy_(block.view(target.shape))


def _checkpoint_files(folder: Path) -> dict[str, tuple[Path, str]]:
    """Every key of the checkpoint in ``folder``: the file holding it and its key there."""
    from safetensors import safe_open

    index, single = folder / INDEX_FILE, folder / SINGLE_FILE
    if index.is_file():
        weight_map: Mapping[str, str] = json.loads(index.read_text())["weight_map"]
        files = {key: (folder / name, key) for key, name in weight_map.items()}
        absent = sorted({p.name for p, _ in files.values() if not p.is_file()})
        if absent:
            raise FileNotFoundError(f"load_pretrained: {index} lists {absent}, not in {folder}")
        return files
    if single.is_file():
        with safe_open(str(single), framework="pt", device="cpu") as f:
            return {key: (single, key) for key in f.keys()}  # noqa: SIM118 (safe_open is no dict)
    raise FileNotFoundError(
        f"load_pretrained: {folder} holds neither {SINGLE_FILE} nor {INDEX_FILE} (a "
        "transformers checkpoint folder in safetensors; .bin checkpoints are not read)"
    )


def _renamed_to_model(
    files: dict[str, tuple[Path, str]], own: Mapping[str, torch.Tensor], prefix: str
) -> dict[str, tuple[Path, str]]:
    """The checkpoint's keys in the model's names, across transformers' base-model prefix.

    A checkpoint of ``GPT2Model`` names ``h.0.ln_1.weight`` what ``GPT2LMHeadModel`` names
    ``transformer.h.0.ln_1.weight``, and the reverse; each file is still read under its own
    key. Renamed only when no key matches as it is and some match renamed.
    """
    if not prefix or any(k in own for k in files):
        return files
    head = prefix + "."
    if any(k.startswith(head) for k in own):  # the checkpoint is the base model's
        renamed = {head + k: v for k, v in files.items()}
    else:  # the model is the base model
        renamed = {k.removeprefix(head): v for k, v in files.items()}
    return renamed if any(k in own for k in renamed) else files


def _aliases(own: Mapping[str, torch.Tensor]) -> list[list[str]]:
    """The model's keys grouped by tensor: tied parameters share one group, in state order."""
    groups: dict[int, list[str]] = {}
    for name, t in own.items():
        groups.setdefault(id(t), []).append(name)
    return list(groups.values())


def _patterns(model: nn.Module, attribute: str) -> list[str]:
    return list(getattr(model, attribute, None) or [])


def _matches(key: str, patterns: Iterable[str]) -> bool:
    return any(re.search(p, key) for p in patterns)


def _few(keys: list[str], n: int = 8) -> str:
    return f"{keys[:n]}{f' and {len(keys) - n} more' if len(keys) > n else ''}"


def save_pretrained(
    model: nn.Module,
    folder: str | os.PathLike[str],
    *,
    max_shard_size: int | str = "5GB",
    dtype: torch.dtype | None = None,
    context: ParallelContext | None = None,
) -> Path:
    """Write ``model`` as a transformers checkpoint folder, gathering one tensor at a time.

    The folder holds ``config.json`` (when the model has a transformers config) and the
    weights in the original model's names and forms (what :func:`gather_full_state_dict`
    returns), in ``model.safetensors`` or, past ``max_shard_size``, in numbered files with a
    ``model.safetensors.index.json``: what transformers' ``from_pretrained`` reads. Tied
    parameters are written once, under the name transformers keeps (not the tied head's).

    Collective: every rank of the model calls it (the tensor ranks gather each tensor
    together; under ZeRO-3 the data ranks too). Rank 0 writes, holding one full tensor at a
    time; it writes into a temporary folder beside ``folder`` and renames it into place at
    the end (an existing ``folder`` is moved aside first and removed after), so a reader
    never sees a half-written checkpoint. Every rank returns once the folder is there, or
    raises if the writer failed (all ranks exchange the outcome, in place of a barrier).

    Args:
        model: The parallelized model (or a plain one).
        folder: Where the checkpoint goes.
        max_shard_size: The largest file, in bytes or as ``"5GB"``, ``"500MiB"``; a tensor
            larger than it gets a file of its own.
        dtype: Write floating tensors in this dtype (default: the model's).
        context: The context holding the model's groups (default: its layers').

    Returns:
        The folder.

    Raises:
        ValueError: ``max_shard_size`` cannot be read, or the model is split into pipeline
            stages (each stage holds part of the model; not written yet).
        OSError: (or whatever writing raised) on the writing rank, when it could not write
            the folder (a full disk, no permission); it still takes part in every gather,
            and its temporary folder is removed.
        RuntimeError: on every other rank in that case, naming the writer's error: the
            ranks agree on the outcome before returning, so none waits for a writer that
            gave up.
    """
    folder = Path(folder)
    limit = _size_in_bytes(max_shard_size)
    ctx = context or _find_context(model) or current_or_none(None)
    if ctx is not None and ctx.get_world_size(ParallelMode.PIPELINE) > 1:
        raise ValueError(
            f"save_pretrained: the model is split into {ctx.get_world_size(ParallelMode.PIPELINE)}"
            " pipeline stages; each holds part of it, and writing them is not supported yet"
        )
    own = model.state_dict(keep_vars=True)
    names = _kept_names(own, _tied_names(model))
    out_dtype = {n: _out_dtype(own[n], dtype) for n in names}
    shards = _shard_layout(names, own, out_dtype, limit)
    writer = not dist.is_initialized() or dist.get_rank() == 0
    group = ctx.get_group(ParallelMode.GLOBAL) if ctx is not None else None

    temp = folder.parent / f".{folder.name}.tmp-{os.getpid()}"
    attempt = _FirstFailure(enabled=writer)
    attempt(_fresh_folder, temp)
    weight_map: dict[str, str] = {}
    total = 0
    for i, keys in enumerate(shards):
        file = SINGLE_FILE if len(shards) == 1 else _numbered(i, len(shards))
        header = {k: (out_dtype[k], full_shape(own[k])) for k in keys}
        out = _SafetensorsStream(temp / file, header)
        attempt(out.open)
        for key in keys:  # gathered on every rank even once the writer failed: collective
            full = gather_full_tensors(model, {key: own[key]}, ctx)[key]
            attempt(out.write, key, full, out_dtype[key])
            del full
        out.close()
        attempt(out.check_complete)
        weight_map |= dict.fromkeys(keys, file)
        total += sum(_nbytes(full_shape(own[k]), out_dtype[k]) for k in keys)
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        text = json.dumps(index, indent=2, sort_keys=True) + "\n"
        attempt((temp / INDEX_FILE).write_text, text)
    attempt(_write_config, model, temp, out_dtype)
    attempt(_move_into_place, temp, folder)
    if attempt.failure is not None:
        shutil.rmtree(temp, ignore_errors=True)
    _agree_on_failure(attempt.failure, folder, group)
    return folder


class _FirstFailure:
    """Calls made on the writing rank until one raises; that exception is kept, not raised.

    The writer keeps gathering with the other ranks after a failed write (they are in the
    same collectives), and every rank learns of the failure at the end
    (:func:`_agree_on_failure`) instead of waiting for the writer forever.
    """

    def __init__(self, *, enabled: bool) -> None:
        self.enabled = enabled
        self.failure: Exception | None = None

    def __call__(self, fn: Any, *args: Any) -> None:
        if not self.enabled or self.failure is not None:
            return
        try:
            fn(*args)
        except Exception as exc:  # re-raised by _agree_on_failure, on this rank as it was
            self.failure = exc


def _agree_on_failure(
    failure: Exception | None, folder: Path, group: dist.ProcessGroup | None
) -> None:
    """Raise on every rank if the writer failed (a collective where several ranks save).

    It takes the place of the final barrier: every rank sends its failure (the writer's, or
    none) and waits for every other's, so no rank returns before the folder is in place, and
    none waits for a writer that gave up. The writer raises its own exception; the others a
    ``RuntimeError`` naming it.
    """
    if dist.is_initialized():
        everyone: list[Any] = [None] * dist.get_world_size(group)
        mine = None if failure is None else f"{type(failure).__name__}: {failure}"
        dist.all_gather_object(everyone, mine, group=group)
    else:
        everyone = [None]
    if failure is not None:
        raise failure
    failed = [(rank, text) for rank, text in enumerate(everyone) if text is not None]
    if failed:
        rank, text = failed[0]
        raise RuntimeError(
            f"save_pretrained: {folder} was not written: the writing rank (rank {rank} of the "
            f"group) failed: {text}"
        )


def _fresh_folder(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)


def _numbered(i: int, count: int) -> str:
    return f"model-{i + 1:05d}-of-{count:05d}.safetensors"


def _size_in_bytes(size: int | str) -> int:
    if isinstance(size, int):
        value = size
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", size, flags=re.IGNORECASE)
        if match is None:
            raise ValueError(
                f"save_pretrained: max_shard_size {size!r} is not a size such as 5GB, 500MiB "
                "or a number of bytes"
            )
        value = int(float(match[1]) * _UNITS[(match[2] or "").upper()])
    if value < 1:
        raise ValueError(f"save_pretrained: max_shard_size {size!r} is below one byte")
    return value


def _tied_names(model: nn.Module) -> set[str]:
    """The keys transformers leaves out of a checkpoint as ties (``lm_head.weight``)."""
    tied = getattr(model, "_tied_weights_keys", None) or ()
    return set(tied)  # a dict (transformers 5: tied -> source) or a list (4.x): its keys


def _kept_names(own: Mapping[str, torch.Tensor], tied: set[str]) -> list[str]:
    """One key per tensor: of tied keys the first transformers does not drop as a tie."""
    kept = []
    for names in _aliases(own):
        untied = [n for n in names if n not in tied]
        kept.append((untied or names)[0])
    order = {name: i for i, name in enumerate(own)}
    return sorted(kept, key=order.__getitem__)


def _out_dtype(t: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    return dtype if dtype is not None and t.is_floating_point() else t.dtype


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    numel = 1
    for n in shape:
        numel *= n
    return numel * dtype.itemsize


def _shard_layout(
    names: list[str],
    own: Mapping[str, torch.Tensor],
    dtypes: Mapping[str, torch.dtype],
    limit: int,
) -> list[list[str]]:
    """The keys of each file, in order: a new file where the next tensor would pass ``limit``."""
    shards: list[list[str]] = [[]]
    size = 0
    for name in names:
        n = _nbytes(full_shape(own[name]), dtypes[name])
        if shards[-1] and size + n > limit:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    return shards


class _SafetensorsStream:
    """One safetensors file written tensor by tensor, its header (every shape) written first.

    The format: an 8-byte little-endian header length, the JSON header (each key's dtype,
    shape and byte range in the data that follows, plus ``__metadata__``), then the data.
    Writing it directly lets rank 0 hold one tensor at a time, where ``safetensors.torch.
    save_file`` needs every tensor of the file in memory.
    """

    def __init__(self, path: Path, header: Mapping[str, tuple[torch.dtype, tuple[int, ...]]]):
        if sys.byteorder != "little":
            raise RuntimeError("save_pretrained: safetensors files are little-endian")
        self._path = path
        self._expected = dict(header)
        self._order = list(header)
        meta: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        begin = 0
        for key, (dtype, shape) in header.items():
            end = begin + _nbytes(shape, dtype)
            meta[key] = {"dtype": _DTYPE_CODES[dtype], "shape": list(shape)}
            meta[key]["data_offsets"] = [begin, end]
            begin = end
        raw = json.dumps(meta, separators=(",", ":")).encode()
        self._header = raw + b" " * (-len(raw) % 8)  # data starts 8-byte aligned
        self._file: BinaryIO | None = None

    def open(self) -> None:
        """Create the file and write its header."""
        self._file = open(self._path, "wb")  # noqa: SIM115 (closed by close())
        self._file.write(struct.pack("<Q", len(self._header)))
        self._file.write(self._header)

    def write(self, key: str, tensor: torch.Tensor, dtype: torch.dtype) -> None:
        """Append ``key``'s data in ``dtype``; keys come in the header's order and shapes."""
        assert self._file is not None
        tensor = tensor.to(dtype)
        expected = self._order.pop(0)
        dtype, shape = self._expected[expected]
        if key != expected or tensor.dtype != dtype or tuple(tensor.shape) != shape:
            raise RuntimeError(
                f"save_pretrained: {self._path.name} expects {expected!r} {dtype} {list(shape)}"
                f" next, got {key!r} {tensor.dtype} {list(tensor.shape)}"
            )
        data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        self._file.write(data.numpy().data)

    def close(self) -> None:
        """Close the file if it is open (also after a failed write)."""
        if self._file is not None:
            self._file.close()
            self._file = None

    def check_complete(self) -> None:
        """Raise if a tensor of the header was not written."""
        if self._order:
            raise RuntimeError(f"save_pretrained: {self._path.name} lacks {self._order}")


def _write_config(model: nn.Module, folder: Path, dtypes: Mapping[str, torch.dtype]) -> None:
    """``config.json`` from the model's transformers config, naming its class and dtype."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_json_file"):
        return
    config = copy.deepcopy(config)
    config.architectures = [type(model).__name__]
    floating = [d for d in dtypes.values() if d.is_floating_point]
    if floating:
        saved = max(set(floating), key=floating.count)
        # transformers 5 names it dtype, 4.x torch_dtype
        setattr(config, "dtype" if hasattr(config, "dtype") else "torch_dtype", saved)
    if hasattr(config, "save_pretrained"):
        config.save_pretrained(folder)
    else:
        config.to_json_file(folder / "config.json")
    generation = getattr(model, "generation_config", None)
    if generation is not None and hasattr(generation, "save_pretrained"):
        generation.save_pretrained(folder)


def _move_into_place(temp: Path, folder: Path) -> None:
    """Rename ``temp`` to ``folder``; an existing ``folder`` is moved aside, then removed."""
    if folder.exists():
        old = folder.parent / f".{folder.name}.old-{os.getpid()}"
        shutil.rmtree(old, ignore_errors=True)
        folder.rename(old)
        temp.rename(folder)
        shutil.rmtree(old)
    else:
        temp.rename(folder)
