"""The overlap floor of bench_scale: compute and I/O slowing each other, measured and combined."""

from __future__ import annotations

import time

import pytest

from infinity.cli.common.contention import Contention, Stream, measure, overlapped_floor
from swap import EngineSettings, SwapEngine


def test_without_contention_the_floor_is_the_larger_of_the_two() -> None:
    assert overlapped_floor(4.0, 10e9, 2e9, slowdown=1.0, retained=1.0) == pytest.approx(5.0)
    assert overlapped_floor(6.0, 10e9, 2e9, slowdown=1.0, retained=1.0) == pytest.approx(6.0)
    assert overlapped_floor(6.0, 0, 2e9, slowdown=3.0, retained=0.5) == 6.0


def test_slowed_compute_finishes_alone_after_the_io() -> None:
    # 10 GB at 2 GB/s (all kept): the I/O ends at 5 s, by when compute slowed 2x has done 2.5
    # of its 4 s; the other 1.5 s run alone.
    assert overlapped_floor(4.0, 10e9, 2e9, slowdown=2.0, retained=1.0) == pytest.approx(6.5)


def test_slowed_io_finishes_alone_after_the_compute() -> None:
    # 4 s of compute (not slowed) beside I/O at half of 2 GB/s: 4 GB moved by then, the other
    # 6 GB at the full 2 GB/s take 3 s.
    assert overlapped_floor(4.0, 10e9, 2e9, slowdown=1.0, retained=0.5) == pytest.approx(7.0)


def test_measure_times_both_alone_and_together(tmp_path) -> None:
    calls = []

    def compute() -> None:
        calls.append(sum(i * i for i in range(20_000)))

    found = measure(
        tmp_path, EngineSettings(), compute, repeats=2, warmup=1, nbytes=4 << 20, window=0.0
    )
    assert isinstance(found, Contention)
    assert len(calls) == 1 + 1 + 2 * 2  # warm-up, one to size the window, alone and beside
    assert found.compute_alone_s > 0 and found.compute_beside_io_s > 0
    # the stream moved bytes both alone (at least a second) and beside the compute
    assert found.io_alone_bps > 0
    assert found.io_beside_compute_bps >= 0
    assert found.as_dict()["compute_slowdown"] == found.compute_slowdown
    assert not list(tmp_path.rglob("*")) or all(p.is_dir() for p in tmp_path.rglob("*"))


def test_a_short_unit_is_timed_in_a_row_long_enough_to_see_transfers_finish(tmp_path) -> None:
    calls = []

    def compute() -> None:  # milliseconds: no 64 MiB transfer finishes within one
        calls.append(sum(i * i for i in range(2_000)))

    found = measure(tmp_path, EngineSettings(), compute, repeats=1, warmup=1, nbytes=4 << 20)
    timed = len(calls) - 2  # after the warm-up and the unit that sized the window
    assert timed % 2 == 0 and timed // 2 > 1  # alone and beside, each as many units in a row
    assert found.io_beside_compute_bps > 0


@pytest.mark.parametrize("reads_only", [True, False])
def test_a_stream_of_reads_only_writes_nothing_while_it_runs(tmp_path, reads_only) -> None:
    with SwapEngine([tmp_path], EngineSettings()) as engine:
        stream = Stream(engine, 2 << 20, reads_only=reads_only)
        try:
            before = engine.stats()  # the sources it reads back are written first
            stream.run()
            deadline = time.monotonic() + 60  # a guard against a hang, not a timing
            while stream.moved < 16 << 20 and time.monotonic() < deadline:
                time.sleep(0.01)
            stream.pause()
            after = engine.stats()
        finally:
            stream.close()
    assert stream.moved >= 16 << 20
    assert after.bytes_read > before.bytes_read
    if reads_only:
        assert after.bytes_written == before.bytes_written
    else:
        assert after.bytes_written - before.bytes_written >= 4 << 20
