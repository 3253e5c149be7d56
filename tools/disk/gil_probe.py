"""How much swap I/O slows the Python code of the training loop.

The main thread spins a pure-Python counting loop while the engine moves data in the background,
driven only by completion callbacks (as the runtime's prefetch and write-back are), and the loop's
rate is compared with its rate while nothing else runs. Anything the backend does while holding
the GIL shows up as a ratio below 1; the bandwidth the engine reaches while competing with the
loop is recorded too, because a backend can also keep the loop fast by starving its own I/O.

The same loop next to fio (another process, no GIL involved) is the reference: what is left of
the loop's speed when only the CPUs and the kernel's I/O work are shared.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from pathlib import Path

from swap import BufferPool, SwapEngine
from tools.common.aggregate import Summary, summarize
from tools.disk.fio import FioJob, FioRunner
from tools.disk.sweep import DIRECTIONS, Point

log = logging.getLogger(__name__)

_CHUNK = 2000


def _cpu_wait() -> float:
    """Seconds the calling thread has been runnable but waiting for a CPU (Linux schedstat);
    0 where that is not available."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return 0.0


@dataclass(frozen=True)
class Window:
    """One run of the counting loop."""

    rate: float  # iterations per second
    cpu_wait: float  # share of the window the thread waited for a CPU (other processes/threads)

    @property
    def rate_on_cpu(self) -> float:
        """Iterations per second of the time the thread could have had a CPU: without the
        waits for one, which other processes cause as much as the I/O. What remains lost is
        the time spent blocked, which for this loop is waiting for the GIL."""
        return self.rate / max(1.0 - self.cpu_wait, 0.05)


def spin(stop: threading.Event) -> Window:
    """Runs a counting loop until ``stop`` is set."""
    count = 0
    is_set = stop.is_set
    waited = _cpu_wait()
    start = time.perf_counter()
    while not is_set():
        for _ in range(_CHUNK):
            count += 1
    elapsed = time.perf_counter() - start
    return Window(count / elapsed, (_cpu_wait() - waited) / elapsed)


def idle_window(seconds: float) -> Window:
    stop = threading.Event()
    # A timer thread sleeps in a lock wait without the GIL, so it costs the loop nothing.
    timer = threading.Timer(seconds, stop.set)
    timer.start()
    window = spin(stop)
    timer.join()
    return window


class BackgroundStream:
    """Moves ``size`` bytes through every buffer of ``pool``; each completion starts the next
    transfer from its callback, so no application thread is involved after ``start``."""

    def __init__(self, engine: SwapEngine, extent, pool: BufferPool, size: int, op: str) -> None:
        self.engine, self.extent, self.size = engine, extent, size
        self.move = engine.write if op == "write" else engine.read
        self.chunk = pool.buffer_size
        self.offsets = list(range(0, size, self.chunk))
        self.buffers = pool.buffers
        self.next = 0
        self.outstanding = 0
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.started = self.finished = 0.0

    def start(self) -> None:
        self.started = time.perf_counter()
        for buffer in self.buffers[: len(self.offsets)]:
            self._submit(buffer)

    def _submit(self, buffer) -> None:
        with self.lock:
            if self.next >= len(self.offsets) or self.error is not None:
                if self.outstanding == 0:
                    self.finished = time.perf_counter()
                    self.done.set()
                return
            offset = self.offsets[self.next]
            self.next += 1
            self.outstanding += 1
        future = self.move(
            self.extent, buffer, nbytes=min(self.chunk, self.size - offset), extent_offset=offset
        )
        future.add_done_callback(functools.partial(self._on_done, buffer=buffer))

    def _on_done(self, future: Future, buffer) -> None:
        with self.lock:
            self.outstanding -= 1
            if future.exception() is not None and self.error is None:
                self.error = future.exception()
        self._submit(buffer)

    @property
    def gbps(self) -> float:
        seconds = self.finished - self.started
        return self.size / seconds / 1e9 if seconds > 0 else 0.0


@dataclass
class InterferenceResult:
    """The loop's windows with and without I/O. Every loaded window is compared with the median
    of all idle windows of the measurement: the idle speed of a shared machine jumps between
    windows, and one slow idle window would otherwise read as a ratio above 1."""

    point: Point
    loaded: dict[str, list[Window]] = field(default_factory=lambda: {d: [] for d in DIRECTIONS})
    io_gbps: dict[str, list[float]] = field(default_factory=lambda: {d: [] for d in DIRECTIONS})
    idle: list[Window] = field(default_factory=list)
    #: direction -> the same point's median GB/s without the loop (from the grid), if known
    io_reference: dict[str, float] = field(default_factory=dict)

    def idle_rate(self, on_cpu: bool = False) -> float:
        summary = summarize(w.rate_on_cpu if on_cpu else w.rate for w in self.idle)
        return summary.median if summary else 0.0

    def ratios(self, direction: str, on_cpu: bool = False) -> list[float]:
        """Loop speed in each loaded window / median idle speed; ``on_cpu``: both counted
        over the time the loop had a CPU (see Window.rate_on_cpu)."""
        reference = self.idle_rate(on_cpu)
        if not reference:
            return []
        return [(w.rate_on_cpu if on_cpu else w.rate) / reference for w in self.loaded[direction]]

    def ratio(self, direction: str, on_cpu: bool = False) -> Summary | None:
        return summarize(self.ratios(direction, on_cpu))

    def bandwidth(self, direction: str) -> Summary | None:
        return summarize(self.io_gbps[direction])

    def idle_cpu_wait(self) -> Summary | None:
        return summarize(w.cpu_wait for w in self.idle)

    def as_dict(self) -> dict:
        def opt(summary: Summary | None) -> dict | None:
            return summary.as_dict() if summary else None

        return {
            "point": self.point.as_dict(),
            "label": self.point.label,
            "idle_windows": [asdict(w) for w in self.idle],
            "loaded_windows": {d: [asdict(w) for w in ws] for d, ws in self.loaded.items()},
            "ratios": {d: self.ratios(d) for d in DIRECTIONS},
            "io_gbps": self.io_gbps,
            "io_reference": self.io_reference,
            "idle_rate": self.idle_rate(),
            "summary": {
                d: {
                    "ratio": opt(self.ratio(d)),
                    "ratio_on_cpu": opt(self.ratio(d, on_cpu=True)),
                    "io_gbps": opt(self.bandwidth(d)),
                    "cpu_wait": opt(summarize(w.cpu_wait for w in self.loaded[d])),
                }
                for d in DIRECTIONS
            },
            "idle_cpu_wait": opt(self.idle_cpu_wait()),
        }


def measure_interference(
    point: Point,
    path: Path,
    pool: BufferPool,
    size: int,
    repeats: int,
    idle_seconds: float,
    on_step=lambda: None,
) -> InterferenceResult:
    """``repeats`` rounds of: idle loop, write under the loop, idle loop, read under the loop."""
    result = InterferenceResult(point)
    with SwapEngine(path, point.settings(size)) as engine:
        extent = engine.allocate(size)
        warm = BackgroundStream(engine, extent, pool, size, "write")  # overwrites from now on
        warm.start()
        warm.done.wait()
        if warm.error:
            raise warm.error
        for _ in range(repeats):
            for direction in DIRECTIONS:
                result.idle.append(idle_window(idle_seconds))
                background = BackgroundStream(engine, extent, pool, size, direction)
                background.start()
                window = spin(background.done)
                if background.error:
                    raise background.error
                result.loaded[direction].append(window)
                result.io_gbps[direction].append(background.gbps)
                on_step()
    return result


def measure_fio_interference(
    runner: FioRunner,
    block_size: int,
    iodepth: int,
    size: int,
    repeats: int,
    idle_seconds: float,
    on_step=lambda: None,
) -> InterferenceResult:
    """The loop next to fio. fio needs a good part of a second to start and to report, so it
    runs time-based and the loop covers a window well inside its I/O phase."""
    lead = 0.5  # past fio's start-up
    result = InterferenceResult(Point("fio", block_size, iodepth))
    for _ in range(repeats):
        for direction in DIRECTIONS:
            result.idle.append(idle_window(idle_seconds))
            job = FioJob(
                direction,
                block_size,
                iodepth,
                size,
                runner.ioengine or "io_uring",
                runtime=lead + idle_seconds + 0.5,
            )
            process = runner.spawn(job)
            try:
                time.sleep(lead)
                result.loaded[direction].append(idle_window(idle_seconds))
            finally:
                fio = runner.finish(process, job)
            result.io_gbps[direction].append(fio.gbps)
            on_step()
    return result
