"""The swap engine: moves bytes between pool buffers and extents of swap files.

A transfer (one extent range <-> one buffer range) is cut into requests of at most
``block_size`` bytes on a grid of ``block_size`` blocks starting at the extent's first byte, so a
request never crosses a stripe unit or an integrity chunk (a whole number of blocks). Requests
wait in one queue per drive, and the engine keeps at most ``queue_depth`` queue slots in use per
drive (and never more than the backend's own queue depth) across all transfers. A slot holds a
chain: up to ``chain_length`` contiguous requests of one transfer that the backend moves without
the interpreter in between, with one read or write (``IOBackend.start_chain``; see
``CHAIN_BYTES`` for why), and reports with one call.
Each transfer returns a ``concurrent.futures.Future`` resolving to its logical byte count;
``read_sync``/``write_sync`` are the blocking forms.

Threads: requests complete on the backend's threads (the uring completion thread, the pool's
workers), which do bookkeeping and submit the next requests. Checksums are computed on the engine's
hasher thread, one call per integrity chunk with the GIL released (see ``swap.integrity``): a
write's chunks while the write is in flight, a read's chunk once all its bytes arrived. The
completion thread never waits for the interpreter in between, and the training thread loses the
interpreter once per chunk instead of for every hashed byte. Done-callbacks of the transfer futures
run on one dispatcher thread of the engine, so a callback that blocks (``read_sync`` in a
done-callback, a slow consumer) holds up other callbacks but never the I/O itself. A transfer
future's ``result``/``exception``/``done`` read the transfer's own state, not the dispatcher's
progress, so waiting on another transfer inside a callback works; only ``concurrent.futures.wait``/
``as_completed`` inside a callback would wait on the dispatcher.

Short transfers are continued from where they stopped (the kernel may return fewer bytes than
asked); a read that returns 0 bytes means the file is shorter than the extent and fails. Any
other error fails the transfer with a :class:`SwapIOError` that names file, offset and cause.

Timeouts: a watchdog thread fails the transfer of any request in flight longer than
``request_timeout`` with :class:`TransferTimeoutError`; the request's memory and file space are
quarantined until it completes (``swap.timeouts``).
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import queue
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from swap.backends.base import BackendAbandonedError, IOBackend, IORequest, Op, Outcome
from swap.buffers import ALIGNMENT, HostBuffer
from swap.drive_queues import DriveQueues
from swap.errors import IntegrityError, SwapConfigError, SwapIOError, TransferTimeoutError
from swap.files import Extent, SwapDirectories, SwapSpace, check_directory
from swap.hashing import ChunkHasher
from swap.integrity import Chunk, Integrity
from swap.probe import choose_backend_for, make_backend
from swap.settings import EngineSettings
from swap.stats import EngineStats, StatsRecorder
from swap.timeouts import Quarantine, Watchdog, cannot_start, request_timed_out
from swap.transfer import (
    CHAIN_BYTES,
    Chain,
    Piece,
    Quarantined,
    Transfer,
    TransferFuture,
    chain_length,
    checked_range,
    cut_into_pieces,
    padded_in_buffer,
)

log = logging.getLogger(__name__)

__all__ = ["CHAIN_BYTES", "EngineSettings", "SwapEngine", "TransferFuture", "chain_length"]

SIDECAR_NAME = "integrity.json"


# Engines not yet closed. Their threads keep them alive, so an engine its owner forgot to close
# still gets closed (and its swap files, often GiBs, removed) when the interpreter exits.
_open_engines: weakref.WeakSet[SwapEngine] = weakref.WeakSet()


def open_engines() -> list[SwapEngine]:
    """The engines of this process not yet closed (a cleanup on the way out that cannot wait
    for them to close, such as a SIGTERM handler, removes their files itself)."""
    return list(_open_engines)


def _forget_engines_in_child() -> None:
    """A forked child inherits the parent's engines (their fds and io_uring ring) but owns none
    of them: closing them at its exit would unlink the parent's swap files and tear down the
    ring the parent still uses."""
    _open_engines.clear()


os.register_at_fork(after_in_child=_forget_engines_in_child)


@atexit.register
def _close_open_engines() -> None:
    for engine in list(_open_engines):
        try:
            engine.close()
        except Exception:
            log.exception("closing a swap engine at exit failed")


class SwapEngine:
    """Swap files under ``paths`` plus a backend; see the module docstring."""

    def __init__(
        self,
        paths: Sequence[Path | str] | Path | str | SwapDirectories,
        settings: EngineSettings | None = None,
        *,
        keep_files: bool = False,
        backend: IOBackend | None = None,
        backend_wrapper: Callable[[IOBackend], IOBackend] | None = None,
        label: str = "",
    ) -> None:
        """``paths``: the swap directories (checked here, unless they are
        :class:`~swap.files.SwapDirectories` already checked). ``backend``: the I/O backend
        (default: the best every directory supports); ``backend_wrapper`` (tests and tools)
        wraps it, e.g. in a fault-injecting backend. ``label`` goes into the run directories'
        names (``infinity-swap-<label>...``): a rank number, so that one rank's files are
        recognisable next to another's."""
        if isinstance(paths, (str, Path)):
            paths = [paths]
        self.settings = settings or EngineSettings()
        self.keep_files = keep_files
        if isinstance(paths, SwapDirectories):
            roots = list(paths.paths)
        else:
            # Every directory is checked before anything is created in any of them.
            roots = [check_directory(Path(p)) for p in paths]
        if not roots:
            raise SwapConfigError("nvme_path lists no directory")
        if backend is None:
            name = choose_backend_for(self.settings.backend, roots)
            backend = make_backend(
                name,
                self.settings.queue_depth * len(roots),
                self.settings.thread_count,
                self.settings.close_timeout,
            )
        if backend_wrapper is not None:
            backend = backend_wrapper(backend)
        self.backend = backend
        window = backend.queue_depth  # queue slots over all drives
        #: the requests waiting per drive and the queue slots in use
        self.queues = DriveQueues(
            len(roots),
            window,
            min(self.settings.queue_depth, window),
            chain_length(self.settings, backend.max_chain),
        )
        try:
            self.space = SwapSpace(
                SwapDirectories(tuple(roots)),
                direct=backend.direct,
                file_size=self.settings.file_size,
                stripe_size=max(self.settings.block_size, ALIGNMENT),
                label=label,
                grow=self.settings.grow_files,
            )
        except BaseException:
            backend.close()
            raise
        self._integrity = (
            Integrity(self.settings.chunk_size) if self.settings.verify_checksums else None
        )
        self._stats = StatsRecorder()
        self._lock = threading.Lock()
        self._drained = threading.Condition(self._lock)
        self._inflight = 0  # requests in flight, zombies included: they hold backend slots
        self._zombies = 0
        self._flying: set[Piece] = set()  # in flight and not timed out
        self._quarantine = Quarantine()
        self._active: set[Transfer] = set()
        #: threads inside the pump loop now: a completion that arrives while its own thread is
        #: pumping leaves the queue to that loop, and a chain they hold may not be handed
        #: over yet (close() leaves it to them)
        self._pumpers: set[int] = set()
        self._closed = False
        #: finished transfers whose futures the dispatcher resolves, then None: it ends
        self._resolve: queue.SimpleQueue[Transfer | None] = queue.SimpleQueue()
        self._dispatcher = threading.Thread(
            target=self._dispatch, name="swap-callbacks", daemon=True
        )
        self._dispatcher.start()
        self._hasher: ChunkHasher | None = None
        if self._integrity is not None:
            self._hasher = ChunkHasher(self._integrity, self._lock, self._hashed_locked)
        self._watchdog: Watchdog | None = None
        if self.settings.request_timeout is not None:
            self._watchdog = Watchdog(
                self._lock, self.settings.request_timeout, self._expire_overdue_locked
            )
        _open_engines.add(self)
        log.info(
            "swap engine: backend=%s block_size=%d queue_depth=%d dirs=%s verify=%s "
            "request_timeout=%s",
            backend.name,
            self.settings.block_size,
            self.settings.queue_depth,
            [str(d) for d in self.space.run_dirs],
            self.settings.verify_checksums,
            self.settings.request_timeout,
        )

    # -- allocation -------------------------------------------------------------------------
    def allocate(self, nbytes: int) -> Extent:
        return self.space.allocate(nbytes)

    def free(self, extent: Extent) -> None:
        """Returns the extent's space. While a timed-out request may still write into it, the
        space is held back (and freed when that request completes, or with the files)."""
        with self._lock:
            if self._quarantine.was_freed(extent):
                raise ValueError(f"double free: extent #{extent.serial} was freed already")
            if self._quarantine.hold_back(extent):
                return
        self.space.free(extent)
        if self._integrity is not None:
            self._integrity.forget(extent)

    # -- transfers --------------------------------------------------------------------------
    def write(
        self,
        extent: Extent,
        buffer: HostBuffer,
        *,
        nbytes: int | None = None,
        extent_offset: int = 0,
        buffer_offset: int = 0,
        tag: Any = None,
    ) -> TransferFuture:
        """Writes ``nbytes`` from ``buffer[buffer_offset:]`` to ``extent[extent_offset:]``.

        Direct I/O moves whole 4096-byte blocks, so a write whose ``nbytes`` is not a multiple
        of 4096 writes zeros after it up to the block end, and zeroes those buffer bytes to say
        so; it must therefore end at the extent's end, where those bytes are padding. ``tag``
        (short, JSON-able) names what the bytes are; reads may ask for it back."""
        return self._start(
            Op.WRITE, extent, buffer, nbytes, extent_offset, buffer_offset, tag
        ).future

    def read(
        self,
        extent: Extent,
        buffer: HostBuffer,
        *,
        nbytes: int | None = None,
        extent_offset: int = 0,
        buffer_offset: int = 0,
        tag: Any = None,
    ) -> TransferFuture:
        """Reads ``nbytes`` of ``extent[extent_offset:]`` into ``buffer[buffer_offset:]``.

        The buffer must have room for ``nbytes`` rounded up to 4096; bytes past ``nbytes`` in
        that rounded span are overwritten with what the extent holds there. With verification
        on, the future fails with :class:`IntegrityError` unless the bytes are those last
        written there, and (given ``tag``) that write had this tag."""
        return self._start(
            Op.READ, extent, buffer, nbytes, extent_offset, buffer_offset, tag
        ).future

    def write_sync(self, extent: Extent, buffer: HostBuffer, **kwargs: Any) -> int:
        return self._start(Op.WRITE, extent, buffer, **_range(kwargs)).future.result()

    def read_sync(self, extent: Extent, buffer: HostBuffer, **kwargs: Any) -> int:
        return self._start(Op.READ, extent, buffer, **_range(kwargs)).future.result()

    def _start(
        self,
        op: Op,
        extent: Extent,
        buffer: HostBuffer,
        nbytes: int | None = None,
        extent_offset: int = 0,
        buffer_offset: int = 0,
        tag: Any = None,
    ) -> Transfer:
        nbytes = checked_range(extent, nbytes, extent_offset, buffer_offset)
        self.space.check_extent(extent)
        if self._quarantine.was_freed(extent):
            raise ValueError(f"extent #{extent.serial} ({extent.nbytes} bytes) was freed")
        padded = padded_in_buffer(op, extent, buffer, nbytes, extent_offset, buffer_offset)
        check, refused = None, None
        if self._integrity is not None:
            try:
                check = self._integrity.begin(
                    op is Op.WRITE, extent, extent_offset, extent_offset + padded, tag
                )
            except IntegrityError as exc:  # the read cannot return what it asks for: no I/O
                refused = exc
        transfer = Transfer(op, nbytes, buffer, extent, check)
        pieces, covered = (
            ([], [])
            if refused
            else cut_into_pieces(
                transfer,
                extent_offset,
                buffer_offset,
                padded,
                self.settings.block_size,
                self.settings.chunk_size,
            )
        )
        chunks = covered if op is Op.WRITE else []
        try:
            self._enqueue(transfer, op, pieces, chunks, refused)
        finally:
            # Also when a signal handler raised in there: requests already queued must be
            # submitted, or they would wait for a completion that never comes (close() would
            # then wait its whole timeout for them).
            self._pump()
        return transfer

    def _enqueue(
        self,
        transfer: Transfer,
        op: Op,
        pieces: list[Piece],
        chunks: list[Chunk],
        refused: IntegrityError | None,
    ) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError("the swap engine is closed")
            # Under the engine lock, so no other thread can finish it before it has started.
            self._stats.transfer_started(op.value)
            self._active.add(transfer)
            if refused is not None:
                transfer.error = refused
                self._stats.note_error()
            transfer.queued = len(pieces)
            for piece in pieces:
                self.queues.add(piece)
            if chunks:
                # The bytes are in the buffer already: hash them while they are being written.
                assert self._hasher is not None  # chunks are covered only with integrity
                for chunk in chunks:
                    self._hasher.queue_locked(transfer, chunk)
            if not pieces:  # nbytes == 0, or refused
                self._finish_locked(transfer)
            if self._zombies:
                self._fail_stalled_locked()

    def _pump(self) -> None:
        # A completion that arrives while this thread is already pumping (a backend that finished
        # inside submit) leaves the queue to the running loop instead of recursing. That loop
        # re-checks the queues after every submit, so nothing is left behind. No user code runs
        # in here (callbacks run on the dispatcher), so the outer loop always gets back control.
        me = threading.get_ident()
        if me in self._pumpers:
            return
        self._pumpers.add(me)
        try:
            with self.backend.plugged():  # one system call for the requests submitted here
                self._pump_loop()
        finally:
            self._pumpers.discard(me)

    def _pump_loop(self) -> None:
        while True:
            with self._lock:
                pieces = self.queues.take()
                if pieces is None:
                    return
                transfer = pieces[0].transfer
                transfer.queued -= len(pieces)
                if transfer.error is not None or transfer.done:
                    # A failed transfer's remaining requests are dropped, not submitted.
                    self._finish_locked(transfer)
                    self._notify_if_drained_locked()
                    continue
                chain = Chain(pieces[0].file.drive, len(pieces), threading.get_ident())
                self.queues.occupy(chain)
                self._inflight += len(pieces)
                transfer.outstanding += len(pieces)
                now = time.monotonic()
                for piece in pieces:
                    piece.chain = chain
                    piece.started = now
                    self._flying.add(piece)
            # A signal handler can raise (KeyboardInterrupt, a user's SystemExit) between any
            # two bytecodes here. The requests are counted in flight: they must still be
            # settled, or close() would wait out its timeout for requests nobody submitted.
            # start_chain either raises (nothing started) or will report the chain once;
            # settling twice is harmless (each piece applies its first outcome only).
            try:
                self._stats.request_submitted(transfer.op.value, len(pieces))
                requests = [
                    IORequest(transfer.op, piece.file.fd, piece.offset, piece.address, piece.length)
                    for piece in pieces
                ]
                chain.handed = True
                self.backend.start_chain(requests, functools.partial(self._settle, pieces))
            except Exception as exc:
                self._settle(pieces, [exc] * len(pieces))
            except BaseException as exc:
                self._settle(pieces, [exc] * len(pieces))
                raise

    def _settle(self, pieces: list[Piece], outcomes: Sequence[Outcome]) -> None:
        """Applies the outcome of each of a chain's requests (bytes moved, or the exception it
        failed with) under one acquisition of the lock: a short request is continued, a failed
        one fails its transfer with an error naming file, offset and cause. Runs on the
        backend's thread, once per chain."""
        if all(outcome == piece.length for piece, outcome in zip(pieces, outcomes)):
            with self._lock:
                freed = self._settle_whole_locked(pieces)
            if freed is not None:
                if freed:
                    self._stats.request_done()
                    self._pump()
                return
        settled = []
        for piece, outcome in zip(pieces, outcomes):
            error: BaseException | None = None
            result = 0
            if isinstance(outcome, BaseException):
                error = outcome
            else:
                result = outcome
            requeue = None
            detail = ""
            if error is None and result < piece.length:
                if result <= 0 or (self.backend.direct and result % ALIGNMENT):
                    error = OSError(0, "short transfer")
                    detail = (
                        "the file is shorter than the extent (truncated or replaced swap file?)"
                        if piece.transfer.op is Op.READ and result == 0
                        else f"the kernel moved {result} of {piece.length} bytes"
                    )
                else:
                    requeue = Piece(
                        piece.transfer,
                        piece.file,
                        piece.offset + result,
                        piece.address + result,
                        piece.length - result,
                        piece.chunk,
                    )
            elif error is not None and not getattr(error, "errno", 0):
                detail = f"{type(error).__name__}: {error}"
            settled.append((piece, result, error, requeue, detail))
        freed = False
        with self._lock:
            for piece, result, error, requeue, detail in settled:
                freed |= self._settle_locked(piece, result, error, requeue, detail)
            self._notify_if_drained_locked()
        if freed:
            # Only a freed slot lets anything new start; completions that free none (a
            # requeued remainder included) leave the queue to the one that frees it.
            self._stats.request_done()
            self._pump()

    def _settle_whole_locked(self, pieces: list[Piece]) -> bool | None:
        """The common case of ``_settle``: every request of the chain moved all its bytes.
        The chain is one transfer's contiguous requests, so its bookkeeping is done once for
        all of them. Returns whether the slot was freed, or None (nothing done) when one of
        them was settled before or timed out: those take the request-by-request path."""
        if any(piece.settled or piece.timed_out for piece in pieces):
            return None
        transfer = pieces[0].transfer
        chain = pieces[0].chain
        assert chain is not None
        count = len(pieces)
        for piece in pieces:
            piece.settled = True
        self._inflight -= count
        chain.left -= count
        freed = chain.left == 0
        if freed:
            self.queues.release(chain)
        self._flying.difference_update(pieces)
        transfer.outstanding -= count
        if transfer.op is Op.READ:
            for piece in pieces:
                if piece.chunk is not None:
                    self._chunk_bytes_arrived_locked(transfer, piece.chunk, piece.length)
        self._finish_locked(transfer)
        self._notify_if_drained_locked()
        return freed

    def _settle_locked(
        self,
        piece: Piece,
        result: int,
        error: BaseException | None,
        requeue: Piece | None,
        detail: str,
    ) -> bool:
        """One request's outcome; True when it freed its chain's queue slot."""
        if piece.settled:
            return False
        piece.settled = True
        transfer = piece.transfer
        self._inflight -= 1
        chain = piece.chain
        assert chain is not None
        chain.left -= 1
        freed = chain.left == 0
        if freed:
            self.queues.release(chain)
        if piece.timed_out:
            self._zombie_done_locked(piece, error)
            return freed
        self._flying.discard(piece)
        if isinstance(error, BackendAbandonedError):
            self._quarantine.abandon(piece)
        transfer.outstanding -= 1
        if error is None and piece.chunk is not None and transfer.op is Op.READ:
            self._chunk_bytes_arrived_locked(transfer, piece.chunk, result)
        if requeue is not None:
            # The rest goes first in its drive's queue: the transfer is under way.
            self._stats.note_retry()
            transfer.queued += 1
            self.queues.add(requeue, first=True)
        elif error is not None and transfer.error is None and not transfer.done:
            err = getattr(error, "errno", 0) or 0
            transfer.error = SwapIOError(
                transfer.op.value, piece.file.path, piece.offset, piece.length, err, detail
            )
            transfer.error.__cause__ = error
            self._stats.note_error()
        self._finish_locked(transfer)
        return freed

    def _chunk_bytes_arrived_locked(self, transfer: Transfer, chunk: Chunk, nbytes: int) -> None:
        left = transfer.chunk_left.get(chunk.index)
        if left is None:
            return
        left -= nbytes
        transfer.chunk_left[chunk.index] = left
        if left <= 0 and transfer.error is None:
            del transfer.chunk_left[chunk.index]
            assert self._hasher is not None  # chunks are counted only with integrity
            self._hasher.queue_locked(transfer, chunk)

    def _hashed_locked(self, transfer: Transfer, failure: BaseException | None) -> None:
        """A chunk of ``transfer`` was hashed (``failure``: its mismatch or error)."""
        if failure is not None and transfer.error is None and not transfer.done:
            transfer.error = failure
            self._stats.note_error()
        self._finish_locked(transfer)
        self._notify_if_drained_locked()

    def _finish_locked(self, transfer: Transfer) -> None:
        """Once nothing of the transfer remains queued or in flight, marks it done and hands its
        future to the dispatcher: the future's callbacks may block or start new transfers, which
        must happen neither under this lock nor on a backend thread."""
        if transfer.outstanding or transfer.queued or transfer.hashing > 0 or transfer.done:
            return
        transfer.done = True
        self._active.discard(transfer)
        check = transfer.check
        if check is not None and check.write:
            integrity = self._integrity
            assert integrity is not None  # checks are made by it
            if transfer.error is None:
                integrity.commit(check)
            else:
                integrity.write_failed(check, transfer.error)
        self._stats.transfer_finished(transfer.op.value, 0 if transfer.error else transfer.nbytes)
        transfer.event.set()
        self._resolve.put(transfer)

    def _hashing(self) -> int:
        """Chunks queued for or being hashed: their transfers are not finished."""
        return self._hasher.pending if self._hasher is not None else 0

    def _notify_if_drained_locked(self) -> None:
        if self._inflight == self._zombies and not self.queues.queued and self._hashing() <= 0:
            self._drained.notify_all()

    def _dispatch(self) -> None:
        while True:
            transfer = self._resolve.get()
            if transfer is None:
                return
            # Future runs (and logs the failures of) its callbacks itself; nothing escapes here.
            if transfer.error is not None:
                Future.set_exception(transfer.future, transfer.error)
            else:
                Future.set_result(transfer.future, transfer.nbytes)
            transfer.future.detach()

    # -- timeouts and quarantine (swap.timeouts) -------------------------------------------
    def _expire_overdue_locked(self, now: float) -> float | None:
        """The watchdog's call: fails the transfers of the requests in flight for
        ``request_timeout`` or longer at ``now``; returns when the oldest request left in
        flight started."""
        timeout = self.settings.request_timeout
        assert timeout is not None  # the watchdog runs only with one
        expired = [p for p in self._flying if now - p.started >= timeout]
        for piece in expired:
            self._expire_locked(piece, timeout)
        if expired:
            self._fail_stalled_locked()
        return min((p.started for p in self._flying), default=None)

    def _expire_locked(self, piece: Piece, timeout: float) -> None:
        """``piece`` timed out: it still holds its queue slot (the kernel has it), its chain's
        slot counts as stalled, and its memory and space are quarantined."""
        piece.timed_out = True
        self._flying.discard(piece)
        self._zombies += 1
        if piece.chain is not None:
            self.queues.stall(piece.chain)
        piece.transfer.outstanding -= 1
        record = self._quarantine.hold(piece)
        self._stats.note_timeout()
        self._fail_transfer_locked(piece.transfer, request_timed_out(piece, timeout, record))

    def _fail_transfer_locked(self, transfer: Transfer, error: BaseException) -> None:
        """Fails ``transfer`` now: its queued requests are dropped at once (no slot may ever
        free up to pop them) and it finishes when its requests still in flight complete."""
        if transfer.error is None and not transfer.done:
            transfer.error = error
            self._stats.note_error()
        if transfer.queued:
            self.queues.drop(transfer)
            transfer.queued = 0
        self._finish_locked(transfer)
        self._notify_if_drained_locked()

    def _fail_stalled_locked(self) -> None:
        """Fails the queued transfers of a drive whose every slot is held by a hung request:
        nothing would ever start them, so waiting would be a hang."""
        timeout = self.settings.request_timeout
        assert timeout is not None  # requests time out only with one
        for drive_queue, hung in list(self.queues.hung()):
            for transfer in list(dict.fromkeys(p.transfer for p in drive_queue)):
                piece = next(p for p in drive_queue if p.transfer is transfer)
                self._fail_transfer_locked(transfer, cannot_start(transfer, piece, hung, timeout))

    def _zombie_done_locked(self, piece: Piece, error: BaseException | None) -> None:
        """A request that timed out completed after all (or was abandoned by the backend)."""
        self._zombies -= 1
        extent = self._quarantine.completed(piece, error)
        if extent is not None and not self._closed:
            self.space.free(extent)
            if self._integrity is not None:
                self._integrity.forget(extent)

    def quarantined(self) -> list[Quarantined]:
        """Requests that timed out and have not completed: their buffer ranges must not be
        reused, and their extents' space is held back."""
        with self._lock:
            return self._quarantine.records()

    # -- reporting and teardown -------------------------------------------------------------
    def stats(self) -> EngineStats:
        integrity = self._integrity
        with self._lock:
            quarantined = len(self._quarantine)
        return self._stats.snapshot(
            self.backend.counters.thread_cpu_seconds
            + (self._hasher.cpu_seconds if self._hasher is not None else 0.0),
            checksum_seconds=integrity.seconds if integrity else 0.0,
            integrity_errors=integrity.errors if integrity else 0,
            quarantined=quarantined,
        )

    @property
    def backend_name(self) -> str:
        return self.backend.name

    def close(self) -> None:
        """Waits (at most ``settings.close_timeout``) for transfers under way, fails whatever is
        left with :class:`TransferTimeoutError`, then closes the backend and removes the files
        (unless ``keep_files``: then the integrity records are written next to them as
        ``integrity.json``). New transfers are refused from the moment close starts. Requests
        that already timed out are not waited for."""
        deadline = time.monotonic() + self.settings.close_timeout
        if not self._closed:
            # A plugged submit that an exception cut short (a signal handler raising SystemExit
            # in the training thread) may still hold requests this close would wait for.
            self.backend.flush()
            self._settle_orphans()
        with self._lock:
            if self._closed:
                return
            self._closed = True
            _open_engines.discard(self)
            while self._inflight - self._zombies or self.queues.queued or self._hashing() > 0:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._drained.wait(remaining)
            if self._inflight - self._zombies or self.queues.queued:
                log.error(
                    "swap engine: closing with %d request(s) in flight and %d queued after "
                    "%.3g s; their transfers fail",
                    self._inflight - self._zombies,
                    self.queues.queued,
                    self.settings.close_timeout,
                )
                self.queues.clear()
                self._fail_active_locked()
            if self._watchdog is not None:
                self._watchdog.stop_locked()
        if self._watchdog is not None:
            self._watchdog.join(5.0)
        self.backend.close()
        with self._lock:
            # A backend that never resolves a request (closed or not) must not leave a transfer
            # pending forever, nor its memory unreferenced while the kernel may still use it.
            for piece in list(self._flying) + self._quarantine.pieces():
                self._quarantine.abandon(piece)
            self._flying.clear()
            self._fail_active_locked()
        if self._hasher is not None:
            self._hasher.stop(max(1.0, deadline - time.monotonic()))
        if self.keep_files and self._integrity is not None:
            for run_dir in self.space.run_dirs:
                try:
                    self._integrity.write_sidecar(run_dir / SIDECAR_NAME)
                except OSError as exc:
                    log.warning("could not write the integrity sidecar in %s: %s", run_dir, exc)
        self.space.close(keep=self.keep_files)
        self._resolve.put(None)
        if self._dispatcher is not threading.current_thread():
            self._dispatcher.join(max(1.0, deadline - time.monotonic()))

    def _settle_orphans(self) -> None:
        """Fails the requests a signal handler's exception left counted in flight or queued
        but never given to the backend (it can raise between any two bytecodes of the thread
        submitting them), then submits what is still queued: close would otherwise wait its
        whole timeout (60 s by default) for completions that cannot come. Only chains whose
        submitting thread has left the pump loop count: another thread's may be on its way."""
        with self._lock:
            pumping = set(self._pumpers)
            orphans: dict[Chain, list[Piece]] = {}
            for piece in self._flying:
                chain = piece.chain
                if (
                    chain is not None
                    and not chain.handed
                    and not piece.settled
                    and chain.owner not in pumping
                ):
                    orphans.setdefault(chain, []).append(piece)
            if not pumping:
                # Taken off a queue and then dropped by the exception: counted, gone.
                self.queues.recount()
        for pieces in orphans.values():
            error = RuntimeError(
                "never submitted: an exception raised by a signal handler interrupted the "
                "thread submitting it"
            )
            self._settle(pieces, [error] * len(pieces))
        if orphans:
            log.warning(
                "swap engine: %d request(s) that an interrupted submit never started fail",
                sum(len(p) for p in orphans.values()),
            )
        self._pump()

    def _fail_active_locked(self) -> None:
        for transfer in list(self._active):
            if transfer.error is None:
                transfer.error = TransferTimeoutError(
                    f"the swap engine was closed before this {transfer.op.value} of "
                    f"{transfer.nbytes} bytes finished (close_timeout="
                    f"{self.settings.close_timeout:g} s)"
                )
                self._stats.note_error()
            transfer.outstanding = transfer.queued = 0
            self._finish_locked(transfer)

    def __enter__(self) -> SwapEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _range(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments of the sync forms, checked like the async forms check theirs."""
    unknown = set(kwargs) - {"nbytes", "extent_offset", "buffer_offset", "tag"}
    if unknown:
        raise TypeError(f"unexpected keyword argument(s): {', '.join(sorted(unknown))}")
    return kwargs
