"""transformers checkpoint folders in and out of a parallelized model, a rank's slices at a time.

A model too large for one rank is built on the meta device (:func:`~tessera.layers.
meta_parameters`), parallelized (only this rank's shards are allocated; without a tensor mode
nothing is, and what the rank holds -- the whole model, its pipeline stage, or its rows under
ZeRO-3 once ``initialize`` sharded the meta model -- is allocated here), then loaded here:
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

import json
import os
import re
import shutil
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tessera.context import (
    INDEX_FILE,
    SAFETENSORS_DTYPES,
    SINGLE_FILE,
    ParallelContext,
    ParallelMode,
    PretrainedSource,
    SafetensorsStream,
    ShardInfo,
    copy_tokenizer_files,
    fresh_folder,
    get_shard_info,
    move_into_place,
    original_names_of,
    pipeline_shared_key,
    plan_pretrained_files,
    shard_size_in_bytes,
    write_config,
    write_index,
)

from ..shared.context_access import current_or_none
from .materialize import allocate, initialize_meta_modules
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

#: The attribute :func:`mark_pretrained_source` sets on a module.
SOURCE_ATTR = "_tessera_pretrained_source"


def mark_pretrained_source(module: nn.Module, model: nn.Module) -> None:
    """Record on ``module`` (a layer cut from ``model``) what ``model``'s checkpoints need."""
    setattr(module, SOURCE_ATTR, PretrainedSource.of(model))


#: A model, or this rank's chunks of an interleaved pipeline (``build_pipeline_model`` with
#: ``num_chunks > 1`` returns a list of stages, named as in the full model).
Model = nn.Module | Sequence[nn.Module]


def _parts(model: Model) -> list[nn.Module]:
    """The modules ``model`` is made of: itself, or its chunks."""
    return [model] if isinstance(model, nn.Module) else list(model)


def _source_of(model: Model) -> PretrainedSource:
    """``model``'s own record if it is a transformers model, else the first its layers carry."""
    parts = _parts(model)
    if len(parts) == 1 and getattr(parts[0], "config", None) is not None:
        return PretrainedSource.of(parts[0])
    for part in parts:
        for module in part.modules():
            found = getattr(module, SOURCE_ATTR, None)
            if isinstance(found, PretrainedSource):
                return found
    return PretrainedSource.of(parts[0])


def _context_of(
    model: Model, context: ParallelContext | None, caller: str
) -> ParallelContext | None:
    """``context``, else the model's layers', else the current one.

    Raises:
        ValueError: none, for a pipeline stage of ``pipeline_layers`` in a job of several
            ranks: which stage it is, and so what the others hold, is the context's to say.
    """
    parts = _parts(model)
    found = next((c for c in map(_find_context, parts) if c is not None), None)
    ctx = context or found or current_or_none(None)
    cut = any(getattr(m, SOURCE_ATTR, None) is not None for p in parts for m in p.modules())
    if ctx is None and cut and dist.is_initialized() and dist.get_world_size() > 1:
        raise ValueError(
            f"{caller}: the model is cut from another ({_source_of(model).class_name}, by "
            "pipeline_layers) and no context says which stage it is: pass context= or "
            "launch with one (the other stages hold the rest of the model)"
        )
    return ctx


def _original_named(model: Model) -> dict[str, torch.Tensor]:
    """``model``'s state dict (``keep_vars``) under the original model's names.

    A pipeline stage of ``pipeline_layers`` names GPT-2's ``transformer.h.0.mlp.c_fc.weight``
    ``layer0.layer.mlp.c_fc.weight``; its layers carry the map back
    (:func:`~tessera.context.original_names_of`). Other modules keep their names.
    """
    parts = _parts(model)
    originals = original_names_of(parts)
    return {
        originals.get(n, n): t
        for part in parts  # an interleaved stage's chunks: disjoint layers, disjoint names
        for n, t in part.state_dict(keep_vars=True).items()
    }


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
    model: Model,
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
        model: The model, parallelized or not, or this rank's pipeline stage (a list of
            chunks under an interleaved schedule: ``build_pipeline_model(...,
            num_chunks=2)``, each read under the model's names). Built inside
            ``meta_parameters``, what is still on meta is allocated on the context's device
            first (without a tensor mode: everything the rank holds) and what the checkpoint
            does not fill is initialized alike on every rank (seeded by the context's seed and
            the module's name).
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
            file and both shapes), or buffers the checkpoint lacks are on the meta device
            (build inside ``meta_parameters``, which leaves buffers real).
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
    _allocate_meta(model, [target for _, target in to_load], ctx)

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


def _allocate_meta(model: Model, read: list[torch.Tensor], ctx: ParallelContext | None) -> None:
    """Give storage to what this rank holds on the meta device, before reading into it.

    Without a tensor mode ``parallelize`` allocates nothing: a model built inside
    ``meta_parameters`` reaches here on meta (whole under data parallelism, a pipeline stage,
    or FSDP2's rows once ``initialize`` sharded it under ZeRO-3). The tensors read from the
    checkpoint get uninitialized storage on the context's device (their parameter objects
    kept: ties, optimizers and FSDP2 still hold them); a module holding a meta parameter the
    checkpoint does not fill is initialized, alike on every rank
    (:func:`~tessera.layers.state.materialize.initialize_meta_modules`: seeded by the
    context's seed and the module's name).
    """
    parts = _parts(model)
    params = [p for part in parts for p in part.parameters()]
    ids = {id(t) for t in read}
    buffers = [(n, b) for part in parts for n, b in part.named_buffers()]
    unread = sorted(n for n, b in buffers if b.is_meta and id(b) not in ids)
    if unread:
        raise ValueError(
            f"load_pretrained: the buffers {_few(unread)} are on the meta device and not in the "
            "checkpoint: their values (computed when the model was built) cannot be recovered. "
            "Build the model inside tessera.layers.meta_parameters() instead of "
            "torch.device('meta'): parameters on meta, buffers real"
        )
    if not any(t.is_meta for t in read) and not any(p.is_meta for p in params):
        return
    real = next((t for t in params if not t.is_meta), None)
    device = ctx.device if ctx is not None else real.device if real is not None else None
    device = device if device is not None else torch.device("cpu")
    initialize_meta_modules(
        [named for part in parts for named in part.named_modules()],
        device,
        ctx.base_seed if ctx is not None else 0,
        init_weights=getattr(parts[0], "_init_weights", None),
        skip=ids,
        caller="load_pretrained",
    )
    for target in read:
        allocate(target, device)


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
    model: Model,
    folder: str | os.PathLike[str],
    *,
    max_shard_size: int | str = "5GB",
    dtype: torch.dtype | None = None,
    tokenizer_from: str | os.PathLike[str] | None = None,
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
        model: The parallelized model (or a plain one), or this rank's pipeline stage (or
            its chunks, a list, under an interleaved schedule).
        folder: Where the checkpoint goes.
        max_shard_size: The largest file, in bytes or as ``"5GB"``, ``"500MiB"``; a tensor
            larger than it gets a file of its own.
        dtype: Write floating tensors in this dtype (default: the model's).
        tokenizer_from: A folder (the checkpoint the run started from) whose tokenizer files
            (``tokenizer.json``, ``tokenizer_config.json``, ``vocab.json``, ``merges.txt``,
            ``spiece.model``, ...: ``tessera.context.TOKENIZER_FILES``, whichever it holds)
            rank 0 copies beside the weights, inside the temporary folder, so that
            ``AutoTokenizer.from_pretrained(folder)`` works once the folder is in place.
        context: The context holding the model's groups (default: its layers').

    Returns:
        The folder.

    Raises:
        ValueError: ``max_shard_size`` cannot be read.
        FileNotFoundError: on rank 0, ``tokenizer_from`` is no folder or holds no tokenizer
            file (before any tensor is gathered; a ``RuntimeError`` naming it elsewhere).
        OSError: (or whatever writing raised) on the writing rank, when it could not write
            the folder (a full disk, no permission); it still takes part in every gather,
            and the temporary folder is removed.
        RuntimeError: on every other rank in that case, naming the writer's error: the
            ranks agree on the outcome before returning, so none waits for a writer that
            gave up.
    """
    folder = Path(folder)
    limit = shard_size_in_bytes(max_shard_size)
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
        attempt(fresh_folder, temp)
        if tokenizer_from is not None:
            attempt(_copy_tokenizer, tokenizer_from, temp)
    mine = [(n, SAFETENSORS_DTYPES[out_dtype[n]], full_shape(own[n])) for n in names]
    plans = _all_gather(
        dict(temp=str(temp), failure=_text(attempt.failure), stage=stage, writes=mine)
        if writer
        else dict(stage=stage),
        group,
    )
    temp = Path(plans[0]["temp"])
    if root and any(p.get("failure") for p in plans):  # nothing gathered: nothing to wait for
        shutil.rmtree(temp, ignore_errors=True)
    _raise_failed(attempt.failure, [p.get("failure") for p in plans], folder)

    stages = [(int(p["stage"]), p["writes"]) for p in plans if "writes" in p]
    files, header = plan_pretrained_files(stages, limit)
    for file, (owner, keys) in files.items():
        if owner != stage:
            continue  # another stage's ranks write it
        out = SafetensorsStream.of(temp / file, keys, header, "save_pretrained")
        attempt(out.open)
        for key in keys:  # gathered on every rank even once the writer failed: collective
            full = gather_full_tensors(_parts(model)[0], {key: own[key]}, ctx)[key]
            attempt(out.write, key, full, out.dtype_of(key))
            del full
        out.close()
        attempt(out.check_complete)
    if root:
        attempt(write_index, temp, files, header)
        attempt(write_config, source, temp, header)

    # Every writer done (or failed) before rank 0 moves the folder into place, or removes it;
    # then every rank learns the outcome, once nothing is left to clean up.
    failed = any(p.get("failure") for p in _all_gather(dict(failure=_text(attempt.failure)), group))
    if root:
        if not failed:
            attempt(move_into_place, temp, folder)
        if failed or attempt.failure is not None:
            shutil.rmtree(temp, ignore_errors=True)
    outcome = _all_gather(dict(failure=_text(attempt.failure)), group)
    _raise_failed(attempt.failure, [p.get("failure") for p in outcome], folder)
    return folder


def _copy_tokenizer(source: str | os.PathLike[str], temp: Path) -> None:
    copy_tokenizer_files(source, temp, caller="save_pretrained")


def _is_writer(ctx: ParallelContext | None) -> bool:
    """Whether this rank writes its stage's files: data and tensor rank 0 of its stage."""
    if ctx is None:
        return not dist.is_initialized() or dist.get_rank() == 0
    return all(ctx.get_local_rank(m) == 0 for m in (ParallelMode.DATA, ParallelMode.TENSOR))


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
