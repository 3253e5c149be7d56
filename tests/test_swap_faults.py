"""Faults injected under a real engine: every kind x read/write x backend either succeeds with
the right bytes or fails with the exact error naming file, offset and cause; nothing written
before is lost, no thread hangs, and close removes every file."""

from __future__ import annotations

import errno
import threading
from concurrent.futures import Future
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
from swap.backends.base import IOBackend, IORequest, Op, outcome_of, resolve
from swap.backends.threads import ThreadBackend
from swap.faults import KINDS
from tests.conftest import REAL_BACKENDS, contents, fill, random_bytes
from tests.waiting import GUARD, closes, until

TIMEOUT = GUARD  # no test waits longer than this on anything: a hang fails the test instead
BLOCK = 64 << 10
SIZE = 3 * BLOCK + 5000  # three whole chunks and a short tail chunk
#: the request timeout where a hang is injected: short, so it costs little
HANG_TIMEOUT = 0.5
#: elsewhere: on a loaded machine a small request has taken over a second, which must not turn
#: a slow or failed request into a timeout the case does not expect
REQUEST_TIMEOUT = 30.0


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


def no_new_threads(before: set[threading.Thread]) -> None:
    """Waits (guarded) until every thread started since ``before`` has ended."""
    until(
        lambda: not [t for t in threading.enumerate() if t not in before and t.is_alive()],
        what="the end of the engine's threads",
    )


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
    engine, faults = build(
        make_engine,
        disk_dir,
        backend,
        request_timeout=HANG_TIMEOUT if kind == "hang" else REQUEST_TIMEOUT,
    )
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
    if op == "write":
        fill(source, v2)
        future = engine.write(target, source, tag=("t", 2))
    else:
        future = engine.read(target, sink, tag=("t", 1))
    error = future.exception(TIMEOUT)
    assert faults.injected == {kind: 1}

    if kind in ("short", "slow"):  # continued / just later: the right bytes, nothing retried
        assert error is None and future.result() == SIZE
        retries = engine.stats().retries
        assert retries >= 1 if kind == "short" else retries == 0
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
        assert error.path == path and error.offset == offset and error.timeout == HANG_TIMEOUT
        text = str(error)
        assert str(path) in text and f"offset {offset}" in text
        assert f"request_timeout={HANG_TIMEOUT:g} s" in text and "quarantined" in text
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

    closes(engine.close)
    assert list(disk_dir.iterdir()) == []
    assert engine.quarantined() == []  # the injected hang was released, never abandoned
    if kind == "hang":
        assert error.quarantine.released.is_set()
    no_new_threads(before)


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
    closes(engine.close)
    assert list(disk_dir.iterdir()) == []


class HeldRead(IOBackend):
    """Passes requests to ``inner``, except the first read, which it holds until ``release()``
    (a request the drive takes its time over, for exactly as long as the test says)."""

    def __init__(self, inner: IOBackend) -> None:
        super().__init__(inner.queue_depth, inner.close_timeout)
        self.inner, self.name, self.direct = inner, inner.name, inner.direct
        self.counters = inner.counters
        self.held: list[tuple[Future[int], IORequest]] = []
        self.passed = 0

    def submit(self, request: IORequest) -> Future[int]:
        if request.op is Op.READ and not self.held:
            future: Future[int] = Future()
            future.set_running_or_notify_cancel()
            self.held.append((future, request))
            return future
        self.passed += 1
        return self.inner.submit(request)

    def release(self) -> None:
        for future, request in self.held:
            self.inner.submit(request).add_done_callback(
                lambda done, outer=future: resolve(outer, outcome_of(done))
            )

    def close(self) -> None:
        self.inner.close()


@pytest.mark.parametrize("backend", ["uring", "threads"])
def test_a_slow_request_does_not_hold_up_the_others(disk_dir, make_engine, buffers, backend):
    """While one read is held at the drive, later reads and writes complete; the held one
    completes, with its bytes, once the drive lets it go."""
    try:
        name = choose_backend(backend, disk_dir)
    except SwapConfigError as exc:
        pytest.skip(f"backend {backend} unavailable here: {exc}")
    held = HeldRead(make_backend(name, 4, None, 5.0))
    engine = make_engine(disk_dir, backend, io=held, block_size=BLOCK, queue_depth=4)
    slow_extent, fast_extent = engine.allocate(BLOCK), engine.allocate(BLOCK)
    data = random_bytes(BLOCK, 5)
    fill(buffers[2], data)
    engine.write(slow_extent, buffers[2], tag="slow").result(TIMEOUT)
    engine.write(fast_extent, buffers[2], tag="fast").result(TIMEOUT)
    slow = engine.read(slow_extent, buffers[0], tag="slow")
    assert len(held.held) == 1
    for _ in range(3):  # the others come and go while it is held
        assert engine.read(fast_extent, buffers[1], tag="fast").result(TIMEOUT) == BLOCK
        assert engine.write(fast_extent, buffers[2], tag="fast").result(TIMEOUT) == BLOCK
    assert not slow.done()
    held.release()
    assert slow.result(TIMEOUT) == BLOCK
    assert torch.equal(contents(buffers[0], BLOCK), data)
    assert held.passed == 8


def test_hung_slots_fail_queued_transfers_instead_of_hanging(disk_dir, make_engine, buffers):
    engine, faults = build(
        make_engine, disk_dir, "threads", queue_depth=2, request_timeout=HANG_TIMEOUT
    )
    source = buffers[0]
    extent = engine.allocate(SIZE)  # four requests: two hang, two wait for a slot forever
    faults.inject("hang", times=None)
    error = engine.write(extent, source).exception(TIMEOUT)
    assert type(error) is TransferTimeoutError
    assert len(engine.quarantined()) == 2 and faults.hung == 2
    # every slot is held by a hung request: a new transfer fails now rather than never
    other = engine.allocate(BLOCK)
    error = engine.read(other, buffers[1]).exception(TIMEOUT)
    assert type(error) is TransferTimeoutError and "cannot start" in str(error)
    # freeing an extent a hung write may still land in holds its space back
    used = engine.space.allocated_bytes
    engine.free(extent)
    assert engine.space.allocated_bytes == used
    with pytest.raises(ValueError, match="freed"):
        engine.write(extent, source)
    closes(engine.close)  # the hung requests timed out already: not waited for
    assert list(disk_dir.iterdir()) == [] and engine.quarantined() == []


def test_hang_without_request_timeout_is_bounded_by_close(disk_dir, make_engine, buffers):
    engine, faults = build(
        make_engine, disk_dir, "threads", request_timeout=None, close_timeout=0.3
    )
    extent = engine.allocate(BLOCK)
    faults.inject("hang")
    future = engine.read(extent, buffers[0])
    assert faults.hung == 1 and not future.done()
    closes(engine.close, gives_up=True)
    assert isinstance(future.exception(TIMEOUT), TransferTimeoutError)
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
        closes(engine.close, gives_up=True)
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
