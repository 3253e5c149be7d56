"""``IOBackend.start_chain``: one report per chain, with every request's outcome, instead of a
future per request (the engine's completion path, which runs on the backend's threads and so
holds the GIL away from the training thread for every line it runs per request)."""

from __future__ import annotations

import errno
import os
import threading
from concurrent.futures import Future

import pytest
import torch

from swap import ALIGNMENT, BufferPool, FaultInjectingBackend, IORequest, Op, make_backend
from swap.backends.base import IOBackend, outcome_of, resolve_outcomes
from tests.conftest import REAL_BACKENDS, contents, fill, random_bytes

TIMEOUT = 20
BLOCKS = 8


@pytest.fixture
def buffers():
    with BufferPool(2, BLOCKS * ALIGNMENT) as pool:
        yield pool.acquire(), pool.acquire()


@pytest.fixture
def data_file(disk_dir):
    fd = os.open(disk_dir / "chain.bin", os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    os.posix_fallocate(fd, 0, BLOCKS * ALIGNMENT)
    yield fd
    os.close(fd)


@pytest.fixture(params=REAL_BACKENDS)
def backend(request, disk_dir):
    try:
        io = make_backend(request.param, 4, None, 5.0)
    except OSError as exc:
        pytest.skip(f"backend {request.param} unavailable: {exc}")
    yield io
    io.close()


class Reports:
    """Collects the reports of chains and counts them: each chain must report exactly once."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.outcomes: list[list] = []
        self.arrived = threading.Semaphore(0)

    def __call__(self, outcomes: list) -> None:
        with self.lock:
            self.outcomes.append(outcomes)
        self.arrived.release()

    def wait(self, count: int) -> list[list]:
        for _ in range(count):
            assert self.arrived.acquire(timeout=TIMEOUT), "a chain never reported"
        return self.outcomes


def chain(op: Op, fd: int, buffer, first: int, count: int) -> list[IORequest]:
    """``count`` contiguous one-page requests from page ``first`` of the file and the buffer."""
    return [
        IORequest(op, fd, b * ALIGNMENT, buffer.address + b * ALIGNMENT, ALIGNMENT)
        for b in range(first, first + count)
    ]


def test_a_chain_reports_once_with_each_outcome_and_moves_real_bytes(backend, data_file, buffers):
    source, sink = buffers
    data = random_bytes(BLOCKS * ALIGNMENT, seed=11)
    fill(source, data)
    writes = Reports()
    backend.start_chain(chain(Op.WRITE, data_file, source, 0, 4), writes)
    backend.start_chain(chain(Op.WRITE, data_file, source, 4, 4), writes)
    assert sorted(writes.wait(2)) == [[ALIGNMENT] * 4] * 2
    reads = Reports()
    backend.start_chain(chain(Op.READ, data_file, sink, 0, BLOCKS), reads)
    assert reads.wait(1) == [[ALIGNMENT] * BLOCKS]
    assert torch.equal(contents(sink, BLOCKS * ALIGNMENT), data)
    assert not reads.arrived.acquire(timeout=0.1)  # and never a second report
    assert len(writes.outcomes) == 2


def test_a_failed_chain_reports_the_error_for_its_requests(backend, disk_dir, buffers):
    path = disk_dir / "read-only.bin"
    path.write_bytes(b"\0" * 2 * ALIGNMENT)
    read_only = os.open(path, os.O_RDONLY)
    try:
        reports = Reports()
        backend.start_chain(chain(Op.WRITE, read_only, buffers[0], 0, 2), reports)
        (outcomes,) = reports.wait(1)
        assert len(outcomes) == 2
        assert all(isinstance(o, OSError) and o.errno == errno.EBADF for o in outcomes)
    finally:
        os.close(read_only)


def test_a_short_chain_leaves_its_later_requests_short(backend, disk_dir, buffers):
    """Reading past the end of a file: the requests before the end get their bytes, the one
    across it is short and the ones after it get nothing, as if each had run alone."""
    path = disk_dir / "short.bin"
    payload = random_bytes(ALIGNMENT + ALIGNMENT // 2, seed=12)
    path.write_bytes(payload.numpy().tobytes())
    fd = os.open(path, os.O_RDONLY)  # buffered: a read may end inside a page
    try:
        reports = Reports()
        backend.start_chain(chain(Op.READ, fd, buffers[1], 0, 3), reports)
        (outcomes,) = reports.wait(1)
        assert outcomes == [ALIGNMENT, ALIGNMENT // 2, 0]
        assert torch.equal(contents(buffers[1], payload.numel()), payload)
    finally:
        os.close(fd)


def test_a_failing_report_does_not_stop_later_chains(backend, data_file, buffers, caplog):
    def broken(_outcomes):
        raise RuntimeError("a broken consumer")

    backend.start_chain(chain(Op.WRITE, data_file, buffers[0], 0, 2), broken)
    reports = Reports()
    backend.start_chain(chain(Op.WRITE, data_file, buffers[0], 2, 2), reports)
    assert reports.wait(1) == [[ALIGNMENT] * 2]


def test_a_closed_backend_refuses_a_chain_and_never_reports_it(backend, data_file, buffers):
    backend.close()
    reports = Reports()
    with pytest.raises(RuntimeError, match="closed"):
        backend.start_chain(chain(Op.WRITE, data_file, buffers[0], 0, 1), reports)
    assert not reports.arrived.acquire(timeout=0.1)


def test_the_default_gathers_the_futures_of_a_wrapped_backend(disk_dir, data_file, buffers):
    """A backend without chains of its own (the fault injector) reports through the default,
    which gathers submit_chain's futures: an injected error and a short request arrive as
    outcomes of their own requests."""
    inner = make_backend("threads", 2, None, 5.0)
    faults = FaultInjectingBackend(inner)
    try:
        faults.inject("eio", op="write", times=1)
        reports = Reports()
        faults.start_chain(chain(Op.WRITE, data_file, buffers[0], 0, 1), reports)
        (failed,) = reports.wait(1)
        assert isinstance(failed[0], OSError) and failed[0].errno == errno.EIO
        faults.inject("short", op="write", times=1)
        shortened = Reports()
        request = IORequest(Op.WRITE, data_file, 0, buffers[0].address, 2 * ALIGNMENT)
        faults.start_chain([request], shortened)
        assert shortened.wait(1) == [[ALIGNMENT]]
    finally:
        faults.close()


def test_outcomes_and_futures_convert_both_ways():
    done, failed, cancelled = Future(), Future(), Future()
    done.set_result(7)
    failed.set_exception(OSError(errno.EIO, "boom"))
    cancelled.cancel()
    assert outcome_of(done) == 7
    assert isinstance(outcome_of(failed), OSError)
    assert outcome_of(cancelled).errno == errno.ECANCELED
    futures = [Future(), Future()]
    resolve_outcomes(futures, [3, OSError(errno.ENOSPC, "full")])
    assert futures[0].result() == 3 and futures[1].exception().errno == errno.ENOSPC


def test_a_backend_of_single_requests_still_takes_chains_of_one():
    class Single(IOBackend):
        def submit(self, request):
            future: Future[int] = Future()
            future.set_result(request.length)
            return future

        def close(self):
            pass

    reports = Reports()
    Single(1).start_chain([IORequest(Op.READ, 0, 0, 0, ALIGNMENT)], reports)
    assert reports.wait(1) == [[ALIGNMENT]]
    with pytest.raises(ValueError, match="chains of one"):
        Single(1).start_chain([IORequest(Op.READ, 0, 0, 0, 1)] * 2, reports)
