"""io_uring through the ``liburing`` package, on O_DIRECT files.

Facts about the wrapper this is built around:

* every wrapper call holds the GIL, waits included, so this backend never waits inside the ring:
  an eventfd is registered with the ring and a completion thread blocks in ``os.eventfd_read``
  (which releases the GIL), then drains the completion queue without blocking;
* one ring is not thread-safe, so ``get_sqe .. submit`` and the drain run under one lock;
* ``Iovec`` keeps a reference to its buffers forever; it is built over a ctypes proxy of the
  address (which owns nothing) and cached per (address, length), so the pool's memory can still
  be freed and the number of Iovecs stays bounded by the distinct spans used;
* ``cqe[i]`` indexes the raw ring without wrapping, so completions are taken one at a time with
  ``io_uring_peek_cqe`` and ``io_uring_cqe_seen``;
* reading ``CQE.res`` of a failed request raises ``OSError`` carrying the errno.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import Future

from swap.backends.base import IOBackend, IORequest, Op, memory_at

log = logging.getLogger(__name__)

try:  # the package is a hard dependency, but a broken install must not break the other backends
    import liburing as _uring
except Exception as exc:  # pragma: no cover - depends on the install
    _uring = None
    _IMPORT_ERROR: Exception | None = exc
else:
    _IMPORT_ERROR = None

_IOVEC_CACHE_LIMIT = 1 << 16


def uring_unavailable_reason() -> str | None:
    """None when io_uring can be used here, else why not."""
    if _uring is None:
        return f"the liburing package failed to import: {_IMPORT_ERROR}"
    ring = _uring.Ring()
    try:
        _uring.io_uring_queue_init(2, ring, 0)
    except OSError as exc:
        return f"io_uring_queue_init failed: {exc} (kernel too old, or io_uring disabled)"
    _uring.io_uring_queue_exit(ring)
    return None


class UringBackend(IOBackend):
    name = "uring"
    direct = True

    def __init__(self, queue_depth: int) -> None:
        super().__init__(queue_depth)
        reason = uring_unavailable_reason()
        if reason:
            raise OSError(reason)
        entries = 1
        while entries < queue_depth:
            entries *= 2
        self._ring = _uring.Ring()
        _uring.io_uring_queue_init(entries, self._ring, 0)
        self._eventfd = os.eventfd(0, os.EFD_CLOEXEC)
        _uring.io_uring_register_eventfd(self._ring, self._eventfd)
        self._cqe = _uring.Cqe()
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._pending: dict[int, tuple["Future[int]", IORequest]] = {}
        self._iovecs: dict[tuple[int, int], object] = {}
        self._next_id = 1
        self._closing = False
        self._thread = threading.Thread(target=self._complete_loop, name="swap-uring-completion",
                                        daemon=True)
        self._thread.start()

    def submit(self, request: IORequest) -> "Future[int]":
        future: Future[int] = Future()
        future.set_running_or_notify_cancel()
        with self._lock:
            if self._closing:
                raise RuntimeError("the uring backend is closed")
            if len(self._pending) >= self.queue_depth:
                raise RuntimeError(f"more than queue_depth={self.queue_depth} requests in flight")
            sqe = _uring.io_uring_get_sqe(self._ring)
            if sqe is None:
                raise RuntimeError("io_uring submission queue is full")
            iovec = self._iovec(request.address, request.length)
            if request.op is Op.READ:
                _uring.io_uring_prep_readv(sqe, request.fd, iovec, request.offset)
            else:
                _uring.io_uring_prep_writev(sqe, request.fd, iovec, request.offset)
            request_id = self._next_id
            self._next_id += 1
            sqe.user_data = request_id
            self._pending[request_id] = (future, request)
            try:
                _uring.io_uring_submit(self._ring)
            except OSError:
                del self._pending[request_id]
                raise
        return future

    def _iovec(self, address: int, length: int) -> object:
        key = (address, length)
        iovec = self._iovecs.get(key)
        if iovec is None:
            if len(self._iovecs) >= _IOVEC_CACHE_LIMIT:
                self._iovecs.clear()
            iovec = _uring.Iovec([memory_at(address, length)])
            self._iovecs[key] = iovec
        return iovec

    def _complete_loop(self) -> None:
        cpu_start = time.thread_time()
        while True:
            os.eventfd_read(self._eventfd)
            done: list[tuple["Future[int]", int, int]] = []
            with self._lock:
                while True:
                    try:
                        _uring.io_uring_peek_cqe(self._ring, self._cqe)
                    except BlockingIOError:
                        break
                    entry = self._cqe[0]
                    request_id = entry.user_data
                    try:
                        result, err = entry.res, 0
                    except OSError as exc:
                        result, err = -1, exc.errno or 5
                    _uring.io_uring_cqe_seen(self._ring, entry)
                    pending = self._pending.pop(request_id, None)
                    if pending is not None:
                        done.append((pending[0], result, err))
                if not self._pending:
                    self._idle.notify_all()
                stop = self._closing and not self._pending
            for future, result, err in done:
                if err:
                    future.set_exception(OSError(err, os.strerror(err)))
                else:
                    future.set_result(result)
            now = time.thread_time()
            self.counters.add_cpu(now - cpu_start)
            cpu_start = now
            if stop:
                return

    def close(self) -> None:
        with self._lock:
            if self._closing:
                return
            while self._pending:
                self._idle.wait()
            self._closing = True
        os.eventfd_write(self._eventfd, 1)
        self._thread.join()
        _uring.io_uring_unregister_eventfd(self._ring)
        _uring.io_uring_queue_exit(self._ring)
        os.close(self._eventfd)
        self._iovecs.clear()
