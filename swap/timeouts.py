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

Two objects the engine owns: a :class:`Watchdog`, the thread that has the engine expire overdue
requests, and a :class:`Quarantine`, which keeps the records, the held-back extents and the
abandoned buffers. Neither touches the engine's request accounting (queue slots, transfers):
the engine keeps that, and tells them what happened.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from swap.backends.base import BackendAbandonedError
from swap.errors import TransferTimeoutError
from swap.files import Extent
from swap.transfer import Piece, Quarantined, Transfer

log = logging.getLogger("swap.engine")

#: requests the backend gave up on while they may still run; their buffers stay referenced
_abandoned: list[Quarantined] = []


class Watchdog:
    """A thread that calls ``expire(now)`` under ``lock`` until stopped. ``expire`` fails the
    requests in flight since ``now - timeout`` or earlier, and returns when the oldest request
    left in flight started (None when there is none); the watchdog sleeps until that one is due.

    Its own thread, not the engine's dispatcher: a callback blocking on a hung transfer would
    otherwise stop the very thread that is to time it out."""

    def __init__(
        self, lock: threading.Lock, timeout: float, expire: Callable[[float], float | None]
    ) -> None:
        self._wake = threading.Condition(lock)
        self._timeout = timeout
        self._expire = expire
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="swap-watchdog", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with self._wake:
            while not self._stopped:
                now = time.monotonic()
                oldest = self._expire(now)
                # Idle, it wakes every timeout/2: a request submitted meanwhile is then seen
                # long before its deadline, so submits never need to wake it.
                if oldest is None:
                    wait = self._timeout / 2
                else:
                    wait = max(oldest + self._timeout - now, 0.001)
                self._wake.wait(wait)

    def stop_locked(self) -> None:
        """Asks the thread to end; the caller holds the lock given at construction."""
        self._stopped = True
        self._wake.notify_all()

    def join(self, timeout: float) -> None:
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)


class Quarantine:
    """The requests that timed out and may still run in the kernel: a record of each (its
    buffer range must not be reused until ``record.released``), and the space of extents freed
    while one of them may still write there, held back until the last of those completes.
    Every method is called with the engine's lock held."""

    def __init__(self) -> None:
        self._records: dict[Piece, Quarantined] = {}
        self._per_extent: dict[int, int] = {}  # extent serial -> timed-out requests on it
        self._held_back: dict[int, Extent] = {}  # freed while such a request may write to it

    def __len__(self) -> int:
        return len(self._records)

    def records(self) -> list[Quarantined]:
        return list(self._records.values())

    def pieces(self) -> list[Piece]:
        return list(self._records)

    def hold(self, piece: Piece) -> Quarantined:
        """``piece`` timed out: its buffer range and its extent's space are held from now on."""
        record = self._records[piece] = _record(piece)
        serial = piece.transfer.extent.serial
        self._per_extent[serial] = self._per_extent.get(serial, 0) + 1
        return record

    def completed(self, piece: Piece, error: BaseException | None) -> Extent | None:
        """A request that timed out completed after all: its record is released, unless the
        backend only gave up on it (then it may still run, and its buffer stays referenced).
        Returns the extent whose space may now be freed, if it was freed meanwhile."""
        if isinstance(error, BackendAbandonedError):
            self.abandon(piece)
        else:
            record = self._records.pop(piece, None)
            if record is not None:
                record.released.set()
        serial = piece.transfer.extent.serial
        left = self._per_extent.get(serial, 1) - 1
        if left:
            self._per_extent[serial] = left
            return None
        self._per_extent.pop(serial, None)
        return self._held_back.pop(serial, None)

    def abandon(self, piece: Piece) -> None:
        """The backend stopped waiting for ``piece``, which may still run: its buffer stays
        referenced for the life of the process."""
        record = self._records.pop(piece, None) or _record(piece)
        _abandoned.append(record)
        log.error(
            "swap engine: abandoned %s: the kernel may still complete it, so its buffer "
            "stays referenced (and must stay unused) for the life of the process",
            record.describe(),
        )

    def was_freed(self, extent: Extent) -> bool:
        """Whether ``extent`` was freed and its space is still held back."""
        return extent.serial in self._held_back

    def hold_back(self, extent: Extent) -> bool:
        """At its free: keeps ``extent``'s space while a request that timed out may still write
        into it (``completed`` hands it back). True when it did."""
        if not self._per_extent.get(extent.serial):
            return False
        self._held_back[extent.serial] = extent
        log.warning(
            "extent #%d freed while a request that timed out may still write to it; its "
            "space is held back until that request completes",
            extent.serial,
        )
        return True


def _record(piece: Piece) -> Quarantined:
    transfer = piece.transfer
    start = piece.address - transfer.buffer.address
    return Quarantined(
        transfer.op.value,
        piece.file.path,
        piece.offset,
        piece.length,
        transfer.extent.serial,
        transfer.buffer,
        start,
        start + piece.length,
    )


def request_timed_out(piece: Piece, timeout: float, record: Quarantined) -> TransferTimeoutError:
    """The error of the transfer of ``piece``, a request that timed out (logged here)."""
    transfer = piece.transfer
    message = (
        f"{transfer.op.value} of {piece.length} bytes at offset {piece.offset} in "
        f"{piece.file.path} did not complete within request_timeout={timeout:g} s "
        f"(device hung or overloaded); the transfer of {transfer.nbytes} bytes fails. "
        f"The request may still complete in the kernel, so its buffer range "
        f"[{record.buffer_start}, {record.buffer_end}) of buffer #{transfer.buffer.index} and "
        f"the extent's space are quarantined: do not reuse that buffer range "
        f"(SwapEngine.quarantined() lists it)"
    )
    log.error("swap engine: %s", message)
    error = TransferTimeoutError(
        message, path=piece.file.path, offset=piece.offset, timeout=timeout
    )
    error.quarantine = record  # the caller can wait for record.released before reusing
    return error


def cannot_start(
    transfer: Transfer, piece: Piece, hung: int, timeout: float
) -> TransferTimeoutError:
    """The error of a queued ``transfer`` (``piece`` its first queued request) on a drive whose
    ``hung`` request slots are all held by requests that timed out."""
    return TransferTimeoutError(
        f"{transfer.op.value} of {transfer.nbytes} bytes at offset {piece.offset} in "
        f"{piece.file.path} cannot start: all {hung} request slots are held by requests "
        f"that exceeded request_timeout={timeout:g} s (device hung)",
        path=piece.file.path,
        offset=piece.offset,
        timeout=timeout,
    )
