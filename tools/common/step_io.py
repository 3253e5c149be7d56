"""A measured floor for an attached step: plain PyTorch with the step's bytes moved beside it.

The floor ``bench_budget`` prints takes the plain step and the disk each on its own. On a machine
where the cores that compute also submit, complete and checksum the transfers, and the memory that
feeds the kernels also takes the transfers' copies, the two slow each other down. This measures what
they do together with the best schedule there is: every step starts moving its bytes (reads and
writes interleaved by bytes, 16 MiB transfers as the store's largest shards, through the same swap
engine and settings) the moment it starts, from a thread of its own, and the step ends when both its
compute and its bytes are done. No store, no eviction, no waiting for a shard: only the contention,
so an attached step cannot beat it.

:func:`fio_beside` moves bytes at a given rate from fio, in another process: what the machine
charges the compute for the traffic when neither this engine nor this interpreter moves it.
"""

from __future__ import annotations

import contextlib
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType

import torch
from torch import nn

from infinity.cli.common.transfers import run_transfers
from swap import BufferPool, EngineSettings, SwapEngine
from tools.common.workloads import duplex_order, timed_steps

CHUNK = 16 << 20
IN_FLIGHT = 8  # transfers in flight, one per buffer


class StepIO:
    """Moves ``read_bytes`` and ``write_bytes`` per step through a swap engine on ``path``,
    from a background thread, between :meth:`start` and :meth:`wait`."""

    def __init__(
        self, path: Path, settings: EngineSettings, read_bytes: int, write_bytes: int
    ) -> None:
        self._pool = BufferPool(IN_FLIGHT, CHUNK)
        self._engine = SwapEngine([path], settings)
        self._sources = [self._engine.allocate(CHUNK) for _ in range(-(-read_bytes // CHUNK))]
        self._targets = [self._engine.allocate(CHUNK) for _ in range(-(-write_bytes // CHUNK))]
        for extent in self._sources:  # reads find checksummed bytes, as the store's do
            self._engine.write_sync(extent, self._pool.buffers[0])
        self._go = threading.Event()
        self._done = threading.Event()
        self._stop = False
        self._error: BaseException | None = None
        self.seconds: list[float] = []  # each step's transfer time, from start()
        self._thread = threading.Thread(target=self._serve, name="step-io", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            self._go.wait()
            self._go.clear()
            if self._stop:
                return
            started = time.perf_counter()
            try:
                self._move()
            except BaseException as error:  # handed to the training thread by wait()
                self._error = error
            self.seconds.append(time.perf_counter() - started)
            self._done.set()

    def _move(self) -> None:
        run_transfers(duplex_order(self._engine, self._sources, self._targets), self._pool.buffers)

    def start(self) -> None:
        self._done.clear()
        self._go.set()

    def wait(self) -> None:
        self._done.wait()
        if self._error is not None:
            raise self._error

    def close(self) -> None:
        self._stop = True
        self._go.set()
        self._thread.join(timeout=60)
        self._engine.close()
        self._pool.close()

    def __enter__(self) -> StepIO:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.close()


def steps_beside_io(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    io: StepIO,
    steps: int,
    batch: int,
    width: int,
) -> tuple[list[float], list[float]]:
    """Seconds of each plain step whose bytes ``io`` moves while it computes, from the step's
    start until both its compute and its bytes are done, and of its compute alone."""
    phases: list[tuple[float, float, float]] = []
    times = timed_steps(
        model, optimizer, steps, batch, width, phases, at_start=io.start, at_end=io.wait
    )
    return times, [sum(phase) for phase in phases]


@contextlib.contextmanager
def fio_beside(
    fio: str, directory: Path, read_rate: float, write_rate: float, seconds: int = 600
) -> Iterator[None]:
    """fio reading and writing at ``read_rate`` and ``write_rate`` bytes/s (1 MiB O_DIRECT
    requests, queue depth 16) in ``directory`` for the duration of the block."""
    job = directory / "fio-beside"
    mix = max(1, min(99, round(100 * read_rate / max(read_rate + write_rate, 1))))
    command = [
        fio,
        "--name=beside",
        f"--filename={job}",
        "--rw=randrw",
        f"--rwmixread={mix}",
        "--bs=1m",
        "--direct=1",
        "--ioengine=libaio",
        "--iodepth=16",
        "--size=1g",
        "--time_based",
        f"--runtime={seconds}",
        f"--rate={max(1, int(read_rate))},{max(1, int(write_rate))}",
        "--output-format=json",
    ]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        time.sleep(3)  # the file laid out and the rate reached before anything is timed
        if process.poll() is not None:
            error = process.stderr.read().decode(errors="replace") if process.stderr else ""
            raise RuntimeError(f"fio exited early ({process.returncode}): {error[-400:]}")
        yield
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        job.unlink(missing_ok=True)
