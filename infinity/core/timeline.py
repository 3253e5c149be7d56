"""What the store did and when: transfers, waits, module compute and optimizer steps.

Off by default; ``store.timeline.enabled = True`` (or ``with store.timeline.recording():``)
records a few steps at a cost of one small tuple per transfer and event. Every recording call
returns at once while disabled. The records feed three views:

* ``export_chrome(path)``: a Chrome trace JSON for Perfetto / chrome://tracing (event names and
  lanes are documented in :mod:`infinity.observability.trace_export`);
* ``plot(path)``: a PNG with compute, stall, read and write lanes;
* ``summary()``: busy seconds, stall seconds, bytes moved and how much I/O hid behind compute.

The recorder is here, in core, which every part records into; the first two views are the
store's :class:`infinity.observability.timeline.Timeline`, which adds them to it.

While recording, transfers, stalls and optimizer steps also show up in ``torch.profiler``
traces as ``record_function`` ranges named ``infinity::read``, ``infinity::write`` (at submit),
``infinity::stall`` and ``infinity::step``. Ranges are opened only on the thread that made the
call (the training thread or an autograd thread), never on the I/O threads that complete
transfers. A stall or step the caller did not wrap in :meth:`Timeline.profile_range` /
:meth:`Timeline.timed` is known only once over, so it shows as a zero-length range at its end
whose args give the shard and the measured duration.

Compute is derived, not measured: each forward/backward event starts a span for its module that
lasts until the next event or optimizer step (or the end of the recording), and the time the
training thread spent stalled on I/O is cut out of it, so compute and stalls never overlap.

All times are ``time.perf_counter()`` seconds.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

Interval = tuple[float, float]

#: torch.profiler range names, by transfer op or span phase
PROFILER_RANGES = {
    "read": "infinity::read",
    "write": "infinity::write",
    "stall": "infinity::stall",
    "step": "infinity::step",
}
_NULL: AbstractContextManager[None] = contextlib.nullcontext()


@dataclass
class Transfer:
    shard: str
    op: str  # "read" (nvme -> host), "write" (host -> nvme), "h2d", "d2h"
    nbytes: int
    start: float
    end: float | None = None
    prefetch: bool = False
    stalled: bool = False  # the training thread waited for it
    error: str | None = None


@dataclass
class Span:
    name: str  # module name, "step", or "stall"
    phase: str  # "fwd", "bwd", "step", "stall", "d2h"
    start: float
    end: float


@dataclass
class Timeline:
    enabled: bool = False
    #: also emit torch.profiler ranges while recording (cheap when no profiler is active)
    profile: bool = True
    transfers: list[Transfer] = field(default_factory=list)
    spans: list[Span] = field(default_factory=list)
    events: list[tuple[float, str, str]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)
    #: per thread: profiler range names open there (so markers do not duplicate them)
    _local: threading.local = field(
        default_factory=threading.local, init=False, repr=False, compare=False
    )

    # -- recording (hot path: return at once while disabled) --------------------------------
    def io_started(
        self, shard: str, op: str, nbytes: int, prefetch: bool = False
    ) -> Transfer | None:
        if not self.enabled:
            return None
        record = Transfer(shard, op, nbytes, time.perf_counter(), prefetch=prefetch)
        with self.lock:
            self.transfers.append(record)
        if self.profile:
            self._mark(
                PROFILER_RANGES.get(op) or f"infinity::{op}",
                f"{shard} {nbytes} bytes{' prefetch' if prefetch else ''}",
            )
        return record

    @staticmethod
    def io_finished(record: Transfer | None, error: BaseException | None = None) -> None:
        # Runs on an I/O thread: no profiler calls here.
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
        if self.profile:
            self._mark(PROFILER_RANGES["stall"], f"{shard} waited {(end - start) * 1e6:.0f} us")

    def span(self, name: str, phase: str, start: float, end: float) -> None:
        if not self.enabled:
            return
        with self.lock:
            self.spans.append(Span(name, phase, start, end))
        if self.profile and phase == "step":
            self._mark(PROFILER_RANGES["step"], f"{name} {(end - start) * 1e6:.0f} us")

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
    def recording(self) -> Iterator[Timeline]:
        previous, self.enabled = self.enabled, True
        try:
            yield self
        finally:
            self.enabled = previous

    # -- torch.profiler ranges ----------------------------------------------------------------
    def profile_range(self, name: str, detail: str = "") -> AbstractContextManager[None]:
        """A ``record_function`` range around a block while recording, else a no-op. Call it
        on the thread that runs the block; a stall or step recorded inside a range of the same
        name adds no zero-length marker."""
        if not (self.enabled and self.profile):
            return _NULL
        return _Range(self, name, detail)

    @contextmanager
    def timed(self, name: str, phase: str) -> Iterator[None]:
        """Records the block as a span (and a profiler range for "step"/"stall")."""
        if not self.enabled:
            yield
            return
        started = time.perf_counter()
        with self.profile_range(PROFILER_RANGES.get(phase, f"infinity::{phase}"), name):
            try:
                yield
            finally:
                self.span(name, phase, started, time.perf_counter())

    def _open(self) -> dict[str, int]:
        open_ = getattr(self._local, "open", None)
        if open_ is None:
            open_ = self._local.open = {}
        return open_

    def _mark(self, name: str, detail: str) -> None:
        """A zero-length range now: the call is known only once it is over (or at submit)."""
        if self._open().get(name):
            return
        with torch.profiler.record_function(name, detail):
            pass

    # -- analysis -----------------------------------------------------------------------------
    def snapshot(self) -> Timeline:
        """A disabled copy that I/O threads no longer change (transfer ends are frozen)."""
        with self.lock:
            return Timeline(
                transfers=[dataclasses.replace(t) for t in self.transfers],
                spans=list(self.spans),
                events=list(self.events),
            )

    def origin(self) -> float:
        """The time of the first record (0.0 when nothing was recorded)."""
        starts = (
            [t.start for t in self.transfers]
            + [s.start for s in self.spans]
            + [e[0] for e in self.events]
        )
        return min(starts, default=0.0)

    def horizon(self) -> float:
        """The time of the last record: where unfinished transfers and open spans end."""
        ends = (
            [t.end if t.end is not None else t.start for t in self.transfers]
            + [s.end for s in self.spans]
            + [e[0] for e in self.events]
        )
        return max(ends, default=0.0)

    def compute_spans(self) -> list[Span]:
        """Module forward/backward spans and optimizer steps, with stalls cut out, in order."""
        stalls = union((s.start, s.end) for s in self.spans if s.phase == "stall")
        steps = sorted((s for s in self.spans if s.phase == "step"), key=lambda s: s.start)
        step_starts = [s.start for s in steps]
        events = sorted(self.events)
        horizon = self.horizon()
        whole: list[Span] = []
        for i, (at, kind, name) in enumerate(events):
            end = events[i + 1][0] if i + 1 < len(events) else horizon
            k = bisect.bisect_left(step_starts, at)
            if k < len(steps):
                end = min(end, steps[k].start)
            if k and steps[k - 1].end > at:
                # A forward/backward inside the step (an LBFGS closure): keep it nested there,
                # as Chrome traces need properly nested slices on one lane.
                end = min(end, steps[k - 1].end)
            whole.append(Span(name, kind, at, max(end, at)))
        whole += steps
        out: list[Span] = []
        for span in sorted(whole, key=lambda s: s.start):
            out += [
                Span(span.name, span.phase, a, b)
                for a, b in subtract((span.start, span.end), stalls)
                if b > a
            ]
        return out

    def summary(self) -> dict[str, Any]:
        """Busy seconds per activity, stalls, bytes moved and overlap. See ``summarise``."""
        return summarise(self.snapshot())


class _Range:
    """``record_function`` plus the per-thread bookkeeping of which names are open."""

    __slots__ = ("timeline", "name", "function")

    def __init__(self, timeline: Timeline, name: str, detail: str) -> None:
        self.timeline = timeline
        self.name = name
        self.function = torch.profiler.record_function(name, detail)

    def __enter__(self) -> None:
        open_ = self.timeline._open()
        open_[self.name] = open_.get(self.name, 0) + 1
        self.function.__enter__()

    def __exit__(self, *exc: object) -> None:
        try:
            self.function.__exit__(*exc)
        finally:
            self.timeline._open()[self.name] -= 1


# -- interval arithmetic (closed-open intervals in seconds) -----------------------------------
def union(intervals: Iterable[Interval]) -> list[Interval]:
    """Sorted, disjoint intervals covering the same time."""
    merged: list[Interval] = []
    for start, end in sorted(intervals):
        end = max(end, start)
        if merged and start <= merged[-1][1]:
            if end > merged[-1][1]:
                merged[-1] = (merged[-1][0], end)
        else:
            merged.append((start, end))
    return merged


def length(intervals: Iterable[Interval]) -> float:
    return sum(end - start for start, end in intervals)


def intersect(a: list[Interval], b: list[Interval]) -> list[Interval]:
    """The overlap of two sorted disjoint interval lists."""
    out: list[Interval] = []
    i = j = 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if end > start:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract(span: Interval, holes: list[Interval]) -> list[Interval]:
    """``span`` minus sorted disjoint ``holes``."""
    start, end = span
    pieces: list[Interval] = []
    # Disjoint sorted holes have sorted ends too: skip those that end before the span.
    k = bisect.bisect_right(holes, (start, float("inf"))) - 1
    k = max(k, 0)
    for hole_start, hole_end in holes[k:]:
        if hole_start >= end:
            break
        if hole_end <= start:
            continue
        if hole_start > start:
            pieces.append((start, hole_start))
        start = max(start, hole_end)
    if end > start:
        pieces.append((start, end))
    return pieces


def summarise(timeline: Timeline) -> dict[str, Any]:
    """``hidden_fraction``: the share of I/O busy time (any transfer in flight) during which
    the training thread computed; 1.0 when there was no I/O. ``overlap_efficiency``: overlapped
    seconds over the shorter of I/O busy and compute time, so 1.0 means the shorter activity ran
    entirely under the longer one (perfect pipelining); 0.0 when either is absent."""
    horizon = timeline.horizon()
    compute = timeline.compute_spans()
    compute_union = union((s.start, s.end) for s in compute)

    def finished(op: str) -> list[Transfer]:
        return [t for t in timeline.transfers if t.op == op and t.end is not None]

    def busy(transfers: Iterable[Transfer]) -> list[Interval]:
        return union(
            (t.start, t.end if t.end is not None else max(horizon, t.start)) for t in transfers
        )

    io = busy(timeline.transfers)
    io_seconds = length(io)
    compute_seconds = length(compute_union)
    overlap = length(intersect(io, compute_union))
    shorter = min(io_seconds, compute_seconds)
    stalls = [s for s in timeline.spans if s.phase == "stall"]
    reads = [t for t in timeline.transfers if t.op == "read"]

    def phase_seconds(phase: str) -> float:
        return length(union((s.start, s.end) for s in compute if s.phase == phase))

    return {
        "total_seconds": horizon - timeline.origin(),
        "compute_seconds": compute_seconds,
        "forward_seconds": phase_seconds("fwd"),
        "backward_seconds": phase_seconds("bwd"),
        "step_seconds": phase_seconds("step"),
        "io_busy_seconds": io_seconds,
        "read_busy_seconds": length(busy(reads)),
        "write_busy_seconds": length(busy(t for t in timeline.transfers if t.op == "write")),
        "overlap_seconds": overlap,
        "exposed_io_seconds": io_seconds - overlap,
        "stall_seconds": sum(s.end - s.start for s in stalls),
        "d2h_seconds": sum(s.end - s.start for s in timeline.spans if s.phase == "d2h"),
        "bytes_read": sum(t.nbytes for t in finished("read") if t.error is None),
        "bytes_written": sum(t.nbytes for t in finished("write") if t.error is None),
        "hidden_fraction": min(1.0, overlap / io_seconds) if io_seconds > 0 else 1.0,
        "overlap_efficiency": min(1.0, overlap / shorter) if shorter > 0 else 0.0,
        "counts": {
            "reads": len(reads),
            "prefetch_reads": sum(t.prefetch for t in reads),
            "demand_reads": sum(not t.prefetch for t in reads),
            "writes": sum(t.op == "write" for t in timeline.transfers),
            "stalled_transfers": sum(t.stalled for t in timeline.transfers),
            "errors": sum(t.error is not None for t in timeline.transfers),
            "unfinished": sum(t.end is None for t in timeline.transfers),
            "stalls": len(stalls),
            "forward": sum(kind == "fwd" for _, kind, _ in timeline.events),
            "backward": sum(kind == "bwd" for _, kind, _ in timeline.events),
            # step spans also time each update step_in_backward runs, named by its parameter
            "steps": sum(s.phase == "step" and s.name == "optimizer.step" for s in timeline.spans),
            "d2h": sum(s.phase == "d2h" for s in timeline.spans),
        },
    }
