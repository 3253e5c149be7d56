"""Trace recording, departures, Belady eviction, and the residency state machine."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from infinity import OffloadConfig, TieredStore
from infinity.core.overwrite import write_entry
from infinity.core.policies import BeladyEviction, LookaheadPrefetch, LRUEviction
from infinity.core.residency import TRANSITIONS, Residency, ResidencyError, check_transition
from infinity.core.shards import ShardKind
from infinity.core.trace import BACKWARD, FORWARD, Event, Trace, TraceFollower
from tests.store_helpers import assert_equivalent, compare, make_model


class Branchy(nn.Module):
    """Takes a different path through its layers when ``skip`` is set: control flow."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))
        self.skip = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            if self.skip and i == 2:
                continue
            x = torch.tanh(layer(x))
        return x.square().mean()


def _branchy_run(model, optimizer, pattern):
    torch.manual_seed(3)
    losses = []
    for skip in pattern:
        model.skip = skip
        loss = model(torch.randn(8, 16))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def test_departure_from_the_trace_warns_once_and_still_trains_right(tmp_path, caplog):
    torch.manual_seed(0)
    reference = Branchy()
    pattern = [False, False, True, False, True, True, False]
    plain = copy.deepcopy(reference)
    plain_losses = _branchy_run(plain, torch.optim.Adam(plain.parameters(), lr=0.01), pattern)
    attached = copy.deepcopy(reference)
    store = TieredStore(
        OffloadConfig(
            offload_param="nvme",
            nvme_path=str(tmp_path),
            buffer_size=4096,
            buffer_count=3,
            prefetch_depth=2,
        )
    )
    model, optimizer = store.attach(attached, torch.optim.Adam(attached.parameters(), lr=0.01))
    with caplog.at_level(logging.WARNING, logger="infinity.core.trace"):
        losses = _branchy_run(model, optimizer, pattern)
    stats = store.stats()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    store.close()
    assert_equivalent(plain_losses, losses, plain.state_dict(), state)
    warnings = [r for r in caplog.records if "departs from the recorded trace" in r.message]
    assert len(warnings) == 1
    assert stats["trace_departures"] >= 3


def test_prefetch_runs_ahead_once_a_trace_exists(tmp_path):
    result = compare(
        make_model(),
        4,
        {"offload_param": "nvme", "buffer_size": 1 << 14, "buffer_count": 16, "prefetch_depth": 3},
        tmp_path=tmp_path,
    )
    assert_equivalent(*result[:4])
    assert result[4]["prefetched_loads"] > 0


def _trace(sequence: list[list[int]]) -> Trace:
    trace = Trace()
    for module, entries in enumerate(sequence):
        trace.append(Event(FORWARD, module, tuple(entries)))
    return trace


def test_belady_evicts_the_furthest_next_use_first():
    follower = TraceFollower()
    follower.traces["mode"] = _trace([[0], [1], [2], [3], [1], [0]])
    follower.start_iteration("mode")
    follower.observe(Event(FORWARD, 0, (0,)))
    follower.observe(Event(FORWARD, 1, (1,)))
    # At position 2: next uses are 2 -> 0 events away, 3 -> 1, 1 -> 2, 0 -> 3.
    trace, position = follower.trace, follower.position
    order = BeladyEviction().order(
        [0, 1, 2, 3], lambda e: trace.next_use(e, position), recency=lambda e: 0
    )
    assert order == [0, 1, 3, 2]


def test_without_a_trace_eviction_is_least_recently_used():
    follower = TraceFollower()
    follower.start_iteration("new mode")  # recording: nothing to follow yet
    assert follower.trace is None
    last_used = {0: 5, 1: 2, 2: 9}
    assert BeladyEviction().order([0, 1, 2], None, last_used.get) == [1, 0, 2]
    assert LRUEviction().order([0, 1, 2], None, last_used.get) == [1, 0, 2]


def test_lookahead_lists_upcoming_entries_nearest_first():
    follower = TraceFollower()
    follower.traces["m"] = _trace([[0], [1, 2], [2, 3], [4]])
    follower.start_iteration("m")
    follower.observe(Event(FORWARD, 0, (0,)))
    assert list(LookaheadPrefetch(2).wanted(follower)) == [1, 2, 3]


def test_lookahead_counts_its_depth_in_events_that_move_bytes():
    """A LoRA layer: base weights (even entries, 100 bytes) each followed by its two adapters
    (odd entries, 1 byte). Depth 2 reaches two base weights ahead, with the adapters between;
    counting every event, it reached one adapter pair and no weight."""
    sizes = {0: 100, 1: 1, 2: 100, 3: 1, 4: 100, 5: 1, 6: 100}
    follower = TraceFollower()
    follower.traces["m"] = _trace([[0], [1], [1], [2], [3], [3], [4], [5], [5], [6]])
    follower.start_iteration("m")
    follower.observe(Event(FORWARD, 0, (0,)))
    assert list(LookaheadPrefetch(2).wanted(follower)) == [1]
    policy = LookaheadPrefetch(2, entry_bytes=sizes.__getitem__)
    assert list(policy.wanted(follower)) == [1, 2, 3, 4]
    # the window ends with the trace, and depth 0 prefetches nothing
    for event in follower.trace.events[1:7]:
        follower.observe(event)
    assert list(policy.wanted(follower)) == [5, 6]
    assert list(LookaheadPrefetch(0, entry_bytes=sizes.__getitem__).wanted(follower)) == []


def test_every_transition_outside_the_table_is_refused():
    for old in Residency:
        for new in Residency:
            if new in TRANSITIONS[old]:
                check_transition("s", old, new)
            else:
                with pytest.raises(ResidencyError, match=f"{old.name} -> {new.name}"):
                    check_transition("s", old, new)


def test_states_describe_their_copies():
    assert Residency.NVME.on_nvme and not Residency.NVME.on_host
    assert Residency.HOST.dirty and not Residency.HOST.on_nvme
    assert Residency.DEVICE_NVME.on_device and not Residency.DEVICE_NVME.on_host
    assert Residency.NVME_LOADING.in_flight and not Residency.NVME_LOADING.on_host


def test_an_entry_between_uses_prints_without_reading_its_empty_storage(tmp_path):
    """Between uses the device copy has its real shape over an empty storage; printing it
    would read freed memory (a segfault, as when pytest shows a failing frame's arguments)."""
    model = Stack(2)
    store = TieredStore(OffloadConfig(offload_param="nvme", nvme_path=str(tmp_path)))
    store.attach(model)
    try:
        entry = store.registry.entries[0]
        assert not entry.resident
        assert (
            repr(entry)
            == "ParamEntry(0: layers.0.weight, (8, 8) x torch.float32, not resident, holds=0)"
        )
    finally:
        store.close()


class Stack(nn.Module):
    def __init__(self, count: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8, bias=False) for _ in range(count))


ENTRIES = 6
operations = st.lists(
    st.tuples(
        st.sampled_from(["gather", "drop", "write", "read", "load", "drain"]),
        st.integers(0, ENTRIES - 1),
        st.integers(0, 1000),
    ),
    min_size=1,
    max_size=40,
)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(ops=operations)
def test_residency_machine_always_reads_back_the_last_write(tmp_path_factory, ops):
    """Random gathers, device drops, writes, reads, loads and drains against a dict reference,
    with an arena of three slots for six shards, so eviction and write-back happen constantly."""
    path = tmp_path_factory.mktemp("nvme")
    model = Stack(ENTRIES)
    reference = {i: layer.weight.detach().clone() for i, layer in enumerate(model.layers)}
    store = TieredStore(
        OffloadConfig(
            offload_param="nvme",
            nvme_path=str(path),
            buffer_size=4096,
            buffer_count=3,
            device_budget=3 * 256,
        )
    )
    store.attach(model)
    placement = store.placement
    entries = store.registry.entries
    try:
        for op, index, seed in ops:
            entry = entries[index]
            if op == "gather":
                placement.gather(entry)  # evicts unheld copies to make room
                assert torch.equal(entry.param.data, reference[index])
                placement.release(entry)
            elif op == "drop":
                placement.drop_device(entry)
            elif op == "write":
                value = torch.randn(entry.shape, generator=torch.Generator().manual_seed(seed))
                write_entry(store, entry, value)
                reference[index] = value
            elif op == "read":
                assert torch.equal(store.materialize(entry), reference[index])
            elif op == "load":
                shard = entry.shards[0]
                placement.reap(shard)
                placement.load_async(shard)
            else:
                placement.drain()
            peak = placement.device.usage.peak
            assert peak <= placement.device.budget
            assert placement.host.usage.current <= placement.host.budget
        for index, entry in enumerate(entries):
            assert torch.equal(store.materialize(entry), reference[index])
    finally:
        store.close()
    for index, layer in enumerate(model.layers):
        assert torch.equal(layer.weight.detach(), reference[index])


def test_backward_events_are_recorded_in_order(tmp_path):
    model = Stack(3)
    store = TieredStore(OffloadConfig(offload_param="cpu"))
    store.attach(model)
    x = torch.randn(2, 8, requires_grad=True)
    for layer in model.layers:
        x = layer(x)
    x.sum().backward()
    recording = store.follower.recording
    kinds = [(e.kind, e.module) for e in recording.events]
    assert kinds == [
        (FORWARD, 0),
        (FORWARD, 1),
        (FORWARD, 2),
        (BACKWARD, 2),
        (BACKWARD, 1),
        (BACKWARD, 0),
    ]
    store.close()


def test_eviction_ranks_masters_by_when_the_step_needs_them(tmp_path):
    """With parameters on NVMe the step updates every master at the end of the iteration: after
    its backward a layer's master is needed there, not only at the next forward, and the step
    walks the shards in order, so within it a later shard is needed later."""
    import torch

    from infinity import OffloadConfig, TieredStore

    model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(4)])
    store = TieredStore(
        OffloadConfig(
            offload_param="nvme",
            offload_optimizer="nvme",
            nvme_path=str(tmp_path),
            buffer_size=1 << 16,
            buffer_count=64,
            step_in_backward=False,
        )
    )
    model, optimizer = store.attach(model, torch.optim.AdamW(model.parameters()))

    def backward() -> None:
        model(torch.randn(2, 32)).square().mean().backward()

    for _ in range(2):  # the trace is recorded, then followed
        backward()
        optimizer.step()
        optimizer.zero_grad()
    backward()  # the iteration is at its end, its step still to come
    placement = store.placement
    next_use = placement.room.ranking()
    end = len(placement.follower.trace) - placement.follower.position + 0.5
    masters = sorted(
        (s for s in store.registry.shards.values() if s.kind is ShardKind.PARAM),
        key=lambda s: s.entry.index,
    )
    uses = [next_use(s) for s in masters]
    # All are needed by the step, in its order, before the next iteration goes past its first
    # module (by the trace alone, the last layer's master would wait for the next forward).
    assert uses == sorted(uses) and max(uses) < end + 0.5
    state = [next_use(c) for s in masters for c in s.companions.values()]
    assert state == sorted(state) and max(state) < end + 0.5
    optimizer.step()
    next_use = placement.room.ranking()
    trace, position = placement.follower.trace, placement.follower.position
    # stepped: back to the next forward
    assert [next_use(s) for s in masters] == [
        trace.next_use(s.entry.index, position) for s in masters
    ]
    store.close()


def _fault_pages(pages: int) -> None:
    """Writes ``pages`` fresh anonymous pages: as many minor faults."""
    import mmap

    region = mmap.mmap(-1, pages * mmap.PAGESIZE)
    for offset in range(0, len(region), mmap.PAGESIZE):
        region[offset] = 1
    region.close()


def test_the_follower_counts_each_event_s_page_faults():
    """The recorded iteration's faults per event as they were; the followed ones' as the median
    of the last few: what the planner prices for a heap that keeps no freed blocks."""
    follower = TraceFollower()
    events = [Event(FORWARD, 0, ()), Event(FORWARD, 1, ()), Event(BACKWARD, 1, ())]
    pages = 2048

    def iteration(touched: set[int]) -> None:
        follower.start_iteration("train")
        for position, event in enumerate(events):
            follower.observe(event)
            if position in touched:
                _fault_pages(pages)
        follower.pause()

    iteration({0, 2})  # recorded: the first and last events fault fresh pages
    for _ in range(5):
        iteration({1})  # followed: only the second does
    trace = follower.traces["train"]
    assert len(trace.recorded_faults) == len(trace.faults) == len(events)
    first, middle, last = trace.recorded_faults
    assert first >= pages and last >= pages and middle < pages
    first, middle, last = trace.faults
    assert middle >= pages and first < pages and last < pages
