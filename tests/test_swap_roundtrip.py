"""Bytes written through the engine come back bit-equal, on every backend, for every dtype,
size and range shape, with many transfers in flight and extents striped over directories."""

from __future__ import annotations

import os
from concurrent.futures import wait

import pytest
import torch

from swap import ALIGNMENT, BufferPool, align_up
from tests.conftest import REAL_BACKENDS, contents, fill, random_bytes

DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.complex64,
    torch.complex128,
]
DTYPES += [
    getattr(torch, name)
    for name in (
        "complex32",
        "uint16",
        "uint32",
        "uint64",
        "float8_e4m3fn",
        "float8_e5m2",
        "float8_e4m3fnuz",
        "float8_e5m2fnuz",
        "float8_e8m0fnu",
    )
    if hasattr(torch, name)
]


@pytest.fixture(params=REAL_BACKENDS)
def engine(request, make_engine, disk_dir):
    return make_engine(disk_dir, request.param, block_size=16 << 10)


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype_round_trips_bit_equal(engine, pool, dtype):
    itemsize = torch.empty((), dtype=dtype).element_size()
    numel = 5003  # odd: the byte count is not a multiple of 4096 for any item size
    raw = random_bytes(numel * itemsize, seed=itemsize)
    if dtype is torch.bool:
        raw &= 1  # a bool byte other than 0/1 is not a valid bool
    values = raw.view(dtype)
    extent = engine.allocate(raw.numel())
    buffer = pool.acquire()
    buffer.view(dtype, numel).copy_(values)
    assert engine.write_sync(extent, buffer) == raw.numel()
    buffer.array[:] = 0xEE
    assert engine.read_sync(extent, buffer) == raw.numel()
    back = buffer.view(dtype, numel)
    assert back.dtype == dtype
    assert torch.equal(back.view(torch.uint8), raw)
    buffer.release()
    engine.free(extent)


SIZES = [
    1,
    2,
    4095,
    4096,
    4097,
    7919,
    65521,
    (16 << 10) + 1,
    5 * (16 << 10) - 1,
    7 * (16 << 10) + 4099,
]


@pytest.mark.parametrize("backend", REAL_BACKENDS)
def test_awkward_sizes_over_three_directories(make_engine, tmp_path, backend):
    dirs = [tmp_path / name for name in "abc"]
    for d in dirs:
        d.mkdir()
    engine = make_engine(dirs, backend, block_size=16 << 10, queue_depth=2)
    with BufferPool(1, 256 << 10) as pool:
        buffer = pool.acquire()
        for seed, size in enumerate(SIZES):
            data = random_bytes(size, seed)
            extent = engine.allocate(size)
            fill(buffer, data)
            buffer.array[size : align_up(size)] = 0x77  # padding the write must zero
            assert engine.write_sync(extent, buffer) == size
            assert not buffer.array[size : align_up(size)].any()
            buffer.array[:] = 0x55
            assert engine.read_sync(extent, buffer) == size
            assert torch.equal(contents(buffer, size), data), size
            # the read overwrote the padded span with the extent's (zero) padding
            assert not buffer.array[size : align_up(size)].any()
            assert (buffer.array[align_up(size) :] == 0x55).all()
            engine.free(extent)
        buffer.release()


def test_zero_byte_transfers(make_engine, disk_dir, pool):
    engine = make_engine(disk_dir)
    extent = engine.allocate(0)
    buffer = pool.acquire()
    assert engine.write(extent, buffer).result(timeout=5) == 0
    assert engine.read_sync(extent, buffer) == 0
    assert engine.stats().write_transfers == 1


@pytest.mark.parametrize("backend", REAL_BACKENDS)
def test_extents_ending_exactly_at_end_of_file(make_engine, disk_dir, pool, backend):
    engine = make_engine(disk_dir, backend, file_size=4 * ALIGNMENT)
    first = engine.allocate(2 * ALIGNMENT + 1)  # 3 pages
    second = engine.allocate(ALIGNMENT - 5)  # the 4th page: ends at the end of the file
    big = engine.allocate(6 * ALIGNMENT + 3)  # larger than file_size: a file of its own
    seg, seg2, seg3 = first.segments[0], second.segments[0], big.segments[0]
    assert seg.file is seg2.file
    assert seg2.offset + seg2.length == seg2.file.capacity == os.fstat(seg2.file.fd).st_size
    assert seg3.file is not seg.file and seg3.offset + seg3.length == seg3.file.capacity
    buffers = [pool.acquire() for _ in range(3)]
    data = [random_bytes(e.nbytes, i) for i, e in enumerate((first, second, big))]
    for extent, buffer, payload in zip((first, second, big), buffers, data):
        fill(buffer, payload)
        engine.write_sync(extent, buffer)
    for extent, buffer, payload in zip((first, second, big), buffers, data):
        buffer.array[:] = 0
        engine.read_sync(extent, buffer)
        assert torch.equal(contents(buffer, extent.nbytes), payload)


@pytest.mark.parametrize("backend", REAL_BACKENDS)
def test_partial_ranges(make_engine, disk_dir, backend):
    engine = make_engine(disk_dir, backend, block_size=8 << 10)
    size = 10 * ALIGNMENT + 123
    extent = engine.allocate(size)
    expected = random_bytes(size, 1)
    with BufferPool(2, 64 << 10) as pool:
        a, b = pool.acquire(), pool.acquire()
        fill(a, expected)
        engine.write_sync(extent, a)
        # overwrite pages 2..4 from the middle of another buffer
        patch = random_bytes(3 * ALIGNMENT, 2)
        fill(b, patch, offset=ALIGNMENT)
        engine.write_sync(
            extent, b, extent_offset=2 * ALIGNMENT, buffer_offset=ALIGNMENT, nbytes=3 * ALIGNMENT
        )
        expected[2 * ALIGNMENT : 5 * ALIGNMENT] = patch
        # overwrite the unaligned tail
        tail = random_bytes(ALIGNMENT + 123, 3)
        fill(b, tail, offset=2 * ALIGNMENT)
        engine.write(extent, b, extent_offset=9 * ALIGNMENT, buffer_offset=2 * ALIGNMENT).result(5)
        expected[9 * ALIGNMENT :] = tail
        # whole extent
        b.array[:] = 0
        engine.read_sync(extent, b)
        assert torch.equal(contents(b, size), expected)
        # ranges read into offsets of a buffer
        for ext_off, buf_off, nbytes in [
            (0, 0, 1),
            (ALIGNMENT, 3 * ALIGNMENT, 2 * ALIGNMENT),
            (4 * ALIGNMENT, ALIGNMENT, 4097),
            (9 * ALIGNMENT, 0, ALIGNMENT + 123),
            (10 * ALIGNMENT, 8 * ALIGNMENT, 100),
        ]:
            b.array[:] = 0xAB
            assert (
                engine.read_sync(
                    extent, b, extent_offset=ext_off, buffer_offset=buf_off, nbytes=nbytes
                )
                == nbytes
            )
            assert torch.equal(contents(b, nbytes, buf_off), expected[ext_off : ext_off + nbytes])
            assert (b.array[:buf_off] == 0xAB).all()  # nothing before the range was touched


def test_range_checks(make_engine, disk_dir, pool):
    engine = make_engine(disk_dir)
    extent = engine.allocate(3 * ALIGNMENT + 10)
    buffer = pool.acquire()
    with pytest.raises(ValueError, match="multiples"):
        engine.read(extent, buffer, extent_offset=100)
    with pytest.raises(ValueError, match="multiples"):
        engine.read(extent, buffer, buffer_offset=10)
    with pytest.raises(ValueError, match="outside"):
        engine.read(extent, buffer, extent_offset=ALIGNMENT, nbytes=3 * ALIGNMENT + 11)
    with pytest.raises(ValueError, match="does not fit"):
        engine.read(extent, buffer, buffer_offset=buffer.nbytes - ALIGNMENT)
    with pytest.raises(ValueError, match="must end at the extent's end"):
        engine.write(extent, buffer, nbytes=100)  # would zero bytes 100..4095 of the extent
    with pytest.raises(TypeError):
        engine.read_sync(extent, buffer, offset=0)
    engine.free(extent)
    with pytest.raises(ValueError, match="not allocated"):
        engine.read(extent, buffer)  # use after free


@pytest.mark.parametrize("backend", REAL_BACKENDS)
def test_dozens_of_concurrent_transfers(make_engine, tmp_path, backend):
    dirs = [tmp_path / name for name in "xyz"]
    for d in dirs:
        d.mkdir()
    engine = make_engine(dirs, backend, block_size=8 << 10, queue_depth=3, file_size=256 << 10)
    sizes = [3 * ALIGNMENT + 7, 40000, 8 << 10, 65536, 1, 12345, 50001, 30000]
    with BufferPool(len(sizes), 64 << 10) as pool:
        extents = [engine.allocate(size) for size in sizes]
        buffers = [pool.acquire() for _ in sizes]
        data = [random_bytes(size, 10 + i) for i, size in enumerate(sizes)]
        futures = []
        for extent, buffer, payload in zip(extents, buffers, data):
            fill(buffer, payload)
            # each extent in aligned chunks, every chunk its own transfer
            for start in range(0, extent.nbytes, 2 * ALIGNMENT):
                futures.append(
                    engine.write(
                        extent,
                        buffer,
                        extent_offset=start,
                        buffer_offset=start,
                        nbytes=min(2 * ALIGNMENT, extent.nbytes - start),
                    )
                )
        assert len(futures) >= 24
        done, not_done = wait(futures, timeout=30)
        assert not not_done
        assert all(f.result() > 0 for f in futures)
        for buffer in buffers:
            buffer.array[:] = 0
        futures = [engine.read(e, b) for e, b in zip(extents, buffers)]
        futures += [engine.read(e, b) for e, b in zip(extents, buffers)]  # same again, racing
        assert [f.result(timeout=30) for f in futures] == sizes + sizes
        for buffer, payload in zip(buffers, data):
            assert torch.equal(contents(buffer, payload.numel()), payload)
        assert engine.stats().inflight_peak <= 3 * 3


@pytest.mark.parametrize("count", [2, 3])
def test_striping_puts_bytes_in_every_directory(make_engine, tmp_path, count):
    dirs = [tmp_path / f"d{i}" for i in range(count)]
    for d in dirs:
        d.mkdir()
    stripe = 8 << 10
    engine = make_engine(dirs, "threads", block_size=stripe, file_size=256 << 10)
    size = 10 * stripe + 5
    extent = engine.allocate(size)
    assert len(extent.segments) == count
    assert {s.file.path.parent.parent for s in extent.segments} == set(dirs)
    data = random_bytes(size, 7)
    with BufferPool(1, 128 << 10) as pool:
        buffer = pool.acquire()
        fill(buffer, data)
        engine.write_sync(extent, buffer)
        # every piece sits where locate says, in the file of its directory
        padded = align_up(size)
        expected = torch.zeros(padded, dtype=torch.uint8)
        expected[:size] = data
        seen = set()
        for file, file_offset, ext_offset, length in extent.locate(0, padded):
            with open(file.path, "rb") as handle:
                handle.seek(file_offset)
                on_disk = torch.frombuffer(bytearray(handle.read(length)), dtype=torch.uint8)
            assert torch.equal(on_disk, expected[ext_offset : ext_offset + length])
            seen.add(file.path.parent.parent)
        assert seen == set(dirs)
        for d in dirs:
            (run_dir,) = d.iterdir()
            assert any(f.stat().st_size and f.read_bytes().strip(b"\0") for f in run_dir.iterdir())
        buffer.array[:] = 0
        engine.read_sync(extent, buffer)
        assert torch.equal(contents(buffer, size), data)


def test_busy_seconds_count_overlapping_directions_once(make_engine, disk_dir):
    """busy_seconds is the time either direction had a transfer in flight: each direction's
    own seconds with nothing overlapping, less than their sum when a read and a write ran
    together, never less than either."""
    engine = make_engine(disk_dir, file_size=16 << 20)
    size = 4 << 20
    with BufferPool(2, size, name="busy") as buffers:
        first, second = buffers.acquire(), buffers.acquire()
        extents = [engine.allocate(size), engine.allocate(size)]
        engine.write(extents[0], first).result(timeout=30)
        engine.read(extents[0], first).result(timeout=30)
        alone = engine.stats()
        assert alone.busy_seconds == pytest.approx(
            alone.read_seconds + alone.write_seconds, rel=1e-6
        )
        # a write and a read of another extent, in flight together
        futures = [engine.write(extents[1], second), engine.read(extents[0], first)]
        for future in futures:
            future.result(timeout=30)
        both = engine.stats()
        busy = both.busy_seconds - alone.busy_seconds
        reading = both.read_seconds - alone.read_seconds
        writing = both.write_seconds - alone.write_seconds
        assert max(reading, writing) <= busy + 1e-9
        assert busy < reading + writing
        first.release()
        second.release()
