"""Applying the outcome of NVMe transfers to the residency states ("reaping"), and what a
failed transfer does.

:class:`Completions` is a part of :class:`infinity.core.placement.Placement` with its own state
(each shard's failed attempts, the quarantined arena ranges, the I/O counters and the seconds
waited); what it needs of the placement (re-issuing a write, giving back or leaving a slot) is
:class:`SlotKeeper`. Like the rest of the placement it runs on the training thread only: the
swap engine's futures complete in the background, and their outcome is applied here when the
training thread next looks at the shard.

Failed transfers never leave a shard without a valid copy:

* a failed write leaves the shard ``HOST`` (dirty): its host copy stays the only valid one and is
  never dropped until a write of it completes. The write is re-issued up to ``max_retries``
  times at once; after that the shard stays dirty and the error is raised by whatever needs the
  shard clean (eviction that finds no other room, ``flush``);
* a failed read leaves the shard ``NVME`` (its NVMe copy is still the valid one). The demand
  path (:meth:`Placement.ensure_host`) reads it again up to ``max_retries`` times and then raises
  the error, which names file, offset and cause (``SwapIOError``, ``TransferTimeoutError``,
  ``IntegrityError``). A failed prefetch is not an error by itself;
* a read that timed out may still be completed by the kernel later, writing into its arena
  slot: that slot is quarantined (left allocated, counted in ``quarantined_bytes``) until the
  engine reports the request finished, and the retry reads into another slot. A write that
  timed out may still land later, so its retry goes to a fresh extent (the engine holds the old
  one's space back until then).

Every NVMe transfer carries the tag ``[shard id, version]``, so with ``verify_checksums`` a read
returns exactly the bytes of the version last written for that shard or fails naming what it
found instead (a flipped byte, a stale or swapped extent).
"""

from __future__ import annotations

import logging
import time
from typing import Protocol

from infinity.core.residency import Residency as R
from infinity.core.shards import Shard, ShardRegistry
from infinity.core.tiers import HostTier
from infinity.core.timeline import Timeline
from swap import SwapEngine, SwapError, align_up

# The placement's logger: its transfer warnings keep the name users filter them by.
log = logging.getLogger("infinity.core.placement")

#: re-issues of a failed transfer before its error surfaces: a single EIO, timeout or bad read
#: must not abort training, while a persistent fault still surfaces after a bounded delay
MAX_RETRIES = 2


def retryable(error: BaseException) -> bool:
    """Errors of the I/O itself (swap errors and OS errors); anything else is a bug or misuse
    (an engine closed under the store, a bad range) and is raised as it is."""
    return isinstance(error, (SwapError, OSError))


class SlotKeeper(Protocol):
    """What applying transfer outcomes needs of the placement."""

    def store_async(self, shard: Shard) -> None:
        """Starts HOST -> NVMe (a failed write's retry)."""

    def free_slot(self, shard: Shard) -> None:
        """Gives ``shard``'s arena slot back."""

    def leave_slot(self, shard: Shard) -> None:
        """``shard`` leaves its arena slot, which stays allocated (quarantined)."""


class Completions:
    """Transfer outcomes and failures of one placement (see the module docstring)."""

    def __init__(
        self,
        slots: SlotKeeper,
        registry: ShardRegistry,
        host: HostTier,
        engine: SwapEngine | None,
        timeline: Timeline,
        max_retries: int = MAX_RETRIES,
    ) -> None:
        self._slots = slots
        self.registry = registry
        self.host = host
        self.engine = engine
        self.timeline = timeline
        #: attempts of a transfer after its first failure (see the module docstring)
        self.max_retries = max_retries
        #: the training thread's seconds waiting for transfers
        self.stall_seconds = 0.0
        #: transfers that failed (each attempt), re-issued, succeeded after failing, and failed
        #: for good (after the retries)
        self.io_errors = 0
        self.io_retries = 0
        self.io_recoveries = 0
        self.io_failures = 0
        #: shard -> failed attempts of its current transfer
        self._failed: dict[Shard, int] = {}
        #: arena ranges (offset, nbytes, shard id) a timed-out read may still write into
        self.quarantine: list[tuple[int, int, str]] = []

    @property
    def _engine(self) -> SwapEngine:
        engine = self.engine
        assert engine is not None  # NVMe transfers, and their outcomes, need the engine
        return engine

    # -- attempts -------------------------------------------------------------------------------
    def attempt(self, shard: Shard) -> None:
        """A transfer of ``shard`` is issued: a retry if its last attempt failed."""
        if self._failed.get(shard):
            self.io_retries += 1

    def failures(self, shard: Shard) -> int:
        """Failed attempts of ``shard``'s current transfer."""
        return self._failed.get(shard, 0)

    def gave_up(self, shard: Shard) -> None:
        """``shard``'s transfer failed for good: its error is raised."""
        self._failed.pop(shard, None)
        self.io_failures += 1

    def forget(self, shard: Shard) -> None:
        """``shard``'s failed transfer no longer matters (its value is overwritten whole)."""
        self._failed.pop(shard, None)

    # -- reaping NVMe completions -----------------------------------------------------------
    def reap(self, shard: Shard, wait: bool = False) -> BaseException | None:
        """Applies the outcome of ``shard``'s transfer to its state, once it has finished (with
        ``wait``: waits for it, and for the retries of a failed write).

        Raises only if the engine refuses a retry (closed): every outcome leaves a legal state
        with a valid copy. A failed write is re-issued (up to ``max_retries``) and otherwise
        leaves the shard ``HOST`` (dirty); a failed read leaves it ``NVME`` (``ensure_host``
        reads it again). Returns the error of a transfer that failed and was not re-issued
        here, else None."""
        while True:
            future = shard.pending
            if future is None:
                return None
            if not future.done():
                if not wait:
                    return None
                started = time.perf_counter()
                # A real-length torch.profiler range while recording (a no-op otherwise).
                with self.timeline.profile_range("infinity::stall", shard.id):
                    try:
                        future.result()
                    except Exception:
                        pass
                    ended = time.perf_counter()
                    self.timeline.stall(shard.io_record, shard.id, started, ended)
                self.stall_seconds += ended - started
            shard.pending = None
            error = future.exception()
            if shard.state is R.NVME_LOADING:
                if error is None:
                    self.registry.set_state(shard, R.HOST_NVME)
                    self._succeeded(shard, "read")
                    return None
                self._read_failed(shard, error)
                return error
            if shard.state is not R.HOST_STORING:  # pragma: no cover - a bookkeeping bug
                raise RuntimeError(f"{shard} had a transfer in flight in state {shard.state.name}")
            if error is None:
                self.registry.set_state(shard, R.HOST_NVME)
                self._succeeded(shard, "write")
                return None
            if not self._write_failed(shard, error):
                return error
            # re-issued: loop to wait for the retry (or return at once without ``wait``)

    def _succeeded(self, shard: Shard, op: str) -> None:
        failures = self._failed.pop(shard, 0)
        if failures:
            self.io_recoveries += 1
            log.info("%s of shard %s succeeded after %d failed attempt(s)", op, shard.id, failures)

    def _read_failed(self, shard: Shard, error: BaseException) -> None:
        """NVME_LOADING -> NVME: the NVMe copy is still the valid one. The slot is freed, or
        quarantined when a timed-out request of the read may still write into it."""
        self.io_errors += 1
        self._failed[shard] = self._failed.get(shard, 0) + 1
        start, size = shard.arena_offset, align_up(max(shard.nbytes, 1))
        assert start is not None  # a read goes into an arena slot
        if self._kernel_may_write(start, start + size):
            self.quarantine.append((start, shard.nbytes, shard.id))
            log.warning(
                "arena range [%d, %d) of shard %s is quarantined: a read into it timed "
                "out and may still complete; it stays allocated until it does",
                start,
                start + size,
                shard.id,
            )
            self._slots.leave_slot(shard)
        else:
            self._slots.free_slot(shard)
        self.registry.set_state(shard, R.NVME)
        log.warning(
            "read of shard %s (%d bytes) failed: %s: %s",
            shard.id,
            shard.nbytes,
            type(error).__name__,
            error,
        )

    def _write_failed(self, shard: Shard, error: BaseException) -> bool:
        """HOST_STORING -> HOST (the host copy stays the valid one), then re-issues the write
        while retries are left; True if it did."""
        self.io_errors += 1
        attempt = self._failed.get(shard, 0) + 1
        self._failed[shard] = attempt
        if self._write_may_land_late(shard):
            self._replace_extent(shard)
        self.registry.set_state(shard, R.HOST)
        if attempt <= self.max_retries and retryable(error):
            log.warning(
                "write of shard %s (%d bytes) failed: %s: %s; retry %d of %d",
                shard.id,
                shard.nbytes,
                type(error).__name__,
                error,
                attempt,
                self.max_retries,
            )
            self._slots.store_async(shard)
            return True
        self._failed.pop(shard, None)
        self.io_failures += 1
        log.error(
            "write of shard %s (%d bytes) failed after %d attempt(s): %s: %s; its host copy "
            "stays the only valid one (dirty)",
            shard.id,
            shard.nbytes,
            attempt,
            type(error).__name__,
            error,
        )
        return False

    def _kernel_may_write(self, start: int, end: int) -> bool:
        """Whether a timed-out read request still in the kernel covers arena bytes
        [start, end)."""
        arena = self.host.arena
        return any(
            q.op == "read" and q.buffer is arena and q.buffer_start < end and q.buffer_end > start
            for q in self._engine.quarantined()
        )

    def _write_may_land_late(self, shard: Shard) -> bool:
        assert shard.extent is not None  # it was written
        serial = shard.extent.serial
        return any(q.op == "write" and q.extent == serial for q in self._engine.quarantined())

    def _replace_extent(self, shard: Shard) -> None:
        """Moves ``shard`` to a fresh extent: a timed-out write to the old one may still land
        and would overwrite a later write there (the engine holds the old space back)."""
        try:
            fresh = self._engine.allocate(shard.nbytes)
        except SwapError as exc:
            log.warning(
                "no fresh extent for shard %s after a timed-out write (%s); it keeps "
                "its extent, where verification catches a late write",
                shard.id,
                exc,
            )
            return
        old, shard.extent = shard.extent, fresh
        assert old is not None  # it was written
        self._engine.free(old)

    def reclaim_quarantine(self) -> None:
        """Gives back the quarantined arena ranges no timed-out read covers any more."""
        if not self.quarantine:
            return
        arena = self.host.arena
        records = [q for q in self._engine.quarantined() if q.op == "read" and q.buffer is arena]
        kept = []
        for offset, nbytes, shard_id in self.quarantine:
            end = offset + align_up(max(nbytes, 1))
            if any(q.buffer_start < end and q.buffer_end > offset for q in records):
                kept.append((offset, nbytes, shard_id))
                continue
            self.host.give_arena(offset, nbytes)
            log.info("arena range [%d, %d) (shard %s) left quarantine", offset, end, shard_id)
        self.quarantine = kept

    @property
    def quarantined_bytes(self) -> int:
        return sum(align_up(max(n, 1)) for _, n, _ in self.quarantine)
