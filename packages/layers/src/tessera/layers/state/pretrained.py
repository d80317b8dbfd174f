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

Under ZeRO-3 (FSDP2, loaded after ``initialize``) a parameter is a DTensor over DATA holding
rows of the tensor-parallel block: those rows are a smaller block of the full tensor, read the
same way. A pipeline stage of ``pipeline_layers`` speaks the model's names (its layers carry
them, and the model's class, config and ties: :class:`PretrainedSource`).

Saving walks the other way: every rank gathers one tensor at a time
(:func:`gather_full_tensors`, collective over TENSOR, and DATA under ZeRO-3), and the first
rank of each pipeline stage streams its stage's tensors into safetensors files of their own
whose headers it wrote first (every full shape is known from the ShardInfo and FullForm
without communication). The files are written to a temporary folder renamed into place at the
end, so a reader never sees half a checkpoint.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import struct
import sys
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import torch
import torch.distributed as dist
from torch import nn

from tessera.context import (
    ParallelContext,
    ParallelMode,
    ShardInfo,
    get_shard_info,
    original_names_of,
    pipeline_shared_key,
)

from ..shared.context_access import current_or_none
from .state_dict import (
    _find_context,
    full_shape,
    gather_full_tensors,
    shard_of_full,
    shard_reads,
)

__all__ = [
    "PretrainedKeys",
    "PretrainedSource",
    "load_pretrained",
    "mark_pretrained_source",
    "save_pretrained",
]

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
_CODE_DTYPES = {code: dtype for dtype, code in _DTYPE_CODES.items()}
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS |= {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


#: The attribute :func:`mark_pretrained_source` sets on a module.
SOURCE_ATTR = "_tessera_pretrained_source"


@dataclass(frozen=True)
class PretrainedSource:
    """What a checkpoint folder needs of the transformers model some modules were cut from.

    A pipeline stage holds some of a model's layers (``pipeline_layers``), not the model, so
    each layer carries this record (:func:`mark_pretrained_source`): a stage then writes the
    ``config.json`` of the model's class, leaves out its tied keys, and loads a checkpoint of
    the base model as the model would. A transformers model is its own record.

    Attributes:
        class_name: The model's class (``config.json``'s ``architectures``).
        config: Its transformers config (``None``: no ``config.json`` is written).
        generation_config: Its generation config, if any.
        tied_keys: The keys transformers leaves out of a checkpoint as ties (``lm_head.weight``).
        base_model_prefix: Where its base model sits (``transformer`` for GPT-2).
        ignore_missing: Its ``_keys_to_ignore_on_load_missing`` patterns.
        ignore_unexpected: Its ``_keys_to_ignore_on_load_unexpected`` patterns.
    """

    class_name: str
    config: Any = None
    generation_config: Any = None
    tied_keys: frozenset[str] = frozenset()
    base_model_prefix: str = ""
    ignore_missing: tuple[str, ...] = ()
    ignore_unexpected: tuple[str, ...] = ()

    @classmethod
    def of(cls, model: nn.Module) -> PretrainedSource:
        """The record of ``model`` (any module; a transformers model fills every field)."""
        tied = getattr(model, "_tied_weights_keys", None) or ()
        config = getattr(model, "config", None)
        return cls(
            class_name=type(model).__name__,
            config=config if hasattr(config, "to_json_file") else None,
            generation_config=getattr(model, "generation_config", None),
            # a dict (transformers 5: tied -> source) or a list (4.x): its keys
            tied_keys=frozenset(tied),
            base_model_prefix=str(getattr(model, "base_model_prefix", "") or ""),
            ignore_missing=tuple(getattr(model, "_keys_to_ignore_on_load_missing", None) or ()),
            ignore_unexpected=tuple(
                getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()
            ),
        )


def mark_pretrained_source(module: nn.Module, model: nn.Module) -> None:
    """Record on ``module`` (a layer cut from ``model``) what ``model``'s checkpoints need."""
    setattr(module, SOURCE_ATTR, PretrainedSource.of(model))


def _source_of(model: nn.Module) -> PretrainedSource:
    """``model``'s own record if it is a transformers model, else the first its layers carry."""
    if getattr(model, "config", None) is None:
        for module in model.modules():
            found = getattr(module, SOURCE_ATTR, None)
            if isinstance(found, PretrainedSource):
                return found
    return PretrainedSource.of(model)


def _context_of(
    model: nn.Module, context: ParallelContext | None, caller: str
) -> ParallelContext | None:
    """``context``, else the model's layers', else the current one.

    Raises:
        ValueError: none, for a pipeline stage of ``pipeline_layers`` in a job of several
            ranks: which stage it is, and so what the others hold, is the context's to say.
    """
    ctx = context or _find_context(model) or current_or_none(None)
    cut = any(getattr(m, SOURCE_ATTR, None) is not None for m in model.modules())
    if ctx is None and cut and dist.is_initialized() and dist.get_world_size() > 1:
        raise ValueError(
            f"{caller}: the model is cut from another ({_source_of(model).class_name}, by "
            "pipeline_layers) and no context says which stage it is: pass context= or "
            "launch with one (the other stages hold the rest of the model)"
        )
    return ctx


def _original_named(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s state dict (``keep_vars``) under the original model's names.

    A pipeline stage of ``pipeline_layers`` names GPT-2's ``transformer.h.0.mlp.c_fc.weight``
    ``layer0.layer.mlp.c_fc.weight``; its layers carry the map back
    (:func:`~tessera.context.original_names_of`). Other modules keep their names.
    """
    originals = original_names_of([model])
    return {originals.get(n, n): t for n, t in model.state_dict(keep_vars=True).items()}


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
    model: nn.Module,
    folder: str | os.PathLike[str],
    *,
    strict: bool = True,
    context: ParallelContext | None = None,
) -> PretrainedKeys:
    """Load a transformers checkpoint folder into ``model``, each rank reading its slices.

    No communication: every rank reads, of each tensor its model holds, only the slices that
    make up its block (:func:`shard_reads`; a plain split is one slice, a fused q/k/v one per
    part, a GPT-2 ``Conv1D`` is sliced as stored and transposed), and copies them into its
    parameter: its peak is its shards plus one slice. Read whole are only the tensors the rank
    holds whole (norms, replicated biases, key/value heads repeated over the ranks splitting
    heads) and any tensor whose form no slice arithmetic relates to the stored one (none of
    tessera's layers makes one today). Under ZeRO-3 / FSDP2 a model loaded after
    ``initialize`` holds each parameter as a DTensor over DATA: each data rank reads only the
    rows of its block it holds, into FSDP2's storage of them (loaded before ``initialize``, the
    blocks are sharded by it). A pipeline stage of ``pipeline_layers`` reads its tensors
    under the model's names (its layers carry them), its copy of a weight tied across stages
    under the name it is tied under (GPT-2's head: the embedding's ``transformer.wte.weight``).
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
            checkpoint in the model. A pipeline stage holds part of the model: the stages
            exchange the names they hold (collective over PIPELINE: every stage calls it) and
            a key is unexpected when no stage holds it. ``False`` loads what this rank holds,
            without communication, and returns the rest.
        context: The context holding the model's groups (default: its layers', else the
            current one); read only for a pipeline's stages under ``strict``.

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
    source = _source_of(model)
    own = _original_named(model)
    aliases = _aliases(own)
    held = {name for names in aliases for name in names}
    ctx = _context_of(model, context, "load_pretrained")
    stages = ctx.get_world_size(ParallelMode.PIPELINE) if ctx is not None else 1
    if strict and stages > 1:  # a stage holds part of the model: all of them hold it all
        everyone: list[Any] = [None] * stages
        group = ctx.get_cpu_group(ParallelMode.PIPELINE) if ctx is not None else None
        dist.all_gather_object(everyone, sorted(held), group=group)
        held = {name for names in everyone for name in names}
    files = _checkpoint_files(folder)
    files = _renamed_to_model(files, held, source.base_model_prefix)

    ignore_missing, ignore_unexpected = source.ignore_missing, source.ignore_unexpected
    to_load: list[tuple[str, torch.Tensor]] = []  # one key per tensor of the model
    missing: list[str] = []
    for names in aliases:
        present = [n for n in names if n in files]
        if present:
            to_load.append((present[0], own[names[0]]))
        elif not all(_matches(n, ignore_missing) for n in names):
            missing.append(names[0])
    unexpected = [k for k in files if k not in held and not _matches(k, ignore_unexpected)]
    if strict and (missing or unexpected):
        where = {k: files[k][0].name for k in unexpected}
        raise KeyError(
            f"load_pretrained: {folder} does not match the model: missing keys "
            f"{_few(missing)}, unexpected keys {_few([f'{k} ({where[k]})' for k in unexpected])}"
        )
    on_meta = [key for key, target in to_load if target.is_meta]
    if on_meta:
        raise ValueError(
            f"load_pretrained: {_few(on_meta)} are on the meta device: parallelize the model "
            "built inside meta_parameters() first (it allocates this rank's shards), then load"
        )

    by_file: dict[Path, list[tuple[str, torch.Tensor]]] = {}
    for key, target in to_load:
        by_file.setdefault(files[key][0], []).append((key, target))
    wrong: list[str] = []
    for path, entries in by_file.items():  # headers only: every shape before any tensor
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for key, target in entries:
                shape = tuple(f.get_slice(files[key][1]).get_shape())
                expected = list(full_shape(target))
                if list(shape) != expected:
                    wrong.append(f"{key!r} in {path.name}: {list(shape)}, expected {expected}")
    if wrong:
        raise ValueError(
            f"load_pretrained: {len(wrong)} tensors of {folder} have other shapes than the "
            f"model's full ones: {'; '.join(wrong[:8])}{' ...' if len(wrong) > 8 else ''}"
        )

    with torch.no_grad():
        for path, entries in by_file.items():
            for key, target in entries:
                # Opened per tensor: safetensors maps the file, and every page a read touches
                # (a column block touches them all) stays resident while it is open. So at most
                # one tensor's pages are, not the whole file's.
                with safe_open(str(path), framework="pt", device="cpu") as f:
                    try:
                        _load_block(f, files[key][1], key, target)
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
    from torch.distributed.tensor import DTensor

    piece: ShardInfo | None = None  # this data rank's part of the block, under ZeRO-3
    dest = target
    if isinstance(target, DTensor):
        piece, within = _piece_of(target)
        dest = target.to_local()  # FSDP2's storage of this rank's part: written in place
        if dest.numel() == 0:
            return
    plan = shard_reads(target, info=piece)
    if plan is None:
        full = f.get_tensor(stored)  # the whole tensor: its forms need it
        block = shard_of_full(key, target, full.to(target.dtype))
        dest.copy_(block if piece is None else block[within])
        return
    in_place = type(dest) in (torch.Tensor, nn.Parameter) and dest.is_contiguous()
    block = (
        dest.view(plan.shape)
        if in_place
        else torch.empty(plan.shape, dtype=dest.dtype, device=dest.device)
    )
    stored_slice = f.get_slice(stored)
    shape = tuple(stored_slice.get_shape())
    for read in plan.reads:
        whole = all((s.start, s.stop) == (0, n) for s, n in zip(read.source, shape, strict=True))
        box = f.get_tensor(stored) if whole else stored_slice[read.source]
        plan.place(block, read, box)
        del box
    if not in_place:
        dest.copy_(block.view(dest.shape))


def _piece_of(target: Any) -> tuple[ShardInfo, tuple[slice, ...]]:
    """The ShardInfo of the part of its block a DTensor holds here, and where it sits in it.

    ZeRO-3 (FSDP2) holds each parameter as a DTensor over DATA whose global shape is the
    tensor-parallel block's (the ShardInfo's local shape): this rank's part (rows of the block)
    is a smaller block of the full tensor, read like any other, so a data rank reads its own
    share of the file and no more.
    """
    (chunk,) = target.__create_chunk_list__()
    offsets, sizes = tuple(chunk.offsets), tuple(chunk.sizes)
    shape = tuple(target.shape)
    info = get_shard_info(target) or ShardInfo(shape, (0,) * len(shape), shape)
    data = str(ParallelMode.DATA.value)
    split = tuple(
        modes + ((data,) if (o, n) != (0, whole) and data not in modes else ())
        for modes, o, n, whole in zip(info.split_modes, offsets, sizes, shape, strict=True)
    )
    piece = ShardInfo(
        global_shape=info.global_shape,
        offsets=tuple(a + b for a, b in zip(info.offsets, offsets, strict=True)),
        local_shape=sizes,
        split_modes=split,
        replicated_modes=tuple(m for m in info.replicated_modes if m != data),
    )
    return piece, tuple(slice(o, o + n) for o, n in zip(offsets, sizes, strict=True))


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
    files: dict[str, tuple[Path, str]], own: Collection[str], prefix: str
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
    """The model's keys grouped by tensor: tied parameters share one group, in state order.

    A pipeline stage's copy of a weight tied across stages (GPT-2's head on the last stage)
    also goes by the name it is tied under (``mark_pipeline_shared``'s key, the embedding's
    name in the model), which is where the checkpoint holds it.
    """
    groups: dict[int, list[str]] = {}
    for name, t in own.items():
        groups.setdefault(id(t), []).append(name)
    for names in groups.values():
        shared = pipeline_shared_key(own[names[0]])
        if shared is not None and shared not in names:
            names.append(shared)
    return list(groups.values())


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
    together; under ZeRO-3 the data ranks too). The first rank of each pipeline stage (data
    and tensor rank 0; rank 0 alone without a pipeline) writes that stage's tensors into files
    of their own, holding one full tensor at a time: a stage of ``pipeline_layers`` writes
    under the model's names (its layers carry them), and the copy of a weight tied across
    stages (GPT-2's head) is written once, by the stage holding it under its own name. The
    files go into a temporary folder beside ``folder`` that rank 0 renames into place at the
    end (an existing ``folder`` is moved aside first and removed after), so a reader never
    sees a half-written checkpoint; with several stages every stage's writer must see that
    folder (a shared file system), as every rank must see a folder it loads. Every rank
    returns once the folder is there, or raises if a writer failed (all ranks exchange the
    outcome, in place of a barrier).

    Args:
        model: The parallelized model (or a plain one), or this rank's pipeline stage.
        folder: Where the checkpoint goes.
        max_shard_size: The largest file, in bytes or as ``"5GB"``, ``"500MiB"``; a tensor
            larger than it gets a file of its own.
        dtype: Write floating tensors in this dtype (default: the model's).
        context: The context holding the model's groups (default: its layers').

    Returns:
        The folder.

    Raises:
        ValueError: ``max_shard_size`` cannot be read.
        OSError: (or whatever writing raised) on the writing rank, when it could not write
            the folder (a full disk, no permission); it still takes part in every gather,
            and the temporary folder is removed.
        RuntimeError: on every other rank in that case, naming the writer's error: the
            ranks agree on the outcome before returning, so none waits for a writer that
            gave up.
    """
    folder = Path(folder)
    limit = _size_in_bytes(max_shard_size)
    ctx = _context_of(model, context, "save_pretrained")
    source = _source_of(model)
    own = _original_named(model)
    names = _kept_names(own, set(source.tied_keys))
    out_dtype = {n: _out_dtype(own[n], dtype) for n in names}
    root = not dist.is_initialized() or dist.get_rank() == 0
    writer = _is_writer(ctx)
    stage = ctx.get_local_rank(ParallelMode.PIPELINE) if ctx is not None else 0
    group = ctx.get_cpu_group(ParallelMode.GLOBAL) if ctx is not None else None

    # One exchange: rank 0's temporary folder (made, or why not), each writer's tensors.
    temp = folder.parent / f".{folder.name}.tmp-{os.getpid()}"
    attempt = _FirstFailure(enabled=writer)
    if root:
        attempt(_fresh_folder, temp)
    mine = [(n, _DTYPE_CODES[out_dtype[n]], full_shape(own[n])) for n in names]
    plans = _all_gather(
        dict(temp=str(temp), failure=_text(attempt.failure), stage=stage, writes=mine)
        if writer
        else dict(stage=stage),
        group,
    )
    temp = Path(plans[0]["temp"])
    _raise_failed(attempt.failure, [p.get("failure") for p in plans], folder)

    files, header = _files_of_stages(plans, limit)
    codes = _CODE_DTYPES
    for file, (owner, keys) in files.items():
        if owner != stage:
            continue  # another stage's ranks write it
        out = _SafetensorsStream(
            temp / file, {k: (codes[header[k][0]], header[k][1]) for k in keys}
        )
        attempt(out.open)
        for key in keys:  # gathered on every rank even once the writer failed: collective
            full = gather_full_tensors(model, {key: own[key]}, ctx)[key]
            attempt(out.write, key, full, codes[header[key][0]])
            del full
        out.close()
        attempt(out.check_complete)
    if root:
        if len(files) > 1:
            weight_map = {k: file for file, (_, keys) in files.items() for k in keys}
            total = sum(_nbytes(shape, codes[code]) for code, shape in header.values())
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            text = json.dumps(index, indent=2, sort_keys=True) + "\n"
            attempt((temp / INDEX_FILE).write_text, text)
        attempt(_write_config, source, temp, [codes[code] for code, _ in header.values()])

    # Every writer done (or failed) before rank 0 moves the folder into place, or removes it;
    # then every rank learns the outcome, once nothing is left to clean up.
    failed = any(p.get("failure") for p in _all_gather(dict(failure=_text(attempt.failure)), group))
    if root:
        if not failed:
            attempt(_move_into_place, temp, folder)
        if failed or attempt.failure is not None:
            shutil.rmtree(temp, ignore_errors=True)
    outcome = _all_gather(dict(failure=_text(attempt.failure)), group)
    _raise_failed(attempt.failure, [p.get("failure") for p in outcome], folder)
    return folder


def _is_writer(ctx: ParallelContext | None) -> bool:
    """Whether this rank writes its stage's files: data and tensor rank 0 of its stage."""
    if ctx is None:
        return not dist.is_initialized() or dist.get_rank() == 0
    return all(ctx.get_local_rank(m) == 0 for m in (ParallelMode.DATA, ParallelMode.TENSOR))


def _files_of_stages(
    plans: list[dict[str, Any]], limit: int
) -> tuple[dict[str, tuple[int, list[str]]], dict[str, tuple[str, tuple[int, ...]]]]:
    """The files, stage by stage: ``{file: (stage, keys)}`` and every key's (dtype, shape).

    Each stage's writer writes files of its own tensors (a new file where the next tensor
    would pass ``limit``), in stage order; a key two stages hold is written by the first.
    """
    header: dict[str, tuple[str, tuple[int, ...]]] = {}
    per_stage: list[tuple[int, list[list[str]]]] = []
    for plan in sorted((p for p in plans if "writes" in p), key=lambda p: int(p["stage"])):
        shards: list[list[str]] = [[]]
        size = 0
        for key, code, shape in plan["writes"]:
            if key in header:
                continue
            header[key] = (code, tuple(shape))
            n = _nbytes(tuple(shape), _CODE_DTYPES[code])
            if shards[-1] and size + n > limit:
                shards.append([])
                size = 0
            shards[-1].append(key)
            size += n
        per_stage.append((int(plan["stage"]), [keys for keys in shards if keys]))
    count = sum(len(shards) for _, shards in per_stage)
    files: dict[str, tuple[int, list[str]]] = {}
    for stage, shards in per_stage:
        for keys in shards:
            name = SINGLE_FILE if count == 1 else _numbered(len(files), count)
            files[name] = (stage, keys)
    return files, header


def _all_gather(mine: dict[str, Any], group: dist.ProcessGroup | None) -> list[dict[str, Any]]:
    """Every rank's ``mine`` (of the group; just ``mine`` without torch.distributed)."""
    if not dist.is_initialized():
        return [mine]
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    return everyone


def _text(failure: Exception | None) -> str | None:
    return None if failure is None else f"{type(failure).__name__}: {failure}"


class _FirstFailure:
    """Calls made on a writing rank until one raises; that exception is kept, not raised.

    A writer keeps gathering with the other ranks after a failed write (they are in the
    same collectives), and every rank learns of the failure at the next exchange
    (:func:`_raise_failed`) instead of waiting for the writer forever.
    """

    def __init__(self, *, enabled: bool) -> None:
        self.enabled = enabled
        self.failure: Exception | None = None

    def __call__(self, fn: Any, *args: Any) -> None:
        if not self.enabled or self.failure is not None:
            return
        try:
            fn(*args)
        except Exception as exc:  # re-raised by _raise_failed, on this rank as it was
            self.failure = exc


def _raise_failed(failure: Exception | None, everyone: list[str | None], folder: Path) -> None:
    """Raise on every rank if a writer failed (``everyone``: each rank's failure, exchanged).

    The exchange takes the place of a barrier: no rank returns before the folder is in place,
    and none waits for a writer that gave up. A writer that failed raises its own exception;
    the others a ``RuntimeError`` naming it.
    """
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


def _kept_names(own: Mapping[str, torch.Tensor], tied: set[str]) -> list[str]:
    """One key per tensor: of tied keys the first transformers does not drop as a tie.

    A pipeline stage's copy of a weight another stage holds under the name it is tied under
    (GPT-2's head on the last stage) is left to that stage.
    """
    kept = []
    for names in _aliases(own):
        if any(n not in own for n in names):
            continue
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


def _write_config(source: PretrainedSource, folder: Path, dtypes: list[torch.dtype]) -> None:
    """``config.json`` from the model's transformers config, naming its class and dtype."""
    config = source.config
    if config is None:
        return
    config = copy.deepcopy(config)
    config.architectures = [source.class_name]
    floating = [d for d in dtypes if d.is_floating_point]
    if floating:
        saved = max(set(floating), key=floating.count)
        # transformers 5 names it dtype, 4.x torch_dtype
        setattr(config, "dtype" if hasattr(config, "dtype") else "torch_dtype", saved)
    if hasattr(config, "save_pretrained"):
        config.save_pretrained(folder)
    else:
        config.to_json_file(folder / "config.json")
    generation = source.generation_config
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
