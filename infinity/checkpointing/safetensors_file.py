"""A safetensors file read with plain positioned reads, a range of one tensor at a time.

The format: an 8-byte little-endian header length, a JSON header giving each tensor's dtype,
shape and byte range (``data_offsets``, counted from the end of the header; ``__metadata__``
holds strings), then the tensors' raw little-endian bytes, row-major, so any flat range of a
tensor is one contiguous range of the file. A range is read with ``os.preadv`` into a buffer
the caller reuses (:class:`ReadBuffer`), so the process holds that range and nothing else of
the file: the file's pages stay in the page cache, which the kernel reclaims, outside the
process's resident set. A memory map (``safetensors.safe_open``) instead keeps every page it
touched resident in the process until it is unmapped: loading a 1.74 GB checkpoint through one
raised the peak RSS by 1.74 GB, under a 256 MiB host budget.

The header is checked before anything is read: each tensor's dtype known, its byte range
inside the file and as long as its shape and dtype say. A file that fails is a
``CheckpointError`` naming it and what is wrong; reading it runs no code."""

from __future__ import annotations

import json
import math
import os
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import torch

from infinity.errors import CheckpointError

#: safetensors' dtype names torch has a dtype for (some only in recent versions; not the
#: sub-byte F4 and F6)
DTYPES: dict[str, torch.dtype] = {
    name: dtype
    for name, dtype in {
        "F64": torch.float64,
        "F32": torch.float32,
        "F16": torch.float16,
        "BF16": torch.bfloat16,
        "I64": torch.int64,
        "I32": torch.int32,
        "I16": torch.int16,
        "I8": torch.int8,
        "U8": torch.uint8,
        "BOOL": torch.bool,
        "C64": torch.complex64,
        "F8_E4M3": getattr(torch, "float8_e4m3fn", None),
        "F8_E5M2": getattr(torch, "float8_e5m2", None),
        "F8_E4M3FNUZ": getattr(torch, "float8_e4m3fnuz", None),
        "F8_E5M2FNUZ": getattr(torch, "float8_e5m2fnuz", None),
        "F8_E8M0": getattr(torch, "float8_e8m0fnu", None),
        "U16": getattr(torch, "uint16", None),
        "U32": getattr(torch, "uint32", None),
        "U64": getattr(torch, "uint64", None),
    }.items()
    if dtype is not None
}
#: the largest header safetensors itself reads
MAX_HEADER_BYTES = 100_000_000
#: how far past a read the kernel is asked to read the file ahead (into the page cache, which
#: is not the process's memory), at least two reads' worth
READ_AHEAD_BYTES = 32 << 20


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor's bytes are in the file."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # of its first byte, from the start of the file

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class ReadBuffer:
    """Host memory for reads, reused from one read to the next and grown to the largest."""

    def __init__(self) -> None:
        self._data = bytearray()

    def take(self, nbytes: int) -> memoryview:
        if nbytes > len(self._data):
            self._data = bytearray(nbytes)  # the old one goes with the last tensor viewing it
        return memoryview(self._data)[:nbytes]


class SafetensorsFile:
    """One safetensors file, open for reads of its tensors' ranges (see the module docstring)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        try:
            self._fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            raise CheckpointError(f"cannot open {self.path}: {exc.strerror}") from exc
        self._advised = 0  # the end of the range read ahead so far
        try:
            self.tensors = self._header()
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        except BaseException:
            os.close(self._fd)
            raise

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def _bad(self, cause: str) -> CheckpointError:
        return CheckpointError(
            f"{self.path} is not a readable safetensors file: {cause}; the download or copy may "
            "be incomplete or damaged: fetch the file again"
        )

    def _header(self) -> dict[str, TensorInfo]:
        if sys.byteorder != "little":
            raise CheckpointError(
                f"{self.path}: safetensors holds little-endian bytes, this host's are not"
            )
        size = os.fstat(self._fd).st_size
        if size < 8:
            raise self._bad(f"{size} bytes, shorter than the 8-byte header length")
        (length,) = struct.unpack("<Q", os.pread(self._fd, 8, 0))
        if length > min(MAX_HEADER_BYTES, size - 8):
            raise self._bad(f"a header of {length} bytes in a file of {size}")
        try:
            header = json.loads(os.pread(self._fd, length, 8))
        except (UnicodeDecodeError, ValueError) as exc:
            raise self._bad(f"its header is not JSON ({exc})") from exc
        if not isinstance(header, dict):
            raise self._bad("its header is not a JSON object")
        tensors = {}
        for key, spec in header.items():
            if key != "__metadata__":
                tensors[key] = self._tensor(key, spec, data=8 + length, size=size)
        return tensors

    def _tensor(self, key: str, spec: object, data: int, size: int) -> TensorInfo:
        if not isinstance(spec, dict):
            raise self._bad(f"{key}'s entry is not an object")
        dtype = DTYPES.get(str(spec.get("dtype")))
        if dtype is None:
            raise self._bad(f"{key} has dtype {spec.get('dtype')!r}, not one of {sorted(DTYPES)}")
        shape, offsets = spec.get("shape"), spec.get("data_offsets")
        if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
            raise self._bad(f"{key} has shape {shape!r}, not a list of sizes")
        if not (
            isinstance(offsets, list)
            and len(offsets) == 2
            and all(type(o) is int for o in offsets)
            and 0 <= offsets[0] <= offsets[1]
        ):
            raise self._bad(f"{key} has data_offsets {offsets!r}, not [begin, end]")
        info = TensorInfo(dtype, tuple(shape), data + offsets[0])
        if offsets[1] - offsets[0] != info.numel * dtype.itemsize:
            raise self._bad(
                f"{key} spans {offsets[1] - offsets[0]} bytes, its shape {shape} of {dtype} "
                f"needs {info.numel * dtype.itemsize}"
            )
        if data + offsets[1] > size:
            raise self._bad(
                f"{key} ends at byte {data + offsets[1]}, past the file's end ({size} bytes)"
            )
        return info

    def _read_ahead(self, start: int, nbytes: int) -> None:
        """Asks the kernel to read ``start`` to ``start + nbytes`` into the page cache while the
        caller uses what it read: each range once, as the reads move on."""
        end = start + nbytes
        if hasattr(os, "posix_fadvise") and end > self._advised + nbytes // 2:
            begin = max(start, self._advised)
            os.posix_fadvise(self._fd, begin, end - begin, os.POSIX_FADV_WILLNEED)
            self._advised = end

    def read(self, key: str, first: int, count: int, buffer: ReadBuffer) -> torch.Tensor:
        """Elements ``first`` to ``first + count`` of tensor ``key``'s flat values, in its dtype,
        read into ``buffer``: valid until the next read into it."""
        info = self.tensors[key]
        if not 0 <= first <= first + count <= info.numel:
            raise IndexError(f"{key}: elements {first}..{first + count} of {info.numel}")
        if count == 0:
            return torch.empty(0, dtype=info.dtype)
        nbytes = count * info.dtype.itemsize
        view = buffer.take(nbytes)
        start = info.offset + first * info.dtype.itemsize
        done = 0
        while done < nbytes:
            got = os.preadv(self._fd, [view[done:]], start + done)
            if got <= 0:  # shortened since its header was checked
                raise self._bad(f"it ends at byte {start + done}, inside {key}")
            done += got
        self._read_ahead(start + nbytes, max(2 * nbytes, READ_AHEAD_BYTES))
        return torch.frombuffer(view, dtype=info.dtype, count=count)
