"""The swap engine's hasher: one thread that checksums integrity chunks, one call per chunk with
the GIL released inside it (see :mod:`swap.integrity`), so the completion thread never waits for
the interpreter to hash and the training thread loses it once per chunk, not per hashed byte."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable

from swap.integrity import Chunk, Integrity
from swap.transfer import Transfer


class ChunkHasher:
    """Chunks queued for hashing and the thread that hashes them. ``lock`` is the engine's:
    chunks are queued under it, and ``hashed_locked(transfer, failure)`` runs under it once a
    chunk is hashed (``failure``: its mismatch or error, else None)."""

    def __init__(
        self,
        integrity: Integrity,
        lock: threading.Lock,
        hashed_locked: Callable[[Transfer, BaseException | None], None],
    ) -> None:
        self._integrity = integrity
        self._lock = lock
        self._hashed_locked = hashed_locked
        #: chunks queued for or being hashed: their transfers are not done
        self.pending = 0
        #: the thread's CPU seconds
        self.cpu_seconds = 0.0
        #: chunks to hash, then None: the thread ends
        self._jobs: queue.SimpleQueue[tuple[Transfer, Chunk] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="swap-hash", daemon=True)
        self._thread.start()

    def queue_locked(self, transfer: Transfer, chunk: Chunk) -> None:
        """Queues ``chunk`` of ``transfer`` (under the engine's lock)."""
        # Job first, counts after: a signal handler that raises in between leaves the counts
        # at or below zero (read as none pending), never a count of jobs nobody will run.
        self._jobs.put((transfer, chunk))
        transfer.hashing += 1
        self.pending += 1  # close waits for these: the transfer is not finished yet

    def stop(self, timeout: float) -> None:
        """Ends the thread after every queued chunk (their transfers finish first)."""
        self._jobs.put(None)
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _loop(self) -> None:
        integrity = self._integrity
        while True:
            job = self._jobs.get()
            if job is None:
                return
            transfer, chunk = job
            started = time.thread_time()
            failure: BaseException | None
            try:
                assert transfer.check is not None  # only checked transfers queue chunks
                failure = integrity.chunk_done(transfer.check, chunk, transfer.buffer.array)
            except Exception as exc:
                failure = exc
            self.cpu_seconds += time.thread_time() - started
            with self._lock:
                self.pending -= 1
                transfer.hashing -= 1
                self._hashed_locked(transfer, failure)
