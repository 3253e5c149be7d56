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

``io_uring_submit`` is a system call made with the GIL held, so requests are handed over in
batches where possible: within ``plugged()`` (the engine plugs while it fills the queue, and the
completion thread while it resolves one drain's completions, whose callbacks submit the next
requests) SQEs are only prepared, and one submit sends them all when the context ends.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Iterator

from swap.backends.base import (BackendAbandonedError, IOBackend, IORequest, Op, memory_at,
                                resolve)

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


# io_uring_enter errors after which the SQEs stay in the ring and go in with the next submit.
_TRANSIENT = (errno.EAGAIN, errno.EBUSY, errno.EINTR)
#: user_data of a slot turned into a no-op: request ids start at 1, so no request has it
_IGNORED = 0
_SUBMIT_TRIES = 50


class UringBackend(IOBackend):
    name = "uring"
    direct = True

    def __init__(self, queue_depth: int, close_timeout: float = 30.0) -> None:
        super().__init__(queue_depth, close_timeout)
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
        # request id -> (future, request, iovec); the iovec is held until the completion so its
        # C array outlives the request even if the cache below is cleared meanwhile.
        self._pending: dict[int, tuple["Future[int]", IORequest, object]] = {}
        self._iovecs: dict[tuple[int, int], object] = {}
        self._next_id = 1
        self._closing = False
        self._ring_open = True
        self._local = threading.local()  # .held: request ids prepared in a plugged context
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
            request_id = self._next_id
            self._next_id += 1
            try:
                iovec = self._iovec(request.address, request.length)
                if request.op is Op.READ:
                    _uring.io_uring_prep_readv(sqe, request.fd, iovec, request.offset)
                else:
                    _uring.io_uring_prep_writev(sqe, request.fd, iovec, request.offset)
                sqe.user_data = request_id
                self._pending[request_id] = (future, request, iovec)
                held = getattr(self._local, "held", None)
                if held is not None:
                    held.append(request_id)
                    return future
            except BaseException:
                # Interrupted (a signal handler raising in this thread, say) after taking the
                # slot: the slot goes to the kernel with the next submit whatever happens, so it
                # must not keep what an earlier request left in it. The caller never got this
                # request's future: it must not run either.
                _uring.io_uring_prep_nop(sqe)
                sqe.user_data = _IGNORED
                self._pending.pop(request_id, None)
                self._flush_locked()  # hand the no-op over: it must not hold the slot
                raise
            error, _ = self._submit_locked([request_id])
        if error is not None:
            raise error  # the engine fails the request; its future is dropped with it
        return future

    @contextmanager
    def plugged(self) -> Iterator[None]:
        if getattr(self._local, "held", None) is not None:
            yield  # nested: the outermost context submits
            return
        held: list[int] = []
        self._local.held = held
        try:
            yield
        finally:
            self._local.held = None
            if held:
                with self._lock:
                    error, dropped = self._submit_locked(held) if self._ring_open else (None, [])
                # Nothing of them will run: fail them outside the lock, as their callbacks may
                # submit again.
                for future in dropped:
                    resolve(future, 0, error)

    def flush(self) -> None:
        # This thread's interrupted plugged context, if any, will never submit: stop holding.
        self._local.held = None
        with self._lock:
            if not self._closing:
                self._flush_locked()

    def _flush_locked(self) -> None:
        """Hands every prepared SQE to the kernel (those of requests nobody submitted, no-ops)."""
        if self._ring_open:
            error, _ = self._submit_locked([])
            if error is not None:
                log.warning("io_uring_submit failed while flushing held requests: %s", error)

    def _submit_locked(self, request_ids: list[int]
                       ) -> tuple[OSError | None, list["Future[int]"]]:
        """Hands the prepared SQEs to the kernel; returns the error that dropped them, if any,
        and the futures of the dropped requests.

        liburing publishes the SQEs (advances the SQ tail) before io_uring_enter, so when enter
        fails the requests are still in the ring and run with the next successful submit: they
        must then stay pending, or their completions would land in memory the caller believes is
        free. Transient failures are retried; after a non-transient one the ring is unusable and
        nothing in it will run, so the requests are dropped and the error returned."""
        for attempt in range(_SUBMIT_TRIES):
            try:
                _uring.io_uring_submit(self._ring)
                return None, []
            except OSError as exc:
                if exc.errno not in _TRANSIENT:
                    dropped = [self._pending.pop(i, None) for i in request_ids]
                    return exc, [d[0] for d in dropped if d is not None]
                if attempt + 1 == _SUBMIT_TRIES:
                    log.warning("io_uring_submit keeps failing (%s); the requests stay queued in "
                                "the ring and go in with the next submit", exc)
                    return None, []
            time.sleep(0.001 * (attempt + 1))
        return None, []

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
        try:
            self._drain_forever()
        except BaseException as exc:  # pragma: no cover - a bug or a torn-down ring
            # Without this thread nothing would ever complete: fail what is pending, loudly.
            log.exception("uring completion thread died")
            with self._lock:
                pending, self._pending = self._pending, {}
                self._idle.notify_all()
            for future, _, _ in pending.values():
                resolve(future, 0, OSError(errno.EIO, f"uring completion thread died: {exc}"))

    def _drain_forever(self) -> None:
        cpu_start = time.thread_time()
        while True:
            os.eventfd_read(self._eventfd)
            done: list[tuple["Future[int]", int, int]] = []
            with self._lock:
                if not self._ring_open:
                    return
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
                        result, err = -1, exc.errno or errno.EIO
                    _uring.io_uring_cqe_seen(self._ring, entry)
                    pending = self._pending.pop(request_id, None)
                    if pending is not None:
                        done.append((pending[0], result, err))
                if not self._pending:
                    self._idle.notify_all()
                stop = self._closing
            # Outside the lock: the futures' callbacks may submit new requests, which go to the
            # kernel together once all of this drain's completions are resolved.
            with self.plugged():
                for future, result, err in done:
                    resolve(future, result, OSError(err, os.strerror(err)) if err else None)
            now = time.thread_time()
            self.counters.add_cpu(now - cpu_start)
            cpu_start = now
            if stop:
                return

    def close(self) -> None:
        deadline = time.monotonic() + self.close_timeout
        with self._lock:
            if self._closing:
                return
            # On the completion thread (a callback closing the backend) nothing can complete
            # while we wait, so there is nothing to wait for.
            on_completion_thread = self._thread is threading.current_thread()
            if self._pending:
                # Requests prepared but never handed over (a caller interrupted between the two
                # by an exception): they go in now, or nothing would ever complete them.
                self._flush_locked()
            while self._pending and not on_completion_thread:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._idle.wait(remaining)
            self._closing = True
            stuck, self._pending = self._pending, {}
        if stuck:
            # Tearing the ring down makes the kernel cancel what it can; a request it cannot
            # cancel may still finish into its buffer later, which is why this is an error.
            log.error("uring backend: %d request(s) still in flight after %.3g s; closing the "
                      "ring without them (their buffers may still be written to)", len(stuck),
                      self.close_timeout)
            for future, request, _ in stuck.values():
                resolve(future, 0, BackendAbandonedError(
                    f"the uring backend was closed while a {request.op.value} of "
                    f"{request.length} bytes at offset {request.offset} was in flight"))
        os.eventfd_write(self._eventfd, 1)
        if not on_completion_thread:
            self._thread.join(max(1.0, deadline - time.monotonic()))
        with self._lock:
            # The completion thread checks _ring_open under this lock, so it never touches a
            # ring that is gone even if it is still busy in a callback.
            self._ring_open = False
            _uring.io_uring_unregister_eventfd(self._ring)
            _uring.io_uring_queue_exit(self._ring)
            self._iovecs.clear()
        if not self._thread.is_alive():
            os.close(self._eventfd)
        else:  # it still reads the eventfd; leave the descriptor to the process exit
            os.eventfd_write(self._eventfd, 1)

