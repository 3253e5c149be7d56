"""The heap watch: reuse of freed heap blocks only under the line the budgets draw."""

from __future__ import annotations

import ctypes.util

import pytest

from infinity.memory import HeapWatch, bound_heap_retention, resident_bytes

pytestmark = pytest.mark.skipif(not ctypes.util.find_library("c") or resident_bytes() == 0,
                                reason="needs glibc and /proc/self/statm")


@pytest.fixture(autouse=True)
def pinned():
    assert bound_heap_retention()  # what a store with a host budget starts from
    # Nothing to undo afterwards: the thresholds change speed, never results.


def test_reuse_starts_only_with_room_under_the_line():
    rss = resident_bytes()
    tight = HeapWatch(rss + (8 << 20))
    tight.check()
    assert tight.seen_peak >= rss
    assert not tight.start(largest=1 << 20, extra=64 << 20) and not tight.active
    roomy = HeapWatch(rss + (1 << 30))
    roomy.check()
    assert roomy.start(largest=1 << 20, extra=64 << 20) and roomy.active


def test_passing_the_line_turns_reuse_off_for_good():
    watch = HeapWatch(resident_bytes() + (1 << 30))
    assert watch.start(largest=1 << 20, extra=0)
    watch.check()
    assert watch.active and watch.gave_up_at is None
    watch.limit = 1  # the process is now past the line
    watch.check()
    assert not watch.active and watch.gave_up_at > 1
    watch.limit = resident_bytes() + (1 << 30)  # room again: reuse stays off
    assert not watch.start(largest=1 << 20, extra=0) and not watch.active


def test_a_store_with_a_host_budget_watches_its_heap(tmp_path):
    import torch

    from infinity import OffloadConfig, TieredStore
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)])
    store = TieredStore(OffloadConfig(offload_param="nvme", offload_optimizer="nvme",
                                      nvme_path=str(tmp_path), buffer_size=1 << 18,
                                      buffer_count=8, host_budget=4 << 20))
    model, optimizer = store.attach(model, torch.optim.AdamW(model.parameters()))
    watch = store._heap_watch
    assert watch is not None and watch.limit > 4 << 20
    watch.limit += 1 << 30  # room for reuse whatever else this test process holds
    for _ in range(2):
        model(torch.randn(4, 256)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    assert watch.seen_peak > 0  # sampled during the steps
    assert watch.active  # reuse started after the first step
    store.close()
    assert not watch.active  # a closed store leaves the process bounded
    assert TieredStore(OffloadConfig(offload_param="cpu"))._heap_watch is None
