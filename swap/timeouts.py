"""Request timeouts and the quarantine of requests that timed out, for :class:`SwapEngine`.

A request in flight longer than ``request_timeout`` fails its transfer with
:class:`TransferTimeoutError`, but the request itself cannot be taken back from the kernel: it may
still complete at any time, reading its file range into its buffer range (a read) or storing its
buffer range into its file range (a write). So it stays counted in flight (it holds a backend
slot, like any request the kernel has), its buffer stays referenced and is listed by
``SwapEngine.quarantined()`` (the caller must not put other data there), and freeing its extent
holds the space back until the request completes. A request that completes after all leaves
quarantine; one the backend abandons at close leaves its buffer referenced in ``_abandoned`` for
the life of the process, so the kernel never writes into memory that was freed or reused.

Lives in a mixin so the engine module stays about moving bytes; it uses the engine's lock and
counters directly.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

from swap.backends.base import BackendAbandonedError
from swap.errors import TransferTimeoutError
from swap.transfer import Piece, Quarantined, Transfer

if TYPE_CHECKING:
    from swap.engine import SwapEngine

log = logging.getLogger("swap.engine")

#: requests the backend gave up on while they may still run; their buffers stay referenced
_abandoned: list[Quarantined] = []


class TimeoutsMixin:
    """The watchdog thread and the quarantine bookkeeping of :class:`SwapEngine`."""

    def _start_watchdog(self: SwapEngine) -> None:
        self._watch = threading.Condition(self._lock)
        self._watch_stop = False
        self._watchdog: threading.Thread | None = None
        if self.settings.request_timeout is not None:
            # Its own thread, not the dispatcher: a callback blocking on a hung transfer would
            # otherwise stop the very thread that is to time it out.
            self._watchdog = threading.Thread(
                target=self._watch_requests, name="swap-watchdog", daemon=True
            )
            self._watchdog.start()

    def _stop_watchdog_locked(self: SwapEngine) -> None:
        self._watch_stop = True
        self._watch.notify_all()

    def _watch_requests(self: SwapEngine) -> None:
        timeout = self.settings.request_timeout
        assert timeout is not None
        with self._lock:
            while not self._watch_stop:
                now = time.monotonic()
                expired = [p for p in self._flying if now - p.started >= timeout]
                for piece in expired:
                    self._expire_locked(piece, timeout)
                if expired:
                    self._fail_stalled_locked()
                oldest = min((p.started for p in self._flying), default=None)
                # Idle, it wakes every timeout/2: a request submitted meanwhile is then seen
                # long before its deadline, so submits never need to wake it.
                wait = timeout / 2 if oldest is None else max(oldest + timeout - now, 0.001)
                self._watch.wait(wait)

    def _expire_locked(self: SwapEngine, piece: Piece, timeout: float) -> None:
        transfer = piece.transfer
        piece.timed_out = True
        self._flying.discard(piece)
        self._zombies += 1
        chain = piece.chain
        if chain is not None and not chain.stalled:
            chain.stalled = True
            self._stalled += 1
            self._drive_stalled[chain.drive] += 1
        transfer.outstanding -= 1
        start = piece.address - transfer.buffer.address
        record = Quarantined(
            transfer.op.value,
            piece.file.path,
            piece.offset,
            piece.length,
            transfer.extent.serial,
            transfer.buffer,
            start,
            start + piece.length,
        )
        self._quarantine[piece] = record
        serial = transfer.extent.serial
        self._extent_zombies[serial] = self._extent_zombies.get(serial, 0) + 1
        self._stats.note_timeout()
        message = (
            f"{transfer.op.value} of {piece.length} bytes at offset {piece.offset} in "
            f"{piece.file.path} did not complete within request_timeout={timeout:g} s "
            f"(device hung or overloaded); the transfer of {transfer.nbytes} bytes fails. "
            f"The request may still complete in the kernel, so its buffer range "
            f"[{start}, {start + piece.length}) of buffer #{transfer.buffer.index} and the "
            f"extent's space are quarantined: do not reuse that buffer range "
            f"(SwapEngine.quarantined() lists it)"
        )
        log.error("swap engine: %s", message)
        error = TransferTimeoutError(
            message, path=piece.file.path, offset=piece.offset, timeout=timeout
        )
        error.quarantine = record  # the caller can wait for record.released before reusing
        self._fail_transfer_locked(transfer, error)

    def _fail_transfer_locked(self: SwapEngine, transfer: Transfer, error: BaseException) -> None:
        """Fails ``transfer`` now: its queued requests are dropped at once (no slot may ever
        free up to pop them) and it finishes when its requests still in flight complete."""
        if transfer.error is None and not transfer.done:
            transfer.error = error
            self._stats.note_error()
        if transfer.queued:
            for drive_queue in self._queues:
                kept = [p for p in drive_queue if p.transfer is not transfer]
                if len(kept) != len(drive_queue):
                    drive_queue.clear()
                    drive_queue.extend(kept)
            self._queued -= transfer.queued
            transfer.queued = 0
        self._finish_locked(transfer)
        self._notify_if_drained_locked()

    def _fail_stalled_locked(self: SwapEngine) -> None:
        """Fails the queued transfers of a drive whose every slot is held by a hung request:
        nothing would ever start them, so waiting would be a hang."""
        stalled_all = self._stalled >= self.window
        for drive, drive_queue in enumerate(self._queues):
            stalled = self._drive_stalled[drive]
            if not drive_queue or not (stalled_all or stalled >= self.drive_depth):
                continue
            for transfer in list(dict.fromkeys(p.transfer for p in drive_queue)):
                piece = next(p for p in drive_queue if p.transfer is transfer)
                self._fail_transfer_locked(
                    transfer,
                    TransferTimeoutError(
                        f"{transfer.op.value} of {transfer.nbytes} bytes at offset "
                        f"{piece.offset} in {piece.file.path} cannot start: all "
                        f"{stalled or self._stalled} request "
                        f"slots are held by requests that exceeded request_timeout="
                        f"{self.settings.request_timeout:g} s (device hung)",
                        path=piece.file.path,
                        offset=piece.offset,
                        timeout=self.settings.request_timeout,
                    ),
                )

    def _zombie_done_locked(self: SwapEngine, piece: Piece, error: BaseException | None) -> None:
        """A request that timed out completed after all: its slot and quarantine are released,
        unless the backend only gave up on it (then it may still run)."""
        self._zombies -= 1
        if isinstance(error, BackendAbandonedError):
            self._abandon_locked(piece)
        else:
            record = self._quarantine.pop(piece, None)
            if record is not None:
                record.released.set()
        serial = piece.transfer.extent.serial
        left = self._extent_zombies.get(serial, 1) - 1
        if left:
            self._extent_zombies[serial] = left
            return
        self._extent_zombies.pop(serial, None)
        extent = self._deferred_free.pop(serial, None)
        if extent is not None and not self._closed:
            self.space.free(extent)
            if self._integrity is not None:
                self._integrity.forget(extent)

    def _abandon_locked(self: SwapEngine, piece: Piece) -> None:
        transfer = piece.transfer
        start = piece.address - transfer.buffer.address
        record = self._quarantine.pop(piece, None) or Quarantined(
            transfer.op.value,
            piece.file.path,
            piece.offset,
            piece.length,
            transfer.extent.serial,
            transfer.buffer,
            start,
            start + piece.length,
        )
        _abandoned.append(record)
        log.error(
            "swap engine: abandoned %s: the kernel may still complete it, so its buffer "
            "stays referenced (and must stay unused) for the life of the process",
            record.describe(),
        )

    def quarantined(self: SwapEngine) -> list[Quarantined]:
        """Requests that timed out and have not completed: their buffer ranges must not be
        reused, and their extents' space is held back."""
        with self._lock:
            return list(self._quarantine.values())
