"""The swap engine: moves bytes between pool buffers and extents of swap files.

A transfer (one extent range <-> one buffer range) is cut into requests of at most
``block_size`` bytes that never cross a stripe unit. Requests wait in one queue per drive, and
the engine keeps at most ``queue_depth`` of them in flight per drive (and never more than the
backend's own queue depth) across all transfers. Each transfer returns a
``concurrent.futures.Future`` resolving to its logical byte count; ``read_sync``/``write_sync``
are the blocking forms.

Threads: requests complete on the backend's threads (the uring completion thread, the pool's
workers), which only do bookkeeping and submit the next requests. Done-callbacks of the transfer
futures run on one dispatcher thread of the engine, so a callback that blocks (``read_sync`` in
a done-callback, a slow consumer) holds up other callbacks but never the I/O itself. A transfer
future's ``result``/``exception``/``done`` read the transfer's own state, not the dispatcher's
progress, so waiting on another transfer inside a callback works; only
``concurrent.futures.wait``/``as_completed`` inside a callback would wait on the dispatcher.

Short transfers are continued from where they stopped (the kernel may return fewer bytes than
asked); a read that returns 0 bytes means the file is shorter than the extent and fails. Any
other error fails the transfer with a :class:`SwapIOError` that names file, offset and cause.
"""

from __future__ import annotations

import atexit
import errno
import logging
import queue
import threading
import time
import weakref
from collections import deque
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeoutError
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from swap.backends.base import IOBackend, IORequest, Op
from swap.buffers import ALIGNMENT, HostBuffer, align_up
from swap.errors import SwapConfigError, SwapIOError, TransferTimeoutError
from swap.files import Extent, SwapFile, SwapSpace, check_directory
from swap.probe import choose_backend_for, make_backend
from swap.stats import EngineStats, StatsRecorder

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineSettings:
    """How the engine talks to the disk. Field names match the runtime's ``aio`` config.

    ``close_timeout`` bounds how long ``close`` waits for transfers still queued or in flight
    before failing them with :class:`TransferTimeoutError`."""
    backend: str = "auto"
    block_size: int = 1 << 20
    queue_depth: int = 8
    thread_count: int | None = None
    file_size: int = 1 << 30
    close_timeout: float = 60.0

    def __post_init__(self) -> None:
        for name in ("block_size", "queue_depth", "file_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise SwapConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.block_size % ALIGNMENT:
            raise SwapConfigError(f"block_size must be a multiple of {ALIGNMENT}, got "
                                  f"{self.block_size}")
        if self.thread_count is not None and (not isinstance(self.thread_count, int)
                                              or isinstance(self.thread_count, bool)
                                              or self.thread_count < 1):
            raise SwapConfigError(f"thread_count must be a positive integer, got "
                                  f"{self.thread_count!r}")
        if not isinstance(self.close_timeout, (int, float)) or isinstance(self.close_timeout, bool) \
                or not self.close_timeout > 0:
            raise SwapConfigError(f"close_timeout must be a positive number of seconds, got "
                                  f"{self.close_timeout!r}")


class _Transfer:
    __slots__ = ("op", "future", "nbytes", "outstanding", "queued", "error", "buffer", "done",
                 "event")

    def __init__(self, op: Op, nbytes: int, buffer: HostBuffer) -> None:
        self.op = op
        self.future = TransferFuture(self)
        self.future.set_running_or_notify_cancel()
        self.nbytes = nbytes
        self.outstanding = 0  # requests in flight
        self.queued = 0  # requests waiting in a drive queue
        self.error: BaseException | None = None
        self.done = False
        self.event = threading.Event()  # set with ``done``; what TransferFuture waits on
        self.buffer = buffer  # keeps the memory alive while requests are in flight


class TransferFuture(Future):
    """The future of one transfer. Its outcome is known as soon as the last request completes,
    before the dispatcher thread gets to run the done-callbacks: ``result``, ``exception`` and
    ``done`` answer from that, so they never wait on the dispatcher (which may be running the
    very callback that asks)."""

    def __init__(self, transfer: "_Transfer") -> None:
        super().__init__()
        self._transfer = transfer

    def done(self) -> bool:
        return self._transfer.event.is_set() or super().done()

    def result(self, timeout: float | None = None) -> int:
        error = self.exception(timeout)
        if error is not None:
            raise error
        return self._transfer.nbytes

    def exception(self, timeout: float | None = None) -> BaseException | None:
        if not self._transfer.event.wait(timeout):
            # concurrent.futures' own TimeoutError: only an alias of the builtin from 3.11 on
            raise FutureTimeoutError(f"the transfer did not finish within {timeout} s")
        return self._transfer.error


@dataclass(slots=True)
class _Piece:
    transfer: _Transfer
    file: SwapFile
    offset: int
    address: int
    length: int


_STOP = object()

# Engines not yet closed. Their threads keep them alive, so an engine its owner forgot to close
# still gets closed (and its swap files, often GiBs, removed) when the interpreter exits.
_open_engines: "weakref.WeakSet[SwapEngine]" = weakref.WeakSet()


@atexit.register
def _close_open_engines() -> None:
    for engine in list(_open_engines):
        try:
            engine.close()
        except Exception:  # noqa: BLE001 - exiting anyway: report, then close the next one
            log.exception("closing a swap engine at exit failed")


class SwapEngine:
    """Swap files under ``paths`` plus a backend; see the module docstring."""

    def __init__(self, paths: Sequence[Path | str] | Path | str,
                 settings: EngineSettings | None = None, *, keep_files: bool = False,
                 backend: IOBackend | None = None) -> None:
        if isinstance(paths, (str, Path)):
            paths = [paths]
        self.settings = settings or EngineSettings()
        self.keep_files = keep_files
        # Every directory is checked before anything is created in any of them.
        roots = [check_directory(Path(p)) for p in paths]
        if not roots:
            raise SwapConfigError("nvme_path lists no directory")
        if backend is None:
            name = choose_backend_for(self.settings.backend, roots)
            backend = make_backend(name, self.settings.queue_depth * len(roots),
                                   self.settings.thread_count, self.settings.close_timeout)
        self.backend = backend
        self.window = backend.queue_depth
        self.drive_depth = min(self.settings.queue_depth, self.window)
        try:
            self.space = SwapSpace(roots, direct=backend.direct, file_size=self.settings.file_size,
                                   stripe_size=max(self.settings.block_size, ALIGNMENT))
        except BaseException:
            backend.close()
            raise
        self._stats = StatsRecorder()
        self._lock = threading.Lock()
        self._drained = threading.Condition(self._lock)
        self._queues: list[deque[_Piece]] = [deque() for _ in roots]
        self._drive_inflight = [0] * len(roots)
        self._next_queue = 0  # round robin over the drive queues
        self._queued = 0
        self._inflight = 0
        self._active: set[_Transfer] = set()
        self._local = threading.local()
        self._closed = False
        self._resolve: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._dispatcher = threading.Thread(target=self._dispatch, name="swap-callbacks",
                                            daemon=True)
        self._dispatcher.start()
        _open_engines.add(self)
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
              extent_offset: int = 0, buffer_offset: int = 0) -> TransferFuture:
        """Writes ``nbytes`` from ``buffer[buffer_offset:]`` to ``extent[extent_offset:]``.

        Direct I/O moves whole 4096-byte blocks, so a write whose ``nbytes`` is not a multiple
        of 4096 writes zeros after it up to the block end, and zeroes those buffer bytes to say
        so; it must therefore end at the extent's end, where those bytes are padding."""
        return self._start(Op.WRITE, extent, buffer, nbytes, extent_offset, buffer_offset).future

    def read(self, extent: Extent, buffer: HostBuffer, *, nbytes: int | None = None,
             extent_offset: int = 0, buffer_offset: int = 0) -> TransferFuture:
        """Reads ``nbytes`` of ``extent[extent_offset:]`` into ``buffer[buffer_offset:]``.

        The buffer must have room for ``nbytes`` rounded up to 4096; bytes past ``nbytes`` in
        that rounded span are overwritten with what the extent holds there."""
        return self._start(Op.READ, extent, buffer, nbytes, extent_offset, buffer_offset).future

    def write_sync(self, extent: Extent, buffer: HostBuffer, **kwargs: int) -> int:
        return self._start(Op.WRITE, extent, buffer, **_range(kwargs)).future.result()

    def read_sync(self, extent: Extent, buffer: HostBuffer, **kwargs: int) -> int:
        return self._start(Op.READ, extent, buffer, **_range(kwargs)).future.result()

    def _start(self, op: Op, extent: Extent, buffer: HostBuffer, nbytes: int | None = None,
               extent_offset: int = 0, buffer_offset: int = 0) -> _Transfer:
        if nbytes is None:
            nbytes = extent.nbytes - extent_offset
        if extent_offset % ALIGNMENT or buffer_offset % ALIGNMENT or buffer_offset < 0:
            raise ValueError(f"extent_offset and buffer_offset must be non-negative multiples of "
                             f"{ALIGNMENT}, got {extent_offset} and {buffer_offset}")
        if nbytes < 0 or extent_offset < 0 or extent_offset + nbytes > extent.nbytes:
            raise ValueError(f"range [{extent_offset}, {extent_offset + nbytes}) is outside the "
                             f"extent's {extent.nbytes} bytes")
        self.space.check_extent(extent)
        padded = align_up(nbytes)
        if buffer_offset + padded > buffer.nbytes:
            raise ValueError(f"{op.value} of {nbytes} bytes (padded to {padded}) at buffer offset "
                             f"{buffer_offset} does not fit in a {buffer.nbytes}-byte buffer")
        if op is Op.WRITE and padded > nbytes:
            if extent_offset + nbytes != extent.nbytes:
                raise ValueError(f"a write of {nbytes} bytes (not a multiple of {ALIGNMENT}) "
                                 f"must end at the extent's end ({extent.nbytes}), else the "
                                 f"block padding would overwrite the bytes after it")
            # Deterministic padding: the file holds exactly what was written, then zeros.
            buffer.array[buffer_offset + nbytes:buffer_offset + padded] = 0
        transfer = _Transfer(op, nbytes, buffer)
        pieces = []
        block = self.settings.block_size
        base = buffer.address + buffer_offset
        for file, file_offset, ext_offset, length in extent.locate(extent_offset, padded):
            address = base + (ext_offset - extent_offset)
            for start in range(0, length, block):
                pieces.append(_Piece(transfer, file, file_offset + start, address + start,
                                     min(block, length - start)))
        with self._lock:
            if self._closed:
                raise RuntimeError("the swap engine is closed")
            # Under the engine lock, so no other thread can finish it before it has started.
            self._stats.transfer_started(op.value)
            self._active.add(transfer)
            transfer.queued = len(pieces)
            self._queued += len(pieces)
            for piece in pieces:
                self._queues[piece.file.drive].append(piece)
            if not pieces:  # nbytes == 0
                self._finish_locked(transfer)
        self._pump()
        return transfer

    def _pump(self) -> None:
        # A completion that arrives while this thread is already pumping (a backend that finished
        # inside submit) leaves the queue to the running loop instead of recursing. That loop
        # re-checks the queues after every submit, so nothing is left behind. No user code runs
        # in here (callbacks run on the dispatcher), so the outer loop always gets back control.
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
                piece = self._take_locked()
                if piece is None:
                    return
                transfer = piece.transfer
                transfer.queued -= 1
                self._queued -= 1
                if transfer.error is not None or transfer.done:
                    # A failed transfer's remaining requests are dropped, not submitted.
                    self._finish_locked(transfer)
                    self._notify_if_drained_locked()
                    continue
                self._inflight += 1
                self._drive_inflight[piece.file.drive] += 1
                transfer.outstanding += 1
            self._stats.request_submitted(transfer.op.value)
            request = IORequest(transfer.op, piece.file.fd, piece.offset, piece.address,
                                piece.length)
            try:
                future = self.backend.submit(request)
            except Exception as exc:  # noqa: BLE001 - any failure fails this transfer, no leak
                self._on_done(piece, None, exc)
                continue
            future.add_done_callback(lambda f, p=piece: self._on_done(p, f, None))

    def _take_locked(self) -> _Piece | None:
        """The next request to submit: round robin over drives with a free queue slot."""
        if self._inflight >= self.window:
            return None
        count = len(self._queues)
        for step in range(count):
            drive = (self._next_queue + step) % count
            if self._queues[drive] and self._drive_inflight[drive] < self.drive_depth:
                self._next_queue = (drive + 1) % count
                return self._queues[drive].popleft()
        return None

    def _on_done(self, piece: _Piece, future: "Future[int] | None",
                 error: BaseException | None) -> None:
        transfer = piece.transfer
        result = 0
        if future is not None:
            if future.cancelled():
                error = OSError(errno.ECANCELED, "the backend cancelled the request")
            else:
                error = future.exception()
                if error is None:
                    result = future.result()
        requeue = None
        detail = ""
        if error is None and result < piece.length:
            if result <= 0 or (self.backend.direct and result % ALIGNMENT):
                error = OSError(0, "short transfer")
                detail = ("the file is shorter than the extent (truncated or replaced swap file?)"
                          if transfer.op is Op.READ and result == 0
                          else f"the kernel moved {result} of {piece.length} bytes")
            else:
                requeue = _Piece(transfer, piece.file, piece.offset + result,
                                 piece.address + result, piece.length - result)
        elif error is not None and not getattr(error, "errno", 0):
            detail = f"{type(error).__name__}: {error}"
        self._stats.request_done()
        with self._lock:
            self._inflight -= 1
            self._drive_inflight[piece.file.drive] -= 1
            transfer.outstanding -= 1
            if requeue is not None:
                # The rest goes first in its drive's queue: the transfer is already under way.
                self._stats.note_retry()
                transfer.queued += 1
                self._queued += 1
                self._queues[piece.file.drive].appendleft(requeue)
            elif error is not None and transfer.error is None and not transfer.done:
                err = getattr(error, "errno", 0) or 0
                transfer.error = SwapIOError(transfer.op.value, piece.file.path, piece.offset,
                                             piece.length, err, detail)
                transfer.error.__cause__ = error
                self._stats.note_error()
            self._finish_locked(transfer)
            self._notify_if_drained_locked()
        self._pump()

    def _finish_locked(self, transfer: _Transfer) -> None:
        """Once nothing of the transfer remains queued or in flight, marks it done and hands its
        future to the dispatcher: the future's callbacks may block or start new transfers, which
        must happen neither under this lock nor on a backend thread."""
        if transfer.outstanding or transfer.queued or transfer.done:
            return
        transfer.done = True
        self._active.discard(transfer)
        self._stats.transfer_finished(transfer.op.value, 0 if transfer.error else transfer.nbytes)
        transfer.event.set()
        self._resolve.put(transfer)

    def _notify_if_drained_locked(self) -> None:
        if not self._inflight and not self._queued:
            self._drained.notify_all()

    def _dispatch(self) -> None:
        while True:
            item = self._resolve.get()
            if item is _STOP:
                return
            transfer: _Transfer = item  # type: ignore[assignment]
            # Future runs (and logs the failures of) its callbacks itself; nothing escapes here.
            if transfer.error is not None:
                Future.set_exception(transfer.future, transfer.error)
            else:
                Future.set_result(transfer.future, transfer.nbytes)

    # -- reporting and teardown -------------------------------------------------------------
    def stats(self) -> EngineStats:
        return self._stats.snapshot(self.backend.counters.thread_cpu_seconds)

    @property
    def backend_name(self) -> str:
        return self.backend.name

    def close(self) -> None:
        """Waits (at most ``settings.close_timeout``) for transfers under way, fails whatever is
        left with :class:`TransferTimeoutError`, then closes the backend and removes the files
        (unless ``keep_files``). New transfers are refused from the moment close starts."""
        deadline = time.monotonic() + self.settings.close_timeout
        with self._lock:
            if self._closed:
                return
            self._closed = True
            _open_engines.discard(self)
            while self._inflight or self._queued:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._drained.wait(remaining)
            if self._inflight or self._queued:
                log.error("swap engine: closing with %d request(s) in flight and %d queued after "
                          "%.3g s; their transfers fail", self._inflight, self._queued,
                          self.settings.close_timeout)
                for drive_queue in self._queues:
                    drive_queue.clear()
                self._queued = 0
                self._fail_active_locked()
        self.backend.close()
        with self._lock:
            # A backend that never resolves a request (closed or not) must not leave a transfer
            # pending forever.
            self._fail_active_locked()
        self.space.close(keep=self.keep_files)
        self._resolve.put(_STOP)
        if self._dispatcher is not threading.current_thread():
            self._dispatcher.join(max(1.0, deadline - time.monotonic()))

    def _fail_active_locked(self) -> None:
        for transfer in list(self._active):
            if transfer.error is None:
                transfer.error = TransferTimeoutError(
                    f"the swap engine was closed before this {transfer.op.value} of "
                    f"{transfer.nbytes} bytes finished (close_timeout="
                    f"{self.settings.close_timeout:g} s)")
                self._stats.note_error()
            transfer.outstanding = transfer.queued = 0
            self._finish_locked(transfer)

    def __enter__(self) -> "SwapEngine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _range(kwargs: dict[str, int]) -> dict[str, int]:
    """The keyword arguments of the sync forms, checked like the async forms check theirs."""
    unknown = set(kwargs) - {"nbytes", "extent_offset", "buffer_offset"}
    if unknown:
        raise TypeError(f"unexpected keyword argument(s): {', '.join(sorted(unknown))}")
    return kwargs
