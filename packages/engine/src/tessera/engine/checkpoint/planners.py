"""torch.distributed.checkpoint (DCP) planners for blocks, and a reader that never unpickles.

Why DCP and why these planners: DCP already does what resharding needs. Its metadata records,
for every tensor, the global size and the chunks written (offsets + sizes); on load,
``create_read_items_for_chunk_list`` intersects the chunks a rank asks for with the chunks on
disk, whatever layout wrote them; on save, ``dedup_save_plans`` keeps one writer for a chunk
that several replicas hold and ``_validate_global_plan`` rejects chunks that overlap or leave
holes. What DCP lacks is a way to describe a chunk other than a ``DTensor`` (whose placements
cannot express tessera's mixed-radix 2D/2.5D/3D splits) or the deprecated ``ShardedTensor``.
So the planners below take plain local tensors plus a side table of (global shape, offsets)
read from ShardInfo: ``BlockSavePlanner`` emits one ``WriteItem`` per block,
``BlockLoadPlanner`` one chunk request per block. Both work on gloo/CPU and NCCL alike.

Why a reader of our own: DCP's ``FileSystemReader.read_metadata`` ``pickle.load``s the
``.metadata`` file, i.e. runs whatever a crafted file asks for. The tensor data itself is read
with ``torch.load(weights_only=True)``. So the saver also writes the metadata as JSON
(``metadata.json``) and ``JsonMetadataReader`` rebuilds DCP's ``Metadata`` from it; the
pickled ``.metadata`` is kept only so that plain ``dcp.load`` can read the directory too. The
reader also reads the data file by file, so that one that does not decode is named in the
error instead of surfacing as an anonymous unpickler or zip error.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader, _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    LoadPlanner,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.futures import Future

from .blocks import Block
from .errors import CheckpointCorruptError, describe

__all__ = [
    "METADATA_JSON",
    "BlockLoadPlanner",
    "BlockSavePlanner",
    "JsonMetadataReader",
    "metadata_from_json",
    "metadata_to_json",
]

#: The JSON twin of DCP's pickled ``.metadata``.
METADATA_JSON = "metadata.json"


class BlockSavePlanner(DefaultSavePlanner):
    """Writes each block at its offsets in its global tensor.

    Args:
        blocks: Key -> this rank's block. Replicas holding the same block (same key and
            offsets) are deduplicated by DCP: one of them writes it.
    """

    def __init__(self, blocks: Mapping[str, Block]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._blocks = dict(blocks)

    def create_local_plan(self) -> SavePlan:
        """One SHARD write item per block (an empty block of a non-empty tensor: none)."""
        items = []
        for key, block in self._blocks.items():
            if block.local.numel() == 0 and any(block.global_shape):
                continue
            offsets = torch.Size(block.offsets)
            items.append(
                WriteItem(
                    index=MetadataIndex(key, offsets),
                    type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(
                        chunk=ChunkStorageMetadata(offsets=offsets, sizes=block.local.shape),
                        properties=TensorProperties.create_from_tensor(block.local),
                        size=torch.Size(block.global_shape),
                    ),
                )
            )
        self.plan = SavePlan(items)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor:
        """A compact CPU copy of the block (``torch.save`` of a view would save its base)."""
        local = self._blocks[write_item.index.fqn].local
        return local.detach().to("cpu", copy=True).contiguous()


class BlockLoadPlanner(DefaultLoadPlanner):
    """Reads into each block the parts of the saved chunks that overlap it.

    Args:
        blocks: Key -> the tensor to fill in place and its offsets; every key must be in the
            checkpoint (checked by the caller with a clear message before loading).
    """

    def __init__(self, blocks: Mapping[str, Block]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._blocks = dict(blocks)

    def create_local_plan(self) -> LoadPlan:
        """The read items resharding the saved chunks onto this rank's blocks."""
        assert self.metadata is not None
        items = []
        for key, block in self._blocks.items():
            if block.local.numel() == 0:
                continue
            md = self.metadata.state_dict_metadata[key]
            assert isinstance(md, TensorStorageMetadata)
            chunk = ChunkStorageMetadata(
                offsets=torch.Size(block.offsets), sizes=torch.Size(block.local.shape)
            )
            items.extend(create_read_items_for_chunk_list(key, md, [chunk]))
        return LoadPlan(items)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        """The local block the read item's ``dest_offsets`` are relative to."""
        return self._blocks[index.fqn].local


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype(name: str, source: object) -> torch.dtype:
    value = getattr(torch, name, None)
    if not isinstance(value, torch.dtype):
        raise CheckpointCorruptError(f"{source}: unknown dtype {name!r}")
    return value


def metadata_to_json(metadata: Metadata) -> dict[str, Any]:
    """The tensor part of DCP's metadata as plain JSON (what ``JsonMetadataReader`` reads)."""
    tensors: dict[str, Any] = {}
    for key, md in metadata.state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata):
            raise TypeError(f"checkpoint entry {key!r} is not a tensor")
        tensors[key] = {
            "dtype": _dtype_name(md.properties.dtype),
            "size": list(md.size),
            "chunks": [{"offsets": list(c.offsets), "sizes": list(c.sizes)} for c in md.chunks],
        }
    storage = []
    for index, info in (metadata.storage_data or {}).items():
        if info.transform_descriptors:
            raise TypeError(f"{index.fqn}: stream transforms are not supported")
        storage.append(
            {
                "key": index.fqn,
                "offsets": list(index.offset) if index.offset is not None else None,
                "index": index.index,
                "file": info.relative_path,
                "byte_offset": int(info.offset),
                "length": int(info.length),
            }
        )
    return {"version": metadata.version, "tensors": tensors, "storage": storage}


def metadata_from_json(data: Mapping[str, Any], source: object = METADATA_JSON) -> Metadata:
    """DCP ``Metadata`` from what ``metadata_to_json`` wrote.

    Args:
        data: The parsed JSON.
        source: The file it came from, named in errors.

    Raises:
        CheckpointCorruptError: the JSON does not have the expected structure.
    """
    try:
        state: dict[str, Any] = {}
        for key, md in data["tensors"].items():
            state[key] = TensorStorageMetadata(
                properties=TensorProperties(dtype=_dtype(md["dtype"], source)),
                size=torch.Size(md["size"]),
                chunks=[
                    ChunkStorageMetadata(
                        offsets=torch.Size(c["offsets"]), sizes=torch.Size(c["sizes"])
                    )
                    for c in md["chunks"]
                ],
            )
        storage: dict[MetadataIndex, _StorageInfo] = {}
        for entry in data["storage"]:
            index = MetadataIndex(entry["key"], entry["offsets"], entry["index"])
            file = str(entry["file"])
            if Path(file).name != file:
                raise CheckpointCorruptError(f"{source}: data file {file!r} is not local")
            storage[index] = _StorageInfo(file, int(entry["byte_offset"]), int(entry["length"]))
        return Metadata(
            state_dict_metadata=state,
            storage_data=storage,
            storage_meta=StorageMeta(),
            version=data.get("version"),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointCorruptError(f"{source} is malformed: {exc!r}") from exc


class JsonMetadataReader(FileSystemReader):
    """DCP's file reader: metadata from ``metadata.json`` (no pickle), failures by file name."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """Rebuild the metadata from JSON (no unpickling)."""
        path = Path(self.path) / METADATA_JSON
        with path.open("r", encoding="utf-8") as f:
            metadata = metadata_from_json(json.load(f), path)
        assert metadata.storage_meta is not None
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read file by file; a file that does not decode raises ``CheckpointCorruptError``.

        DCP collects the error of every rank and raises it on all of them, wrapped in its
        ``CheckpointException`` (see ``reading.read_blocks``).
        """
        per_file: dict[str, list[Any]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(
                item
            )
        for name, items in per_file.items():
            try:
                super().read_data(LoadPlan(items), planner).wait()
            except Exception as exc:
                path = Path(self.path) / name
                raise CheckpointCorruptError(f"{path} cannot be read: {describe(exc)}") from exc
        done: Future[None] = Future()
        done.set_result(None)
        return done
