"""What the store did and when: transfers, waits, module compute and optimizer steps.

Off by default; ``store.timeline.enabled = True`` (or ``with store.timeline.recording():``)
records a few steps at a cost of one small tuple per transfer and event. The records feed the
Chrome trace export and the PNG plot.

All times are ``time.perf_counter()`` seconds.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator


@dataclass
class Transfer:
    shard: str
    op: str            # "read" (nvme -> host), "write" (host -> nvme), "h2d", "d2h"
    nbytes: int
    start: float
    end: float | None = None
    prefetch: bool = False
    stalled: bool = False   # the training thread waited for it
    error: str | None = None


@dataclass
class Span:
    name: str          # module name, "step", or "stall"
    phase: str         # "fwd", "bwd", "step", "stall"
    start: float
    end: float


@dataclass
class Timeline:
    enabled: bool = False
    transfers: list[Transfer] = field(default_factory=list)
    spans: list[Span] = field(default_factory=list)
    events: list[tuple[float, str, str]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def io_started(self, shard: str, op: str, nbytes: int, prefetch: bool = False
                   ) -> Transfer | None:
        if not self.enabled:
            return None
        record = Transfer(shard, op, nbytes, time.perf_counter(), prefetch=prefetch)
        with self.lock:
            self.transfers.append(record)
        return record

    @staticmethod
    def io_finished(record: Transfer | None, error: BaseException | None = None) -> None:
        if record is not None:
            record.end = time.perf_counter()
            if error is not None:
                record.error = str(error)

    def stall(self, record: Transfer | None, shard: str, start: float, end: float) -> None:
        if not self.enabled:
            return
        if record is not None:
            record.stalled = True
        with self.lock:
            self.spans.append(Span(shard, "stall", start, end))

    def span(self, name: str, phase: str, start: float, end: float) -> None:
        if self.enabled:
            with self.lock:
                self.spans.append(Span(name, phase, start, end))

    def event(self, kind: str, name: str) -> None:
        if self.enabled:
            with self.lock:
                self.events.append((time.perf_counter(), kind, name))

    def clear(self) -> None:
        with self.lock:
            self.transfers.clear()
            self.spans.clear()
            self.events.clear()

    @contextmanager
    def recording(self) -> Iterator["Timeline"]:
        previous, self.enabled = self.enabled, True
        try:
            yield self
        finally:
            self.enabled = previous
