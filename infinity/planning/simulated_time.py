"""Time in the planner's replay: the training thread's clock, the disk's queues, and how the two
slow each other down when they run at once.

The replay advances one clock. The training thread *computes* (a module's recorded seconds, the
optimizer's, a device copy) or *waits* for a transfer. The disk works through its queues of
transfers meanwhile. Each queue holds work measured in seconds at the disk profile's bandwidth,
and works it off as the clock moves:

* while the training thread waits, the disk runs alone, at full speed;
* while it computes and a transfer is in flight, both run slower, as measured on the machine
  (:class:`Contention`): the compute takes ``compute_slowdown`` times its seconds alone and the
  disk keeps ``io_retained`` of its bandwidth. On a machine with few cores the engine's threads
  (submission, completion, checksums) take cores from torch's intra-op threads, and the
  computation's memory traffic slows the copies the engine makes; on two cores the plain steps
  of the planner's validation matrix took 1.1-1.9x as long beside the engine's streaming as
  alone (``docs/scaling.md``).

Reads and writes in flight at the same moment can also slow each other beyond their shares of
one bandwidth (on drives whose controller or flash favours one direction at a time). The disk
profile's ``mixed_efficiency``, its measured combined rate over the rate its two directions alone
imply, is the pace at which the queues work while both directions have work in them; 1.0 when
the profile has no combined figure. On this machine's virtio disk it measured 0.94-1.0.

With no contention (both 1.0, :data:`NO_CONTENTION`) and no mixed penalty this is the earlier
model exactly: the disk's transfers complete at fixed times and compute advances the clock by
its seconds.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any

from infinity.errors import InfinityError
from swap import EngineStats

GB = 1e9
#: work (seconds) below which a queue counts as drained: float sums of many transfers
_EPSILON = 1e-12


class ContentionError(InfinityError, ValueError):
    """A contention figure out of range (a slowdown below 1, a retained share outside (0, 1])."""


@dataclass(frozen=True)
class Contention:
    """How compute and the swap engine slow each other when both run: ``compute_slowdown`` is
    the compute's seconds beside the engine streaming over its seconds alone (1.0: not at all);
    ``io_retained`` the share of its bandwidth the engine keeps beside compute (1.0: all);
    ``source`` says where the figures come from."""

    compute_slowdown: float = 1.0
    io_retained: float = 1.0
    source: str = "not measured: compute and the disk are taken not to slow each other"

    def __post_init__(self) -> None:
        if not (math.isfinite(self.compute_slowdown) and self.compute_slowdown >= 1.0):
            raise ContentionError(
                f"compute_slowdown must be a finite number >= 1 (compute beside the disk "
                f"over compute alone), got {self.compute_slowdown}"
            )
        if not (0.0 < self.io_retained <= 1.0):
            raise ContentionError(
                f"io_retained must be in (0, 1] (the share of the disk's bandwidth kept "
                f"beside compute), got {self.io_retained}"
            )

    @property
    def measured(self) -> bool:
        return self.compute_slowdown != 1.0 or self.io_retained != 1.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "compute_slowdown": self.compute_slowdown,
            "io_retained": self.io_retained,
            "source": self.source,
        }


NO_CONTENTION = Contention()


class DiskQueue:
    """Transfers worked off in order: ``submitted`` and ``done`` are cumulative work, in seconds
    at full bandwidth; each transfer's end mark and direction are kept until it is done."""

    def __init__(self) -> None:
        self.submitted = 0.0
        self.done = 0.0
        self._transfers: deque[tuple[float, str]] = deque()
        self._in_flight: dict[str, int] = {}

    @property
    def pending(self) -> float:
        return max(0.0, self.submitted - self.done)

    def add(self, seconds: float, direction: str = "read") -> float:
        """Queues ``seconds`` of work; returns the work mark at which it is done."""
        self._drop_done()  # only what is in flight is kept, over however long a replay
        self.submitted += seconds
        self._transfers.append((self.submitted, direction))
        self._in_flight[direction] = self._in_flight.get(direction, 0) + 1
        return self.submitted

    def finished(self, mark: float) -> bool:
        return self.done >= mark - _EPSILON

    def _drop_done(self) -> None:
        while self._transfers and self.finished(self._transfers[0][0]):
            _, direction = self._transfers.popleft()
            self._in_flight[direction] -= 1

    def directions(self) -> set[str]:
        """The directions of the transfers not yet done."""
        self._drop_done()
        return {direction for direction, count in self._in_flight.items() if count}

    def until_next_done(self) -> float:
        """Work left until the first transfer not yet done is (0.0 with none)."""
        self._drop_done()
        return self._transfers[0][0] - self.done if self._transfers else 0.0


class SimulatedClock:
    """The replay's one clock: ``now``, the seconds the training thread ``stalled`` waiting for
    the disk, and the disk's queues, worked off as it moves (at ``mixed_efficiency`` of their
    pace while reads and writes are both in flight)."""

    def __init__(
        self, contention: Contention = NO_CONTENTION, mixed_efficiency: float = 1.0
    ) -> None:
        if not (0.0 < mixed_efficiency <= 1.0):
            raise ContentionError(
                f"mixed_efficiency must be in (0, 1] (the disk's pace with reads and writes "
                f"in flight together), got {mixed_efficiency}"
            )
        self.now = 0.0
        self.stalled = 0.0
        self.contention = contention
        self.mixed_efficiency = mixed_efficiency
        self.queues: dict[str, DiskQueue] = {}

    def queue(self, name: str) -> DiskQueue:
        return self.queues.setdefault(name, DiskQueue())

    def _busy(self) -> list[DiskQueue]:
        return [q for q in self.queues.values() if q.pending > _EPSILON]

    def _mixed(self, busy: list[DiskQueue]) -> bool:
        if self.mixed_efficiency >= 1.0:
            return False
        directions: set[str] = set()
        for q in busy:
            directions |= q.directions()
        return len(directions) > 1

    def _pace(self, busy: list[DiskQueue]) -> tuple[float, float]:
        """The queues' pace (work seconds per second, contention aside) and the work they can
        do at it before what is in flight changes: until one drains, or while reads and writes
        are mixed, until the next transfer is done."""
        if self._mixed(busy):
            return self.mixed_efficiency, min(q.until_next_done() for q in busy)
        return 1.0, min(q.pending for q in busy)

    def compute(self, seconds: float) -> None:
        """The training thread computes for ``seconds`` (as timed alone); slower, and the disk
        too, while transfers are in flight."""
        left = max(0.0, seconds)
        slowdown = self.contention.compute_slowdown
        retained = self.contention.io_retained
        while left > 0:
            busy = self._busy()
            if not busy:
                self.now += left
                return
            pace, horizon = self._pace(busy)
            rate = retained * pace
            # wall seconds until the compute is done, or what is in flight changes
            wall = min(left * slowdown, horizon / rate)
            for q in busy:
                q.done = min(q.submitted, q.done + wall * rate)
            self.now += wall
            left -= wall / slowdown
            if left * slowdown <= _EPSILON:
                return

    def wait(self, queue: DiskQueue, mark: float) -> None:
        """The training thread waits until ``queue`` has done its work up to ``mark``; the disk
        runs alone meanwhile."""
        while not queue.finished(mark):
            busy = self._busy()
            pace, horizon = self._pace(busy) if busy else (1.0, 0.0)
            work = min(mark - queue.done, horizon) if busy else mark - queue.done
            wall = work / pace
            for q in busy:
                q.done = min(q.submitted, q.done + work)
            self.now += wall
            self.stalled += wall
            if work <= _EPSILON:
                queue.done = max(queue.done, mark)

    def wait_idle(self) -> None:
        """Waits until every queue has drained."""
        for q in self.queues.values():
            self.wait(q, q.submitted)


class SimulatedTransfer:
    """A transfer that completes when its queue has worked off its mark; waiting for it moves
    the clock there (a future, as the swap engine returns)."""

    def __init__(self, clock: SimulatedClock, queue: DiskQueue, mark: float, nbytes: int) -> None:
        self._clock = clock
        self._queue = queue
        self._mark = mark
        self.nbytes = nbytes

    def done(self) -> bool:
        return self._queue.finished(self._mark)

    def result(self, timeout: float | None = None) -> int:
        self._clock.wait(self._queue, self._mark)
        return self.nbytes

    def exception(self, timeout: float | None = None) -> None:
        self._clock.wait(self._queue, self._mark)
        return None

    def add_done_callback(self, callback: Any) -> None:
        callback(self)


@dataclass(frozen=True)
class SimulatedExtent:
    serial: int
    nbytes: int


class SimulatedSpace:
    def __init__(self) -> None:
        self.allocated_bytes = 0


class SimulatedEngine:
    """The swap engine's interface over simulated time: one queue of transfers at the disk
    profile's bandwidth (two queues when reads and writes do not share it). ``disk`` is a
    :class:`~infinity.planning.planner.DiskProfile`."""

    backend_name = "simulated"
    keep_files = False

    def __init__(self, clock: SimulatedClock, disk: Any) -> None:
        self.clock = clock
        self.disk = disk
        self.space = SimulatedSpace()
        self._serial = 0
        self._counts: dict[str, Any] = {
            "bytes_read": 0,
            "bytes_written": 0,
            "read_seconds": 0.0,
            "write_seconds": 0.0,
            "read_requests": 0,
            "write_requests": 0,
        }

    def allocate(self, nbytes: int) -> SimulatedExtent:
        self._serial += 1
        self.space.allocated_bytes += nbytes
        return SimulatedExtent(self._serial, nbytes)

    def free(self, extent: SimulatedExtent) -> None:
        self.space.allocated_bytes -= extent.nbytes

    def _transfer(self, op: str, nbytes: int) -> SimulatedTransfer:
        queue = self.clock.queue("read" if self.disk.shared else op)
        gbps = self.disk.read_gbps if op == "read" else self.disk.write_gbps
        seconds = nbytes / (gbps * GB)
        counts = self._counts
        counts[f"bytes_{'read' if op == 'read' else 'written'}"] += nbytes
        counts[f"{op}_seconds"] += seconds  # at full bandwidth
        counts[f"{op}_requests"] += 1
        return SimulatedTransfer(self.clock, queue, queue.add(seconds, op), nbytes)

    def read(
        self, extent: SimulatedExtent, buffer: Any, *, nbytes: int | None = None, **_: Any
    ) -> SimulatedTransfer:
        return self._transfer("read", extent.nbytes if nbytes is None else nbytes)

    def write(
        self, extent: SimulatedExtent, buffer: Any, *, nbytes: int | None = None, **_: Any
    ) -> SimulatedTransfer:
        return self._transfer("write", extent.nbytes if nbytes is None else nbytes)

    def quarantined(self) -> list:
        return []

    def stats(self) -> EngineStats:
        return EngineStats(**self._counts)

    def close(self) -> None:
        pass
