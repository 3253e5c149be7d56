"""Whole files written and read at the disk's speed: a stream of pieces appended to one file
through the swap backends (O_DIRECT where the file system allows it), for checkpoints.

Through the page cache, a file of a few GB is written at the pace of the kernel's writeback (a
quarter of the disk's bandwidth measured on this project's virtio disk) and then fsynced.
:class:`StreamWriter` instead copies each piece into aligned buffers and keeps up to
``buffer_count`` of them in flight with the backend; every piece starts at a multiple of 4096 bytes
(zero padding in between), so a reader can read it back with O_DIRECT too (:func:`read_pieces`,
which keeps several reads in flight the same way). Every call returns when its bytes are copied, not
written; ``close`` waits for the writes, fsyncs and reports the first failure, naming the file.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path

import torch

from swap.backends.base import IORequest, Op
from swap.buffers import ALIGNMENT, BufferPool, HostBuffer, align_up
from swap.errors import SwapIOError
from swap.probe import choose_backend_for, make_backend


class StreamWriter:
    """Appends pieces to ``path`` (created, must not exist); see the module docstring."""

    def __init__(
        self,
        path: Path,
        *,
        buffer_size: int = 16 << 20,
        buffer_count: int = 4,
        backend: str = "auto",
    ) -> None:
        self.path = Path(path)
        name = choose_backend_for(backend, [self.path.parent])
        self.backend = make_backend(name, buffer_count)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
        if self.backend.direct:
            flags |= os.O_DIRECT
        try:
            self.fd = os.open(self.path, flags, 0o600)
        except OSError:
            self.backend.close()
            raise
        self.pool = BufferPool(buffer_count, buffer_size, name="stream")
        self.free = list(self.pool.buffers)
        self.in_flight: list[tuple[Future[int], HostBuffer, int, int]] = []
        self.buffer = self.free.pop()
        self.filled = 0  # bytes in the current buffer
        self.flushed = 0  # file offset where the current buffer goes
        #: the first failed write: (its file offset, its length, the error)
        self.error: tuple[int, int, OSError] | None = None
        self.closed = False

    @property
    def position(self) -> int:
        return self.flushed + self.filled

    def write(self, data: memoryview | bytes) -> int:
        """Appends ``data`` at the next multiple of 4096; returns the offset it starts at."""
        self._pad_to(align_up(self.position))
        start = self.position
        view = memoryview(data).cast("B")
        done = 0
        while done < len(view):
            room = self.buffer.nbytes - self.filled
            take = min(room, len(view) - done)
            self.buffer.memoryview(self.filled, self.filled + take)[:] = view[done : done + take]
            self.filled += take
            done += take
            if self.filled == self.buffer.nbytes:
                self._submit()
        return start

    def _pad_to(self, offset: int) -> None:
        gap = offset - self.position
        if gap:
            self.buffer.memoryview(self.filled, self.filled + gap)[:] = bytes(gap)
            self.filled += gap
            if self.filled == self.buffer.nbytes:
                self._submit()

    def _submit(self) -> None:
        length = align_up(self.filled)
        if length > self.filled:  # the file's tail: padded to the block size
            self.buffer.memoryview(self.filled, length)[:] = bytes(length - self.filled)
        future = self.backend.submit(
            IORequest(Op.WRITE, self.fd, self.flushed, self.buffer.address, length)
        )
        self.in_flight.append((future, self.buffer, self.flushed, length))
        self.flushed += self.filled
        self.filled = 0
        while not self.free:
            self._reap_oldest()
        self.buffer = self.free.pop()

    def _reap_oldest(self) -> None:
        future, buffer, offset, length = self.in_flight.pop(0)
        try:
            written = future.result()
            if written != length:
                raise OSError(errno.EIO, f"short write: {written} of {length} bytes")
        except OSError as exc:
            self.error = self.error or (offset, length, exc)
        self.free.append(buffer)

    def close(self) -> int:
        """Writes what is buffered, waits for every write, fsyncs; returns the file's size.
        Raises :class:`SwapIOError` naming the file if a write failed."""
        if self.closed:
            return self.flushed
        self.closed = True
        try:
            if self.filled:
                self._submit()
            while self.in_flight:
                self._reap_oldest()
            if self.error is None:
                os.fsync(self.fd)
        finally:
            os.close(self.fd)
            self.backend.close()
            self.pool.close()
        if self.error is not None:
            offset, length, exc = self.error
            raise SwapIOError("write", self.path, offset, length, exc.errno or 0, str(exc)) from exc
        return self.flushed

    def __enter__(self) -> StreamWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_pieces(
    path: Path,
    pieces: list[tuple[int, int]],
    *,
    request_size: int = 8 << 20,
    depth: int = 4,
    backend: str = "auto",
) -> Iterator[tuple[int, torch.Tensor]]:
    """Reads ``pieces`` ((offset, length), offsets multiples of 4096 as :class:`StreamWriter`
    places them) of ``path``, in file order, with up to ``depth`` requests of ``request_size``
    bytes in flight through the backend (O_DIRECT where allowed), each straight into the
    piece's own aligned memory. Yields (index in ``pieces``, its bytes as a uint8 tensor) as
    each completes; a piece past the end of the file comes back short, so the caller can say
    the file is truncated. Raises :class:`SwapIOError` naming the file if a read fails."""
    path = Path(path)
    requests = []  # (piece index, file offset, length, offset in the piece)
    order = sorted(range(len(pieces)), key=lambda i: pieces[i][0])
    for index in order:
        offset, length = pieces[index]
        if offset % ALIGNMENT:
            raise ValueError(f"piece at {offset} of {path} is not 4096-aligned")
        for start in range(0, align_up(length), request_size):
            requests.append(
                (index, offset + start, min(request_size, align_up(length) - start), start)
            )
    left = {i: 0 for i in order}
    for request in requests:
        left[request[0]] += 1
    for index in order:
        if not left[index]:
            yield index, torch.empty(0, dtype=torch.uint8)
    if not requests:
        return
    name = choose_backend_for(backend, [path.parent])
    io = make_backend(name, depth)
    flags = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | (os.O_DIRECT if io.direct else 0)
    fd = os.open(path, flags)
    flight: list[tuple[Future[int], tuple[int, int, int, int]]] = []
    memory: dict[int, torch.Tensor] = {}
    got: dict[int, int] = {}
    try:
        pending = iter(requests)
        next_request = next(pending, None)
        while flight or next_request is not None:
            while next_request is not None and len(flight) < depth:
                index, file_offset, length, start = next_request
                if index not in memory:
                    memory[index] = _aligned(align_up(pieces[index][1]))
                address = memory[index].data_ptr() + start
                flight.append(
                    (io.submit(IORequest(Op.READ, fd, file_offset, address, length)), next_request)
                )
                next_request = next(pending, None)
            future, (index, request_offset, length, start) = flight.pop(0)
            try:
                n = future.result()
            except OSError as exc:
                raise SwapIOError(
                    "read", path, request_offset, length, exc.errno or 0, str(exc)
                ) from exc
            got[index] = got.get(index, 0) + max(0, min(n, pieces[index][1] - start))
            left[index] -= 1
            if not left[index]:
                yield index, memory.pop(index)[: got[index]]
    finally:
        for future, _ in flight:
            try:
                future.result()
            except OSError:
                pass
        os.close(fd)
        io.close()


def _aligned(nbytes: int) -> torch.Tensor:
    """``nbytes`` of uint8 starting at a multiple of 4096 (what O_DIRECT reads into)."""
    raw = torch.empty(nbytes + ALIGNMENT, dtype=torch.uint8)
    shift = -raw.data_ptr() % ALIGNMENT
    return raw[shift : shift + nbytes]


__all__ = ["ALIGNMENT", "StreamWriter", "read_pieces"]
