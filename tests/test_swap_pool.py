"""The buffer pool: aligned slots, bounded waits, cross-thread release, zero-copy views."""

from __future__ import annotations

import gc
import os
import threading
import time

import numpy as np
import pytest
import torch

from swap import (
    ALIGNMENT,
    BufferPool,
    EngineSettings,
    HostBuffer,
    PoolExhaustedError,
    SwapConfigError,
    SwapEngine,
)
from tests.waiting import GUARD, returns


def test_every_buffer_is_aligned_and_disjoint():
    with BufferPool(5, 5000) as pool:
        assert pool.buffer_size == 8192 and pool.nbytes == 5 * 8192
        addresses = [b.address for b in pool.buffers]
        assert all(a % ALIGNMENT == 0 for a in addresses)
        assert all(b.nbytes == 8192 for b in pool.buffers)
        assert sorted(addresses) == [addresses[0] + i * 8192 for i in range(5)]
        assert not pool.pinned or torch.cuda.is_available()


def test_exhaustion_raises_once_the_wait_is_over_and_names_holders():
    with BufferPool(2, ALIGNMENT, name="tiny") as pool:
        pool.acquire(holder="layer.0")
        pool.acquire(holder="layer.1")
        assert pool.free_count == 0 and pool.try_acquire() is None
        with pytest.raises(PoolExhaustedError, match="layer.1") as info:
            returns(pool.acquire, 0.05, what="acquire(timeout=0.05)")
        assert "tiny" in str(info.value)
        with pytest.raises(PoolExhaustedError):
            pool.acquire()  # timeout 0: no wait at all


def test_release_from_another_thread_unblocks_acquire():
    with BufferPool(1, ALIGNMENT) as pool:
        held = pool.acquire()
        releaser = threading.Timer(0.1, held.release)
        releaser.start()
        again = pool.acquire(timeout=GUARD)  # raises PoolExhaustedError if nothing woke it
        assert again is held
        releaser.join()


def test_close_wakes_a_waiting_acquire():
    pool = BufferPool(1, ALIGNMENT)
    pool.acquire()
    errors = []

    def waiter():
        try:
            pool.acquire(timeout=10)
        except RuntimeError as exc:
            errors.append(exc)

    thread = threading.Thread(target=waiter)
    thread.start()
    time.sleep(0.05)
    pool.close()
    thread.join(5)
    assert not thread.is_alive() and "closed" in str(errors[0])


def test_double_release_and_foreign_release_raise():
    with BufferPool(2, ALIGNMENT) as pool, BufferPool(1, ALIGNMENT) as other:
        buffer = pool.acquire()
        buffer.release()
        with pytest.raises(ValueError, match="not held"):
            buffer.release()
        with pytest.raises(ValueError, match="not held"):
            other.release(pool.acquire())
        with pytest.raises(ValueError):
            pool.release(pool.buffers[1])  # never acquired


def test_borrow_gives_back_on_error():
    with BufferPool(1, ALIGNMENT) as pool:
        with pytest.raises(KeyError):
            with pool.borrow() as buffer:
                assert pool.free_count == 0
                raise KeyError
        assert pool.free_count == 1 and pool.acquire() is buffer


def test_numpy_and_torch_views_share_memory():
    with BufferPool(2, 3 * ALIGNMENT) as pool:
        buffer = pool.acquire()
        assert buffer.tensor.data_ptr() == buffer.address == buffer.array.ctypes.data
        buffer.array[:] = 0
        buffer.tensor[5] = 200
        assert buffer.array[5] == 200
        floats = buffer.view(torch.float32, 10, byte_offset=ALIGNMENT)
        floats[:] = 1.5
        assert floats.data_ptr() == buffer.address + ALIGNMENT
        assert np.all(buffer.array[ALIGNMENT : ALIGNMENT + 40].view(np.float32) == 1.5)
        mv = buffer.memoryview(0, 8)
        mv[0] = 9
        assert buffer.tensor[0] == 9
        assert np.shares_memory(buffer.array, pool.buffers[0].array) == (buffer is pool.buffers[0])
        with pytest.raises(ValueError, match="does not fit"):
            buffer.view(torch.float64, 3 * ALIGNMENT // 8 + 1)
        with pytest.raises(ValueError, match="multiple"):
            buffer.view(torch.float32, 1, byte_offset=2)


@pytest.mark.parametrize("count,size", [(0, 4096), (1, 0), (-1, 4096), (True, 4096), (2, 1.5)])
def test_bad_config_raises(count, size):
    with pytest.raises(SwapConfigError):
        BufferPool(count, size)


def test_closed_pool_refuses():
    pool = BufferPool(1, ALIGNMENT)
    pool.close()
    pool.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        pool.acquire()


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs /proc")
def test_prefault_touches_every_page_and_can_be_left_to_first_use():
    size = 256 << 20
    before = _resident_bytes()
    with BufferPool(1, size) as pool:
        assert _resident_bytes() - before >= size * 0.9  # faulted in at creation
    before = _resident_bytes()
    with BufferPool(1, size, prefault=False) as pool:
        assert _resident_bytes() - before < size // 4  # nothing touched yet
        buffer = pool.acquire()
        buffer.tensor[: size // 2].fill_(7)
        assert _resident_bytes() - before >= size // 2 * 0.9
        assert int(buffer.tensor[size // 2 - 1]) == 7 and int(buffer.tensor[-1]) == 0
        buffer.release()


def test_a_finished_transfer_keeps_no_cycle_that_holds_its_buffer(tmp_path):
    """A resolved future forgets its transfer: otherwise transfer and future referred to each
    other, and a closed pool's memory stayed mapped until the garbage collector ran."""
    gc.collect()
    gc.disable()
    try:
        with SwapEngine([tmp_path], EngineSettings()) as engine:
            pool = BufferPool(1, 1 << 20)
            mine = pool.buffers[0].address
            extent = engine.allocate(1 << 20)
            future = engine.write(extent, pool.buffers[0])
            assert future.result() == 1 << 20
            future.add_done_callback(lambda f: None)  # resolved: runs at once, as before
            assert future.done() and future.exception() is None
            engine.read(extent, pool.buffers[0]).result()
            pool.close()
            del pool
        # (other tests' pools may be alive in this process: only this one's buffer counts)
        alive = [o for o in gc.get_objects() if isinstance(o, HostBuffer) and o.address == mine]
        assert alive == []
        assert future.result() == 1 << 20  # the outcome outlives the transfer
    finally:
        gc.enable()
