"""The planner's simulated time: the disk's queues, and compute and the disk slowing each other."""

from __future__ import annotations

import math

import pytest

from infinity.planning.planner import DiskProfile
from infinity.planning.simulated_time import (
    NO_CONTENTION,
    Contention,
    ContentionError,
    SimulatedClock,
    SimulatedEngine,
    SimulatedExtent,
)

# 1 GB/s both ways: a transfer of 10**9 bytes is one second of the disk's work
DISK = DiskProfile(1.0, 1.0, shared=True)
GBYTE = 10**9


def _engine(contention: Contention = NO_CONTENTION) -> tuple[SimulatedClock, SimulatedEngine]:
    clock = SimulatedClock(contention)
    return clock, SimulatedEngine(clock, DISK)


def test_without_contention_transfers_end_at_fixed_times_behind_compute() -> None:
    clock, engine = _engine()
    first = engine.read(SimulatedExtent(1, GBYTE), None)
    second = engine.write(SimulatedExtent(2, GBYTE // 2), None)  # shared: queued behind
    clock.compute(0.75)
    assert clock.now == 0.75 and not first.done()
    clock.compute(0.25)
    assert first.done() and not second.done()
    second.result()
    assert math.isclose(clock.now, 1.5) and math.isclose(clock.stalled, 0.5)
    clock.compute(1.0)  # the disk is idle: compute alone
    assert math.isclose(clock.now, 2.5)


def test_compute_beside_a_transfer_is_slowed_and_slows_the_transfer() -> None:
    clock, engine = _engine(Contention(compute_slowdown=1.5, io_retained=0.5, source="test"))
    transfer = engine.read(SimulatedExtent(1, GBYTE), None)
    # 1 s of compute beside the transfer takes 1.5 s; the disk does 0.75 s of its work meanwhile
    clock.compute(1.0)
    assert math.isclose(clock.now, 1.5) and not transfer.done()
    # the rest (0.25 s of work) runs alone while the training thread waits
    transfer.result()
    assert math.isclose(clock.now, 1.75) and math.isclose(clock.stalled, 0.25)


def test_compute_runs_at_full_speed_once_the_disk_drains() -> None:
    clock, engine = _engine(Contention(compute_slowdown=2.0, io_retained=0.5, source="test"))
    transfer = engine.write(SimulatedExtent(1, GBYTE // 4), None)
    # the 0.25 s write at half speed drains after 0.5 s, in which 0.25 s of compute is done;
    # the other 0.75 s of compute then runs alone
    clock.compute(1.0)
    assert transfer.done()
    assert math.isclose(clock.now, 1.25) and clock.stalled == 0.0


def test_separate_queues_drain_side_by_side() -> None:
    clock = SimulatedClock()
    engine = SimulatedEngine(clock, DiskProfile(1.0, 1.0, shared=False))
    read = engine.read(SimulatedExtent(1, GBYTE), None)
    write = engine.write(SimulatedExtent(2, GBYTE), None)
    clock.wait_idle()
    assert read.done() and write.done() and math.isclose(clock.now, 1.0)
    stats = engine.stats()
    assert (stats.bytes_read, stats.bytes_written) == (GBYTE, GBYTE)


@pytest.mark.parametrize(
    "fields, match",
    [
        ({"compute_slowdown": 0.9}, "compute_slowdown must be a finite number >= 1"),
        ({"compute_slowdown": float("inf")}, "compute_slowdown"),
        ({"io_retained": 0.0}, r"io_retained must be in \(0, 1\]"),
        ({"io_retained": 1.2}, "io_retained"),
    ],
)
def test_contention_out_of_range_is_refused(fields: dict, match: str) -> None:
    with pytest.raises(ContentionError, match=match):
        Contention(**fields)


def test_no_contention_says_it_was_not_measured() -> None:
    assert not NO_CONTENTION.measured
    assert "not measured" in NO_CONTENTION.as_dict()["source"]
    assert Contention(1.2, 0.8, "here").measured
