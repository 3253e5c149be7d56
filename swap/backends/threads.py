"""A pool of threads doing ``os.preadv`` / ``os.pwritev``.

Both calls release the GIL for the whole system call, so the interpreter keeps running while the
threads wait on the disk. With O_DIRECT this is the portable backend; opened without O_DIRECT
(``BufferedBackend``) it serves file systems that refuse direct I/O.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import Future, ThreadPoolExecutor

from swap.backends.base import IOBackend, IORequest, Op, memory_at


class ThreadBackend(IOBackend):
    name = "threads"
    direct = True

    def __init__(self, queue_depth: int, thread_count: int | None = None) -> None:
        super().__init__(queue_depth)
        self.thread_count = thread_count or queue_depth
        self._pool = ThreadPoolExecutor(max_workers=self.thread_count,
                                        thread_name_prefix=f"swap-{self.name}")

    def submit(self, request: IORequest) -> "Future[int]":
        return self._pool.submit(self._run, request)

    def _run(self, request: IORequest) -> int:
        started = time.thread_time()
        try:
            view = memory_at(request.address, request.length)
            if request.op is Op.READ:
                return os.preadv(request.fd, [view], request.offset)
            return os.pwritev(request.fd, [view], request.offset)
        finally:
            self.counters.add_cpu(time.thread_time() - started)

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(queue_depth={self.queue_depth}, threads={self.thread_count})"


class BufferedBackend(ThreadBackend):
    """Thread pool over files opened without O_DIRECT, for file systems that refuse it.

    Goes through the page cache: slower, more CPU, and the cache holds a copy of what was written,
    so it is chosen only when direct I/O is impossible, and that choice is logged.
    """

    name = "buffered"
    direct = False
