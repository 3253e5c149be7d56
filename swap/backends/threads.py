"""A pool of threads doing ``os.preadv`` / ``os.pwritev``.

Both calls release the GIL for the whole system call, so the interpreter keeps running while the
threads wait on the disk. With O_DIRECT this is the portable backend; opened without O_DIRECT
(``BufferedBackend``) it serves file systems that refuse direct I/O.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from concurrent.futures import Future

from swap.backends.base import (BackendAbandonedError, IOBackend, IORequest, Op, memory_at,
                                resolve)

log = logging.getLogger(__name__)

_NOTHING = object()


class ThreadBackend(IOBackend):
    name = "threads"
    direct = True

    def __init__(self, queue_depth: int, thread_count: int | None = None,
                 close_timeout: float = 30.0) -> None:
        super().__init__(queue_depth, close_timeout)
        self.thread_count = thread_count or queue_depth
        # Own daemon threads rather than a ThreadPoolExecutor: the executor joins its workers at
        # interpreter exit, so one system call that never returns would hang the exit too.
        self._work: queue.SimpleQueue[tuple[Future[int], IORequest] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._inflight: set[Future[int]] = set()
        self._closed = False
        self._threads = [threading.Thread(target=self._worker, name=f"swap-{self.name}-{i}",
                                          daemon=True) for i in range(self.thread_count)]
        for thread in self._threads:
            thread.start()

    def submit(self, request: IORequest) -> "Future[int]":
        future: Future[int] = Future()
        future.set_running_or_notify_cancel()
        with self._lock:
            if self._closed:
                raise RuntimeError(f"the {self.name} backend is closed")
            self._inflight.add(future)
        self._work.put((future, request))
        return future

    def _worker(self) -> None:
        ahead: object = _NOTHING
        while True:
            item = self._work.get() if ahead is _NOTHING else ahead
            ahead = _NOTHING
            if item is None:
                return
            future, request = item
            with self._lock:
                if future not in self._inflight:
                    # Abandoned by a close that timed out: its descriptor may be closed by now
                    # and the number reused by an unrelated file, so it must not run.
                    continue
            started = time.thread_time()
            result, error = 0, None
            try:
                result = self._run(request)
            except BaseException as exc:  # the future carries it to the caller
                error = exc
            self.counters.add_cpu(time.thread_time() - started)
            with self._lock:
                self._inflight.discard(future)
                if not self._inflight:
                    self._idle.notify_all()
            resolve(future, result, error)
            # Resolving usually submitted the next request: take it now, while this thread
            # holds the GIL, instead of handing the interpreter to another worker for it.
            try:
                ahead = self._work.get_nowait()
            except queue.Empty:
                pass

    @staticmethod
    def _run(request: IORequest) -> int:
        view = memory_at(request.address, request.length)
        if request.op is Op.READ:
            return os.preadv(request.fd, [view], request.offset)
        return os.pwritev(request.fd, [view], request.offset)

    def close(self) -> None:
        deadline = time.monotonic() + self.close_timeout
        with self._lock:
            if self._closed:
                return
            self._closed = True
            while self._inflight:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._idle.wait(remaining)
            stuck = list(self._inflight)
            self._inflight.clear()
        for _ in self._threads:
            self._work.put(None)
        if stuck:
            # A thread stuck in a system call cannot be interrupted; its daemon thread is left
            # behind. The futures fail now so nobody waits on them forever.
            log.error("%s backend: %d request(s) still in flight after %.3g s; closing without "
                      "them (their buffers may still be written to)", self.name, len(stuck),
                      self.close_timeout)
            for future in stuck:
                resolve(future, None, BackendAbandonedError(
                    f"the {self.name} backend was closed while this request was in flight"))
            return
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(max(0.0, deadline - time.monotonic()))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(queue_depth={self.queue_depth}, threads={self.thread_count})"



class BufferedBackend(ThreadBackend):
    """Thread pool over files opened without O_DIRECT, for file systems that refuse it.

    Goes through the page cache: slower, more CPU, and the cache holds a copy of what was written,
    so it is chosen only when direct I/O is impossible, and that choice is logged.
    """

    name = "buffered"
    direct = False
