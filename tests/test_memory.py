"""The heap watch: reuse of freed heap blocks only under the line the budgets draw."""

from __future__ import annotations

import ctypes.util
import math

import pytest

from infinity.core import memory
from infinity.core.memory import HeapWatch, bound_heap_retention, resident_bytes
from swap import huge_pages_on_request

pytestmark = pytest.mark.skipif(
    not ctypes.util.find_library("c") or resident_bytes() == 0,
    reason="needs glibc and /proc/self/statm",
)


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
    assert not tight.started
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
    # it ran: the process's peak may hold what it kept (the planner takes that out)
    assert watch.started
    watch.limit = resident_bytes() + (1 << 30)  # room again: reuse stays off
    assert not watch.start(largest=1 << 20, extra=0) and not watch.active
    assert watch.started


def test_without_reuse_a_process_past_the_line_hands_back_its_free_heap():
    import torch

    # 16 KiB blocks come from the heap (under the pinned mmap threshold); every other one freed
    # leaves holes that the trim threshold, which returns only the heap's top, never gives back
    blocks = [torch.ones(4096) for _ in range(8000)]
    del blocks[::2]
    before = resident_bytes()
    watch = HeapWatch(1)  # past the line; reuse never started
    watch.check()
    assert watch.trims == 1 and not watch.active
    assert watch.trimmed_at < before - (32 << 20)  # about 64 MB of holes, less their headers
    watch.check()  # no growth since: no second trim
    assert watch.trims == 1
    watch.decided = True  # bounded for good after the first step: it still trims
    blocks += [torch.ones(4096) for _ in range(8000)]
    del blocks[::2]
    watch.check()
    assert watch.trims == 2
    under = HeapWatch(resident_bytes() + (1 << 30))
    under.check()
    assert under.trims == 0  # under the line: nothing to hand back


def _attached(tmp_path, offload_optimizer: str):
    """A small MLP attached with parameters on NVMe under a 4 MiB host budget."""
    import torch

    from infinity import OffloadConfig, TieredStore

    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)])
    store = TieredStore(
        OffloadConfig(
            offload_param="nvme",
            offload_optimizer=offload_optimizer,
            nvme_path=str(tmp_path),
            buffer_size=1 << 18,
            buffer_count=8,
            host_budget=4 << 20,
        )
    )
    model, optimizer = store.attach(model, torch.optim.AdamW(model.parameters()))
    return store, model, optimizer


def test_a_store_with_a_host_budget_watches_its_heap(tmp_path):
    import torch

    from infinity import OffloadConfig, TieredStore

    store, model, optimizer = _attached(tmp_path, "nvme")
    watch = store._memory.heap_watch
    assert watch is not None and watch.limit > 4 << 20
    watch.limit += 1 << 30  # room for reuse whatever else this test process holds
    for _ in range(2):
        model(torch.randn(4, 256)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    assert watch.seen_peak > 0  # sampled during the steps
    assert watch.active  # reuse started after the first step
    assert store.stats()["heap_reuse"] is True
    store.close()
    assert not watch.active  # a closed store leaves the process bounded
    assert TieredStore(OffloadConfig(offload_param="cpu"))._memory.heap_watch is None


def test_host_memory_outside_the_tiers_raises_the_line():
    rss = resident_bytes()
    budgets_only = HeapWatch(rss - (256 << 20))  # the process is already past that line
    budgets_only.check()
    assert not budgets_only.start(largest=1 << 20, extra=64 << 20)
    watch = HeapWatch(rss - (256 << 20))
    watch.check()
    # ...but 512 MiB of it is optimizer state the user keeps in host memory
    assert watch.start(largest=1 << 20, extra=64 << 20, outside=512 << 20)
    assert watch.limit == rss + (256 << 20)
    watch.stop()


def test_host_tensor_bytes_counts_each_storage_once():
    import torch

    from infinity.core.memory import host_tensor_bytes

    moment = torch.zeros(1000)
    state = {
        0: {"step": torch.tensor(3.0), "exp_avg": moment, "exp_avg_sq": torch.zeros(10, 10)},
        1: {"exp_avg": moment[:10], "other": [torch.zeros(5, dtype=torch.float64)]},
    }
    assert host_tensor_bytes(state) == 4 + 4000 + 400 + 40
    assert host_tensor_bytes({}) == 0


def test_the_line_of_a_store_counts_its_cpu_optimizer_state(tmp_path):
    import torch

    store, model, optimizer = _attached(tmp_path, "cpu")
    watch = store._memory.heap_watch
    before = watch.limit
    model(torch.randn(4, 256)).sum().backward()
    optimizer.step()
    params = sum(p.numel() * 4 for p in model.parameters())
    # Adam's two moments (and its step counters) plus the host gradients' peak
    assert watch.limit - before >= 3 * params
    store.close()


_HUGE_PAGE_CHILD = r"""
import json, logging, os, resource, sys
logging.basicConfig(level=logging.INFO)
import torch
if sys.argv[1] == "late":
    torch.ones(8)  # a CPU tensor before the store: torch has read its setting
from infinity import OffloadConfig, TieredStore
store = TieredStore(OffloadConfig(offload_param="cpu", host_budget=64 << 20))
from infinity.core.memory import bound_heap_retention
bound_heap_retention()  # as attach does: every large block mapped afresh
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
torch.empty(16 << 20, dtype=torch.uint8).fill_(1)  # 4096 pages of 4 KiB
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(json.dumps({"stat": store.stats()["huge_page_allocations"], "faults": faults,
                  "variable": os.environ.get("THP_MEM_ALLOC_ENABLE")}))
"""


def _huge_page_child(when: str, variable: str | None = None) -> tuple[dict, str]:
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    if variable is not None:
        env["THP_MEM_ALLOC_ENABLE"] = variable
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
    done = subprocess.run(
        [sys.executable, "-c", _HUGE_PAGE_CHILD, when],
        env=env,
        timeout=120,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


@pytest.mark.skipif(not huge_pages_on_request(), reason="the kernel gives no huge pages")
def test_a_store_made_before_any_tensor_gets_huge_pages_for_torchs_large_blocks():
    made_first, _ = _huge_page_child("first")
    assert made_first["stat"] is True and made_first["variable"] == "1"
    assert made_first["faults"] < 1024  # 2 MiB faults, not 4096 of 4 KiB
    made_late, log = _huge_page_child("late")
    assert made_late["stat"] is False and made_late["faults"] >= 4096
    assert made_late["variable"] is None  # left as it was for the processes it starts
    assert "Start the process with THP_MEM_ALLOC_ENABLE=1" in log


def test_the_environment_has_the_last_word_on_huge_pages():
    refused, log = _huge_page_child("first", variable="0")
    assert refused["stat"] is False and refused["variable"] == "0"
    assert refused["faults"] >= 4096 and "Start the process" not in log
    if huge_pages_on_request():
        asked, _ = _huge_page_child("late", variable="1")  # set before the process started
        assert asked["stat"] is True and asked["faults"] < 1024


def test_minor_faults_count_fresh_pages_and_fault_seconds_prices_them():
    import mmap

    pages = 1024
    region = mmap.mmap(-1, pages * mmap.PAGESIZE)
    before = memory.minor_faults()
    for offset in range(0, len(region), mmap.PAGESIZE):
        region[offset] = 1
    assert memory.minor_faults() - before >= pages
    region.close()
    seconds = memory.fault_seconds()
    # a fault is about a microsecond here, but a timing is no test: only that it is a price
    # (0 where a loaded machine slowed the refill it is measured against more than the faults)
    assert seconds >= 0.0 and math.isfinite(seconds)
    assert memory.fault_seconds() == seconds  # measured once per process
