"""Checksums and tags: a read returns the bytes last written there with the tag it asks for, or
fails with IntegrityError saying what the bytes are instead.

The two benchmarks at the end are skipped unless SWAP_BENCH=1; run them with ``SWAP_BENCH=1
PYTHONPATH=. .venv/bin/python -m pytest -q -s tests/test_swap_integrity.py -k bench``.
"""

from __future__ import annotations

import json
import os
import statistics
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import swap.integrity
from swap import (
    ALIGNMENT,
    BufferPool,
    FaultInjectingBackend,
    IntegrityError,
    SwapConfigError,
    SwapIOError,
    choose_backend,
    make_backend,
)
from swap.integrity import describe, tag_key, verify_sidecar
from tests.conftest import REAL_BACKENDS, contents, fill, random_bytes

TIMEOUT = 10
BLOCK = 64 << 10
SIZE = 4 * BLOCK + 1000  # four whole chunks and a short tail chunk


@pytest.fixture
def pool():
    with BufferPool(4, SIZE) as p:
        yield p


def patch_file(path: Path, offset: int, data: bytes) -> None:
    """Changes swap-file bytes behind the engine's back (through the page cache; O_DIRECT reads
    write dirty cached pages back first, so the engine sees the change)."""
    with open(path, "r+b") as handle:
        handle.seek(offset)
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def read_file(path: Path, offset: int, length: int) -> bytes:
    with open(path, "rb") as handle:
        handle.seek(offset)
        return handle.read(length)


def written(engine, pool, size: int = SIZE, seed: int = 1, tag=None):
    extent = engine.allocate(size)
    buffer = pool.acquire()
    data = random_bytes(size, seed)
    fill(buffer, data)
    engine.write(extent, buffer, tag=tag).result(TIMEOUT)
    pool.release(buffer)
    return extent, data


@pytest.mark.parametrize("backend", REAL_BACKENDS)
def test_flipped_byte_fails_the_read_naming_file_offset_and_extent(
    make_engine, disk_dir, pool, backend
):
    engine = make_engine(disk_dir, backend, block_size=BLOCK)
    engine.allocate(ALIGNMENT)  # the extent under test does not start at offset 0
    extent, data = written(engine, pool, tag=("w", 3))
    segment = extent.segments[0]
    at = segment.offset + 2 * BLOCK + 777  # inside chunk 2
    old = read_file(segment.file.path, at, 1)
    patch_file(segment.file.path, at, bytes([old[0] ^ 0x10]))
    sink = pool.acquire()
    with pytest.raises(IntegrityError) as info:
        engine.read(extent, sink, tag=("w", 3)).result(TIMEOUT)
    error = info.value
    assert error.path == segment.file.path and error.offset == segment.offset + 2 * BLOCK
    assert error.extent == extent.serial and error.expected == ["w", 3]
    text = str(error)
    assert f"extent #{extent.serial}" in text and str(segment.file.path) in text
    assert f"offset {segment.offset + 2 * BLOCK}" in text and "chunk 2" in text
    assert "shard w version 3" in text and "matches nothing this engine wrote" in text
    assert engine.stats().integrity_errors == 1
    # put the byte back: the same read now verifies
    patch_file(segment.file.path, at, old)
    engine.read(extent, sink, tag=("w", 3)).result(TIMEOUT)
    assert torch.equal(contents(sink, SIZE), data)


def test_truncated_file_is_a_short_read_not_wrong_bytes(make_engine, disk_dir, pool):
    engine = make_engine(disk_dir, "threads", block_size=BLOCK)
    extent, _ = written(engine, pool, tag="t")
    segment = extent.segments[0]
    os.truncate(segment.file.path, segment.offset + BLOCK)
    with pytest.raises(SwapIOError, match="shorter than the extent") as info:
        engine.read(extent, pool.acquire(), tag="t").result(TIMEOUT)
    # requests run in parallel: any request past the new end may be the one reported
    assert info.value.path == segment.file.path and info.value.offset >= segment.offset + BLOCK
    assert (info.value.offset - segment.offset) % BLOCK == 0


@pytest.mark.parametrize("backend", REAL_BACKENDS)
def test_write_that_did_not_land_is_a_stale_extent(make_engine, disk_dir, pool, backend):
    try:
        faults = FaultInjectingBackend(make_backend(choose_backend(backend, disk_dir), 8))
    except SwapConfigError as exc:
        pytest.skip(f"{backend} unavailable here: {exc}")
    engine = make_engine(disk_dir, backend, io=faults, block_size=BLOCK)
    extent, v1 = written(engine, pool, tag={"shard": "layer.0", "version": 1})
    source = pool.acquire()
    fill(source, random_bytes(SIZE, 2))
    faults.inject("drop", op="write", times=None)  # every request reports success, none lands
    engine.write(extent, source, tag={"shard": "layer.0", "version": 2}).result(TIMEOUT)
    faults.clear()
    sink = pool.acquire()
    with pytest.raises(IntegrityError) as info:
        engine.read(extent, sink, tag={"shard": "layer.0", "version": 2}).result(TIMEOUT)
    text = str(info.value)
    assert "holds the bytes of shard layer.0 version 1, this extent's previous write" in text
    assert "did not land (stale extent)" in text and "shard layer.0 version 2" in text
    # every chunk is stale; chunks are verified in parallel, so any may be the one reported
    chunk, rest = divmod(info.value.offset - extent.segments[0].offset, BLOCK)
    assert rest == 0 and 0 <= chunk <= SIZE // BLOCK and f"chunk {chunk})" in text


def test_swapped_extents_are_named(make_engine, disk_dir, pool):
    engine = make_engine(disk_dir, "threads", block_size=BLOCK)
    a, _ = written(engine, pool, size=BLOCK, seed=1, tag=("a", 1))
    b, _ = written(engine, pool, size=BLOCK, seed=2, tag=("b", 7))
    sa, sb = a.segments[0], b.segments[0]
    bytes_a, bytes_b = (
        read_file(sa.file.path, sa.offset, BLOCK),
        read_file(sb.file.path, sb.offset, BLOCK),
    )
    patch_file(sa.file.path, sa.offset, bytes_b)
    patch_file(sb.file.path, sb.offset, bytes_a)
    sink = pool.acquire()
    with pytest.raises(
        IntegrityError,
        match=rf"holds the bytes of shard b version 7 \(extent "
        rf"#{b.serial}, chunk 0\): extents swapped or stale",
    ):
        engine.read(a, sink, tag=("a", 1)).result(TIMEOUT)
    with pytest.raises(IntegrityError, match=rf"shard a version 1 \(extent #{a.serial}"):
        engine.read(b, sink, tag=("b", 7)).result(TIMEOUT)


def test_striped_extent_names_the_right_drive(make_engine, tmp_path, pool):
    dirs = [tmp_path / "d0", tmp_path / "d1"]
    for d in dirs:
        d.mkdir()
    engine = make_engine(dirs, "buffered", block_size=BLOCK)
    extent, _ = written(engine, pool, tag="s")
    assert len(extent.segments) == 2
    chunk3 = extent.segments[1]  # stripe units alternate: chunk 3 is the second unit of drive 1
    patch_file(chunk3.file.path, chunk3.offset + BLOCK, b"\0" * 16)
    with pytest.raises(IntegrityError) as info:
        engine.read(extent, pool.acquire(), tag="s").result(TIMEOUT)
    assert info.value.path == chunk3.file.path and info.value.offset == chunk3.offset + BLOCK
    assert "chunk 3" in str(info.value)


# -- chunks of several requests (the default: one checksum per 64 MiB) ---------------------------

WIDE = 2 * BLOCK  # a chunk of two requests: SIZE is chunks 0 and 1 whole, then a short tail


@pytest.mark.parametrize("backend", REAL_BACKENDS)
def test_chunks_of_several_requests_round_trip_and_catch_a_flipped_byte(
    make_engine, disk_dir, pool, backend
):
    engine = make_engine(disk_dir, backend, block_size=BLOCK, checksum_chunk=WIDE)
    assert engine.settings.chunk_size == WIDE
    extent, data = written(engine, pool, tag="w")
    sink = pool.acquire()
    engine.read(extent, sink, tag="w").result(TIMEOUT)
    assert torch.equal(contents(sink, SIZE), data)
    segment = extent.segments[0]
    patch_file(segment.file.path, segment.offset + 3 * BLOCK + 7, b"\x5a")  # chunk 1, request 4
    with pytest.raises(IntegrityError, match="chunk 1") as info:
        engine.read(extent, sink, tag="w").result(TIMEOUT)
    # Named by the chunk's first byte: the checksum covers the chunk, not one request.
    assert info.value.offset == segment.offset + WIDE
    assert f"extent bytes [{WIDE}, {2 * WIDE})" in str(info.value)


def test_a_chunk_striped_over_two_drives_is_hashed_once_all_of_it_arrived(
    make_engine, tmp_path, pool
):
    dirs = [tmp_path / "d0", tmp_path / "d1"]
    for d in dirs:
        d.mkdir()
    engine = make_engine(dirs, "threads", block_size=BLOCK, checksum_chunk=WIDE)
    extent, data = written(engine, pool, tag="s")
    sink = pool.acquire()
    engine.read(extent, sink, tag="s").result(TIMEOUT)
    assert torch.equal(contents(sink, SIZE), data)
    second = extent.segments[1]  # stripe units alternate: every chunk spans both drives
    patch_file(second.file.path, second.offset + 5, b"\0\0")
    with pytest.raises(IntegrityError, match="chunk 0"):
        engine.read(extent, sink, tag="s").result(TIMEOUT)


def test_short_transfers_inside_a_chunk_are_continued_before_it_is_hashed(
    make_engine, disk_dir, pool
):
    faults = FaultInjectingBackend(make_backend("threads", 8), seed=3)
    engine = make_engine(disk_dir, "threads", io=faults, block_size=BLOCK, checksum_chunk=WIDE)
    extent, data = written(engine, pool, tag="t")
    faults.inject("short", "read", times=3)
    sink = pool.acquire()
    engine.read(extent, sink, tag="t").result(TIMEOUT)
    assert faults.injected["short"] == 3 and engine.stats().retries >= 3
    assert torch.equal(contents(sink, SIZE), data)


def test_partial_ranges_verify_the_wide_chunks_they_cover(make_engine, disk_dir, pool):
    engine = make_engine(disk_dir, "threads", block_size=BLOCK, checksum_chunk=WIDE)
    extent, data = written(engine, pool, tag="p")
    segment = extent.segments[0]
    patch_file(segment.file.path, segment.offset + WIDE + 10, b"\xff")  # chunk 1
    sink = pool.acquire()
    with pytest.raises(IntegrityError, match="chunk 1"):  # covers chunk 1 whole
        engine.read(extent, sink, extent_offset=ALIGNMENT, nbytes=2 * WIDE - ALIGNMENT).result(
            TIMEOUT
        )
    # one request of chunk 1 only: not checkable against the chunk's checksum
    engine.read(extent, sink, extent_offset=WIDE, nbytes=BLOCK).result(TIMEOUT)
    engine.read(extent, sink, nbytes=WIDE, tag="p").result(TIMEOUT)  # chunk 0 is clean
    assert torch.equal(contents(sink, WIDE), data[:WIDE])


def test_checksum_chunk_defaults_to_64_mib_on_the_block_grid(make_engine, disk_dir, pool):
    from swap import EngineSettings

    assert EngineSettings(block_size=BLOCK).chunk_size == 64 << 20
    assert EngineSettings(block_size=3 << 22).chunk_size == 6 * (3 << 22)  # 64 MiB, rounded up
    assert EngineSettings(block_size=BLOCK, checksum_chunk=100 << 10).chunk_size == 2 * BLOCK
    for bad in (0, -1, 1.5, True):
        with pytest.raises(SwapConfigError, match="checksum_chunk"):
            EngineSettings(checksum_chunk=bad)
    engine = make_engine(disk_dir, "threads", block_size=BLOCK, checksum_chunk=None)
    extent, data = written(engine, pool, tag="d")  # one chunk: the whole extent
    segment = extent.segments[0]
    patch_file(segment.file.path, segment.offset + SIZE - 3, b"\x01")
    with pytest.raises(IntegrityError, match="chunk 0"):
        engine.read(extent, pool.acquire(), tag="d").result(TIMEOUT)


def test_tags_and_records_are_checked_before_any_io(make_engine, disk_dir, pool):
    engine = make_engine(disk_dir, "threads", block_size=BLOCK)
    extent, data = written(engine, pool, tag=(5, 2))
    sink = pool.acquire()
    requests = engine.stats().read_requests
    with pytest.raises(
        IntegrityError,
        match="expects shard 5 version 3, but the last write there was shard 5 version 2",
    ):
        engine.read(extent, sink, tag=(5, 3)).result(TIMEOUT)
    fresh = engine.allocate(BLOCK)
    with pytest.raises(IntegrityError, match="no write to it was recorded"):
        engine.read(fresh, sink, tag=(6, 1)).result(TIMEOUT)
    assert engine.stats().read_requests == requests  # refused without touching the disk
    engine.read(fresh, sink).result(TIMEOUT)  # untagged and unrecorded: a raw read
    engine.read(extent, sink, tag=[5, 2]).result(TIMEOUT)  # a list equals the tuple
    engine.read(extent, sink).result(TIMEOUT)  # no tag: checksums only
    assert torch.equal(contents(sink, SIZE), data)
    with pytest.raises(TypeError, match="JSON"):
        engine.write(extent, sink, tag=object())
    with pytest.raises(ValueError, match="characters"):
        engine.write(extent, sink, tag="x" * 600)


def test_partial_ranges_verify_the_chunks_they_cover(make_engine, disk_dir, pool):
    engine = make_engine(disk_dir, "threads", block_size=BLOCK)
    extent, data = written(engine, pool, tag="p")
    segment = extent.segments[0]
    patch_file(segment.file.path, segment.offset + BLOCK + 10, b"\xff\x00\xff")  # chunk 1
    sink = pool.acquire()
    # covers chunk 1 entirely: verified
    with pytest.raises(IntegrityError, match="chunk 1"):
        engine.read(extent, sink, extent_offset=ALIGNMENT, nbytes=2 * BLOCK).result(TIMEOUT)
    # covers chunk 1 in part only: cannot be checked against a whole-chunk checksum
    engine.read(extent, sink, extent_offset=BLOCK, nbytes=BLOCK // 2).result(TIMEOUT)
    # chunks 2.. are clean
    engine.read(extent, sink, extent_offset=2 * BLOCK, nbytes=SIZE - 2 * BLOCK, tag="p").result(
        TIMEOUT
    )
    assert torch.equal(contents(sink, SIZE - 2 * BLOCK), data[2 * BLOCK :])
    # a partial write records the chunks it covers and leaves the half-covered one unknown
    source = pool.acquire()
    fill(source, data[BLOCK : 3 * BLOCK - ALIGNMENT])
    engine.write(
        extent, source, extent_offset=BLOCK, nbytes=2 * BLOCK - ALIGNMENT, tag="p2"
    ).result(TIMEOUT)
    engine.read(extent, sink, tag="p2").result(TIMEOUT)
    assert torch.equal(contents(sink, SIZE), data)


def test_sidecar_is_json_and_checks_the_kept_files(make_engine, disk_dir, pool):
    engine = make_engine(disk_dir, "threads", block_size=BLOCK, keep_files=True)
    extent, _ = written(engine, pool, tag={"shard": 9, "version": 4})
    run_dir = engine.space.run_dirs[0]
    segment = extent.segments[0]
    engine.close()
    sidecar = run_dir / "integrity.json"
    data = json.loads(sidecar.read_text())
    [entry] = data["extents"]
    assert data["algorithm"] == "xxh3_64" and data["chunk_size"] == BLOCK
    assert entry["tag"] == {"shard": 9, "version": 4} and len(entry["chunks"]) == 5
    assert entry["segments"][0]["file"] == str(segment.file.path)
    assert verify_sidecar(sidecar) == []
    patch_file(segment.file.path, segment.offset + 5, b"\x42")
    [problem] = verify_sidecar(sidecar)
    assert f"extent #{extent.serial} chunk 0" in problem


def test_checksums_run_on_io_threads_not_the_caller(make_engine, disk_dir, pool, monkeypatch):
    threads: set[str] = set()
    real = swap.integrity.checksum

    def spy(data, release_gil=False):
        threads.add((threading.current_thread().name, release_gil))
        return real(data, release_gil)

    monkeypatch.setattr(swap.integrity, "checksum", spy)
    engine = make_engine(disk_dir, "threads", block_size=BLOCK)
    extent, _ = written(engine, pool, tag="x")
    engine.read(extent, pool.acquire(), tag="x").result(TIMEOUT)
    # Every chunk on the engine's hasher thread, in calls that release the GIL.
    assert threads == {("swap-hash", True)}
    assert engine.stats().checksum_seconds > 0


def test_verification_off_costs_nothing_and_checks_nothing(
    make_engine, disk_dir, pool, monkeypatch
):
    def forbidden(*args, **kwargs):
        raise AssertionError("checksum computed with verify_checksums off")

    monkeypatch.setattr(swap.integrity, "checksum", forbidden)
    engine = make_engine(disk_dir, "threads", block_size=BLOCK, verify_checksums=False)
    extent, data = written(engine, pool, tag=("x", 1))
    segment = extent.segments[0]
    patch_file(segment.file.path, segment.offset, b"\x00\x01")
    sink = pool.acquire()
    engine.read(extent, sink, tag=("x", 99)).result(TIMEOUT)  # wrong tag, flipped bytes: no error
    assert bytes(sink.array[:2]) == b"\x00\x01"
    assert torch.equal(contents(sink, SIZE)[2:], data[2:])
    stats = engine.stats()
    assert stats.checksum_seconds == 0 and stats.integrity_errors == 0 and stats.errors == 0


def test_describe_and_tag_key():
    assert tag_key((1, 2)) == tag_key([1, 2]) == "[1,2]" and tag_key(None) is None
    assert tag_key({"b": 1, "a": 2}) == '{"a":2,"b":1}'
    assert describe(tag_key(("w", 3))) == "shard w version 3"
    assert describe(tag_key({"shard": "x", "version": 2})) == "shard x version 2"
    assert describe(tag_key("plain")) == "plain" and describe(None) == "untagged data"


# -- benchmarks (SWAP_BENCH=1) ------------------------------------------------------------------
bench = pytest.mark.skipif(not os.environ.get("SWAP_BENCH"), reason="benchmark: set SWAP_BENCH=1")


@bench
def test_bench_checksum_speed():
    """GB/s of crc32c (hardware CRC32C) and xxh3_64 on 64 MiB and 1 MiB buffers."""
    import crc32c
    import xxhash

    print(f"\ncrc32c hardware_based={crc32c.hardware_based}")
    data = np.random.default_rng(0).integers(0, 256, 64 << 20, dtype=np.uint8)
    for size, reps in ((64 << 20, 15), (1 << 20, 600)):
        view = memoryview(data[:size])
        for name, fn in (("crc32c", crc32c.crc32c), ("xxh3_64", xxhash.xxh3_64_intdigest)):
            times = []
            for _ in range(reps):
                started = time.perf_counter()
                fn(view)
                times.append(time.perf_counter() - started)
            print(
                f"{name:8s} {size >> 20:3d} MiB: {size / statistics.median(times) / 1e9:6.1f} "
                f"GB/s (best {size / min(times) / 1e9:.1f})"
            )


@bench
def test_bench_verification_cost(make_engine, disk_dir):
    """1 GiB read through the engine (threads and uring), verify on vs off, interleaved."""
    total, chunk = 1 << 30, 64 << 20
    for backend in ("uring", "threads"):
        engines = {
            v: make_engine(
                disk_dir,
                backend,
                block_size=1 << 20,
                queue_depth=8,
                file_size=total,
                verify_checksums=v,
            )
            for v in (True, False)
        }
        with BufferPool(1, chunk) as pool:
            buffer = pool.acquire()
            buffer.array[:] = np.random.default_rng(1).integers(0, 256, chunk, dtype=np.uint8)
            extents = {}
            for verify, engine in engines.items():
                extents[verify] = [engine.allocate(chunk) for _ in range(total // chunk)]
                for i, extent in enumerate(extents[verify]):
                    engine.write(extent, buffer, tag=i).result(120)
            times: dict[bool, list[float]] = {True: [], False: []}
            hashing: list[float] = []
            for _ in range(int(os.environ.get("SWAP_BENCH_REPEATS", "5"))):
                for verify in (True, False):
                    engine = engines[verify]
                    before = engine.stats().checksum_seconds
                    started = time.perf_counter()
                    for i, extent in enumerate(extents[verify]):
                        engine.read(extent, buffer, tag=i if verify else None).result(120)
                    times[verify].append(time.perf_counter() - started)
                    if verify:
                        hashing.append(engine.stats().checksum_seconds - before)
        on, off = statistics.median(times[True]), statistics.median(times[False])
        print(
            f"\n{backend}: 1 GiB read, verify on {on:.3f} s ({total / on / 1e9:.2f} GB/s), off "
            f"{off:.3f} s ({total / off / 1e9:.2f} GB/s): wall cost {(on - off) / off:+.1%}; "
            f"hashing {statistics.median(hashing):.3f} s of thread time "
            f"({statistics.median(hashing) / off:.1%} of the read time); runs on "
            f"{[round(t, 3) for t in times[True]]} off {[round(t, 3) for t in times[False]]}"
        )


@pytest.mark.parametrize(
    "nbytes", [0, 1, 4096, (60 << 10) - 1, 60 << 10, (60 << 10) + 1, 1 << 20, (4 << 20) + 12288]
)
def test_checksum_in_slices_equals_the_one_shot_hash(nbytes):
    import xxhash

    from swap.integrity import checksum

    data = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)
    assert checksum(data) == xxhash.xxh3_64_intdigest(data.tobytes())
    assert checksum(memoryview(data)) == checksum(torch.from_numpy(data).numpy())
