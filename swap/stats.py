"""Counters the engine keeps so callers can report GB/s, CPU cost and queue behaviour."""

from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class EngineStats:
    """A snapshot. ``*_seconds`` are wall seconds during which at least one transfer of that
    direction was in flight, so ``bytes / seconds`` is the achieved bandwidth while busy."""

    bytes_read: int = 0
    bytes_written: int = 0
    read_seconds: float = 0.0
    write_seconds: float = 0.0
    #: wall seconds during which a transfer of either direction was in flight (the drives'
    #: busy time: read_seconds + write_seconds counts time with both in flight twice)
    busy_seconds: float = 0.0
    read_requests: int = 0
    write_requests: int = 0
    read_transfers: int = 0
    write_transfers: int = 0
    #: the most queue slots in use at once (a chain of requests holds one)
    inflight_peak: int = 0
    cpu_seconds: float = 0.0
    errors: int = 0
    retries: int = 0
    #: requests that exceeded request_timeout
    timeouts: int = 0
    #: reads whose bytes failed verification (or were refused: wrong tag, failed write)
    integrity_errors: int = 0
    #: thread seconds spent hashing chunks (write checksums and read verification)
    checksum_seconds: float = 0.0
    #: requests that timed out and have not completed: their buffer ranges must stay unused
    quarantined: int = 0

    @property
    def read_gbps(self) -> float:
        return self.bytes_read / self.read_seconds / 1e9 if self.read_seconds else 0.0

    @property
    def write_gbps(self) -> float:
        return self.bytes_written / self.write_seconds / 1e9 if self.write_seconds else 0.0

    def as_dict(self) -> dict:
        out = asdict(self)
        out["read_gbps"] = self.read_gbps
        out["write_gbps"] = self.write_gbps
        return out


class _BusyClock:
    """Wall time during which a counter of active transfers is above zero."""

    def __init__(self) -> None:
        self.active = 0
        self.since = 0.0
        self.total = 0.0

    def start(self, now: float) -> None:
        if self.active == 0:
            self.since = now
        self.active += 1

    def stop(self, now: float) -> None:
        self.active -= 1
        if self.active == 0:
            self.total += now - self.since

    def elapsed(self, now: float) -> float:
        return self.total + (now - self.since if self.active else 0.0)


class StatsRecorder:
    """The engine's counters; every method takes the recorder's own lock, so snapshots taken from
    any thread are consistent."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.bytes = {"read": 0, "write": 0}
        self.requests = {"read": 0, "write": 0}
        self.transfers = {"read": 0, "write": 0}
        self.clocks = {"read": _BusyClock(), "write": _BusyClock()}
        self.busy = _BusyClock()  # either direction
        self.inflight = 0
        self.inflight_peak = 0
        self.errors = 0
        self.retries = 0
        self.timeouts = 0

    def transfer_started(self, op: str) -> None:
        with self.lock:
            self.transfers[op] += 1
            now = time.perf_counter()
            self.clocks[op].start(now)
            self.busy.start(now)

    def transfer_finished(self, op: str, nbytes: int) -> None:
        with self.lock:
            self.bytes[op] += nbytes
            now = time.perf_counter()
            self.clocks[op].stop(now)
            self.busy.stop(now)

    def request_submitted(self, op: str, count: int = 1) -> None:
        """``count`` requests submitted as one chain: they hold one queue slot."""
        with self.lock:
            self.requests[op] += count
            self.inflight += 1
            self.inflight_peak = max(self.inflight_peak, self.inflight)

    def request_done(self) -> None:
        """The last request of a chain completed: its slot is free."""
        with self.lock:
            self.inflight -= 1

    def note_retry(self) -> None:
        with self.lock:
            self.retries += 1

    def note_error(self) -> None:
        with self.lock:
            self.errors += 1

    def note_timeout(self) -> None:
        with self.lock:
            self.timeouts += 1

    def snapshot(
        self,
        cpu_seconds: float,
        *,
        checksum_seconds: float = 0.0,
        integrity_errors: int = 0,
        quarantined: int = 0,
    ) -> EngineStats:
        with self.lock:
            now = time.perf_counter()
            return EngineStats(
                bytes_read=self.bytes["read"],
                bytes_written=self.bytes["write"],
                read_seconds=self.clocks["read"].elapsed(now),
                write_seconds=self.clocks["write"].elapsed(now),
                busy_seconds=self.busy.elapsed(now),
                read_requests=self.requests["read"],
                write_requests=self.requests["write"],
                read_transfers=self.transfers["read"],
                write_transfers=self.transfers["write"],
                inflight_peak=self.inflight_peak,
                cpu_seconds=cpu_seconds,
                errors=self.errors,
                retries=self.retries,
                timeouts=self.timeouts,
                integrity_errors=integrity_errors,
                checksum_seconds=checksum_seconds,
                quarantined=quarantined,
            )
