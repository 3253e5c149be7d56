"""Callbacks that start transfers, many threads at once, queue-depth limits, stats, close."""

from __future__ import annotations

import threading
import time
from collections import Counter
from concurrent.futures import Future, wait

import pytest
import torch

from swap import ALIGNMENT, BufferPool, IOBackend, IORequest, make_backend
from tests.conftest import REAL_BACKENDS, contents, fill, random_bytes
from tests.waiting import GUARD, closes, returns

TIMEOUT = GUARD


@pytest.fixture(params=REAL_BACKENDS)
def engine(request, make_engine, disk_dir):
    return make_engine(disk_dir, request.param, block_size=8 << 10, queue_depth=2)


@pytest.fixture
def pool():
    with BufferPool(8, 64 << 10) as p:
        yield p


def test_callback_starts_a_new_transfer(engine, pool):
    source, sink = pool.acquire(), pool.acquire()
    data = random_bytes(30_000, 1)
    fill(source, data)
    extent = engine.allocate(30_000)
    read_back: Future = Future()

    def then_read(_written: Future) -> None:
        engine.read(extent, sink).add_done_callback(
            lambda f: (
                read_back.set_exception(f.exception())
                if f.exception()
                else read_back.set_result(f.result())
            )
        )

    engine.write(extent, source).add_done_callback(then_read)
    assert read_back.result(timeout=TIMEOUT) == 30_000
    assert torch.equal(contents(sink, 30_000), data)


def test_callback_may_block_on_a_sync_transfer(engine, pool):
    """A done-callback that does blocking I/O must not deadlock the engine (with io_uring the
    callback used to run on the only thread that can complete that I/O)."""
    source, sink = pool.acquire(), pool.acquire()
    data = random_bytes(20_000, 2)
    fill(source, data)
    extent = engine.allocate(20_000)
    outcome: Future = Future()

    def read_inside(_written: Future) -> None:
        try:
            first = engine.read_sync(extent, sink)
            # waiting on a future inside a callback works as well
            second = engine.read(extent, sink, nbytes=ALIGNMENT).result(timeout=TIMEOUT)
            outcome.set_result((first, second))
        except BaseException as exc:  # surfaced by the assertion below
            outcome.set_exception(exc)

    engine.write(extent, source).add_done_callback(read_inside)
    assert outcome.result(timeout=TIMEOUT) == (20_000, ALIGNMENT)
    assert torch.equal(contents(sink, 20_000), data)


def test_future_outcome_and_callbacks_agree(engine, pool):
    buffer = pool.acquire()
    extent = engine.allocate(3 * ALIGNMENT)
    seen = []
    called = threading.Event()
    future = engine.write(extent, buffer)
    future.add_done_callback(lambda f: (seen.append((f.done(), f.result())), called.set()))
    assert future.result(timeout=TIMEOUT) == 3 * ALIGNMENT and future.done()
    assert future.exception() is None
    done, _ = wait([future], timeout=TIMEOUT)  # resolved for concurrent.futures too
    assert done == {future}
    assert called.wait(TIMEOUT) and seen == [(True, 3 * ALIGNMENT)]
    late = []
    future.add_done_callback(lambda f: late.append(f.result()))  # runs at once, in this thread
    assert late == [3 * ALIGNMENT]


def test_chain_of_transfers_each_started_by_the_last(engine, pool):
    buffer = pool.acquire()
    extents = [engine.allocate(ALIGNMENT * (1 + i % 3) + i) for i in range(20)]
    payloads = [random_bytes(e.nbytes, 100 + i) for i, e in enumerate(extents)]
    finished: Future = Future()

    def step(index: int) -> None:
        if index == len(extents):
            finished.set_result(True)
            return
        fill(buffer, payloads[index])
        engine.write(extents[index], buffer).add_done_callback(
            lambda f: finished.set_exception(f.exception()) if f.exception() else step(index + 1)
        )

    step(0)
    assert finished.result(timeout=TIMEOUT)
    for extent, payload in zip(extents, payloads):
        buffer.array[:] = 0
        engine.read_sync(extent, buffer)
        assert torch.equal(contents(buffer, extent.nbytes), payload)


def test_many_threads_share_one_engine(engine, pool):
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        try:
            buffer = pool.acquire(timeout=5)
            extent = engine.allocate(10_000 + seed * 999)
            for round_ in range(8):
                data = random_bytes(extent.nbytes, seed * 100 + round_)
                fill(buffer, data)
                engine.write_sync(extent, buffer)
                buffer.array[:] = 0
                engine.read_sync(extent, buffer)
                assert torch.equal(contents(buffer, extent.nbytes), data)
            buffer.release()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TIMEOUT)
    assert not any(t.is_alive() for t in threads) and not errors
    stats = engine.stats()
    assert stats.write_transfers == stats.read_transfers == 48
    assert stats.inflight_peak <= engine.settings.queue_depth


class CountingBackend(IOBackend):
    """Wraps a real backend and records the most requests in flight per file descriptor."""

    def __init__(self, inner: IOBackend) -> None:
        super().__init__(inner.queue_depth)
        self.inner, self.name, self.direct = inner, inner.name, inner.direct
        self.lock = threading.Lock()
        self.now: Counter[int] = Counter()
        self.peak: Counter[int] = Counter()
        self.total_peak = 0

    def submit(self, request: IORequest) -> Future[int]:
        with self.lock:
            self.now[request.fd] += 1
            self.peak[request.fd] = max(self.peak[request.fd], self.now[request.fd])
            self.total_peak = max(self.total_peak, sum(self.now.values()))
        future = self.inner.submit(request)
        future.add_done_callback(lambda _f: self._done(request.fd))
        return future

    def _done(self, fd: int) -> None:
        with self.lock:
            self.now[fd] -= 1

    def close(self) -> None:
        self.inner.close()


@pytest.mark.parametrize("backend", ["uring", "threads"])
def test_queue_depth_holds_per_directory_and_in_total(make_engine, tmp_path, backend):
    dirs = [tmp_path / n for n in "abc"]
    for d in dirs:
        d.mkdir()
    queue_depth = 2
    try:
        inner = make_backend(backend, queue_depth * len(dirs))
    except OSError as exc:
        pytest.skip(f"{backend} unavailable: {exc}")
    counting = CountingBackend(inner)
    engine = make_engine(
        dirs, io=counting, block_size=ALIGNMENT, queue_depth=queue_depth, file_size=1 << 20
    )
    with BufferPool(6, 64 << 10) as pool:
        # small extents rotate over the directories; large ones stripe over all three
        extents = [
            engine.allocate(n)
            for n in (ALIGNMENT, 3 * ALIGNMENT, 40_000, 60_000, 2 * ALIGNMENT, 50_000)
        ]
        buffers = [pool.acquire() for _ in extents]
        data = [random_bytes(e.nbytes, i) for i, e in enumerate(extents)]
        for buffer, payload in zip(buffers, data):
            fill(buffer, payload)
        futures = [engine.write(e, b) for _ in range(2) for e, b in zip(extents, buffers)]
        done, not_done = wait(futures, timeout=TIMEOUT)
        assert not not_done and all(f.exception() is None for f in futures)
        for buffer in buffers:
            buffer.array[:] = 0
        assert [engine.read(e, b).result(TIMEOUT) for e, b in zip(extents, buffers)] == [
            e.nbytes for e in extents
        ]
        for buffer, payload in zip(buffers, data):
            assert torch.equal(contents(buffer, payload.numel()), payload)
    # one file per directory here, so per-descriptor peaks are per-directory peaks
    assert len(engine.space.files) == len(dirs)
    assert max(counting.peak.values()) <= queue_depth
    assert counting.total_peak <= queue_depth * len(dirs)
    stats = engine.stats()
    assert 1 <= stats.inflight_peak <= queue_depth * len(dirs)


def test_stats_count_bytes_requests_and_transfers(make_engine, disk_dir, pool):
    block = 8 << 10
    engine = make_engine(disk_dir, "threads", block_size=block, queue_depth=2)
    sizes = [1, block, block + 1, 3 * block - 5, 0]
    buffer = pool.acquire()
    extents = [engine.allocate(n) for n in sizes]
    for extent in extents:
        engine.write_sync(extent, buffer)
    requests = sum(-(-n // block) for n in sizes)  # one request per block of padded bytes
    stats = engine.stats()
    assert stats.bytes_written == sum(sizes) and stats.bytes_read == 0
    assert stats.write_transfers == len(sizes) and stats.write_requests == requests
    assert stats.read_transfers == stats.read_requests == 0
    assert stats.errors == stats.retries == 0 and stats.write_seconds > 0
    engine.read_sync(extents[3], buffer, nbytes=block + 1)
    stats = engine.stats()
    assert stats.bytes_read == block + 1 and stats.read_requests == 2
    assert stats.read_transfers == 1
    assert 1 <= stats.inflight_peak <= 2
    assert stats.as_dict()["write_gbps"] == stats.write_gbps > 0


def test_close_finishes_queued_transfers(make_engine, disk_dir, pool):
    engine = make_engine(disk_dir, "threads", block_size=ALIGNMENT, queue_depth=1)
    buffers = [pool.acquire() for _ in range(4)]
    extents = [engine.allocate(64 << 10) for _ in buffers]
    futures = [engine.write(e, b) for e, b in zip(extents, buffers)]  # 64 requests, depth 1
    engine.close()
    assert [f.result(timeout=1) for f in futures] == [64 << 10] * 4
    with pytest.raises(RuntimeError, match="closed"):
        engine.write(extents[0], buffers[0])


def test_close_from_a_callback(engine, pool):
    buffer = pool.acquire()
    extent = engine.allocate(ALIGNMENT)
    closed = threading.Event()

    def close_engine(_f: Future) -> None:
        engine.close()
        closed.set()

    engine.write(extent, buffer).add_done_callback(close_engine)
    assert closed.wait(TIMEOUT)
    returns(engine.close, what="a second close()")  # closed already: nothing to do


def test_an_exception_raised_while_a_transfer_is_queued_still_submits_it(
    make_engine, disk_dir, pool, monkeypatch
):
    """A signal handler may raise (KeyboardInterrupt, a user's SystemExit) at any bytecode of
    the caller's thread, here after the requests were queued and before the checksums were:
    the requests must still go out, or close() would wait its whole timeout for them."""
    engine = make_engine(
        disk_dir, "threads", block_size=16 << 10, checksum_chunk=32 << 10, close_timeout=30.0
    )
    extent = engine.allocate(64 << 10)
    buffer = pool.acquire()
    fill(buffer, random_bytes(64 << 10, 5))

    class Interrupting:  # the engine's hash-job queue, raising at the first job
        def __init__(self, jobs):
            self.jobs, self.calls = jobs, 0

        def put(self, job):
            self.calls += 1
            if self.calls == 1:
                raise KeyboardInterrupt
            self.jobs.put(job)

        def get(self):
            return self.jobs.get()

    hasher = engine._hasher
    assert hasher is not None  # verify_checksums
    monkeypatch.setattr(hasher, "_jobs", Interrupting(hasher._jobs))
    with pytest.raises(KeyboardInterrupt):
        engine.write(extent, buffer)
    closes(engine.close)  # it did not wait for requests nobody submitted
    assert engine.stats().write_requests == 4


def test_thread_backend_moves_queued_contiguous_requests_with_one_call(disk_dir, pool):
    """Requests queued behind a busy worker that continue one another in the same file go in one
    preadv/pwritev (one GIL round trip for the run); others keep their own call; every request
    still gets its own result."""
    import os

    from swap import Op
    from swap.backends.threads import ThreadBackend

    gate = threading.Event()
    runs: list[list[int]] = []

    class Recording(ThreadBackend):
        def _run_batch(self, requests):
            if not runs:
                gate.wait(TIMEOUT)  # hold the only worker so that the rest queue up
            runs.append([r.offset // ALIGNMENT for r in requests])
            return super()._run_batch(requests)

    fd = os.open(disk_dir / "runs.bin", os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    try:
        os.posix_fallocate(fd, 0, 8 * ALIGNMENT)
        source, sink = pool.acquire(), pool.acquire()
        data = random_bytes(8 * ALIGNMENT, 5)
        fill(source, data)
        backend = Recording(8, thread_count=1)

        def request(op, block, buffer):
            return backend.submit(
                IORequest(op, fd, block * ALIGNMENT, buffer.address + block * ALIGNMENT, ALIGNMENT)
            )

        held = request(Op.WRITE, 0, source)
        time.sleep(0.05)  # the worker now waits at the gate with block 0
        queued = [request(Op.WRITE, b, source) for b in (1, 2, 5, 6)]
        gate.set()
        assert [f.result(TIMEOUT) for f in [held, *queued]] == [ALIGNMENT] * 5
        assert runs == [[0], [1, 2], [5, 6]]  # 5 does not continue 2
        rest = [request(Op.WRITE, b, source) for b in (3, 4, 7)]
        assert [f.result(TIMEOUT) for f in rest] == [ALIGNMENT] * 3
        reads = [request(Op.READ, b, sink) for b in range(8)]
        assert [f.result(TIMEOUT) for f in reads] == [ALIGNMENT] * 8
        assert torch.equal(contents(sink, 8 * ALIGNMENT), data)
        backend.close()
    finally:
        os.close(fd)


def test_a_short_run_leaves_its_later_requests_short():
    from swap.backends.base import split

    assert split(10, [4, 4, 4]) == [4, 4, 2]
    assert split(3, [4, 4]) == [3, 0]
    assert split(8, [4, 4]) == [4, 4]
    assert split(0, [4]) == [0]
