"""What the cores and the disk give a step when both work at once: the overlap floor.

A step's two floors (its compute alone, its bytes at the engine's GB/s alone) assume the other
costs nothing. On a machine with few cores they share the cores: torch's intra-op threads take
every core for a matmul, and the engine's submission, completion and checksum threads need
them too. So the best a step can do, with its I/O hidden behind its compute as well as any
schedule could, is measured here, not assumed: a compute unit timed alone and beside the engine
streaming reads and writes, and the engine's GB/s alone and beside the compute.

:func:`overlapped_floor` turns those into the seconds a step of ``compute_s`` compute and
``nbytes`` of I/O takes if both run at once from its start until one is done (each slowed as
measured), and the other then finishes alone. A step can come close to it only by overlapping
perfectly; it can beat it only by doing less work.
"""

from __future__ import annotations

import math
import statistics
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from infinity.planning import simulated_time as planner_time
from swap import BufferPool, EngineSettings, SwapEngine

if TYPE_CHECKING:
    from infinity.config import OffloadConfig

#: each transfer of the stream
_CHUNK = 64 << 20
#: transfers in flight (as many host buffers)
_IN_FLIGHT = 4


@dataclass(frozen=True)
class Contention:
    """One compute unit's seconds and the engine's combined GB/s, each alone and beside the
    other."""

    compute_alone_s: float
    compute_beside_io_s: float
    io_alone_bps: float
    io_beside_compute_bps: float

    @property
    def compute_slowdown(self) -> float:
        """How much longer compute takes while the engine streams (1.0: not at all)."""
        return self.compute_beside_io_s / self.compute_alone_s

    @property
    def io_retained(self) -> float:
        """The share of its GB/s the engine keeps while compute runs (1.0: all of it)."""
        return self.io_beside_compute_bps / self.io_alone_bps

    def for_planner(self, what: str) -> planner_time.Contention:
        """These figures as the planner's replay takes them (``what``: the compute unit timed),
        a slowdown below 1 or a share above 1 (noise) taken as none."""
        return planner_time.Contention(
            compute_slowdown=max(1.0, self.compute_slowdown),
            io_retained=min(1.0, max(self.io_retained, 1e-3)),
            source=(
                f"measured here: {what} took {self.compute_alone_s:.3f} s alone and "
                f"{self.compute_beside_io_s:.3f} s beside the engine streaming, which kept "
                f"{self.io_beside_compute_bps / 1e9:.2f} of its {self.io_alone_bps / 1e9:.2f} GB/s"
            ),
        )

    def as_dict(self) -> dict[str, float]:
        return {
            "compute_alone_s": self.compute_alone_s,
            "compute_beside_io_s": self.compute_beside_io_s,
            "io_alone_bps": self.io_alone_bps,
            "io_beside_compute_bps": self.io_beside_compute_bps,
            "compute_slowdown": self.compute_slowdown,
            "io_retained": self.io_retained,
        }


def overlapped_floor(
    compute_s: float, nbytes: float, io_bps: float, slowdown: float, retained: float
) -> float:
    """Seconds for ``compute_s`` of compute (timed alone) and ``nbytes`` at ``io_bps`` (alone)
    when both start together, each slowed as measured (``slowdown``, ``retained``) while the
    other runs, and whichever is left finishes alone."""
    if nbytes <= 0 or io_bps <= 0:
        return compute_s
    both_bps = io_bps * retained
    compute_done_at = compute_s * slowdown
    io_done_at = nbytes / both_bps if both_bps > 0 else float("inf")
    if compute_done_at <= io_done_at:
        return compute_done_at + (nbytes - compute_done_at * both_bps) / io_bps
    return io_done_at + compute_s - io_done_at / slowdown


class Stream:
    """The engine reading ``nbytes`` back while writing as many elsewhere (or, ``reads_only``,
    reading them alone, as a forward that streams weights does), over and over, on a thread of
    its own while running (between :meth:`run` and :meth:`pause`), counting the bytes of each
    finished transfer."""

    def __init__(self, engine: SwapEngine, nbytes: int, reads_only: bool = False) -> None:
        self._engine = engine
        self._reads_only = reads_only
        self._pool = BufferPool(_IN_FLIGHT, _CHUNK)
        self._sources = [engine.allocate(min(_CHUNK, nbytes - o)) for o in range(0, nbytes, _CHUNK)]
        self._targets = [engine.allocate(e.nbytes) for e in self._sources]
        for index, extent in enumerate(self._sources):  # the reads read written bytes
            engine.write(extent, self._pool.buffers[index % _IN_FLIGHT]).result()
        self.moved = 0
        self._running = threading.Event()
        self._paused = threading.Event()
        self._paused.set()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="contention-stream", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        in_flight: list[tuple[Future[Any], int]] = []
        turn = 0
        while True:
            if not self._running.is_set():
                for future, size in in_flight:
                    future.result()
                    self.moved += size
                in_flight.clear()
                self._paused.set()
                self._running.wait()
                if self._closed:
                    return
            if self._reads_only:
                index, read = turn % len(self._sources), True
            else:
                index, read = turn // 2 % len(self._sources), turn % 2 == 0
            extent = self._sources[index] if read else self._targets[index]
            if len(in_flight) >= _IN_FLIGHT:
                future, size = in_flight.pop(0)
                future.result()
                self.moved += size
            buffer = self._pool.buffers[turn % _IN_FLIGHT]
            call = self._engine.read if read else self._engine.write
            in_flight.append((call(extent, buffer), extent.nbytes))
            turn += 1

    def run(self) -> None:
        self._paused.clear()
        self._running.set()

    def pause(self) -> None:
        """Stops starting transfers and waits for those in flight."""
        self._running.clear()
        self._paused.wait()

    def close(self) -> None:
        self.pause()
        self._closed = True
        self._running.set()
        self._thread.join()
        self._pool.close()


def _timed(call: Callable[[], None]) -> float:
    started = time.perf_counter()
    call()
    return time.perf_counter() - started


def measure_for_planner(
    path: Path, config: OffloadConfig, step: Callable[[], None], what: str, nbytes: int
) -> planner_time.Contention:
    """The planner's figures for ``step`` (a plain training step; ``what`` names it) beside the
    engine streaming ``nbytes`` on ``path`` with the settings ``config`` gives the store's
    engine, checksums included: 3 interleaved repeats after 2 warm-up steps."""
    settings = config.aio.engine_settings(verify_checksums=config.verify_checksums)
    found = measure(path, settings, step, repeats=3, warmup=2, nbytes=nbytes)
    return found.for_planner(what)


def measure(
    path: Path,
    settings: EngineSettings,
    compute_unit: Callable[[], None],
    repeats: int = 5,
    warmup: int = 4,
    nbytes: int = 1 << 30,
    reads_only: bool = False,
    window: float = 1.0,
) -> Contention:
    """Times ``compute_unit`` alone and beside the engine streaming on ``path``, and the
    engine's GB/s (reads and writes combined, or ``reads_only``) alone (as long as a compute
    unit, at least a second) and beside the compute, interleaved ``repeats`` times after
    ``warmup`` untimed units (the first steps of a fresh model fault in its memory); the
    medians of each. A unit shorter than ``window`` seconds is run as many times in a row as
    fill it, and timed per unit: the engine counts bytes as its transfers finish, and a few
    milliseconds would see none finish."""
    for _ in range(warmup):
        compute_unit()
    once = _timed(compute_unit)
    runs = max(1, math.ceil(window / once)) if once > 0 else 1

    def batch() -> None:
        for _ in range(runs):
            compute_unit()

    alone: list[float] = []
    beside: list[float] = []
    io_alone: list[float] = []
    io_beside: list[float] = []
    with SwapEngine([path], settings) as engine:
        stream = Stream(engine, nbytes, reads_only)
        try:
            for _ in range(repeats):
                alone.append(_timed(batch))
                stream.run()
                moved = stream.moved
                io_alone.append(_timed(lambda: time.sleep(max(1.0, alone[-1]))))
                io_alone[-1] = (stream.moved - moved) / io_alone[-1]
                moved = stream.moved
                beside.append(_timed(batch))
                io_beside.append((stream.moved - moved) / beside[-1])
                stream.pause()
        finally:
            stream.close()
    return Contention(
        compute_alone_s=statistics.median(alone) / runs,
        compute_beside_io_s=statistics.median(beside) / runs,
        io_alone_bps=statistics.median(io_alone),
        io_beside_compute_bps=statistics.median(io_beside),
    )
