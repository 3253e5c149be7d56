"""Timed passes of the swap engine: the grid points and the transfer-size sweep.

A pass moves ``size`` bytes between one extent and the buffers of a :class:`BufferPool`, keeping
every buffer of the pool in flight as its own transfer, the way a training run overlaps prefetch
and write-back; the engine then keeps ``queue_depth`` requests in flight across those transfers.
"""

from __future__ import annotations

import logging
import os
import resource
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from infinity.cli.common.aggregate import Summary, summarize
from infinity.cli.common.machine import DiskCounters
from infinity.cli.common.units import GIB, format_size
from swap import BufferPool, EngineSettings, HostBuffer, SwapEngine
from swap.files import Extent

log = logging.getLogger(__name__)

DIRECTIONS = ("write", "read")
_SAMPLE_STEP = 1 << 20  # one checked page per MiB of buffer


@dataclass(frozen=True, order=True)
class Point:
    """One engine configuration of the sweep."""

    backend: str
    block_size: int
    queue_depth: int
    thread_count: int | None = None
    #: checksum every chunk (the runtime's default); off only to show what verification costs
    verify: bool = True

    @property
    def label(self) -> str:
        threads = f" t={self.thread_count}" if self.thread_count else ""
        unverified = " (checksums off)" if not self.verify else ""
        return (
            f"{self.backend} bs={format_size(self.block_size)} qd={self.queue_depth}"
            f"{threads}{unverified}"
        )

    def settings(self, file_size: int) -> EngineSettings:
        return EngineSettings(
            backend=self.backend,
            block_size=self.block_size,
            queue_depth=self.queue_depth,
            thread_count=self.thread_count,
            file_size=file_size,
            verify_checksums=self.verify,
        )

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class Sample:
    """One timed pass in one direction."""

    nbytes: int
    seconds: float
    process_cpu: float  # whole process, user + kernel, all threads (the backend's included)
    backend_cpu: float  # the engine's own account of its backend threads
    requests: int
    busy_seconds: float  # engine's wall time with a transfer in flight
    device_request_bytes: float | None = None  # mean size of the requests the disk saw

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    @property
    def cpu_per_gib(self) -> float:
        return self.process_cpu / (self.nbytes / GIB) if self.nbytes else 0.0

    @property
    def backend_cpu_per_gib(self) -> float:
        return self.backend_cpu / (self.nbytes / GIB) if self.nbytes else 0.0

    def as_dict(self) -> dict:
        out = asdict(self)
        out.update(
            gbps=self.gbps,
            cpu_s_per_gib=self.cpu_per_gib,
            backend_cpu_s_per_gib=self.backend_cpu_per_gib,
        )
        return out


@dataclass
class PointResult:
    """Every repeat of one point; ``runs`` holds one dict per repeat (direction -> Sample, or
    ``error``)."""

    point: Point
    runs: list[dict] = field(default_factory=list)

    def samples(self, direction: str) -> list[Sample]:
        return [run[direction] for run in self.runs if direction in run]

    def gbps(self, direction: str) -> Summary | None:
        return summarize(s.gbps for s in self.samples(direction))

    def cpu(self, direction: str) -> Summary | None:
        return summarize(s.cpu_per_gib for s in self.samples(direction))

    def backend_cpu(self, direction: str) -> Summary | None:
        return summarize(s.backend_cpu_per_gib for s in self.samples(direction))

    def device_request(self, direction: str) -> Summary | None:
        return summarize(s.device_request_bytes for s in self.samples(direction))

    def median(self, direction: str) -> float:
        summary = self.gbps(direction)
        return summary.median if summary else 0.0

    def as_dict(self) -> dict:
        def opt(s: Summary | None) -> dict | None:
            return s.as_dict() if s else None

        repeats = []
        for run in self.runs:
            repeats.append(
                {k: (v.as_dict() if isinstance(v, Sample) else v) for k, v in run.items()}
            )
        summary = {
            d: {
                "gbps": opt(self.gbps(d)),
                "cpu_s_per_gib": opt(self.cpu(d)),
                "backend_cpu_s_per_gib": opt(self.backend_cpu(d)),
                "device_request_bytes": opt(self.device_request(d)),
            }
            for d in ("write_fresh", *DIRECTIONS)
        }
        return {
            **self.point.as_dict(),
            "label": self.point.label,
            "repeats": repeats,
            "summary": summary,
        }


def _process_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def fill_pattern(pool: BufferPool, seed: int = 0) -> None:
    """Non-repeating bytes, so a device or host layer that compresses or dedups zeros cannot
    flatter the numbers, and each buffer differs so a misplaced read is visible."""
    rng = np.random.default_rng(seed)
    block = rng.integers(0, 256, size=1 << 20, dtype=np.uint8)
    for buffer in pool.buffers:
        array = buffer.array
        for start in range(0, buffer.nbytes, block.size):
            chunk = array[start : start + block.size]
            np.bitwise_xor(block[: chunk.size], buffer.index + 1, out=chunk)


class _Checker:
    """Samples a page per MiB of each buffer, blanks those pages before a read pass and checks
    they came back: a read that silently moved nothing would otherwise go unnoticed, because
    the buffers already hold the bytes being read back. ``lengths[j]`` is how many bytes the
    last chunk carried by buffer ``j`` fills, which is all a read pass restores."""

    def __init__(self, buffers: tuple[HostBuffer, ...], size: int) -> None:
        chunk, count = buffers[0].nbytes, len(buffers)
        chunks = -(-size // chunk)
        self.buffers = buffers[: min(count, chunks)]
        self.lengths = []
        for j in range(len(self.buffers)):
            last = j + (chunks - 1 - j) // count * count
            self.lengths.append(min(chunk, size - last * chunk))
        self.pages = [
            {o: b.array[o : o + 4096].copy() for o in range(0, length - 4096 + 1, _SAMPLE_STEP)}
            for b, length in zip(self.buffers, self.lengths)
        ]

    def blank(self) -> None:
        for buffer, pages in zip(self.buffers, self.pages):
            for offset in pages:
                buffer.array[offset : offset + 4096] = 0

    def check_and_restore(self) -> None:
        bad = None
        for buffer, pages in zip(self.buffers, self.pages):
            for offset, page in pages.items():
                if bad is None and not np.array_equal(buffer.array[offset : offset + 4096], page):
                    bad = (buffer.index, offset)
                buffer.array[offset : offset + 4096] = page  # the pool stays as filled
        if bad is not None:
            raise RuntimeError(
                f"read-back mismatch in buffer {bad[0]} at byte {bad[1]}: the "
                f"engine returned other bytes than were written"
            )


def _sync_files(engine: SwapEngine, drop: bool) -> None:
    """For the page-cache backend only: flush, and drop the cached copy before a read pass so
    the read comes from the disk."""
    for swap_file in engine.space.files:
        os.fsync(swap_file.fd)
        if drop:
            os.posix_fadvise(swap_file.fd, 0, 0, os.POSIX_FADV_DONTNEED)


def stream(
    engine: SwapEngine,
    extent: Extent,
    buffers: tuple[HostBuffer, ...],
    size: int,
    op: str,
    chunk: int | None = None,
) -> None:
    """Moves ``size`` bytes of ``extent`` in transfers of ``chunk`` bytes (default: a whole
    buffer), one per buffer in flight; buffer ``i % n`` carries chunk ``i``, so every chunk
    written from a buffer is read back into the same one."""
    move = engine.write if op == "write" else engine.read
    chunk = chunk or buffers[0].nbytes
    pending: deque[Future] = deque()
    for i, offset in enumerate(range(0, size, chunk)):
        if len(pending) == len(buffers):
            pending.popleft().result()
        pending.append(
            move(
                extent,
                buffers[i % len(buffers)],
                nbytes=min(chunk, size - offset),
                extent_offset=offset,
            )
        )
    for future in pending:
        future.result()


def timed(
    engine: SwapEngine,
    nbytes: int,
    run: Callable[[], None],
    op: str,
    disk: DiskCounters | None = None,
) -> Sample:
    before = engine.stats()
    device = disk.snapshot() if disk else None
    cpu = _process_cpu()
    start = time.perf_counter()
    run()
    seconds = time.perf_counter() - start
    cpu = _process_cpu() - cpu
    request_bytes = (
        DiskCounters.average_request(device, disk.snapshot(), op)
        if disk and device is not None
        else None
    )
    after = engine.stats()
    return Sample(
        nbytes=nbytes,
        seconds=seconds,
        process_cpu=cpu,
        device_request_bytes=request_bytes,
        backend_cpu=after.cpu_seconds - before.cpu_seconds,
        requests=(
            after.read_requests
            + after.write_requests
            - before.read_requests
            - before.write_requests
        ),
        busy_seconds=(
            after.read_seconds + after.write_seconds - before.read_seconds - before.write_seconds
        ),
    )


def measure_point(
    point: Point, path: Path, pool: BufferPool, size: int, disk: DiskCounters | None = None
) -> dict:
    """One repeat of one point: a first write into the fresh, preallocated file, then the
    measured write (an overwrite, the steady state of a training run), then the read of it.

    Returns ``{"write_fresh": Sample, "write": Sample, "read": Sample, "inflight_peak": int}``.
    The swap engine's run directory, and with it the file, is removed when the engine closes."""
    buffers = pool.buffers
    checker = _Checker(buffers, size)
    with SwapEngine(path, point.settings(size)) as engine:
        direct = engine.backend.direct
        extent = engine.allocate(size)

        def write() -> None:
            stream(engine, extent, buffers, size, "write")
            if not direct:
                _sync_files(engine, drop=False)

        fresh = timed(engine, size, write, "write", disk)
        steady = timed(engine, size, write, "write", disk)
        if not direct:
            _sync_files(engine, drop=True)
        checker.blank()
        read = timed(
            engine, size, lambda: stream(engine, extent, buffers, size, "read"), "read", disk
        )
        checker.check_and_restore()
        peak = engine.stats().inflight_peak
    return {"write_fresh": fresh, "write": steady, "read": read, "inflight_peak": peak}


def transfer_sizes(unit: int, limit: int) -> list[int]:
    """``unit`` times powers of two up to ``limit`` (at least ``unit`` itself)."""
    sizes = [unit]
    while sizes[-1] * 2 <= limit:
        sizes.append(sizes[-1] * 2)
    return sizes


IN_FLIGHT = (1, 2)


class TransferSweep:
    """Bandwidth by transfer size for one point, with one and with two transfers in flight.

    One transfer at a time is the worst case for a buffer: the queue fills at its start and
    drains at its end, so small buffers lose bandwidth at every boundary. With two in flight
    (double buffering) the next transfer is queued before the current one drains. The smallest
    size that still comes close to the best, in either regime, is the buffer size worth
    recommending. The engine (and its file) lives across the rounds so that they can be
    interleaved; the caller must ``close`` it."""

    def __init__(self, point: Point, path: Path, sizes: list[int], total: int) -> None:
        self.point = point
        self.sizes = sizes
        self.total = max(total, 2 * sizes[-1])
        # size -> in flight -> direction -> samples
        self.results: dict[int, dict[int, dict[str, list[Sample]]]] = {
            s: {n: {d: [] for d in DIRECTIONS} for n in IN_FLIGHT} for s in sizes
        }
        self.pool = BufferPool(max(IN_FLIGHT), sizes[-1], name="bench-sweep")
        self.engine: SwapEngine | None = None
        try:
            fill_pattern(self.pool, seed=1)
            self.engine = SwapEngine(path, point.settings(self.total))
            self.extent = self.engine.allocate(self.total)
            # Overwrites from here on, like the grid's measured writes.
            stream(self.engine, self.extent, self.pool.buffers, self.total, "write")
            if not self.engine.backend.direct:
                _sync_files(self.engine, drop=True)
        except BaseException:
            self.close()
            raise

    def measure(self, size: int) -> None:
        """One sample of ``size`` in every regime and direction."""
        engine = self.engine
        assert engine is not None
        nbytes = max(self.total // size, 2) * size
        for in_flight in IN_FLIGHT:
            buffers = self.pool.buffers[:in_flight]
            for direction in DIRECTIONS:

                def run(
                    buffers: tuple[HostBuffer, ...] = buffers, direction: str = direction
                ) -> None:
                    stream(engine, self.extent, buffers, nbytes, direction, chunk=size)
                    if not engine.backend.direct:
                        _sync_files(engine, drop=True)

                self.results[size][in_flight][direction].append(
                    timed(engine, nbytes, run, direction)
                )

    def medians(self) -> dict[int, dict[int, dict[str, float]]]:
        """size -> transfers in flight -> direction -> median GB/s."""
        return {
            size: {
                n: {
                    d: (summarize(s.gbps for s in samples) or Summary(0, 0, 0, 0)).median
                    for d, samples in by_direction.items()
                }
                for n, by_direction in by_flight.items()
            }
            for size, by_flight in self.results.items()
        }

    def as_dict(self) -> dict:
        def entry(samples: list[Sample]) -> dict:
            return {
                "gbps": (summarize(s.gbps for s in samples) or Summary(0, 0, 0, 0)).as_dict(),
                "repeats": [s.as_dict() for s in samples],
            }

        return {
            "point": self.point.as_dict(),
            "label": self.point.label,
            "bytes_per_sample": self.total,
            "sizes": [
                {
                    "transfer_size": size,
                    "in_flight": n,
                    **{d: entry(samples) for d, samples in by_direction.items()},
                }
                for size, by_flight in self.results.items()
                for n, by_direction in by_flight.items()
            ],
        }

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None
        self.pool.close()
