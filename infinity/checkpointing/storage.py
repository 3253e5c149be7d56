"""A storage layer for torch.distributed.checkpoint (DCP) that never unpickles: tensor bytes in
raw files, everything else in JSON.

DCP's own ``FileSystemReader`` unpickles its ``.metadata`` file, and loading a pickle runs
whatever code it names: a checkpoint from someone else must not. Here the checkpoint directory
holds, per writing rank, ``data-<r>.bin`` (tensor chunks end to end, each the little-endian bytes
of a contiguous tensor) and one ``metadata.json`` with every tensor's global size, dtype and
chunks (DCP's ``Metadata``, so DCP's planner reshards on load) and where each chunk's bytes are,
with their xxh3-64 checksum. Each chunk is verified when read: a flipped byte or a truncated
file is an error naming the file and the tensor, never a silently wrong model.

A save writes into ``<path>.partial`` and the coordinator renames it to ``<path>`` once every
file and the metadata are written and fsynced (the previous checkpoint, if any, is replaced
only then): a process killed during a save leaves the previous checkpoint intact.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xxhash
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from infinity.errors import CheckpointError
from swap.stream_file import StreamWriter, read_pieces

METADATA_NAME = "metadata.json"
FORMAT = "infinity-checkpoint-1"
PARTIAL_SUFFIX = ".partial"

_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float32,
        torch.float64,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    )
}


@dataclass(frozen=True)
class ChunkLocation:
    file: str
    offset: int
    length: int
    checksum: str


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_of(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise CheckpointError(f"unsupported dtype {name!r} in checkpoint metadata") from None


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The little-endian bytes of ``tensor`` (made contiguous, on the host), without a copy
    when it already is both."""
    tensor = tensor.detach().to("cpu").contiguous()
    if not tensor.numel():
        return memoryview(b"")
    return tensor.reshape(-1).view(torch.uint8).numpy().data


def tensor_from(
    data: bytes | bytearray, dtype: torch.dtype, shape: tuple[int, ...]
) -> torch.Tensor:
    """A tensor over ``data`` (a bytearray is used in place; bytes are copied)."""
    buffer = data if isinstance(data, bytearray) else bytearray(data)
    raw = torch.from_numpy(np.frombuffer(buffer, dtype=np.uint8))
    return raw.view(dtype).reshape(shape)


def fsync_directory(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class InfinityStorageWriter(StorageWriter):
    """Writes each rank's chunks to its own raw file in ``<path>.partial``; the coordinator
    writes the JSON metadata and renames the directory into place (see the module docstring).
    ``extra_files`` (name -> text) are written by the coordinator beside the metadata;
    ``buffer_size`` and ``buffer_count``: the writer's buffers (the store sizes them to its
    memory plan)."""

    def __init__(
        self,
        path: Path,
        extra_files: dict[str, str] | None = None,
        buffer_size: int = 16 << 20,
        buffer_count: int = 4,
    ) -> None:
        super().__init__()
        self.path = Path(path)
        self.buffer_size = buffer_size
        self.buffer_count = buffer_count
        self.partial = self.path.with_name(self.path.name + PARTIAL_SUFFIX)
        self.extra_files = extra_files or {}
        self.is_coordinator = False
        self.bytes_written = 0

    def reset(self, checkpoint_id: Any = None) -> None:
        pass

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return [
            SavePlan(p.items, storage_data={"file": f"data-{i}.bin"}, planner_data=p.planner_data)
            for i, p in enumerate(plans)
        ]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        name = plan.storage_data["file"]
        results = []
        offset = 0
        for item in plan.items:
            if item.type is WriteItemType.BYTE_IO:
                raise CheckpointError(f"{item.index.fqn}: this storage keeps tensors only")
        # A planner may hand the chunks over in its own order (an asynchronous save gets them
        # as the training thread copies them out): ``stream(items)`` yields (item, tensor).
        stream = getattr(planner, "stream", None)
        chunks: Iterable[tuple[WriteItem, Any]] = (
            stream(plan.items)
            if stream is not None
            else ((item, planner.resolve_data(item)) for item in plan.items)
        )
        # Through the swap backends (O_DIRECT): the page cache's writeback is far slower.
        with StreamWriter(
            self.partial / name, buffer_size=self.buffer_size, buffer_count=self.buffer_count
        ) as file:
            for item, tensor in chunks:
                data = tensor_bytes(tensor)
                checksum = xxhash.xxh3_64_hexdigest(data)
                offset = file.write(data)
                location = ChunkLocation(name, offset, len(data), checksum)
                results.append(
                    WriteResult(index=item.index, size_in_bytes=len(data), storage_data=location)
                )
                self.bytes_written += len(data)
        future: Future[list[WriteResult]] = Future()  # DCP waits on a torch future
        future.set_result(results)
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        storage = {}
        for rank_results in results:
            for result in rank_results:
                location: ChunkLocation = result.storage_data
                storage[_index_key(result.index)] = location.__dict__
        tensors = {}
        for fqn, md in metadata.state_dict_metadata.items():
            if not isinstance(md, TensorStorageMetadata):
                raise CheckpointError(f"{fqn}: this storage keeps tensors only")
            tensors[fqn] = {
                "dtype": dtype_name(md.properties.dtype),
                "size": list(md.size),
                "chunks": [{"offsets": list(c.offsets), "sizes": list(c.sizes)} for c in md.chunks],
            }
        document = {"format": FORMAT, "tensors": tensors, "storage": storage}
        for name, text in self.extra_files.items():
            _write_synced(self.partial / name, text)
        _write_synced(self.partial / METADATA_NAME, json.dumps(document))
        fsync_directory(self.partial)
        publish(self.partial, self.path)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return True

    def storage_meta(self) -> Any:
        return None


def publish(partial: Path, path: Path) -> None:
    """Puts the finished ``partial`` directory at ``path``; an older checkpoint there is
    removed only after the new one is in place under its name."""
    old = path.with_name(path.name + ".old")
    if old.exists():
        shutil.rmtree(old)
    if path.exists():
        os.rename(path, old)
    os.rename(partial, path)
    fsync_directory(path.parent)
    if old.exists():
        shutil.rmtree(old)


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w") as file:
        file.write(text)
        file.flush()
        os.fsync(file.fileno())


def _index_key(index: MetadataIndex) -> str:
    assert index.offset is not None  # every chunk has one
    return index.fqn + "@" + ",".join(str(o) for o in index.offset)


def read_metadata_document(path: Path) -> dict:
    """The checkpoint's metadata.json, checked to be ours."""
    path = Path(path)
    file = path / METADATA_NAME
    if not file.is_file():
        partial = path.with_name(path.name + PARTIAL_SUFFIX)
        hint = f" ({partial} is a save that did not finish)" if partial.exists() else ""
        raise CheckpointError(f"{path} is not a checkpoint: {METADATA_NAME} is missing{hint}")
    try:
        document = json.loads(file.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{file} is corrupt: {exc}") from exc
    if not isinstance(document, dict) or document.get("format") != FORMAT:
        raise CheckpointError(
            f"{file} is not an infinity checkpoint's metadata (format "
            f"{document.get('format') if isinstance(document, dict) else '?'}"
            f", expected {FORMAT})"
        )
    return document


class ChunkReader:
    """Reads and verifies chunks of a checkpoint directory, one at a time."""

    def __init__(self, path: Path, document: dict) -> None:
        self.path = Path(path)
        self.tensors = document["tensors"]
        self.storage = document["storage"]
        self._cached: tuple[tuple[str, tuple[int, ...]], torch.Tensor] | None = None
        self.bytes_read = 0

    def chunk(self, fqn: str, offsets: list[int] | tuple[int, ...]) -> torch.Tensor:
        """One chunk, verified."""
        key = (fqn, tuple(offsets))
        if self._cached is not None and self._cached[0] == key:
            return self._cached[1]
        for _, tensor in self.chunks([key]):
            self._cached = (key, tensor)
            return tensor
        raise AssertionError("unreachable")

    def chunks(
        self, keys: list[tuple[str, tuple[int, ...]]]
    ) -> Iterator[tuple[tuple[str, tuple[int, ...]], torch.Tensor]]:
        """The chunks ``keys`` ((tensor name, offsets)), verified, in file order, with the
        reads of the next ones in flight while each is handed out."""
        by_file: dict[str, list[tuple[tuple[str, tuple[int, ...]], dict, list[int]]]] = {}
        for fqn, offsets in keys:
            name = fqn + "@" + ",".join(str(o) for o in offsets)
            try:
                location = self.storage[name]
                info = self.tensors[fqn]
            except KeyError:
                raise CheckpointError(
                    f"{self.path}: no chunk of {fqn} at {list(offsets)} in the metadata"
                ) from None
            sizes = next(c["sizes"] for c in info["chunks"] if c["offsets"] == list(offsets))
            by_file.setdefault(location["file"], []).append(
                ((fqn, tuple(offsets)), location, sizes)
            )
        for file_name, wanted in sorted(by_file.items()):
            file = self.path / file_name
            if not file.is_file():
                raise CheckpointError(f"{file} is missing: the checkpoint is incomplete")
            pieces = [(location["offset"], location["length"]) for _, location, _ in wanted]
            try:
                for index, data in read_pieces(file, pieces):
                    key, location, sizes = wanted[index]
                    yield key, self._verified(file, key[0], location, sizes, data)
            except OSError as exc:
                raise CheckpointError(f"cannot read {file}: {exc}") from exc

    def _verified(
        self, file: Path, fqn: str, location: dict, sizes: list[int], data: torch.Tensor
    ) -> torch.Tensor:
        if data.numel() != location["length"]:
            raise CheckpointError(
                f"{file} is truncated: {fqn} needs bytes "
                f"{location['offset']}..{location['offset'] + location['length']}"
                f", the file ends before"
            )
        if xxhash.xxh3_64_hexdigest(data.numpy().data) != location["checksum"]:
            raise CheckpointError(
                f"{file} is corrupt: the bytes of {fqn} (offset "
                f"{location['offset']}, {location['length']} bytes) do not "
                f"match their checksum"
            )
        self.bytes_read += data.numel()
        return data.view(dtype_of(self.tensors[fqn]["dtype"])).reshape(tuple(sizes))


class InfinityStorageReader(StorageReader):
    """Reads what :class:`InfinityStorageWriter` wrote, verifying every chunk."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = Path(path)
        self.document = read_metadata_document(self.path)
        self.chunks = ChunkReader(self.path, self.document)

    def reset(self, checkpoint_id: Any = None) -> None:
        pass

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        state: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
        for fqn, info in self.document["tensors"].items():
            state[fqn] = TensorStorageMetadata(
                properties=TensorProperties(dtype=dtype_of(info["dtype"])),
                size=torch.Size(info["size"]),
                chunks=[
                    ChunkStorageMetadata(
                        offsets=torch.Size(c["offsets"]), sizes=torch.Size(c["sizes"])
                    )
                    for c in info["chunks"]
                ],
            )
        return Metadata(state_dict_metadata=state)

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        pass

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        # Each chunk is read (and verified) once, in file order, the next ones in flight.
        by_chunk: dict[tuple[str, tuple[int, ...]], list[Any]] = {}
        for item in plan.items:
            offset = item.storage_index.offset
            assert offset is not None  # every chunk has one
            key = (item.storage_index.fqn, tuple(offset))
            by_chunk.setdefault(key, []).append(item)
        # A planner that can take a read's bytes as they are (``adopt``) is spared a copy.
        adopt = getattr(planner, "adopt", None)
        for key, chunk in self.chunks.chunks(list(by_chunk)):
            for item in by_chunk[key]:
                source = chunk
                for dim, (start, length) in enumerate(zip(item.storage_offsets, item.lengths)):
                    source = source.narrow(dim, start, length)
                if adopt is not None and adopt(item, source):
                    continue
                target = planner.resolve_tensor(item)
                target.copy_(source)
                planner.commit_tensor(item, target)
        future: Future[None] = Future()
        future.set_result(None)
        return future

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return True
