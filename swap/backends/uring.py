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
* reading ``CQE.res`` of a failed request raises ``OSError`` carrying the errno;
* no call releases the GIL (``io_uring_wait_cqes`` and ``io_uring_submit_and_wait`` neither) and
  ``io_uring_peek_batch_cqe`` raises ``NotImplementedError``, so there is no waiting for several
  completions in one GIL-free call: chains (below) keep the drive busy instead.

``io_uring_submit`` is a system call made with the GIL held, so requests are handed over in
batches where possible: within ``plugged()`` (the engine plugs while it fills the queue, and the
completion thread while it resolves one drain's completions, whose callbacks submit the next
requests) SQEs are only prepared, and one submit sends them all when the context ends.

``submit_chain`` links a chain's SQEs with ``IOSQE_IO_HARDLINK``: the kernel starts each when the
one before it completes, whatever its outcome, so a chain holds one of the ``queue_depth`` slots
and the drive still sees at most ``queue_depth`` requests at a time. What the chains hold behind
their running requests is what keeps the drive busy while the completion thread waits for the
GIL (up to the 5 ms switch interval per wake-up behind a busy training thread): with 16 single
1 MiB requests that wait emptied the queue, and the engine kept 0.5-0.6 of its bandwidth next to
a pure-Python loop; with chains of eight (``swap.engine.CHAIN_BYTES``), 0.78-0.91.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from contextlib import contextmanager

from swap.backends.base import BackendAbandonedError, IOBackend, IORequest, Op, memory_at, resolve

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
_MAX_CHAIN = 16
_MAX_ENTRIES = 32768  # the kernel's limit on submission queue entries


class _Chain:
    """The ids of a chain's requests still pending: the chain holds its slot until none is."""

    __slots__ = ("ids",)

    def __init__(self) -> None:
        self.ids: set[int] = set()


class UringBackend(IOBackend):
    name = "uring"
    direct = True

    def __init__(self, queue_depth: int, close_timeout: float = 30.0) -> None:
        super().__init__(queue_depth, close_timeout)
        reason = uring_unavailable_reason()
        if reason:
            raise OSError(reason)
        self.max_chain = max(1, min(_MAX_CHAIN, _MAX_ENTRIES // queue_depth))
        entries = 1
        while entries < min(queue_depth * self.max_chain, _MAX_ENTRIES):
            entries *= 2
        self._ring = _uring.Ring()
        _uring.io_uring_queue_init(entries, self._ring, 0)
        if not self._ring.features & _uring.IORING_FEAT_NODROP:
            # A kernel before 5.5, which also lacks IOSQE_IO_HARDLINK: no chains.
            self.max_chain = 1
        self._eventfd = os.eventfd(0, os.EFD_CLOEXEC)
        _uring.io_uring_register_eventfd(self._ring, self._eventfd)
        self._cqe = _uring.Cqe()
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        # request id -> (future, request, iovec, chain); the iovec is held until the completion
        # so its C array outlives the request even if the cache below is cleared meanwhile.
        self._pending: dict[int, tuple[Future[int], IORequest, object, _Chain]] = {}
        self._chains: set[_Chain] = set()  # chains in the ring: each holds one queue slot
        self._iovecs: dict[tuple[int, int], object] = {}
        self._next_id = 1
        self._closing = False
        self._ring_open = True
        self._local = threading.local()  # .held: request ids prepared in a plugged context
        self._thread = threading.Thread(
            target=self._complete_loop, name="swap-uring-completion", daemon=True
        )
        self._thread.start()

    def submit(self, request: IORequest) -> Future[int]:
        return self.submit_chain([request])[0]

    def submit_chain(self, requests: Sequence[IORequest]) -> list[Future[int]]:
        if not 1 <= len(requests) <= self.max_chain:
            raise ValueError(f"a chain takes 1 to {self.max_chain} requests, got {len(requests)}")
        futures: list[Future[int]] = []
        for _ in requests:
            future: Future[int] = Future()
            future.set_running_or_notify_cancel()
            futures.append(future)
        with self._lock:
            if self._closing:
                raise RuntimeError("the uring backend is closed")
            if len(self._chains) >= self.queue_depth:
                raise RuntimeError(
                    f"more than queue_depth={self.queue_depth} chains of requests in flight"
                )
            # Before any slot is taken: if this raises, the ring is as it was.
            iovecs = [self._iovec(r.address, r.length) for r in requests]
            chain = _Chain()
            first_id = self._next_id
            sqes: list[object] = []
            try:
                self._chains.add(chain)
                for request, iovec, future in zip(requests, iovecs, futures):
                    sqe = _uring.io_uring_get_sqe(self._ring)
                    if sqe is None:
                        raise RuntimeError("io_uring submission queue is full")
                    sqes.append(sqe)
                    request_id = self._next_id
                    self._next_id += 1
                    if request.op is Op.READ:
                        _uring.io_uring_prep_readv(sqe, request.fd, iovec, request.offset)
                    else:
                        _uring.io_uring_prep_writev(sqe, request.fd, iovec, request.offset)
                    sqe.user_data = request_id
                    if len(sqes) > 1:  # only once this one is complete: a chain never ends open
                        sqes[-2].flags = _uring.IOSQE_IO_HARDLINK
                    chain.ids.add(request_id)
                    self._pending[request_id] = (future, request, iovec, chain)
                ids = list(range(first_id, self._next_id))
                held = getattr(self._local, "held", None)
                if held is not None:
                    held.extend(ids)
                    return futures
            except BaseException:
                # Interrupted (a signal handler raising in this thread, say) after taking slots:
                # they go to the kernel with the next submit whatever happens, so they must not
                # keep what earlier requests left in them. The caller never got these futures:
                # none of these requests may run either.
                for sqe in sqes:
                    _uring.io_uring_prep_nop(sqe)
                    sqe.flags = 0
                    sqe.user_data = _IGNORED
                for request_id in range(first_id, self._next_id):
                    self._pending.pop(request_id, None)
                self._chains.discard(chain)
                self._flush_locked()  # hand the no-ops over: they must not hold the slots
                raise
            error, _ = self._submit_locked(ids)
        if error is not None:
            raise error  # the engine fails the requests; their futures are dropped with them
        return futures

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

    def _submit_locked(self, request_ids: list[int]) -> tuple[OSError | None, list[Future[int]]]:
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
                    dropped = [self._forget_locked(i) for i in request_ids]
                    return exc, [d[0] for d in dropped if d is not None]
                if attempt + 1 == _SUBMIT_TRIES:
                    log.warning(
                        "io_uring_submit keeps failing (%s); the requests stay queued in "
                        "the ring and go in with the next submit",
                        exc,
                    )
                    return None, []
            time.sleep(0.001 * (attempt + 1))
        return None, []

    def _forget_locked(
        self, request_id: int
    ) -> tuple[Future[int], IORequest, object, _Chain] | None:
        """Removes a request from the pending ones, freeing its chain's slot with the last."""
        entry = self._pending.pop(request_id, None)
        if entry is not None:
            chain = entry[3]
            chain.ids.discard(request_id)
            if not chain.ids:
                self._chains.discard(chain)
        return entry

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
                self._chains.clear()
                self._idle.notify_all()
            for future, _, _, _ in pending.values():
                resolve(future, 0, OSError(errno.EIO, f"uring completion thread died: {exc}"))

    def _drain_forever(self) -> None:
        cpu_start = time.thread_time()
        while True:
            os.eventfd_read(self._eventfd)
            done: list[tuple[Future[int], int, int]] = []
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
                    pending = self._forget_locked(request_id)
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
            self._chains.clear()
        if stuck:
            # Tearing the ring down makes the kernel cancel what it can; a request it cannot
            # cancel may still finish into its buffer later, which is why this is an error.
            log.error(
                "uring backend: %d request(s) still in flight after %.3g s; closing the "
                "ring without them (their buffers may still be written to)",
                len(stuck),
                self.close_timeout,
            )
            for future, request, _, _ in stuck.values():
                resolve(
                    future,
                    0,
                    BackendAbandonedError(
                        f"the uring backend was closed while a {request.op.value} of "
                        f"{request.length} bytes at offset {request.offset} was in flight"
                    ),
                )
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
