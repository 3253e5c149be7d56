"""The planner's simulated time: the disk's queues, and compute and the disk slowing each other."""

from __future__ import annotations

import math

import pytest

from infinity.planning.planner import DiskProfile, PlanError
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


def test_reads_and_writes_in_flight_together_go_at_the_mixed_pace() -> None:
    clock = SimulatedClock(mixed_efficiency=0.5)
    engine = SimulatedEngine(clock, DISK)
    read = engine.read(SimulatedExtent(1, GBYTE), None)
    write = engine.write(SimulatedExtent(2, GBYTE), None)  # shared: behind the read
    # both directions in flight: the read's second of work takes two
    read.result()
    assert math.isclose(clock.now, 2.0)
    # the write alone then goes at full pace
    write.result()
    assert math.isclose(clock.now, 3.0) and math.isclose(clock.stalled, 3.0)


def test_one_direction_alone_keeps_its_pace_and_compute_meets_both() -> None:
    clock = SimulatedClock(mixed_efficiency=0.5)
    engine = SimulatedEngine(clock, DISK)
    reads = [engine.read(SimulatedExtent(i, GBYTE // 2), None) for i in range(2)]
    reads[-1].result()
    assert math.isclose(clock.now, 1.0)  # reads alone: no mixed pace
    # beside compute that retains half the disk, mixed traffic goes at a quarter: a 0.25 s
    # read and a 0.25 s write take 1 s of compute for the read, then the write alone at half
    clock = SimulatedClock(Contention(1.0, 0.5, "test"), mixed_efficiency=0.5)
    engine = SimulatedEngine(clock, DISK)
    read = engine.read(SimulatedExtent(1, GBYTE // 4), None)
    write = engine.write(SimulatedExtent(2, GBYTE // 4), None)
    clock.compute(1.0)
    assert read.done() and not write.done()
    clock.compute(0.5)
    assert write.done() and math.isclose(clock.now, 1.5)


def test_side_by_side_directions_both_slow_while_mixed() -> None:
    clock = SimulatedClock(mixed_efficiency=0.5)
    engine = SimulatedEngine(clock, DiskProfile(1.0, 1.0, shared=False))
    read = engine.read(SimulatedExtent(1, GBYTE), None)
    write = engine.write(SimulatedExtent(2, GBYTE // 2), None)
    write.result()  # 0.5 s of work at half pace
    assert math.isclose(clock.now, 1.0) and not read.done()
    read.result()  # its last 0.5 s alone
    assert math.isclose(clock.now, 1.5)


def test_the_disk_profile_s_mixed_efficiency() -> None:
    assert DiskProfile(4.0, 4.0).mixed_efficiency == 1.0  # not measured
    assert DiskProfile(4.0, 4.0, combined_gbps=2.0).mixed_efficiency == 0.5
    assert DiskProfile(4.0, 4.0, combined_gbps=5.0).mixed_efficiency == 1.0
    # shared: 1 GB each way takes 1/4 + 1/2 s alone, 2 GB in 0.75 s is 2.67 GB/s
    assert math.isclose(DiskProfile(4.0, 2.0, combined_gbps=2.0).mixed_efficiency, 0.75)
    # side by side: the slower direction's pace, both ways
    assert DiskProfile(4.0, 2.0, shared=False, combined_gbps=2.0).mixed_efficiency == 0.5
    striped = DiskProfile(4.0, 2.0, combined_gbps=2.0).scaled(2).per_rank(4)
    assert (striped.read_gbps, striped.write_gbps, striped.combined_gbps) == (2.0, 1.0, 1.0)
    assert math.isclose(striped.mixed_efficiency, 0.75)
    with pytest.raises(PlanError, match="combined GB/s must be > 0"):
        DiskProfile(4.0, 4.0, combined_gbps=0.0)
    with pytest.raises(ContentionError, match="mixed_efficiency must be in"):
        SimulatedClock(mixed_efficiency=1.5)
