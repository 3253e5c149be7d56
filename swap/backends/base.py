"""The interface every I/O backend implements.

A backend moves one request (a file descriptor, a file offset and a span of host memory given by
address and length) and returns a ``concurrent.futures.Future`` that resolves to the number of
bytes moved, or fails with the ``OSError`` the kernel returned. Splitting, queue depth, short
transfers and error wording live one level up, in the engine, so each backend stays small.

The engine itself uses ``start_chain``: one callback per chain of requests with all their
outcomes, instead of a future per request. Requests complete on the backend's Python threads,
and every line of Python run there per request is time the training thread cannot hold the GIL:
with a future, its done-callback and the engine's bookkeeping for every 1 MiB request, a
pure-Python loop next to the engine at 2-4 GB/s waited for the GIL 10-15% of its time.

Memory is passed by address rather than as a Python buffer because the io_uring wrapper keeps a
reference to every buffer it is given forever; an address wrapped in a tiny ctypes proxy is the
only thing it then retains. The caller guarantees the memory outlives the request.
"""

from __future__ import annotations

import ctypes
import errno
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from concurrent.futures import Future, InvalidStateError
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from enum import Enum


class Op(str, Enum):
    READ = "read"
    WRITE = "write"


@dataclass(frozen=True, slots=True)
class IORequest:
    op: Op
    fd: int
    offset: int
    address: int
    length: int


def memory_at(address: int, length: int) -> memoryview:
    """A writable memoryview of ``length`` bytes at ``address`` that owns nothing."""
    return memoryview((ctypes.c_char * length).from_address(address)).cast("B")


#: What a backend reports for one request: the bytes it moved, or the exception it failed with.
Outcome = int | BaseException
#: Called once per chain with the outcome of each of its requests, in order.
ChainDone = Callable[[list[Outcome]], None]


class BackendAbandonedError(TimeoutError):
    """The outcome a backend gives a request it stopped waiting for at close (a stuck system
    call, a ring torn down around it). The request may still run and move bytes into or out of
    its memory later, so whoever owns that memory must keep it alive and unused."""


@dataclass
class BackendCounters:
    """CPU time spent in threads the backend owns (completion or worker threads)."""

    thread_cpu_seconds: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add_cpu(self, seconds: float) -> None:
        with self.lock:
            self.thread_cpu_seconds += seconds


class IOBackend(ABC):
    """Moves single requests asynchronously. Subclasses set ``name`` and ``direct``.

    ``close_timeout`` bounds how long ``close`` waits for requests in flight: a request that
    never completes (a hung device, a pipe nobody writes) must not turn shutdown into a hang.
    """

    name: str = "base"
    #: whether files for this backend are opened with O_DIRECT
    direct: bool = True
    #: the most requests ``submit_chain`` takes at once; 1: the backend has no chains
    max_chain: int = 1

    def __init__(self, queue_depth: int, close_timeout: float = 30.0) -> None:
        if not isinstance(queue_depth, int) or isinstance(queue_depth, bool) or queue_depth < 1:
            raise ValueError(f"queue_depth must be a positive integer, got {queue_depth!r}")
        if not close_timeout > 0:
            raise ValueError(f"close_timeout must be > 0, got {close_timeout!r}")
        self.queue_depth = queue_depth
        self.close_timeout = float(close_timeout)
        self.counters = BackendCounters()

    @abstractmethod
    def submit(self, request: IORequest) -> Future[int]:
        """Starts ``request``; the future resolves to bytes moved or raises ``OSError``."""

    def submit_chain(self, requests: Sequence[IORequest]) -> list[Future[int]]:
        """Starts ``requests`` (at most ``max_chain``, each continuing the one before it in the
        same file and memory) as one queue slot, and returns their futures in order. The
        backend moves them without the interpreter in between: the engine's completion path
        can wait for the GIL behind a busy training thread for a whole switch interval, and a
        chain keeps the drive busy meanwhile. Each request still gets its own outcome: the
        backends move contiguous requests with one call, so a short transfer leaves the later
        ones short or empty, as if each had run alone, and an error fails them all. The slot is
        busy until the last one completes."""
        if len(requests) != 1:
            raise ValueError(
                f"{type(self).__name__} takes chains of one request, got {len(requests)}"
            )
        return [self.submit(requests[0])]

    def start_chain(self, requests: Sequence[IORequest], done: ChainDone) -> None:
        """Starts ``requests`` as ``submit_chain`` does, and calls ``done`` once, when every one
        of them has an outcome, with those outcomes in order (bytes moved, or the exception).
        ``done`` runs on a thread of the backend, or in this call if the chain completes at
        once; it must not block. If this raises, nothing was started and ``done`` is never
        called. The engine's path: backends that complete chains themselves report each chain
        with one call and no future; this default gathers ``submit_chain``'s futures."""
        futures = self.submit_chain(requests)
        _Gather(futures, done)

    def plugged(self) -> AbstractContextManager[None]:
        """Within this context, requests submitted by the calling thread may be held back and
        handed to the kernel together when it ends (one system call for many requests). The
        caller must not wait for such a request inside the context."""
        return nullcontext()

    def flush(self) -> None:  # noqa: B027 (a no-op default, not abstract)
        """Hands over requests a plugged context held back and never submitted: one interrupted
        by an exception at the wrong moment (a signal handler raising in the caller's thread),
        whose context may stay unfinished until the interpreter exits. Nothing to do for a
        backend that holds nothing back."""

    @abstractmethod
    def close(self) -> None:
        """Waits up to ``close_timeout`` for requests in flight, then releases the backend's
        threads and kernel objects. Requests still in flight then fail (or are abandoned) and the
        backend logs an error; it never waits forever."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(queue_depth={self.queue_depth})"


def continues(last: IORequest, following: IORequest) -> bool:
    """Whether ``following`` starts in the file where ``last`` ends (same file, same direction):
    one vectored call can move both."""
    return (
        following.fd == last.fd
        and following.op is last.op
        and following.offset == last.offset + last.length
    )


def split(moved: int, lengths: Sequence[int]) -> list[int]:
    """The bytes each request of a run got when one call moved ``moved`` bytes in order: a
    short transfer leaves the later requests short or empty, as if each had run alone."""
    out = []
    for length in lengths:
        out.append(min(length, max(moved, 0)))
        moved -= length
    return out


class _Gather:
    """Calls ``done`` once all ``futures`` are resolved, with their outcomes in order."""

    __slots__ = ("futures", "done", "left", "lock")

    def __init__(self, futures: list[Future[int]], done: ChainDone) -> None:
        self.futures = futures
        self.done = done
        self.left = len(futures)
        self.lock = threading.Lock()
        for future in futures:
            future.add_done_callback(self._one_done)

    def _one_done(self, _future: Future[int]) -> None:
        with self.lock:
            self.left -= 1
            if self.left:
                return
        self.done([outcome_of(future) for future in self.futures])


def outcome_of(future: Future[int]) -> Outcome:
    """A resolved future's outcome: its result, or its exception (ECANCELED if cancelled)."""
    if future.cancelled():
        return OSError(errno.ECANCELED, "the backend cancelled the request")
    error = future.exception()
    return error if error is not None else future.result()


def resolve_outcomes(futures: Sequence[Future[int]], outcomes: Sequence[Outcome]) -> None:
    """Sets each future's outcome (see :func:`resolve`)."""
    for future, outcome in zip(futures, outcomes):
        resolve(future, outcome)


def resolve(future: Future[int], outcome: Outcome) -> None:
    """Sets a request's outcome (bytes moved, or the exception it failed with) unless it already
    has one (close failed it after its timeout, or a fault wrapper settled it): the first
    outcome wins and a late one is dropped."""
    try:
        if isinstance(outcome, BaseException):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)
    except InvalidStateError:
        pass
