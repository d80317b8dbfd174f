"""transformers checkpoint folders written tensor by tensor: the files, their index, config.json.

What tessera-layers' ``save_pretrained`` (a parallel model's tensors gathered one at a time)
and tessera-engine's ``export_pretrained`` (an engine checkpoint's tensors read one at a time,
offline) both write: the weights in safetensors files, one ``model.safetensors`` or, past a
size, ``model-0000i-of-0000n.safetensors`` with a ``model.safetensors.index.json``, the
model's ``config.json`` and, when asked, the tokenizer files of another folder. A file's
header (every key's dtype, shape and byte range) is known before any tensor is, so it is
written first and the tensors streamed after it: the writer holds one tensor at a time, where
``safetensors.torch.save_file`` needs the whole file's.
The folder is written beside its name and renamed into place at the end.

It lives here, with ``ShardInfo`` and ``FullForm``, because the engine writes it too, without
knowing any layer; it imports neither transformers nor safetensors (a config is duck-typed).
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import struct
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch

__all__ = [
    "INDEX_FILE",
    "SAFETENSORS_DTYPES",
    "SINGLE_FILE",
    "PretrainedSource",
    "TOKENIZER_FILES",
    "SafetensorsStream",
    "copy_tokenizer_files",
    "fresh_folder",
    "move_into_place",
    "plan_pretrained_files",
    "shard_size_in_bytes",
    "write_config",
    "write_index",
    "write_pretrained_folder",
]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
#: The files a transformers tokenizer is saved as (``AutoTokenizer.from_pretrained`` reads
#: whichever the folder holds): fast (``tokenizer.json``), BPE, WordPiece, SentencePiece.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "spiece.model",
    "sentencepiece.bpe.model",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
)

#: safetensors' names of the dtypes (its header's ``dtype`` field).
SAFETENSORS_DTYPES: dict[torch.dtype, str] = {
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
_CODE_DTYPES = {code: dtype for dtype, code in SAFETENSORS_DTYPES.items()}
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS |= {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}

#: ``{file: (stage, keys)}``: which keys each file holds, and which pipeline stage writes it.
Files = dict[str, tuple[int, list[str]]]
#: ``{key: (safetensors dtype code, shape)}``.
Header = dict[str, tuple[str, tuple[int, ...]]]


@dataclass(frozen=True)
class PretrainedSource:
    """What a checkpoint folder needs of the transformers model some tensors come from.

    A pipeline stage holds some of a model's layers (``pipeline_layers``), not the model, so
    each layer carries this record (``tessera.layers.mark_pretrained_source``); an engine
    checkpoint holds tensors only, so its export builds the model on the meta device for it.
    A stage then writes the ``config.json`` of the model's class, leaves out its tied keys, and
    loads a checkpoint of the base model as the model would. A transformers model is its own
    record.

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
    def of(cls, model: torch.nn.Module) -> PretrainedSource:
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


def shard_size_in_bytes(size: int | str, caller: str = "save_pretrained") -> int:
    """``max_shard_size`` in bytes: a number, or ``"5GB"``, ``"500MiB"``, ``"8KB"``.

    Raises:
        ValueError: it cannot be read, or is below one byte.
    """
    if isinstance(size, int):
        value = size
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", size, flags=re.IGNORECASE)
        if match is None:
            raise ValueError(
                f"{caller}: max_shard_size {size!r} is not a size such as 5GB, 500MiB "
                "or a number of bytes"
            )
        value = int(float(match[1]) * _UNITS[(match[2] or "").upper()])
    if value < 1:
        raise ValueError(f"{caller}: max_shard_size {size!r} is below one byte")
    return value


def plan_pretrained_files(
    stages: Sequence[tuple[int, Sequence[tuple[str, str, Sequence[int]]]]], limit: int
) -> tuple[Files, Header]:
    """The files, stage by stage: ``{file: (stage, keys)}`` and every key's (dtype, shape).

    Args:
        stages: Per pipeline stage (one, ``0``, without a pipeline), the ``(key, dtype code,
            shape)`` of the tensors it writes, in order.
        limit: The largest file in bytes; a tensor larger than it gets a file of its own.

    Each stage's writer writes files of its own tensors (a new file where the next tensor
    would pass ``limit``), in stage order; a key two stages hold is written by the first.
    """
    header: Header = {}
    per_stage: list[tuple[int, list[list[str]]]] = []
    for stage, writes in sorted(stages, key=lambda s: s[0]):
        shards: list[list[str]] = [[]]
        size = 0
        for key, code, shape in writes:
            if key in header:
                continue
            header[key] = (code, tuple(int(n) for n in shape))
            n = _nbytes(header[key][1], _CODE_DTYPES[code])
            if shards[-1] and size + n > limit:
                shards.append([])
                size = 0
            shards[-1].append(key)
            size += n
        per_stage.append((stage, [keys for keys in shards if keys]))
    count = sum(len(shards) for _, shards in per_stage)
    files: Files = {}
    for stage, shards in per_stage:
        for keys in shards:
            name = SINGLE_FILE if count == 1 else _numbered(len(files), count)
            files[name] = (stage, keys)
    return files, header


def _numbered(i: int, count: int) -> str:
    return f"model-{i + 1:05d}-of-{count:05d}.safetensors"


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    numel = 1
    for n in shape:
        numel *= n
    return numel * dtype.itemsize


class SafetensorsStream:
    """One safetensors file written tensor by tensor, its header (every shape) written first.

    The format: an 8-byte little-endian header length, the JSON header (each key's dtype,
    shape and byte range in the data that follows, plus ``__metadata__``), then the data.
    Writing it directly holds one tensor at a time, where ``safetensors.torch.save_file`` needs
    every tensor of the file in memory.
    """

    def __init__(
        self,
        path: Path,
        header: Mapping[str, tuple[torch.dtype, tuple[int, ...]]],
        caller: str = "save_pretrained",
    ) -> None:
        if sys.byteorder != "little":
            raise RuntimeError(f"{caller}: safetensors files are little-endian")
        self._path = path
        self._caller = caller
        self._expected = dict(header)
        self._order = list(header)
        meta: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        begin = 0
        for key, (dtype, shape) in header.items():
            end = begin + _nbytes(shape, dtype)
            meta[key] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape)}
            meta[key]["data_offsets"] = [begin, end]
            begin = end
        raw = json.dumps(meta, separators=(",", ":")).encode()
        self._header = raw + b" " * (-len(raw) % 8)  # data starts 8-byte aligned
        self._file: BinaryIO | None = None

    @classmethod
    def of(cls, path: Path, keys: Sequence[str], header: Header, caller: str) -> SafetensorsStream:
        """The stream of ``keys`` (planned by :func:`plan_pretrained_files`) into ``path``."""
        codes = _CODE_DTYPES
        return cls(path, {k: (codes[header[k][0]], header[k][1]) for k in keys}, caller)

    def open(self) -> None:
        """Create the file and write its header."""
        self._file = open(self._path, "wb")  # noqa: SIM115 (closed by close())
        self._file.write(struct.pack("<Q", len(self._header)))
        self._file.write(self._header)

    def dtype_of(self, key: str) -> torch.dtype:
        """The dtype ``key`` is written in."""
        return self._expected[key][0]

    def write(self, key: str, tensor: torch.Tensor, dtype: torch.dtype) -> None:
        """Append ``key``'s data in ``dtype``; keys come in the header's order and shapes."""
        assert self._file is not None
        tensor = tensor.to(dtype)
        expected = self._order.pop(0)
        dtype, shape = self._expected[expected]
        if key != expected or tensor.dtype != dtype or tuple(tensor.shape) != shape:
            raise RuntimeError(
                f"{self._caller}: {self._path.name} expects {expected!r} {dtype} {list(shape)}"
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
            raise RuntimeError(f"{self._caller}: {self._path.name} lacks {self._order}")


def write_index(folder: Path, files: Files, header: Header) -> None:
    """``model.safetensors.index.json`` for ``files`` (none for a single file)."""
    if len(files) < 2:
        return
    weight_map = {k: file for file, (_, keys) in files.items() for k in keys}
    codes = _CODE_DTYPES
    total = sum(_nbytes(shape, codes[code]) for code, shape in header.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def write_config(source: PretrainedSource, folder: Path, header: Header) -> None:
    """``config.json`` from the model's transformers config, naming its class and dtype.

    The dtype is the one most floating tensors of ``header`` are written in. Nothing is
    written without a config; the generation config is written beside it when there is one.
    """
    config = source.config
    if config is None:
        return
    config = copy.deepcopy(config)
    config.architectures = [source.class_name]
    dtypes = [_CODE_DTYPES[code] for code, _ in header.values()]
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


def copy_tokenizer_files(
    source: str | os.PathLike[str], folder: Path, *, required: bool = True, caller: str = ""
) -> list[str]:
    """Copy the tokenizer files of ``source`` (:data:`TOKENIZER_FILES`) into ``folder``.

    Called on the temporary folder a checkpoint is written to, so they appear with the weights,
    atomically. Returns the names copied.

    Raises:
        FileNotFoundError: ``source`` is not a folder, or (``required``) holds none of them.
    """
    where = Path(source)
    if not where.is_dir():
        raise FileNotFoundError(f"{caller}: tokenizer_from={where} is not a folder")
    found = [name for name in TOKENIZER_FILES if (where / name).is_file()]
    if required and not found:
        raise FileNotFoundError(
            f"{caller}: tokenizer_from={where} holds no tokenizer file (none of "
            f"{', '.join(TOKENIZER_FILES)})"
        )
    for name in found:
        shutil.copyfile(where / name, folder / name)
    return found


def fresh_folder(path: Path) -> None:
    """An empty folder at ``path`` (whatever was there removed)."""
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)


def move_into_place(temp: Path, folder: Path) -> None:
    """Rename ``temp`` to ``folder``; an existing ``folder`` is moved aside, then removed."""
    if folder.exists():
        old = folder.parent / f".{folder.name}.old-{os.getpid()}"
        shutil.rmtree(old, ignore_errors=True)
        folder.rename(old)
        temp.rename(folder)
        shutil.rmtree(old)
    else:
        temp.rename(folder)


def write_pretrained_folder(
    folder: str | os.PathLike[str],
    tensors: Sequence[tuple[str, torch.dtype, tuple[int, ...]]],
    read: Callable[[str], torch.Tensor],
    source: PretrainedSource,
    *,
    max_shard_size: int | str = "5GB",
    tokenizer_from: str | os.PathLike[str] | None = None,
    tokenizer_required: bool = True,
    caller: str = "write_pretrained_folder",
) -> Path:
    """Write a checkpoint folder in this process, reading one tensor at a time.

    Args:
        folder: Where it goes (an existing folder is replaced once the new one is complete).
        tensors: ``(key, dtype written, full shape)`` of every tensor, in the files' order.
        read: The full tensor of a key (converted to its dtype as it is written).
        source: The model's class, config and generation config (``config.json``).
        max_shard_size: The largest file, in bytes or as ``"5GB"``, ``"500MiB"``.
        tokenizer_from: A folder whose tokenizer files are copied beside the weights
            (:func:`copy_tokenizer_files`).
        tokenizer_required: Whether ``tokenizer_from`` must hold a tokenizer file.
        caller: Names the caller in errors.

    Returns:
        The folder.

    Raises:
        ValueError: ``max_shard_size`` cannot be read.
        FileNotFoundError: ``tokenizer_from`` is no folder, or holds no tokenizer file.
        OSError: the folder cannot be written (its temporary folder is removed).
    """
    folder = Path(folder)
    limit = shard_size_in_bytes(max_shard_size, caller)
    writes = [(key, SAFETENSORS_DTYPES[dtype], shape) for key, dtype, shape in tensors]
    files, header = plan_pretrained_files([(0, writes)], limit)
    temp = folder.parent / f".{folder.name}.tmp-{os.getpid()}"
    fresh_folder(temp)
    try:
        for file, (_, keys) in files.items():
            out = SafetensorsStream.of(temp / file, keys, header, caller)
            out.open()
            try:
                for key in keys:
                    full = read(key)
                    out.write(key, full, out.dtype_of(key))
                    del full
            finally:
                out.close()
            out.check_complete()
        write_index(temp, files, header)
        write_config(source, temp, header)
        if tokenizer_from is not None:
            copy_tokenizer_files(tokenizer_from, temp, required=tokenizer_required, caller=caller)
        move_into_place(temp, folder)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    return folder
