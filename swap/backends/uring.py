"""io_uring through the ``liburing`` package, on O_DIRECT files.

Facts about the wrapper this is built around:

* every wrapper call holds the GIL, waits included, so this backend never waits inside the ring:
  an eventfd is registered with the ring and a completion thread blocks in ``os.eventfd_read``
  (which releases the GIL), then drains the completion queue without blocking;
* one ring is not thread-safe, so ``get_sqe .. submit`` and the drain run under one lock;
* ``Iovec`` keeps a reference to its buffers forever; it is built over ctypes proxies of the
  addresses (which own nothing) and cached per list of (address, length) spans, so the pool's
  memory can still be freed and the number of Iovecs stays bounded by the distinct spans used;
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

A chain (``start_chain``) holds one of the ``queue_depth`` slots until its last request
completes. Requests of a chain that continue one another in the file (all the engine makes) go
to the kernel as one read or write of their whole span, and its result is split over them as if
each had run alone (a short transfer leaves the later ones short, an error fails them all), as
the thread backend's vectored calls do; other requests get an SQE each, linked with
``IOSQE_IO_HARDLINK`` so the kernel starts each when the one before it completes, whatever its
outcome. The kernel runs each step of a link as task work of the thread that submitted it, and
next to a busy CPU that thread waits to be scheduled for every step: 16 chains of eight linked
1 MiB writes kept 0.6 of their bandwidth next to a spinning process, 16 writes of 8 MiB 0.9.
In the engine, merged chains took its solo write bandwidth from 3.6 to 5.5 GB/s on a virtual
disk, and the share it kept next to a pure-Python loop from 0.64 to 0.75 (reads: 0.90 both).

A chain is reported with one call (``start_chain``'s ``done``) once all its completions are in,
from the completion thread; ``submit``/``submit_chain`` build their futures on top of that.
What the chains hold is also what keeps the drive busy while the completion thread waits for the
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
from typing import Any

from swap.backends.base import (
    BackendAbandonedError,
    ChainDone,
    IOBackend,
    IORequest,
    Op,
    Outcome,
    continues,
    memory_at,
    resolve_outcomes,
    split,
)

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
#: stands in for an outcome a complete chain cannot lack
_NEVER = OSError(errno.EIO, "io_uring posted no completion for this request")


class _Chain:
    """One chain in the ring: it holds a queue slot until its last request completes.

    Its requests go to the kernel as units, one SQE each, hard-linked in order: a unit is a run
    of requests that continue one another in the file, moved by one read or write (see
    ``_units``), and its outcome is split over them as if each had run alone."""

    __slots__ = ("requests", "done", "first_id", "units", "outcomes", "iovecs")

    def __init__(
        self,
        requests: Sequence[IORequest],
        done: ChainDone,
        first_id: int,
        units: list[Sequence[IORequest]],
    ) -> None:
        self.requests = requests
        self.done = done
        self.first_id = first_id  # the first unit's id; the others follow it
        self.units = units
        self.outcomes: list[Outcome] = []
        # Held until the chain completes, so their C arrays outlive the requests even if the
        # cache below is cleared meanwhile.
        self.iovecs: list[object] = []

    @property
    def last_id(self) -> int:
        return self.first_id + len(self.units) - 1

    def complete(self, unit_id: int, outcome: Outcome) -> bool:
        """Records one unit's completion; True once the chain is complete. A hard link starts
        each unit only after the one before it completed and posted its completion, so the
        completions come in order and the last unit's ends the chain."""
        unit = self.units[unit_id - self.first_id]
        if isinstance(outcome, BaseException):
            self.outcomes.extend([outcome] * len(unit))
        else:
            self.outcomes.extend(split(outcome, [r.length for r in unit]))
        return unit_id == self.last_id

    def finish(self, missing: BaseException) -> list[Outcome]:
        """Every request's outcome, ``missing`` for those without one (a chain abandoned)."""
        return self.outcomes + [missing] * (len(self.requests) - len(self.outcomes))


def _units(requests: Sequence[IORequest]) -> list[Sequence[IORequest]]:
    """The SQEs of a chain: requests that continue one another go in one read or write, so the
    kernel needs no help from the submitting thread in between (each step of a hard link runs
    as task work of that thread, which waits for a CPU next to a busy interpreter)."""
    units: list[list[IORequest]] = []
    for request in requests:
        if units and continues(units[-1][-1], request):
            units[-1].append(request)
        else:
            units.append([request])
    return list(units)


def _spans(requests: Sequence[IORequest]) -> tuple[tuple[int, int], ...]:
    """The requests' memory as (address, length) spans, adjacent ones joined."""
    spans: list[list[int]] = []
    for request in requests:
        if spans and spans[-1][0] + spans[-1][1] == request.address:
            spans[-1][1] += request.length
        else:
            spans.append([request.address, request.length])
    return tuple((address, length) for address, length in spans)


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
        # request id -> its chain, for every request in the ring
        self._pending: dict[int, _Chain] = {}
        self._chains: set[_Chain] = set()  # chains in the ring: each holds one queue slot
        self._iovecs: dict[tuple[tuple[int, int], ...], object] = {}
        self._next_id = 1
        self._closing = False
        self._ring_open = True
        self._local = threading.local()  # .held: chains prepared in a plugged context
        self._thread = threading.Thread(
            target=self._complete_loop, name="swap-uring-completion", daemon=True
        )
        self._thread.start()

    def submit(self, request: IORequest) -> Future[int]:
        return self.submit_chain([request])[0]

    def submit_chain(self, requests: Sequence[IORequest]) -> list[Future[int]]:
        futures: list[Future[int]] = []
        for _ in requests:
            future: Future[int] = Future()
            future.set_running_or_notify_cancel()
            futures.append(future)
        self.start_chain(requests, lambda outcomes: resolve_outcomes(futures, outcomes))
        return futures

    def start_chain(self, requests: Sequence[IORequest], done: ChainDone) -> None:
        if not 1 <= len(requests) <= self.max_chain:
            raise ValueError(f"a chain takes 1 to {self.max_chain} requests, got {len(requests)}")
        with self._lock:
            if self._closing:
                raise RuntimeError("the uring backend is closed")
            if len(self._chains) >= self.queue_depth:
                raise RuntimeError(
                    f"more than queue_depth={self.queue_depth} chains of requests in flight"
                )
            units = _units(requests)
            chain = _Chain(requests, done, self._next_id, units)
            # Before any slot is taken: if this raises, the ring is as it was.
            chain.iovecs = [self._iovec(_spans(unit)) for unit in units]
            sqes: list[Any] = []  # liburing's SQEs (the package declares no types)
            try:
                self._chains.add(chain)
                for unit, iovec in zip(units, chain.iovecs):
                    sqe = _uring.io_uring_get_sqe(self._ring)
                    if sqe is None:
                        raise RuntimeError("io_uring submission queue is full")
                    sqes.append(sqe)
                    request_id = self._next_id
                    self._next_id += 1
                    first = unit[0]
                    if first.op is Op.READ:
                        _uring.io_uring_prep_readv(sqe, first.fd, iovec, first.offset)
                    else:
                        _uring.io_uring_prep_writev(sqe, first.fd, iovec, first.offset)
                    sqe.user_data = request_id
                    if len(sqes) > 1:  # only once this one is complete: a chain never ends open
                        sqes[-2].flags = _uring.IOSQE_IO_HARDLINK
                    self._pending[request_id] = chain
                held = getattr(self._local, "held", None)
                if held is not None:
                    held.append(chain)
                    return
            except BaseException:
                # Interrupted (a signal handler raising in this thread, say) after taking slots:
                # they go to the kernel with the next submit whatever happens, so they must not
                # keep what earlier requests left in them. The caller was told nothing started:
                # none of these requests may run either.
                for sqe in sqes:
                    _uring.io_uring_prep_nop(sqe)
                    sqe.flags = 0
                    sqe.user_data = _IGNORED
                self._forget_locked(chain)
                self._flush_locked()  # hand the no-ops over: they must not hold the slots
                raise
            error, _ = self._submit_locked([chain])
        if error is not None:
            raise error  # the engine fails the requests

    @contextmanager
    def plugged(self) -> Iterator[None]:
        if getattr(self._local, "held", None) is not None:
            yield  # nested: the outermost context submits
            return
        held: list[_Chain] = []
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
                for chain in dropped:
                    assert error is not None
                    _report(chain, [error] * len(chain.requests))

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

    def _submit_locked(self, chains: list[_Chain]) -> tuple[OSError | None, list[_Chain]]:
        """Hands the prepared SQEs to the kernel; returns the error that dropped them, if any,
        and the dropped chains.

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
                    dropped = [c for c in chains if self._forget_locked(c)]
                    return exc, dropped
                if attempt + 1 == _SUBMIT_TRIES:
                    log.warning(
                        "io_uring_submit keeps failing (%s); the requests stay queued in "
                        "the ring and go in with the next submit",
                        exc,
                    )
                    return None, []
            time.sleep(0.001 * (attempt + 1))
        return None, []

    def _forget_locked(self, chain: _Chain) -> bool:
        """Removes a chain from the pending ones, freeing its slot; False if it was gone."""
        if chain not in self._chains:
            return False
        self._chains.discard(chain)
        for request_id in range(chain.first_id, chain.last_id + 1):
            self._pending.pop(request_id, None)
        return True

    def _iovec(self, spans: tuple[tuple[int, int], ...]) -> object:
        iovec = self._iovecs.get(spans)
        if iovec is None:
            if len(self._iovecs) >= _IOVEC_CACHE_LIMIT:
                self._iovecs.clear()
            iovec = _uring.Iovec([memory_at(address, length) for address, length in spans])
            self._iovecs[spans] = iovec
        return iovec

    def _complete_loop(self) -> None:
        try:
            self._drain_forever()
        except BaseException as exc:  # pragma: no cover - a bug or a torn-down ring
            # Without this thread nothing would ever complete: fail what is pending, loudly.
            log.exception("uring completion thread died")
            with self._lock:
                chains = list(self._chains)
                self._chains.clear()
                self._pending.clear()
                self._idle.notify_all()
            for chain in chains:
                died = OSError(errno.EIO, f"uring completion thread died: {exc}")
                _report(chain, chain.finish(died))

    def _drain_forever(self) -> None:
        cpu_start = time.thread_time()
        while True:
            os.eventfd_read(self._eventfd)
            finished: list[tuple[_Chain, list[Outcome]]] = []
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
                        outcome: Outcome = entry.res
                    except OSError as exc:
                        err = exc.errno or errno.EIO
                        outcome = OSError(err, os.strerror(err))
                    _uring.io_uring_cqe_seen(self._ring, entry)
                    chain = self._pending.get(request_id)
                    if chain is None:
                        continue  # a no-op standing in for an interrupted request
                    if chain.complete(request_id, outcome) and self._forget_locked(chain):
                        finished.append((chain, chain.finish(_NEVER)))
                if not self._chains:
                    self._idle.notify_all()
                stop = self._closing
            # Outside the lock: the callbacks may submit new requests, which go to the kernel
            # together once all of this drain's chains are reported.
            with self.plugged():
                for chain, outcomes in finished:
                    _report(chain, outcomes)
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
            if self._chains:
                # Requests prepared but never handed over (a caller interrupted between the two
                # by an exception): they go in now, or nothing would ever complete them.
                self._flush_locked()
            while self._chains and not on_completion_thread:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._idle.wait(remaining)
            self._closing = True
            stuck = list(self._chains)
            self._chains.clear()
            self._pending.clear()
        if stuck:
            # Tearing the ring down makes the kernel cancel what it can; a request it cannot
            # cancel may still finish into its buffer later, which is why this is an error.
            log.error(
                "uring backend: %d chain(s) of requests still in flight after %.3g s; closing "
                "the ring without them (their buffers may still be written to)",
                len(stuck),
                self.close_timeout,
            )
            for chain in stuck:
                first = chain.requests[0]
                abandoned = BackendAbandonedError(
                    f"the uring backend was closed while a {first.op.value} of "
                    f"{sum(r.length for r in chain.requests)} bytes at offset {first.offset} "
                    f"was in flight"
                )
                _report(chain, chain.finish(abandoned))
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


def _report(chain: _Chain, outcomes: list[Outcome]) -> None:
    """Hands a chain's outcomes to its callback; a failing callback must not stop the thread
    that completes every other chain."""
    try:
        chain.done(outcomes)
    except Exception:
        log.exception("a uring chain's completion callback failed")
