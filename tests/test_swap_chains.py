"""Chains: a transfer's requests reach the backend a queue slot's worth at a time, so the kernel
moves them without a Python thread (and the GIL) between one request and the next."""

from __future__ import annotations

import errno
import os
import threading
import time

import pytest
import torch

from swap import ALIGNMENT, BufferPool, IORequest, Op
from swap.backends.threads import ThreadBackend
from swap.backends.uring import UringBackend, uring_unavailable_reason
from swap.engine import CHAIN_BYTES, chain_length
from swap.settings import EngineSettings
from tests.conftest import contents, fill, random_bytes
from tests.waiting import GUARD, closes, until

TIMEOUT = GUARD
BLOCK = 64 << 10
BLOCKS = 16

needs_uring = pytest.mark.skipif(
    uring_unavailable_reason() is not None, reason="io_uring unavailable"
)


@pytest.fixture
def buffers():
    with BufferPool(2, BLOCKS * BLOCK) as pool:
        yield pool.acquire(), pool.acquire()


def record_chains(backend) -> list[int]:
    """The length of every chain the engine hands ``backend``."""
    lengths: list[int] = []
    real = backend.start_chain

    def recording(requests, done):
        lengths.append(len(requests))
        return real(requests, done)

    backend.start_chain = recording
    return lengths


def test_chain_length_fills_the_drive_queue_within_the_backend_limit():
    settings = EngineSettings(block_size=1 << 20, queue_depth=16)
    assert chain_length(settings, 16) == CHAIN_BYTES // (16 << 20)
    assert chain_length(settings, 1) == 1  # a backend without chains
    assert chain_length(EngineSettings(block_size=CHAIN_BYTES, queue_depth=2), 16) == 1
    assert chain_length(EngineSettings(block_size=ALIGNMENT, queue_depth=1), 16) == 16


@needs_uring
def test_uring_hands_a_whole_transfer_to_the_kernel_with_one_submit(
    make_engine, disk_dir, buffers, monkeypatch
):
    """16 requests on 2 queue slots: two chains of 8 go in with one io_uring_submit, and no
    completion has to take the GIL to start the next request (before chains: 8 or more
    submits, one per completion the thread woke up for)."""
    import swap.backends.uring as uring_module

    engine = make_engine(disk_dir, "uring", block_size=BLOCK, queue_depth=2)
    submits: list[int] = []
    real_submit = uring_module._uring.io_uring_submit
    monkeypatch.setattr(
        uring_module._uring, "io_uring_submit", lambda ring: submits.append(1) or real_submit(ring)
    )
    chains = record_chains(engine.backend)
    extent = engine.allocate(BLOCKS * BLOCK)
    data = random_bytes(BLOCKS * BLOCK, seed=1)
    fill(buffers[0], data)
    engine.write(extent, buffers[0], tag="t").result(TIMEOUT)
    assert chains == [8, 8] and len(submits) == 1
    engine.read(extent, buffers[1], tag="t").result(TIMEOUT)
    assert chains == [8, 8] * 2 and len(submits) == 2
    assert torch.equal(contents(buffers[1], BLOCKS * BLOCK), data)
    stats = engine.stats()
    assert stats.write_requests == stats.read_requests == BLOCKS  # each request still counts
    assert stats.inflight_peak <= 2  # but the queue depth holds


def test_thread_backend_moves_a_chain_with_one_call(make_engine, disk_dir, buffers):
    """One system call, hence one GIL round trip, per chain rather than per request."""
    engine = make_engine(disk_dir, "threads", block_size=BLOCK, queue_depth=2)
    calls: list[int] = []
    real_run = engine.backend._run_batch

    def counting(requests):
        calls.append(len(requests))
        return real_run(requests)

    engine.backend._run_batch = counting
    chains = record_chains(engine.backend)
    extent = engine.allocate(BLOCKS * BLOCK)
    data = random_bytes(BLOCKS * BLOCK, seed=2)
    fill(buffers[0], data)
    engine.write(extent, buffers[0]).result(TIMEOUT)
    engine.read(extent, buffers[1]).result(TIMEOUT)
    assert torch.equal(contents(buffers[1], BLOCKS * BLOCK), data)
    assert chains == [8, 8] * 2
    # a worker may take both chains of a transfer in one call: they continue each other
    assert sum(calls) == 2 * BLOCKS and len(calls) <= 4


def test_a_small_transfer_is_spread_over_the_free_slots(make_engine, disk_dir, buffers):
    """Chains only form when more is queued than there are slots: requests that fit run at
    once, each in its own slot."""
    engine = make_engine(disk_dir, "threads", block_size=BLOCK, queue_depth=4)
    chains = record_chains(engine.backend)
    extent = engine.allocate(3 * BLOCK)
    engine.write(extent, buffers[0]).result(TIMEOUT)
    assert chains == [1, 1, 1]


def test_a_chain_must_be_contiguous_for_the_thread_backend(buffers):
    backend = ThreadBackend(2)
    try:
        with pytest.raises(ValueError, match="continue"):
            backend.submit_chain(
                [
                    IORequest(Op.READ, 0, 0, buffers[0].address, ALIGNMENT),
                    IORequest(Op.READ, 0, 2 * ALIGNMENT, buffers[0].address, ALIGNMENT),
                ]
            )
    finally:
        backend.close()


@needs_uring
def test_uring_chain_runs_in_order_and_holds_one_slot(tmp_path, buffers):
    """The write linked behind a read of an empty pipe waits for that read; the two hold one
    slot between them, so a second request while they wait is one too many."""
    read_end, write_end = os.pipe()
    fd = os.open(tmp_path / "f.bin", os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    backend = UringBackend(1)
    try:
        payload = random_bytes(ALIGNMENT, seed=3)
        fill(buffers[0], payload, offset=ALIGNMENT)
        first, second = backend.submit_chain(
            [
                IORequest(Op.READ, read_end, 0, buffers[0].address, ALIGNMENT),
                IORequest(Op.WRITE, fd, 0, buffers[0].address + ALIGNMENT, ALIGNMENT),
            ]
        )
        time.sleep(0.05)
        assert not first.done() and not second.done() and os.fstat(fd).st_size == 0
        with pytest.raises(RuntimeError, match="queue_depth"):
            backend.submit(IORequest(Op.WRITE, fd, ALIGNMENT, buffers[1].address, ALIGNMENT))
        os.write(write_end, b"x" * ALIGNMENT)
        assert first.result(TIMEOUT) == ALIGNMENT and second.result(TIMEOUT) == ALIGNMENT
        with open(tmp_path / "f.bin", "rb") as f:
            assert f.read() == payload.numpy().tobytes()
        # the slot is free again
        assert (
            backend.submit(IORequest(Op.READ, fd, 0, buffers[1].address, ALIGNMENT)).result(TIMEOUT)
            == ALIGNMENT
        )
    finally:
        backend.close()
        os.close(fd)
        os.close(read_end)
        os.close(write_end)


@needs_uring
def test_uring_chain_requests_keep_their_own_outcome(tmp_path, buffers):
    """A failed request does not cancel the ones linked behind it: each completes as if it had
    run alone (the engine continues or fails each on its own)."""
    path = tmp_path / "f.bin"
    path.write_bytes(b"\0" * ALIGNMENT)
    read_only = os.open(path, os.O_RDONLY)
    fd = os.open(path, os.O_RDWR | os.O_DIRECT)
    backend = UringBackend(2)
    try:
        failed, written = backend.submit_chain(
            [
                IORequest(Op.WRITE, read_only, 0, buffers[0].address, ALIGNMENT),
                IORequest(Op.WRITE, fd, 0, buffers[0].address, ALIGNMENT),
            ]
        )
        error = failed.exception(TIMEOUT)
        assert isinstance(error, OSError) and error.errno == errno.EBADF
        assert written.result(TIMEOUT) == ALIGNMENT
    finally:
        backend.close()
        os.close(fd)
        os.close(read_only)


@needs_uring
@pytest.mark.parametrize(
    ("pages", "interrupted_call"),
    [((0, 2), 2), ((0, 1), 1)],
    ids=["linked-requests", "one-request-for-the-chain"],
)
def test_an_interrupted_chain_leaves_nothing_in_the_ring(
    tmp_path, buffers, monkeypatch, pages, interrupted_call
):
    """An exception after some of a chain's slots were taken: none of its requests runs, and
    the backend stays usable. Requests that do not continue one another take a slot each,
    hard-linked; contiguous ones take one slot for the chain."""
    import swap.backends.uring as uring_module

    fd = os.open(tmp_path / "f.bin", os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    os.posix_fallocate(fd, 0, 3 * ALIGNMENT)
    backend = UringBackend(2)
    real_prep = uring_module._uring.io_uring_prep_writev
    calls = []

    def interrupted(*args):
        calls.append(1)
        if len(calls) == interrupted_call:
            raise KeyboardInterrupt
        return real_prep(*args)

    try:
        fill(buffers[0], random_bytes(3 * ALIGNMENT, seed=4))
        monkeypatch.setattr(uring_module._uring, "io_uring_prep_writev", interrupted)
        with pytest.raises(KeyboardInterrupt):
            backend.submit_chain(
                [
                    IORequest(
                        Op.WRITE, fd, i * ALIGNMENT, buffers[0].address + i * ALIGNMENT, ALIGNMENT
                    )
                    for i in pages
                ]
            )
        monkeypatch.undo()
        time.sleep(0.05)
        with open(tmp_path / "f.bin", "rb") as f:
            assert f.read() == b"\0" * 3 * ALIGNMENT  # nothing prepared ever ran
        assert (
            backend.submit(IORequest(Op.READ, fd, 0, buffers[1].address, ALIGNMENT)).result(TIMEOUT)
            == ALIGNMENT
        )
        closes(backend.close)  # nothing of the chain is left for it to wait for
    finally:
        backend.close()
        os.close(fd)


def test_hung_chain_fails_queued_transfers_instead_of_hanging(make_engine, disk_dir, buffers):
    """A request that never completes holds its chain's slot: with every slot held, queued
    transfers fail at once instead of waiting for a slot forever."""
    release = threading.Event()

    class Hanging(ThreadBackend):
        def _run_batch(self, requests):
            release.wait(TIMEOUT)
            return super()._run_batch(requests)

    backend = Hanging(1)
    engine = make_engine(
        disk_dir, io=backend, block_size=BLOCK, queue_depth=1, request_timeout=0.3, close_timeout=5
    )
    extent = engine.allocate(4 * BLOCK)
    stuck = engine.write(extent, buffers[0])
    error = stuck.exception(TIMEOUT)
    assert type(error).__name__ == "TransferTimeoutError"
    assert len(engine.quarantined()) == 4  # the whole chain may still run
    other = engine.allocate(BLOCK)
    engine.write(engine.allocate(BLOCK), buffers[1])  # queued behind the stuck slot
    error = engine.read(other, buffers[1]).exception(TIMEOUT)
    assert type(error).__name__ == "TransferTimeoutError" and "cannot start" in str(error)
    release.set()
    # the late completions release slot and buffers
    until(lambda: engine.quarantined() == [], what="the release of the quarantined requests")


def test_a_signal_during_the_submit_settles_each_request_once(make_engine, disk_dir, buffers):
    """A signal handler's exception (KeyboardInterrupt) can surface in ``start_chain`` after
    the backend took the chain and its callback: the interrupted submit settles the requests
    with the exception, and the backend reports them again when they complete. Each request's
    outcome must still be applied once, or the in-flight count goes below zero and close()
    waits out its timeout for a request that does not exist (a SIGINT in the middle of a step
    hung its process)."""
    engine = make_engine(disk_dir, "threads", block_size=BLOCK, queue_depth=2)
    real_start = engine.backend.start_chain
    interrupted = []

    def start_then_interrupt(requests, done):
        real_start(requests, done)
        if not interrupted:
            interrupted.append(True)
            raise KeyboardInterrupt

    engine.backend.start_chain = start_then_interrupt
    extent = engine.allocate(BLOCKS * BLOCK)
    with pytest.raises(KeyboardInterrupt):
        engine.write(extent, buffers[0])
    until(lambda: engine._inflight == 0, what="the interrupted write's completion")
    assert engine._inflight == 0 and engine.queues.slots_in_use == 0
    engine.write(extent, buffers[0]).result(TIMEOUT)  # the engine still works
    closes(engine.close)  # no request counted that will never complete


@pytest.mark.parametrize("backend", ["threads", "uring"])
def test_a_signal_before_the_submit_leaves_nothing_for_close_to_wait_for(
    make_engine, disk_dir, buffers, backend
):
    """A signal handler's exception can surface after the engine counted a chain in flight
    and before it gave the chain to the backend (a user's SIGTERM handler raising SystemExit
    mid-step made the process wait out close_timeout at exit). close() fails that request at
    once instead of waiting for a completion that cannot come, and a write queued behind it
    still completes."""
    engine = make_engine(disk_dir, backend, block_size=BLOCK, queue_depth=2, close_timeout=1.0)

    class InterruptedOnce(set):
        armed = True

        def add(self, piece) -> None:
            super().add(piece)
            if InterruptedOnce.armed:  # the chain is counted in flight: a signal lands here
                InterruptedOnce.armed = False
                raise KeyboardInterrupt

    engine._flying = InterruptedOnce(engine._flying)
    lost, kept = engine.allocate(BLOCK), engine.allocate(BLOCK)
    with pytest.raises(KeyboardInterrupt):
        engine.write(lost, buffers[0])
    assert engine._inflight == 1  # counted, never submitted
    later = engine.write(kept, buffers[1])
    closes(engine.close)  # gave up on nothing: the orphan failed at once, the write finished
    assert later.result(TIMEOUT) == BLOCK
    assert engine._inflight == 0 and engine.queues.slots_in_use == 0
