"""The swap engine: moves bytes between pool buffers and extents of swap files.

A transfer (one extent range <-> one buffer range) is cut into requests of at most
``block_size`` bytes that never cross a stripe unit, and the engine keeps at most
``queue_depth`` requests per drive in flight across all transfers. Each transfer returns a
``concurrent.futures.Future`` resolving to its logical byte count; ``read_sync``/``write_sync``
are the blocking forms and simply wait on it.

Short transfers are continued from where they stopped (the kernel may return fewer bytes than
asked); a read that returns 0 bytes means the file is shorter than the extent and fails. Any
other error fails the transfer with a :class:`SwapIOError` that names file, offset and cause.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from swap.backends.base import IOBackend, IORequest, Op
from swap.buffers import ALIGNMENT, HostBuffer, align_up
from swap.errors import SwapConfigError, SwapIOError
from swap.files import Extent, SwapFile, SwapSpace
from swap.probe import choose_backend, make_backend
from swap.stats import EngineStats, StatsRecorder

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineSettings:
    """How the engine talks to the disk. Field names match the runtime's ``aio`` config."""
    backend: str = "auto"
    block_size: int = 1 << 20
    queue_depth: int = 8
    thread_count: int | None = None
    file_size: int = 1 << 30

    def __post_init__(self) -> None:
        for name in ("block_size", "queue_depth", "file_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise SwapConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.block_size % ALIGNMENT:
            raise SwapConfigError(f"block_size must be a multiple of {ALIGNMENT}, got "
                                  f"{self.block_size}")
        if self.thread_count is not None and (not isinstance(self.thread_count, int)
                                              or self.thread_count < 1):
            raise SwapConfigError(f"thread_count must be a positive integer, got "
                                  f"{self.thread_count!r}")


class _Transfer:
    __slots__ = ("op", "future", "nbytes", "outstanding", "queued", "error", "buffer", "done")

    def __init__(self, op: Op, nbytes: int, buffer: HostBuffer) -> None:
        self.op = op
        self.future: Future[int] = Future()
        self.future.set_running_or_notify_cancel()
        self.nbytes = nbytes
        self.outstanding = 0
        self.queued = 0
        self.error: BaseException | None = None
        self.done = False
        self.buffer = buffer  # keeps the memory alive while requests are in flight


@dataclass(slots=True)
class _Piece:
    transfer: _Transfer
    file: SwapFile
    offset: int
    address: int
    length: int


class SwapEngine:
    """Swap files under ``paths`` plus a backend; see the module docstring."""

    def __init__(self, paths: Sequence[Path | str] | Path | str,
                 settings: EngineSettings | None = None, *, keep_files: bool = False,
                 backend: IOBackend | None = None) -> None:
        if isinstance(paths, (str, Path)):
            paths = [paths]
        self.settings = settings or EngineSettings()
        self.keep_files = keep_files
        roots = [Path(p) for p in paths]
        if backend is None:
            from swap.files import check_directory
            name = choose_backend(self.settings.backend, check_directory(roots[0]))
            window = self.settings.queue_depth * len(roots)
            backend = make_backend(name, window, self.settings.thread_count)
        self.backend = backend
        self.window = backend.queue_depth
        try:
            self.space = SwapSpace(roots, direct=backend.direct, file_size=self.settings.file_size,
                                   stripe_size=max(self.settings.block_size, ALIGNMENT))
        except BaseException:
            backend.close()
            raise
        self._stats = StatsRecorder()
        self._lock = threading.Lock()
        self._queue: deque[_Piece] = deque()
        self._inflight = 0
        self._local = threading.local()
        self._closed = False
        log.info("swap engine: backend=%s block_size=%d queue_depth=%d dirs=%s", backend.name,
                 self.settings.block_size, self.settings.queue_depth,
                 [str(d) for d in self.space.run_dirs])

    # -- allocation -------------------------------------------------------------------------
    def allocate(self, nbytes: int) -> Extent:
        return self.space.allocate(nbytes)

    def free(self, extent: Extent) -> None:
        self.space.free(extent)

    # -- transfers --------------------------------------------------------------------------
    def write(self, extent: Extent, buffer: HostBuffer, *, nbytes: int | None = None,
              extent_offset: int = 0, buffer_offset: int = 0) -> "Future[int]":
        """Writes ``nbytes`` from ``buffer[buffer_offset:]`` to ``extent[extent_offset:]``."""
        return self._start(Op.WRITE, extent, buffer, nbytes, extent_offset, buffer_offset)

    def read(self, extent: Extent, buffer: HostBuffer, *, nbytes: int | None = None,
             extent_offset: int = 0, buffer_offset: int = 0) -> "Future[int]":
        """Reads ``nbytes`` of ``extent[extent_offset:]`` into ``buffer[buffer_offset:]``.

        The buffer must have room for ``nbytes`` rounded up to 4096; bytes past ``nbytes`` in
        that rounded span are overwritten with the extent's padding."""
        return self._start(Op.READ, extent, buffer, nbytes, extent_offset, buffer_offset)

    def write_sync(self, extent: Extent, buffer: HostBuffer, **kwargs: int) -> int:
        return self.write(extent, buffer, **kwargs).result()

    def read_sync(self, extent: Extent, buffer: HostBuffer, **kwargs: int) -> int:
        return self.read(extent, buffer, **kwargs).result()

    def _start(self, op: Op, extent: Extent, buffer: HostBuffer, nbytes: int | None,
               extent_offset: int, buffer_offset: int) -> "Future[int]":
        if nbytes is None:
            nbytes = extent.nbytes - extent_offset
        if extent_offset % ALIGNMENT or buffer_offset % ALIGNMENT:
            raise ValueError(f"extent_offset and buffer_offset must be multiples of {ALIGNMENT}")
        if nbytes < 0 or extent_offset + nbytes > extent.nbytes:
            raise ValueError(f"range [{extent_offset}, {extent_offset + nbytes}) is outside the "
                             f"extent's {extent.nbytes} bytes")
        padded = align_up(nbytes)
        if buffer_offset + padded > buffer.nbytes:
            raise ValueError(f"{op.value} of {nbytes} bytes (padded to {padded}) at buffer offset "
                             f"{buffer_offset} does not fit in a {buffer.nbytes}-byte buffer")
        if op is Op.WRITE and padded > nbytes:
            # Deterministic padding: the file holds exactly what was written, then zeros.
            start = buffer_offset + nbytes
            buffer.array[start:buffer_offset + padded] = 0
        transfer = _Transfer(op, nbytes, buffer)
        if padded == 0:
            transfer.future.set_result(0)
            return transfer.future
        pieces = []
        block = self.settings.block_size
        base = buffer.address + buffer_offset
        for file, file_offset, ext_offset, length in extent.locate(extent_offset, padded):
            address = base + (ext_offset - extent_offset)
            for start in range(0, length, block):
                pieces.append(_Piece(transfer, file, file_offset + start, address + start,
                                     min(block, length - start)))
        transfer.queued = len(pieces)
        self._stats.transfer_started(op.value)
        with self._lock:
            if self._closed:
                raise RuntimeError("the swap engine is closed")
            self._queue.extend(pieces)
        self._pump()
        return transfer.future

    def _pump(self) -> None:
        # A completion that arrives while this thread is already pumping (a backend that finished
        # before add_done_callback) leaves the queue to the running loop instead of recursing.
        if getattr(self._local, "pumping", False):
            return
        self._local.pumping = True
        try:
            self._pump_loop()
        finally:
            self._local.pumping = False

    def _pump_loop(self) -> None:
        while True:
            with self._lock:
                if self._inflight >= self.window or not self._queue:
                    return
                piece = self._queue.popleft()
                transfer = piece.transfer
                transfer.queued -= 1
                skip = transfer.error is not None
                if skip:
                    finished = self._finished(transfer)
                else:
                    finished = None
                    self._inflight += 1
                    transfer.outstanding += 1
            if skip:
                if finished is not None:
                    finished()
                continue
            self._stats.request_submitted(transfer.op.value)
            request = IORequest(transfer.op, piece.file.fd, piece.offset, piece.address,
                                piece.length)
            try:
                future = self.backend.submit(request)
            except OSError as exc:
                self._on_done(piece, None, exc)
                continue
            future.add_done_callback(lambda f, p=piece: self._on_done(p, f, None))

    def _on_done(self, piece: _Piece, future: "Future[int] | None",
                 error: BaseException | None) -> None:
        transfer = piece.transfer
        result = 0
        if future is not None:
            error = future.exception()
            if error is None:
                result = future.result()
        requeue = None
        detail = ""
        if error is None and result < piece.length:
            if result == 0 or (self.backend.direct and result % ALIGNMENT):
                error = OSError(0, "short transfer")
                detail = ("the file is shorter than the extent (truncated or replaced swap file?)"
                          if transfer.op is Op.READ and result == 0
                          else f"the kernel moved {result} of {piece.length} bytes")
            else:
                requeue = _Piece(transfer, piece.file, piece.offset + result,
                                 piece.address + result, piece.length - result)
        self._stats.request_done()
        with self._lock:
            self._inflight -= 1
            transfer.outstanding -= 1
            if requeue is not None:
                self._stats.retries += 1
                transfer.queued += 1
                self._queue.appendleft(requeue)
            elif error is not None and transfer.error is None:
                err = getattr(error, "errno", 0) or 0
                transfer.error = SwapIOError(
                    transfer.op.value, piece.file.path, piece.offset, piece.length, err,
                    detail if err == 0 else "")
                transfer.error.__cause__ = error
                self._stats.errors += 1
            finished = self._finished(transfer)
        if finished is not None:
            finished()
        self._pump()

    def _finished(self, transfer: _Transfer):
        """Called under the lock. Once nothing of the transfer remains queued or in flight,
        returns the call that resolves its future; the caller makes it after releasing the lock,
        because the future's callbacks may start new transfers."""
        if transfer.outstanding or transfer.queued or transfer.done:
            return None
        transfer.done = True
        self._stats.transfer_finished(transfer.op.value,
                                      0 if transfer.error else transfer.nbytes)
        if transfer.error is not None:
            return lambda: transfer.future.set_exception(transfer.error)
        return lambda: transfer.future.set_result(transfer.nbytes)

    # -- reporting and teardown -------------------------------------------------------------
    def stats(self) -> EngineStats:
        return self._stats.snapshot(self.backend.counters.thread_cpu_seconds)

    @property
    def backend_name(self) -> str:
        return self.backend.name

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.backend.close()
        self.space.close(keep=self.keep_files)

    def __enter__(self) -> "SwapEngine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
