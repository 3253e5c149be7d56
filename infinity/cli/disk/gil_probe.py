"""How much swap I/O slows the Python code of the training loop, and the loop the I/O.

The main thread spins a pure-Python counting loop while the engine moves data in the background,
driven only by completion callbacks (as the runtime's prefetch and write-back are), and the loop's
rate is compared with its rate while nothing else runs. Anything the backend does while holding
the GIL shows up as a ratio below 1; the bandwidth the engine reaches while competing with the
loop is compared with the same stream run alone next to it, in the same round, because a
backend can also keep the loop fast by starving its own I/O. Pairing the two within each round
(and swapping their order every other round) keeps a disk whose speed drifts over minutes (a
virtual disk, a shared host) from reading as interference.

Each window also records the share of its time the loop's thread slept: it never blocks on
anything but the GIL, so that is the time other threads held the interpreter, whatever else
the machine runs (time waiting for a CPU is counted apart).

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

from infinity.cli.common.aggregate import Summary, summarize
from infinity.cli.disk.fio import FioJob, FioRunner
from infinity.cli.disk.sweep import DIRECTIONS, Point
from swap import BufferPool, SwapEngine

log = logging.getLogger(__name__)

_CHUNK = 2000


def _schedstat() -> tuple[float, float] | None:
    """(seconds on a CPU, seconds runnable but waiting for one) of the calling thread (Linux
    schedstat); None where that is not available."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            run, wait = f.read().split()[:2]
        return int(run) / 1e9, int(wait) / 1e9
    except (OSError, ValueError):
        return None


@dataclass(frozen=True)
class Window:
    """One run of the counting loop."""

    rate: float  # iterations per second
    cpu_wait: float  # share of the window the thread waited for a CPU (other processes/threads)
    #: share of the window the thread slept: the loop blocks on nothing but the GIL, so this is
    #: the time other threads of the process held it (None where schedstat is unavailable)
    gil_wait: float | None = None

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
    before = _schedstat()
    start = time.perf_counter()
    while not is_set():
        for _ in range(_CHUNK):
            count += 1
    elapsed = time.perf_counter() - start
    after = _schedstat()
    if before is None or after is None:
        return Window(count / elapsed, 0.0)
    ran, waited = after[0] - before[0], after[1] - before[1]
    slept = max(0.0, elapsed - ran - waited)
    return Window(count / elapsed, waited / elapsed, slept / elapsed)


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
    #: the same stream without the loop, run next to each loaded one (before it in even rounds,
    #: after it in odd ones)
    io_solo_gbps: dict[str, list[float]] = field(
        default_factory=lambda: {d: [] for d in DIRECTIONS}
    )
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

    def bandwidth_alone(self, direction: str) -> Summary | None:
        return summarize(self.io_solo_gbps[direction])

    def shares(self, direction: str) -> list[float]:
        """GB/s beside the loop / GB/s of the stream alone in the same round, round by round."""
        return [
            loaded / alone
            for loaded, alone in zip(self.io_gbps[direction], self.io_solo_gbps[direction])
            if alone > 0
        ]

    def share(self, direction: str) -> Summary | None:
        return summarize(self.shares(direction))

    def gil_wait(self, direction: str) -> Summary | None:
        """The share of each loaded window the loop waited for the GIL."""
        return summarize(w.gil_wait for w in self.loaded[direction])

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
            "io_solo_gbps": self.io_solo_gbps,
            "io_shares": {d: self.shares(d) for d in DIRECTIONS},
            "io_reference": self.io_reference,
            "idle_rate": self.idle_rate(),
            "summary": {
                d: {
                    "ratio": opt(self.ratio(d)),
                    "ratio_on_cpu": opt(self.ratio(d, on_cpu=True)),
                    "io_gbps": opt(self.bandwidth(d)),
                    "io_share": opt(self.share(d)),
                    "gil_wait": opt(self.gil_wait(d)),
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
    """``repeats`` rounds of, for writes then reads: the stream alone, an idle loop, the stream
    under the loop; every other round runs the stream under the loop first, as a stream can
    run faster or slower for following another one (a virtual disk's write cache)."""
    result = InterferenceResult(point)
    with SwapEngine(path, point.settings(size)) as engine:
        extent = engine.allocate(size)
        _stream(engine, extent, pool, size, "write")  # overwrites from now on
        for round_index in range(repeats):
            for direction in DIRECTIONS:
                steps = ["alone", "idle", "loaded"]
                for step in steps if round_index % 2 == 0 else steps[::-1]:
                    if step == "alone":
                        stream = _stream(engine, extent, pool, size, direction)
                        result.io_solo_gbps[direction].append(stream.gbps)
                    elif step == "idle":
                        result.idle.append(idle_window(idle_seconds))
                    else:
                        background = BackgroundStream(engine, extent, pool, size, direction)
                        background.start()
                        window = spin(background.done)
                        if background.error:
                            raise background.error
                        result.loaded[direction].append(window)
                        result.io_gbps[direction].append(background.gbps)
                on_step()
    return result


def _stream(engine: SwapEngine, extent, pool: BufferPool, size: int, op: str) -> BackgroundStream:
    """Runs one stream with nothing else to do meanwhile."""
    stream = BackgroundStream(engine, extent, pool, size, op)
    stream.start()
    stream.done.wait()
    if stream.error:
        raise stream.error
    return stream


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
            job = FioJob(
                direction,
                block_size,
                iodepth,
                size,
                runner.ioengine or "io_uring",
                runtime=lead + idle_seconds + 0.5,
            )
            result.io_solo_gbps[direction].append(runner.run(job).gbps)
            result.idle.append(idle_window(idle_seconds))
            process = runner.spawn(job)
            try:
                time.sleep(lead)
                result.loaded[direction].append(idle_window(idle_seconds))
            finally:
                fio = runner.finish(process, job)
            result.io_gbps[direction].append(fio.gbps)
            on_step()
    return result
