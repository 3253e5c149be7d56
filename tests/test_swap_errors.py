"""Failures: truncated files, short and failed requests, backends that misbehave or hang."""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from concurrent.futures import Future

import pytest
import torch

from swap import (
    ALIGNMENT,
    BufferPool,
    IOBackend,
    IORequest,
    Op,
    SwapIOError,
    TransferTimeoutError,
    align_up,
)
from swap.backends.base import memory_at
from swap.backends.threads import ThreadBackend
from swap.backends.uring import UringBackend, uring_unavailable_reason
from tests.conftest import REAL_BACKENDS, contents, fill, random_bytes
from tests.waiting import GUARD, closes, returns, until


class FakeBackend(IOBackend):
    """Does each request with ``os.preadv``/``os.pwritev`` (inline, or on a thread of its own
    when ``threaded``), moving at most ``cap`` bytes and reporting ``report(moved)`` bytes;
    ``error`` fails requests, ``refuse`` makes ``submit`` itself raise, ``hang`` never answers."""

    name = "fake"

    def __init__(
        self,
        queue_depth: int = 4,
        *,
        direct: bool = False,
        cap: int | None = None,
        report=None,
        threaded: bool = False,
        error: OSError | None = None,
        refuse: bool = False,
        hang: bool = False,
    ) -> None:
        super().__init__(queue_depth)
        self.direct = direct
        self.cap, self.report, self.threaded = cap, report, threaded
        self.error, self.refuse, self.hang = error, refuse, hang
        self.requests: list[IORequest] = []
        self.closed = False

    def submit(self, request: IORequest) -> Future[int]:
        if self.refuse:
            raise RuntimeError("submit refused by the fake")
        self.requests.append(request)
        future: Future[int] = Future()
        if self.hang:
            return future
        if self.threaded:
            threading.Thread(target=self._run, args=(request, future)).start()
        else:
            self._run(request, future)
        return future

    def _run(self, request: IORequest, future: Future[int]) -> None:
        if self.error is not None:
            future.set_exception(self.error)
            return
        view = memory_at(request.address, min(request.length, self.cap or request.length))
        try:
            if request.op is Op.READ:
                moved = os.preadv(request.fd, [view], request.offset)
            else:
                moved = os.pwritev(request.fd, [view], request.offset)
        except OSError as exc:
            future.set_exception(exc)
            return
        future.set_result(self.report(request, moved) if self.report else moved)

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def buffers():
    with BufferPool(2, 128 << 10) as pool:
        yield pool.acquire(), pool.acquire()


@pytest.mark.parametrize(
    "direct,cap,threaded",
    [
        (False, 1000, False),
        (False, 777, True),
        (True, ALIGNMENT, False),
        (True, 2 * ALIGNMENT, True),
    ],
)
def test_short_transfers_are_continued(tmp_path, make_engine, buffers, direct, cap, threaded):
    fake = FakeBackend(direct=direct, cap=cap, threaded=threaded)
    engine = make_engine(tmp_path, io=fake, block_size=32 << 10)
    source, sink = buffers
    size = 50_000
    data = random_bytes(size, 4)
    extent = engine.allocate(size)
    fill(source, data)
    assert engine.write(extent, source).result(timeout=10) == size
    sink.array[:] = 0
    assert engine.read_sync(extent, sink) == size
    assert torch.equal(contents(sink, size), data)
    stats = engine.stats()
    pieces = -(-align_up(size) // (32 << 10))
    assert stats.retries > 0
    assert stats.write_requests == stats.read_requests == len(fake.requests) // 2
    assert stats.write_requests == pieces + stats.retries // 2
    assert stats.bytes_written == stats.bytes_read == size and stats.errors == 0


def test_unaligned_short_count_on_direct_io_fails(tmp_path, make_engine, buffers):
    fake = FakeBackend(direct=True, report=lambda request, moved: moved - 100)
    engine = make_engine(tmp_path, io=fake)
    extent = engine.allocate(3 * ALIGNMENT)
    with pytest.raises(SwapIOError, match=f"moved {3 * ALIGNMENT - 100} of {3 * ALIGNMENT}"):
        engine.write_sync(extent, buffers[0])


def test_zero_byte_write_fails_naming_file_and_offset(tmp_path, make_engine, buffers):
    fake = FakeBackend(report=lambda request, moved: 0 if request.op is Op.WRITE else moved)
    engine = make_engine(tmp_path, io=fake)
    engine.allocate(ALIGNMENT)
    extent = engine.allocate(2 * ALIGNMENT)
    with pytest.raises(SwapIOError) as info:
        engine.write_sync(extent, buffers[0])
    error = info.value
    assert error.path == extent.segments[0].file.path and error.offset == ALIGNMENT
    assert str(error.path) in str(error) and f"offset {ALIGNMENT}" in str(error)
    assert engine.stats().errors == 1


def test_backend_error_becomes_swap_io_error(tmp_path, make_engine, buffers):
    fake = FakeBackend(error=OSError(errno.EIO, "Input/output error"))
    engine = make_engine(tmp_path, io=fake)
    extent = engine.allocate(100)
    with pytest.raises(SwapIOError) as info:
        engine.read_sync(extent, buffers[0])
    error = info.value
    assert isinstance(error, OSError) and error.errno == errno.EIO and error.op == "read"
    assert "EIO" in str(error) and "check the drive" in str(error)
    assert isinstance(error.__cause__, OSError)


def test_failed_submit_fails_the_transfer_and_leaks_nothing(tmp_path, make_engine, buffers):
    fake = FakeBackend(refuse=True)
    engine = make_engine(tmp_path, io=fake, block_size=ALIGNMENT)
    extent = engine.allocate(5 * ALIGNMENT)  # five requests: the first fails, the rest drop
    future = engine.write(extent, buffers[0])
    error = future.exception(timeout=10)
    assert isinstance(error, SwapIOError) and "submit refused by the fake" in str(error)
    fake.refuse = False
    assert engine.write_sync(extent, buffers[0]) == 5 * ALIGNMENT
    assert engine._inflight == 0 and engine.queues.queued == 0
    assert len(fake.requests) == 5


@pytest.mark.parametrize("backend", REAL_BACKENDS)
def test_read_of_truncated_file_names_file_and_offset(disk_dir, make_engine, buffers, backend):
    engine = make_engine(disk_dir, backend, block_size=64 << 10)
    extent = engine.allocate(3 * ALIGNMENT)
    segment = extent.segments[0]
    assert segment.offset == 0
    engine.write_sync(extent, buffers[0])
    os.truncate(segment.file.path, ALIGNMENT)  # behind the engine's back
    with pytest.raises(SwapIOError) as info:
        engine.read_sync(extent, buffers[1])
    error = info.value
    # the first page comes back, the short read is continued, and the next read finds no file
    assert error.path == segment.file.path and error.offset == ALIGNMENT
    assert str(segment.file.path) in str(error) and f"offset {ALIGNMENT}" in str(error)
    assert "shorter than the extent" in str(error)
    assert engine.stats().retries == 1
    os.truncate(segment.file.path, 0)
    with pytest.raises(SwapIOError, match="at offset 0 in"):
        engine.read(extent, buffers[1]).result(timeout=10)


def test_engine_close_is_bounded_when_a_request_never_completes(
    tmp_path, make_engine, buffers, caplog
):
    fake = FakeBackend(hang=True)
    engine = make_engine(tmp_path, io=fake, close_timeout=0.2)
    extent = engine.allocate(ALIGNMENT)
    future = engine.write(extent, buffers[0])
    waiter_error = []
    waiter = threading.Thread(
        target=lambda: waiter_error.append(
            pytest.raises(TransferTimeoutError, engine.read_sync, extent, buffers[1])
        )
    )
    waiter.start()
    # close only once the waiter's read is in flight, not before it starts
    until(lambda: len(fake.requests) >= 2, what="the waiter's read")
    assert len(fake.requests) == 2
    with caplog.at_level(logging.ERROR, logger="swap.engine"):
        returns(engine.close, what="engine.close()")
    assert isinstance(future.exception(timeout=GUARD), TransferTimeoutError)
    waiter.join(GUARD)
    assert not waiter.is_alive() and waiter_error
    assert fake.closed and list(tmp_path.iterdir()) == []
    assert any("closing with" in r.getMessage() for r in caplog.records)


@pytest.mark.skipif(uring_unavailable_reason() is not None, reason="io_uring unavailable")
def test_uring_close_is_bounded_when_a_request_never_completes(buffers, caplog):
    read_end, write_end = os.pipe()  # nobody writes: the read never completes
    backend = UringBackend(2, close_timeout=0.2)
    try:
        future = backend.submit(IORequest(Op.READ, read_end, 0, buffers[0].address, ALIGNMENT))
        time.sleep(0.05)
        assert not future.done()
        with caplog.at_level(logging.ERROR, logger="swap.backends.uring"):
            returns(backend.close, what="backend.close()")
        assert isinstance(future.exception(timeout=GUARD), TimeoutError)
        assert any("still in flight" in r.getMessage() for r in caplog.records)
        with pytest.raises(RuntimeError, match="closed"):
            backend.submit(IORequest(Op.READ, read_end, 0, buffers[0].address, ALIGNMENT))
        backend.close()  # idempotent
    finally:
        os.close(read_end)
        os.close(write_end)


def test_thread_backend_close_is_bounded_when_a_request_never_completes(buffers, caplog):
    gate = threading.Event()
    ran: list[int] = []

    class Stuck(ThreadBackend):
        def _run_batch(self, requests: list[IORequest]) -> int:
            ran.extend(r.fd for r in requests)
            gate.wait(10)
            return sum(r.length for r in requests)

    backend = Stuck(1, close_timeout=0.2)
    future = backend.submit(IORequest(Op.READ, -1, 0, buffers[0].address, ALIGNMENT))
    # queued behind the stuck one on the only thread: once close gives up, it must never run
    queued = backend.submit(IORequest(Op.READ, -2, 0, buffers[0].address, ALIGNMENT))
    with caplog.at_level(logging.ERROR, logger="swap.backends.threads"):
        returns(backend.close, what="backend.close()")
    assert isinstance(future.exception(timeout=GUARD), TimeoutError)
    assert isinstance(queued.exception(timeout=GUARD), TimeoutError)
    assert any("2 request(s) still in flight" in r.getMessage() for r in caplog.records)
    gate.set()  # the late completion is dropped, not raised in the worker
    until(lambda: not any(t.is_alive() for t in backend._threads), what="the worker's end")
    assert isinstance(future.exception(), TimeoutError)
    assert ran == [-1]  # the queued request never ran


@pytest.mark.skipif(uring_unavailable_reason() is not None, reason="io_uring unavailable")
def test_uring_plugged_requests_go_in_with_one_submit_and_complete(tmp_path, buffers, monkeypatch):
    import swap.backends.uring as uring_module

    calls = []
    real_submit = uring_module._uring.io_uring_submit
    monkeypatch.setattr(
        uring_module._uring, "io_uring_submit", lambda ring: calls.append(1) or real_submit(ring)
    )
    path = tmp_path / "f.bin"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    backend = UringBackend(8)
    try:
        payloads = [random_bytes(ALIGNMENT, seed=i) for i in range(4)]
        for i, payload in enumerate(payloads):
            fill(buffers[0], payload, offset=i * ALIGNMENT)
        with backend.plugged():
            futures = [
                backend.submit(
                    IORequest(
                        Op.WRITE, fd, i * ALIGNMENT, buffers[0].address + i * ALIGNMENT, ALIGNMENT
                    )
                )
                for i in range(4)
            ]
            time.sleep(0.05)
            assert calls == [] and not any(f.done() for f in futures)  # held back
        assert [f.result(timeout=5) for f in futures] == [ALIGNMENT] * 4
        assert len(calls) == 1
        with open(path, "rb") as f:
            assert f.read() == b"".join(p.numpy().tobytes() for p in payloads)
    finally:
        backend.close()
        os.close(fd)


@pytest.mark.skipif(uring_unavailable_reason() is not None, reason="io_uring unavailable")
def test_uring_an_interrupted_submit_leaves_no_stale_request_in_the_ring(
    tmp_path, buffers, monkeypatch
):
    """An exception (a signal handler's, say) between taking a submission slot and filling it:
    the slot must not go to the kernel with what an earlier request left in it, which would
    write that request's bytes a second time."""
    path = tmp_path / "f.bin"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    os.posix_fallocate(fd, 0, 4 * ALIGNMENT)
    backend = UringBackend(1)  # one slot: the interrupted request reuses the first one's
    try:
        old, new = random_bytes(ALIGNMENT, seed=1), random_bytes(ALIGNMENT, seed=2)
        fill(buffers[0], old)
        assert (
            backend.submit(IORequest(Op.WRITE, fd, 0, buffers[0].address, ALIGNMENT)).result(
                timeout=5
            )
            == ALIGNMENT
        )
        real_iovec = backend._iovec

        def interrupted(*_spans):
            raise KeyboardInterrupt

        monkeypatch.setattr(backend, "_iovec", interrupted)
        with pytest.raises(KeyboardInterrupt):
            backend.submit(IORequest(Op.WRITE, fd, 0, buffers[0].address, ALIGNMENT))
        monkeypatch.setattr(backend, "_iovec", real_iovec)
        fill(buffers[0], new)  # the slot still described a write of this buffer to offset 0
        assert (
            backend.submit(
                IORequest(Op.WRITE, fd, ALIGNMENT, buffers[0].address, ALIGNMENT)
            ).result(timeout=5)
            == ALIGNMENT
        )
        closes(backend.close)
        with open(path, "rb") as f:
            written = f.read(2 * ALIGNMENT)
        assert written[:ALIGNMENT] == old.numpy().tobytes()  # not rewritten with the new bytes
        assert written[ALIGNMENT:] == new.numpy().tobytes()
    finally:
        backend.close()
        os.close(fd)


@pytest.mark.skipif(uring_unavailable_reason() is not None, reason="io_uring unavailable")
def test_uring_close_hands_over_requests_prepared_but_never_submitted(tmp_path, buffers):
    """A caller interrupted between preparing requests and submitting them (a plugged block
    whose exit never ran): close submits them, so it does not wait its whole timeout for
    requests the kernel never saw."""
    path = tmp_path / "f.bin"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    backend = UringBackend(4, close_timeout=30)
    try:
        payload = random_bytes(ALIGNMENT, seed=3)
        fill(buffers[0], payload)
        backend._local.held = []  # as inside plugged(), whose submit then never happens
        future = backend.submit(IORequest(Op.WRITE, fd, 0, buffers[0].address, ALIGNMENT))
        backend._local.held = None
        time.sleep(0.05)
        assert not future.done()  # the kernel has not seen it
        closes(backend.close)
        assert future.result(timeout=GUARD) == ALIGNMENT
        with open(path, "rb") as f:
            assert f.read() == payload.numpy().tobytes()
    finally:
        backend.close()
        os.close(fd)


@pytest.mark.skipif(uring_unavailable_reason() is not None, reason="io_uring unavailable")
def test_engine_close_submits_what_an_unfinished_plugged_context_held(
    tmp_path, make_engine, buffers
):
    """SystemExit raised by a signal handler can leave a plugged context unfinished until the
    interpreter exits, after the exit hook's close: close must hand its requests over instead of
    waiting out request_timeout for requests the kernel never saw."""
    engine = make_engine(tmp_path, "uring", request_timeout=30, close_timeout=30)
    extent = engine.allocate(2 * ALIGNMENT)
    payload = random_bytes(2 * ALIGNMENT, seed=4)
    fill(buffers[0], payload)
    engine.backend._local.held = []  # the training thread's cut-short context
    written = engine.write(extent, buffers[0])
    time.sleep(0.05)
    assert not written.done()
    closes(engine.close)
    assert written.result(timeout=GUARD) == 2 * ALIGNMENT


@pytest.mark.skipif(uring_unavailable_reason() is not None, reason="io_uring unavailable")
def test_uring_a_failed_plugged_submit_fails_every_held_request(tmp_path, buffers, monkeypatch):
    import swap.backends.uring as uring_module

    def broken(ring):
        raise OSError(errno.EBADF, "io_uring_enter failed")

    fd = os.open(tmp_path / "f.bin", os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    backend = UringBackend(8)
    try:
        monkeypatch.setattr(uring_module._uring, "io_uring_submit", broken)
        with backend.plugged():
            futures = [
                backend.submit(
                    IORequest(
                        Op.WRITE, fd, i * ALIGNMENT, buffers[0].address + i * ALIGNMENT, ALIGNMENT
                    )
                )
                for i in range(3)
            ]
        for future in futures:
            error = future.exception(timeout=5)
            assert isinstance(error, OSError) and error.errno == errno.EBADF
    finally:
        monkeypatch.undo()
        backend.close()
        os.close(fd)
