"""Faults injected under a real engine: every kind x read/write x backend either succeeds with
the right bytes or fails with the exact error naming file, offset and cause; nothing written
before is lost, no thread hangs, and close removes every file."""

from __future__ import annotations

import errno
import threading
import time
from pathlib import Path

import pytest
import torch

import swap.timeouts
from swap import (
    ALIGNMENT,
    BufferPool,
    EngineSettings,
    FaultInjectingBackend,
    IntegrityError,
    SwapConfigError,
    SwapIOError,
    TransferTimeoutError,
    choose_backend,
    make_backend,
)
from swap.backends.base import IORequest, Op
from swap.backends.threads import ThreadBackend
from swap.faults import KINDS
from tests.conftest import REAL_BACKENDS, contents, fill, random_bytes

TIMEOUT = 10  # no test waits longer than this on anything: a hang fails the test instead
BLOCK = 64 << 10
SIZE = 3 * BLOCK + 5000  # three whole chunks and a short tail chunk
REQUEST_TIMEOUT = 0.5


def build(make_engine, directory: Path, backend: str, seed: int = 0, **settings):
    """A real backend wrapped in a FaultInjectingBackend, under an engine."""
    try:
        name = choose_backend(backend, directory)
    except SwapConfigError as exc:
        pytest.skip(f"backend {backend} unavailable here: {exc}")
    settings.setdefault("queue_depth", 4)
    settings.setdefault("close_timeout", 5.0)
    faults = FaultInjectingBackend(
        make_backend(name, settings["queue_depth"], None, settings["close_timeout"]), seed
    )
    settings.setdefault("request_timeout", REQUEST_TIMEOUT)
    engine = make_engine(directory, backend, io=faults, block_size=BLOCK, **settings)
    assert engine.backend_name == name
    return engine, faults


def close_bounded(engine) -> float:
    """Closes the engine on another thread and fails the test if that takes over TIMEOUT."""
    started = time.monotonic()
    closer = threading.Thread(target=engine.close)
    closer.start()
    closer.join(TIMEOUT)
    assert not closer.is_alive(), "engine.close() hung"
    return time.monotonic() - started


def new_threads_alive(before: set[threading.Thread]) -> list[str]:
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:
        alive = [t.name for t in threading.enumerate() if t not in before and t.is_alive()]
        if not alive:
            return []
        time.sleep(0.02)
    return alive


@pytest.fixture
def buffers():
    with BufferPool(3, SIZE) as pool:
        yield pool.acquire(), pool.acquire(), pool.acquire()


CASES = [
    (kind, op)
    for kind in KINDS
    for op in ("read", "write")
    if not (kind == "enospc" and op == "read")
]


@pytest.mark.parametrize("backend", REAL_BACKENDS)
@pytest.mark.parametrize("kind,op", CASES)
def test_fault_matrix(disk_dir, make_engine, buffers, backend, kind, op):
    before = set(threading.enumerate())
    engine, faults = build(make_engine, disk_dir, backend)
    source, sink, spare = buffers
    keep_data, v1, v2 = (random_bytes(SIZE, seed) for seed in (1, 2, 3))
    keep = engine.allocate(SIZE)
    fill(spare, keep_data)
    engine.write(keep, spare, tag=("keep", 1)).result(TIMEOUT)
    target = engine.allocate(SIZE)
    fill(source, v1)
    engine.write(target, source, tag=("t", 1)).result(TIMEOUT)
    path = target.segments[0].file.path
    offset = target.segments[0].offset + BLOCK  # the fault hits the second request
    assert target.segments[0].offset > 0

    faults.inject(kind, op=op, times=1, delay=0.1, after=1)
    sink.array[:] = 0xEE  # poison: a read that moves nothing must not look right
    started = time.monotonic()
    if op == "write":
        fill(source, v2)
        future = engine.write(target, source, tag=("t", 2))
    else:
        future = engine.read(target, sink, tag=("t", 1))
    error = future.exception(TIMEOUT)
    elapsed = time.monotonic() - started
    assert faults.injected == {kind: 1}

    if kind in ("short", "slow"):  # continued / just slower: the right bytes
        assert error is None and future.result() == SIZE
        if kind == "short":
            assert engine.stats().retries >= 1
        else:
            assert elapsed >= 0.1
    elif kind in ("eio", "enospc"):
        assert type(error) is SwapIOError
        assert error.errno == (errno.EIO if kind == "eio" else errno.ENOSPC)
        assert error.path == path and error.offset == offset and error.op == op
        text = str(error)
        assert str(path) in text and f"offset {offset}" in text
        assert (
            ("EIO" in text and "check the drive" in text)
            if kind == "eio"
            else ("ENOSPC" in text and "full" in text)
        )
        assert "injected" in str(error.__cause__)
    elif kind == "hang":
        assert type(error) is TransferTimeoutError
        assert error.path == path and error.offset == offset and error.timeout == REQUEST_TIMEOUT
        text = str(error)
        assert str(path) in text and f"offset {offset}" in text
        assert f"request_timeout={REQUEST_TIMEOUT:g} s" in text and "quarantined" in text
        assert REQUEST_TIMEOUT <= elapsed < REQUEST_TIMEOUT + 3
        [held] = engine.quarantined()
        assert (held.path, held.offset, held.op) == (path, offset, op)
        assert held.buffer is (source if op == "write" else sink)
        assert (held.buffer_start, held.buffer_end) == (BLOCK, 2 * BLOCK)
        assert error.quarantine is held and not held.released.is_set()
        assert engine.stats().timeouts == 1 and engine.stats().quarantined == 1
    elif op == "write":  # drop: success reported, nothing landed; the read must notice
        assert error is None
        with pytest.raises(
            IntegrityError,
            match=r"holds the bytes of shard t version 1, this "
            r"extent's previous write.*stale",
        ) as info:
            engine.read(target, sink, tag=("t", 2)).result(TIMEOUT)
        assert info.value.path == path and info.value.offset == offset
    else:  # drop read: the buffer kept the poison in chunk 1
        assert type(error) is IntegrityError
        assert error.path == path and error.offset == offset
        assert "matches nothing this engine wrote" in str(error)

    # Nothing lost: the other extent is intact, and the target holds what was last written.
    faults.clear()
    sink.array[:] = 0
    engine.read(keep, sink, tag=("keep", 1)).result(TIMEOUT)
    assert torch.equal(contents(sink, SIZE), keep_data)
    if op == "write" and error is not None:
        # The failed write left the extent undefined: reads are refused until it is rewritten.
        with pytest.raises(IntegrityError, match="the last write to it failed"):
            engine.read(target, sink, tag=("t", 2)).result(TIMEOUT)
    if op == "write":
        fill(source, v2)
        engine.write(target, source, tag=("t", 2)).result(TIMEOUT)
    sink.array[:] = 0
    engine.read(target, sink, tag=("t", 2 if op == "write" else 1)).result(TIMEOUT)
    assert torch.equal(contents(sink, SIZE), v2 if op == "write" else v1)

    assert close_bounded(engine) < TIMEOUT
    assert list(disk_dir.iterdir()) == []
    assert engine.quarantined() == []  # the injected hang was released, never abandoned
    if kind == "hang":
        assert error.quarantine.released.is_set()
    assert new_threads_alive(before) == []


@pytest.mark.parametrize("backend", ["threads", "uring"])
def test_random_faults_lose_nothing(disk_dir, make_engine, backend):
    """Soak in small: many transfers under random faults; each one either returns the right
    bytes or fails with SwapIOError, and the data of successful writes reads back."""
    engine, faults = build(make_engine, disk_dir, backend, seed=7)
    faults.random_faults(0.2, kinds=("eio", "short", "slow"), max_delay=0.01)
    with BufferPool(4, 2 * BLOCK) as pool:
        buffers = [pool.acquire() for _ in range(4)]
        extents = [engine.allocate(2 * BLOCK - 100 * i) for i in range(4)]
        written: dict[int, tuple[torch.Tensor, int]] = {}
        failures = 0
        for round_ in range(6):
            futures = []
            for i, (extent, buffer) in enumerate(zip(extents, buffers)):
                data = random_bytes(extent.nbytes, 100 * round_ + i)
                fill(buffer, data)
                futures.append((i, data, engine.write(extent, buffer, tag=(i, round_))))
            for i, data, future in futures:
                error = future.exception(TIMEOUT)
                if error is None:
                    written[i] = (data, round_)
                else:
                    assert type(error) is SwapIOError and error.errno == errno.EIO
                    written.pop(i, None)
                    failures += 1
        faults.clear()
        for i, (data, round_) in written.items():
            buffers[i].array[:] = 0
            engine.read(extents[i], buffers[i], tag=(i, round_)).result(TIMEOUT)
            assert torch.equal(contents(buffers[i], extents[i].nbytes), data)
        assert sum(faults.injected.values()) > 0 and faults.requests > 0
        assert engine.stats().errors == failures
    close_bounded(engine)
    assert list(disk_dir.iterdir()) == []


@pytest.mark.parametrize("backend", ["uring", "threads"])
def test_a_slow_request_does_not_hold_up_the_others(disk_dir, make_engine, buffers, backend):
    engine, faults = build(make_engine, disk_dir, backend, request_timeout=5)
    slow_extent, fast_extent = engine.allocate(BLOCK), engine.allocate(BLOCK)
    faults.inject("slow", op="read", delay=1.0)
    started = time.monotonic()
    slow = engine.read(slow_extent, buffers[0])
    engine.read(fast_extent, buffers[1]).result(TIMEOUT)
    assert time.monotonic() - started < 0.8 and not slow.done()
    assert slow.result(TIMEOUT) == BLOCK and time.monotonic() - started >= 1.0
    assert faults.injected == {"slow": 1}


def test_hung_slots_fail_queued_transfers_instead_of_hanging(disk_dir, make_engine, buffers):
    engine, faults = build(make_engine, disk_dir, "threads", queue_depth=2)
    source = buffers[0]
    extent = engine.allocate(SIZE)  # four requests: two hang, two wait for a slot forever
    faults.inject("hang", times=None)
    started = time.monotonic()
    error = engine.write(extent, source).exception(TIMEOUT)
    assert type(error) is TransferTimeoutError and time.monotonic() - started < 3
    assert len(engine.quarantined()) == 2 and faults.hung == 2
    # every slot is held by a hung request: a new transfer fails now rather than never
    other = engine.allocate(BLOCK)
    started = time.monotonic()
    error = engine.read(other, buffers[1]).exception(TIMEOUT)
    assert type(error) is TransferTimeoutError and "cannot start" in str(error)
    assert time.monotonic() - started < 1
    # freeing an extent a hung write may still land in holds its space back
    used = engine.space.allocated_bytes
    engine.free(extent)
    assert engine.space.allocated_bytes == used
    with pytest.raises(ValueError, match="freed"):
        engine.write(extent, source)
    assert close_bounded(engine) < 3
    assert list(disk_dir.iterdir()) == [] and engine.quarantined() == []


def test_hang_without_request_timeout_is_bounded_by_close(disk_dir, make_engine, buffers):
    engine, faults = build(
        make_engine, disk_dir, "threads", request_timeout=None, close_timeout=0.3
    )
    extent = engine.allocate(BLOCK)
    faults.inject("hang")
    future = engine.read(extent, buffers[0])
    time.sleep(0.1)
    assert not future.done()
    assert close_bounded(engine) < 3
    assert isinstance(future.exception(1), TransferTimeoutError)
    assert list(disk_dir.iterdir()) == []


def test_request_the_kernel_still_holds_at_close_keeps_its_buffer(tmp_path, make_engine, buffers):
    """A real request stuck in the kernel: it times out, close abandons it, and its buffer stays
    referenced so the late completion cannot land in freed memory."""
    gate = threading.Event()

    class Stuck(ThreadBackend):
        def _run_batch(self, requests: list[IORequest]) -> int:
            gate.wait(TIMEOUT)
            return sum(r.length for r in requests)

    engine = make_engine(
        tmp_path, io=Stuck(2, close_timeout=0.2), request_timeout=0.3, close_timeout=1.0
    )
    extent = engine.allocate(ALIGNMENT)
    kept = len(swap.timeouts._abandoned)
    try:
        error = engine.read(extent, buffers[0]).exception(TIMEOUT)
        assert type(error) is TransferTimeoutError
        assert close_bounded(engine) < 5
        assert len(swap.timeouts._abandoned) == kept + 1
        assert swap.timeouts._abandoned[-1].buffer is buffers[0]
        assert not error.quarantine.released.is_set()  # never: the kernel may still write
        assert list(tmp_path.iterdir()) == []
    finally:
        gate.set()


def test_injector_passes_through_and_validates(tmp_path, make_engine, buffers):
    engine, faults = build(make_engine, tmp_path, "buffered")
    extent = engine.allocate(SIZE)
    data = random_bytes(SIZE, 9)
    fill(buffers[0], data)
    engine.write_sync(extent, buffers[0], tag="x")
    engine.read_sync(extent, buffers[1], tag="x")
    assert torch.equal(contents(buffers[1], SIZE), data)
    assert faults.injected == {} and faults.requests == 8
    for bad in (
        {"kind": "bitrot"},
        {"kind": "enospc", "op": "read"},
        {"kind": "eio", "op": "x"},
        {"kind": "eio", "times": 0},
        {"kind": "eio", "probability": 2},
        {"kind": "slow", "delay": -1},
        {"kind": "eio", "after": -1},
    ):
        with pytest.raises(ValueError):
            faults.inject(**bad)
    with pytest.raises(ValueError):
        faults.random_faults(0.1, kinds=())
    # a probabilistic rule with a seed is reproducible
    picks = []
    for _ in range(2):
        probe = FaultInjectingBackend(ThreadBackend(1), seed=3).inject(
            "drop", times=None, probability=0.5
        )
        request = IORequest(Op.WRITE, -1, 0, buffers[2].address, ALIGNMENT)
        picks.append([probe._pick_locked(request)[0] for _ in range(20)])
        probe.close()
    assert picks[0] == picks[1] and 0 < picks[0].count("drop") < 20


@pytest.mark.parametrize("value", [0, -1, "5", True])
def test_request_timeout_is_validated(value):
    with pytest.raises(SwapConfigError, match="request_timeout"):
        EngineSettings(request_timeout=value)
    assert EngineSettings(request_timeout=None).request_timeout is None
