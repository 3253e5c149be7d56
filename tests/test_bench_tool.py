"""Fast tests of infinity-bench: the pure parts, and one tiny end-to-end run of the CLI."""

from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path

import pytest

from infinity.cli import bench
from infinity.cli.common.aggregate import harmonic_mean, summarize
from infinity.cli.common.units import format_size, parse_size
from infinity.cli.disk import aiofiles_baseline
from infinity.cli.disk.fio import FioError, FioJob, parse_fio_json
from infinity.cli.disk.gil_probe import InterferenceResult, Window, measure_interference
from infinity.cli.disk.recommend import (
    AIO_KEYS,
    CONFIG_KEYS,
    Candidate,
    check_config,
    choose_buffers,
    choose_point,
    config_dict,
    recommend,
    write_config,
)
from infinity.cli.disk.report import aiofiles_lines, summary_lines
from infinity.cli.disk.sweep import Point, PointResult, Sample, fill_pattern
from swap import BufferPool, EngineSettings
from swap.probe import choose_backend

MIB = 1 << 20

# Trimmed from `fio --output-format=json` 3.33 (rw=read, io_uring, bs=1M, iodepth=8, 256M), with a
# warning line ahead of the document as some fio versions print one on stdout.
FIO_READ = """fio: note: both iodepth >= 1 and synchronous I/O engine are selected
{
  "fio version" : "fio-3.33",
  "jobs" : [
    {
      "jobname" : "infinity-bench", "groupid" : 0, "error" : 0,
      "job options" : {"rw" : "read", "bs" : "1M", "iodepth" : "8", "size" : "256M"},
      "read" : {"io_bytes" : 268435456, "io_kbytes" : 262144, "bw_bytes" : 1078054040,
                "bw" : 1052787, "iops" : 1028.112450, "runtime" : 249, "total_ios" : 256},
      "write" : {"io_bytes" : 0, "io_kbytes" : 0, "bw_bytes" : 0, "bw" : 0, "iops" : 0.0,
                 "runtime" : 0, "total_ios" : 0},
      "job_runtime" : 248,
      "usr_cpu" : 2.016129,
      "sys_cpu" : 4.435484
    }
  ]
}
"""


# ------------------------------------------------------------------ units and aggregation


def test_sizes_parse_and_format() -> None:
    assert parse_size("256K") == 256 << 10
    assert parse_size("1M") == parse_size("1MiB") == parse_size("1mb") == MIB
    assert parse_size("1.5G") == 3 << 29
    assert parse_size("4096") == 4096
    for bad in ("", "x", "-1M", "0", "1.5"):
        with pytest.raises(ValueError):
            parse_size(bad)
    assert [format_size(n) for n in (256 << 10, MIB, 4 * MIB, 1 << 30, 4097)] == [
        "256K",
        "1M",
        "4M",
        "1G",
        "4097",
    ]


def test_summarize_median_min_max() -> None:
    s = summarize([3.0, 1.0, 2.0])
    assert (s.median, s.min, s.max, s.n) == (2.0, 1.0, 3.0, 3)
    assert summarize([4.0, 1.0, 2.0, 3.0]).median == 2.5
    # Failed repeats (None, NaN) are left out rather than dragging the median down.
    s = summarize([None, 2.0, math.nan, 4.0])
    assert (s.median, s.n) == (3.0, 2)
    assert summarize([]) is None and summarize([None]) is None
    assert summarize([1.0, 2.0, 3.0]).spread == pytest.approx(1.0)
    assert harmonic_mean(2.0, 2.0) == 2.0 and harmonic_mean(1.0, 3.0) == pytest.approx(1.5)
    assert harmonic_mean(0.0, 3.0) == 0.0


def _sample(gbps: float, cpu: float = 0.1) -> Sample:
    nbytes = 1 << 30
    return Sample(
        nbytes=nbytes,
        seconds=nbytes / gbps / 1e9,
        process_cpu=cpu,
        backend_cpu=cpu / 2,
        requests=1024,
        busy_seconds=0.0,
    )


def test_point_result_aggregates_repeats_and_skips_failures() -> None:
    result = PointResult(Point("uring", MIB, 8))
    for w, r in ((2.0, 1.0), (3.0, 1.5), (1.0, 0.2)):
        result.runs.append({"write": _sample(w), "read": _sample(r, cpu=0.2)})
    result.runs.append({"error": "disk went away"})
    write, read = result.gbps("write"), result.gbps("read")
    assert (write.median, write.min, write.max, write.n) == pytest.approx((2.0, 1.0, 3.0, 3))
    assert (read.median, read.min, read.max) == pytest.approx((1.0, 0.2, 1.5))
    assert result.cpu("read").median == pytest.approx(0.2)
    assert result.backend_cpu("write").median == pytest.approx(0.05)
    data = json.loads(json.dumps(result.as_dict()))
    assert len(data["repeats"]) == 4 and data["repeats"][3] == {"error": "disk went away"}
    assert data["summary"]["write"]["gbps"]["median"] == pytest.approx(2.0)
    assert data["summary"]["write_fresh"]["gbps"] is None


def test_grid_thread_counts_never_exceed_queue_depth() -> None:
    args = bench.parse_args(
        ["--block-sizes", "1M", "--queue-depths", "1,2,8", "--thread-counts", "qd,2,4"]
    )
    points = bench.grid(args, ["uring", "threads"])
    assert [p.thread_count for p in points if p.backend == "uring"] == [None] * 3
    threads = [(p.queue_depth, p.thread_count) for p in points if p.backend == "threads"]
    assert threads == [(1, None), (2, None), (8, None), (8, 2), (8, 4)]


def test_quick_preset_and_explicit_flags() -> None:
    quick = bench.parse_args(["--quick"])
    assert quick.size == 256 * MIB and quick.repeats == 1 and not quick.interference
    assert quick.fio_block_sizes == [4 * MIB] and quick.fio_depths == [16]
    full = bench.parse_args(["--quick", "--repeats", "2", "--interference"])
    assert full.repeats == 2 and full.interference
    assert bench.parse_args([]).size == 1 << 30 and bench.parse_args([]).interference


# ------------------------------------------------------------------ recommendation and config


def _candidate(
    backend: str,
    bs: int,
    qd: int,
    read: float,
    write: float,
    cpu: float = 0.1,
    threads: int | None = None,
) -> Candidate:
    return Candidate(backend, bs, qd, threads, read, write, cpu)


def test_choose_point_prefers_speed_then_cpu_then_bytes_in_flight() -> None:
    slow = _candidate("threads", MIB, 16, 1.0, 1.0, cpu=0.01)
    fast = _candidate("uring", 4 * MIB, 16, 2.00, 2.00, cpu=0.10)
    close_cheap = _candidate("uring", MIB, 8, 1.97, 2.00, cpu=0.05)  # within the tie band
    assert choose_point([slow, fast, close_cheap]) == close_cheap
    # Outside the tie band speed wins whatever the CPU.
    assert choose_point([slow, fast, _candidate("uring", MIB, 8, 1.8, 1.8, cpu=0.01)]) == fast
    # Same speed and CPU: the larger queue, which rides out GIL stalls better.
    deep = _candidate("threads", 4 * MIB, 8, 1.97, 2.00, cpu=0.05)
    assert choose_point([close_cheap, deep]) == deep
    # A point without a read measurement cannot be recommended.
    with pytest.raises(ValueError):
        choose_point([_candidate("uring", MIB, 8, 0.0, 2.0)])


def test_choose_buffers_least_memory_regime() -> None:
    unit = 8 * MIB  # block 1M x qd 8
    by_size = {
        8 * MIB: {1: {"read": 1.0, "write": 1.5}, 2: {"read": 1.7, "write": 2.6}},
        16 * MIB: {1: {"read": 1.4, "write": 2.0}, 2: {"read": 1.95, "write": 2.95}},
        32 * MIB: {1: {"read": 1.7, "write": 2.5}, 2: {"read": 2.0, "write": 3.0}},
        64 * MIB: {1: {"read": 1.92, "write": 2.9}, 2: {"read": 2.0, "write": 3.0}},
    }
    size, count, why = choose_buffers(by_size, unit)
    # One in flight needs 64M (3 x 64M = 192M); two in flight need 16M (5 x 16M = 80M).
    assert (size, count) == (16 * MIB, 5) and "2 transfer(s)" in why
    # If single transfers are already efficient at 16M, three buffers of it are cheaper.
    by_size[16 * MIB][1] = {"read": 1.95, "write": 2.9}
    assert choose_buffers(by_size, unit)[:2] == (16 * MIB, 3)
    # Best read and best write on different sizes: each direction decides, the larger wins.
    noisy = {4 * MIB: {2: {"read": 1.0, "write": 3.0}}, 8 * MIB: {2: {"read": 2.0, "write": 2.0}}}
    assert choose_buffers(noisy, 4 * MIB)[:2] == (8 * MIB, 5)
    # Always a multiple of block_size x queue_depth, at least one full queue.
    assert choose_buffers({4 * MIB: {1: {"read": 1.0, "write": 1.0}}}, 12 * MIB)[0] == 12 * MIB
    # No sweep: a default-sized buffer, double buffered.
    size, count, _ = choose_buffers({}, 12 * MIB)
    assert size % (12 * MIB) == 0 and size >= 64 * MIB and count == 5


def test_config_round_trip_has_exactly_the_native_keys(tmp_path: Path) -> None:
    choice = _candidate("uring", MIB, 8, 2.0, 3.0)
    rec = recommend(
        [choice, _candidate("threads", MIB, 8, 1.0, 1.0)],
        {64 * MIB: {1: {"read": 2.0, "write": 3.0}}},
    )
    assert rec.candidate == choice
    target = tmp_path / "aio.json"
    sibling = write_config(target, rec.config(), {"point": vars(choice)})
    loaded = json.loads(target.read_text())
    assert loaded == {
        "aio": {"backend": "uring", "block_size": MIB, "queue_depth": 8, "thread_count": None},
        "buffer_count": 3,
        "buffer_size": 64 * MIB,
    }
    assert tuple(loaded) == CONFIG_KEYS and tuple(loaded["aio"]) == AIO_KEYS
    assert sibling == tmp_path / "aio.measured.json" and "point" in json.loads(sibling.read_text())
    # What the swap layer and the pool are built from accepts it as is.
    EngineSettings(**loaded["aio"])
    assert loaded["buffer_size"] % (loaded["aio"]["block_size"] * loaded["aio"]["queue_depth"]) == 0
    # Anything extra is refused before it reaches a strict loader.
    with pytest.raises(ValueError):
        check_config({**loaded, "_measured": {}})
    with pytest.raises(ValueError):
        check_config({**loaded, "buffer_size": 3 * MIB})
    threads = config_dict(_candidate("threads", MIB, 8, 1, 1, threads=4), 8 * MIB, 5)
    assert threads["aio"]["thread_count"] == 4


def test_config_loads_in_the_runtime(tmp_path: Path) -> None:
    config_module = pytest.importorskip("infinity.config")
    config = config_dict(_candidate("uring", 4 * MIB, 4, 2.0, 3.0), 32 * MIB, 5)
    loaded = config_module.OffloadConfig.from_dict(config)
    assert (loaded.buffer_count, loaded.buffer_size, loaded.aio.queue_depth) == (5, 32 * MIB, 4)


# ------------------------------------------------------------------ fio


def test_parse_fio_json() -> None:
    result = parse_fio_json(FIO_READ, "read")
    assert result.io_bytes == 256 * MIB
    assert result.gbps == pytest.approx(1.078054040)
    assert result.runtime_s == pytest.approx(0.249)
    assert result.cpu_s == pytest.approx((2.016129 + 4.435484) / 100 * 0.248)
    assert result.cpu_per_gib == pytest.approx(result.cpu_s * 4)
    with pytest.raises(FioError, match="no write data"):
        parse_fio_json(FIO_READ, "write")
    with pytest.raises(FioError, match="error 22"):
        parse_fio_json(FIO_READ.replace('"error" : 0', '"error" : 22'), "read")
    with pytest.raises(FioError, match="no JSON"):
        parse_fio_json("fio: engine io_uring not loadable\n", "read")


def test_fio_command_is_direct_and_sized() -> None:
    command = FioJob("read", MIB, 16, 256 * MIB).command("fio", Path("/x/fio.dat"))
    for flag in (
        "--direct=1",
        "--ioengine=io_uring",
        "--rw=read",
        f"--bs={MIB}",
        "--iodepth=16",
        f"--size={256 * MIB}",
        "--output-format=json",
        "--filename=/x/fio.dat",
        "--iomem=mmap",
    ):
        assert flag in command
    assert "--time_based" not in command
    timed = FioJob("write", MIB, 4, MIB, "libaio", runtime=1.5).command("fio", Path("f"))
    assert "--time_based" in timed and "--runtime=1500ms" in timed


# ------------------------------------------------------------------ measurements


def test_interference_probe_runs(tmp_path: Path) -> None:
    backend = choose_backend("auto", tmp_path)
    with BufferPool(2, 2 * MIB, name="test") as pool:
        fill_pattern(pool)
        result = measure_interference(Point(backend, MIB, 2), tmp_path, pool, 8 * MIB, 2, 0.02)
    for direction in ("read", "write"):
        assert result.ratio(direction).median > 0 and result.bandwidth(direction).median > 0
        # each round also ran the stream alone, and the share pairs the two of its round
        assert len(result.io_solo_gbps[direction]) == len(result.io_gbps[direction]) == 2
        assert result.shares(direction) == [
            loaded / alone
            for loaded, alone in zip(result.io_gbps[direction], result.io_solo_gbps[direction])
        ]
        for window in result.loaded[direction]:
            assert window.gil_wait is None or 0.0 <= window.gil_wait <= 1.0
    summary = result.as_dict()["summary"]["read"]
    assert summary["io_share"]["median"] > 0 and "gil_wait" in summary
    assert list(tmp_path.iterdir()) == []


def test_interference_report_gives_the_share_kept_and_the_gil_wait() -> None:
    result = InterferenceResult(Point("uring", MIB, 16))
    result.idle = [Window(100.0, 0.0, 0.0)] * 2
    for direction, alone, loaded in (("write", 4.0, 2.0), ("read", 2.0, 1.8)):
        result.io_solo_gbps[direction] = [alone]
        result.io_gbps[direction] = [loaded]
        result.loaded[direction] = [Window(90.0, 0.0, 0.05)]
    lines = summary_lines({}, {}, "no fio", {}, [result], None, None)
    (line,) = [line for line in lines if line.strip().startswith("uring")]
    assert "write 0.90 [0.90 on-CPU, GIL 5%] at 2.00 GB/s (50% of 4.00 alone!)" in line
    assert "read 0.90 [0.90 on-CPU, GIL 5%] at 1.80 GB/s (90% of 2.00 alone)" in line


def test_cli_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "data"
    data.mkdir()
    backend = choose_backend("auto", data)
    # Without fio the bench would try to install it, which a unit test must not do.
    fio = [] if shutil.which("fio") else ["--no-fio"]
    out = tmp_path / "out.json"
    config = tmp_path / "aio.json"
    plot = tmp_path / "bench.png"
    code = bench.main(
        [
            "--path",
            str(data),
            "--size",
            "8M",
            "--backends",
            backend,
            "--block-sizes",
            "1M",
            "--queue-depths",
            "2",
            "--thread-counts",
            "qd",
            "--repeats",
            "1",
            "--buffers",
            "2",
            "--buffer-size",
            "4M",
            "--fio-block-sizes",
            "1M",
            "--fio-depths",
            "2",
            "--sweep-limit",
            "4M",
            "--no-interference",
            "--no-progress",
            "--json",
            str(out),
            "--write-config",
            str(config),
            "--plot",
            str(plot),
            *fio,
        ]
    )
    assert code == 0
    stdout = capsys.readouterr().out
    assert "Swap engine, GB/s" in stdout and "Summary (medians)" in stdout
    assert f"{backend:<9}    1M   2" in stdout
    report = json.loads(out.read_text())
    assert len(report["points"]) == 1
    point = report["points"][0]
    assert (point["backend"], point["block_size"], point["queue_depth"]) == (backend, MIB, 2)
    assert len(point["repeats"]) == 1 and "error" not in point["repeats"][0]
    for direction in ("write", "read"):
        assert point["summary"][direction]["gbps"]["median"] > 0
        assert point["repeats"][0][direction]["nbytes"] == 8 * MIB
    assert report["fio"]["jobs"] or report["fio"]["note"]
    assert report["leftover_files"] == []
    assert report["machine"]["cpu_count"] >= 1
    baseline = report["aiofiles"]
    assert baseline["available"] and baseline["block_size"] == MIB and baseline["size"] == 8 * MIB
    for direction in ("write", "read"):
        assert baseline["summary"][direction]["gbps"] > 0
        assert baseline["summary"][direction]["cpu_s_per_gib"] > 0
        assert baseline["ratio"][direction] > 0
    assert "  aiofiles  write " in stdout and "ours/aiofiles write " in stdout
    assert set(json.loads(config.read_text())) == set(CONFIG_KEYS)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert list(data.iterdir()) == []  # swap run dir, fio's and aiofiles' files are gone


def test_aiofiles_baseline_missing_and_cleanup(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("aiofiles")
    entry = aiofiles_baseline.measure(tmp_path, 2 * MIB, 256 << 10, 2)
    assert entry["available"] and len(entry["repeats"]) == 2 and not entry["note"]
    assert entry["repeats"][0]["read"]["nbytes"] == 2 * MIB
    assert list(tmp_path.iterdir()) == []
    lines = aiofiles_lines({"uring": {"read": {"gbps": 1.0}}}, entry)
    assert lines[0].startswith("  aiofiles  write ") and "8 outstanding" in lines[1]
    monkeypatch.setitem(sys.modules, "aiofiles", None)  # import fails as if not installed
    entry = aiofiles_baseline.measure(tmp_path, 2 * MIB, 256 << 10, 1)
    assert not entry["available"] and entry["repeats"] == []
    assert aiofiles_lines({}, entry) == ["  aiofiles not installed (pip install aiofiles)"]


def test_overlap_benchmark_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A tiny run of the overlap benchmark (`make bench` runs the full one): every config runs
    in its own process, and the NVMe runs (updates in the step, and in backward) really swap
    (the arena holds a fraction of the state)."""
    from tools.benchmarks import bench_overlap

    out = tmp_path / "overlap.json"
    assert (
        bench_overlap.main(
            [
                "--layers",
                "4",
                "--width",
                "256",
                "--batch",
                "4",
                "--steps",
                "2",
                "--warmup",
                "1",
                "--repeats",
                "1",
                "--host-budget",
                "0.0345",
                "--arena",
                "0.003",
                "--device-budget",
                "0.001",
                "--buffer-size",
                str(256 << 10),
                "--nvme-path",
                str(tmp_path),
                "--json",
                str(out),
            ]
        )
        == 0
    )
    report = json.loads(out.read_text())
    assert set(report["runs"]) == {"plain", "fits", "nvme@0.00", "nvme+sib@0.00"}
    for name in ("nvme@0.00", "nvme+sib@0.00"):
        nvme = report["runs"][name][0]
        assert nvme["read_bytes"] > 0 and nvme["write_bytes"] > 0, name
        assert len(nvme["phases_s"]) == 3, name
        efficiency = report["summary"][name]["efficiency"]
        assert 0 < efficiency < math.inf
    # The optimizer step takes time of its own only where it runs the updates.
    assert all(p > 0 for p in report["runs"]["nvme@0.00"][0]["phases_s"])
    printed = capsys.readouterr().out
    assert "overlap efficiency" in printed and "median seconds per phase" in printed
