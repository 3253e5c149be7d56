"""The registry counts writes whose NVMe copy was never read: a write is only worth its cost
if the copy it leaves is read back (after an eviction)."""

from __future__ import annotations

import collections
from collections.abc import Callable

import torch

import infinity
from infinity.core.residency import Residency as R
from infinity.core.shards import ShardRegistry


def _shard():
    registry = ShardRegistry()
    entry = registry.add_param("w", torch.nn.Parameter(torch.zeros(1024)), 1 << 20)
    shard = entry.shards[0]
    registry.set_state(shard, R.HOST)
    return registry, shard


def _walk(registry, shard, *states) -> None:
    for state in states:
        registry.set_state(shard, state)


def test_a_write_superseded_or_discarded_unread_is_counted():
    registry, shard = _shard()
    _walk(registry, shard, R.HOST_STORING, R.HOST_NVME, R.HOST)  # updated again, never read
    assert (registry.unread_writes, registry.unread_write_bytes) == (1, 4096)
    _walk(registry, shard, R.HOST_STORING, R.HOST_NVME, R.NVME, R.EMPTY)  # discarded unread
    assert (registry.unread_writes, registry.unread_write_bytes) == (2, 8192)


def test_a_write_read_back_is_not_counted():
    registry, shard = _shard()
    _walk(
        registry, shard, R.HOST_STORING, R.HOST_NVME, R.NVME, R.NVME_LOADING, R.HOST_NVME, R.HOST
    )  # evicted, read back, then updated: the write was needed
    _walk(registry, shard, R.HOST_STORING, R.HOST)  # a failed write is not a write
    _walk(
        registry,
        shard,
        R.HOST_STORING,
        R.HOST_NVME,
        R.DEVICE_HOST_NVME,
        R.DEVICE_NVME,
        R.NVME,
        R.NVME_LOADING,
        R.HOST_NVME,
    )
    assert registry.unread_writes == 0


def test_updates_in_optimizer_step_write_nothing_they_do_not_read(tmp_path):
    """Under a budget that streams the state every step, updates in optimizer.step() write
    back only what is read back later: the step's write-backs go to shards that eviction drops
    before their next update."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(6)])
    store = infinity.TieredStore(
        infinity.OffloadConfig(
            offload_param="nvme",
            offload_optimizer="nvme",
            nvme_path=str(tmp_path),
            buffer_size=1 << 18,
            buffer_count=8,
            host_budget=2 << 20,
            device_budget=2 << 20,  # outside the host budget: an arena of all 2 MiB
        )
    )
    model, optimizer = store.attach(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    for step in range(6):
        model(torch.randn(8, 256)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        if step == 1:
            before = store.stats()
    after = store.stats()
    store.close()
    assert after["bytes_written"] - before["bytes_written"] > 4 * (1 << 20)  # it streams
    assert after["unread_write_bytes"] == before["unread_write_bytes"]


def test_updates_in_backward_write_back_only_what_is_read_back(tmp_path):
    """With updates in backward every shard just updated is the one needed last, so each read
    that needs room finds a fresher dirty shard at the front of the eviction order than the
    one whose write-back it started before. Evicting that written one once its write has
    landed, instead of starting the next write, keeps writes to what is read back: before,
    45% of the bytes written here were updated again unread, and twice the bytes read were
    written (the proportions of the 100.7M MLP under a 1.0 GiB host budget, scaled down)."""
    store, train_step = _updating_in_backward(tmp_path, host_mib=16)
    for step in range(8):
        train_step()
        if step == 1:
            before = store.stats()
    after = store.stats()
    store.close()
    written = after["bytes_written"] - before["bytes_written"]
    read = after["bytes_read"] - before["bytes_read"]
    unread = after["unread_write_bytes"] - before["unread_write_bytes"]
    assert written > 6 * (2 << 20)  # it streams
    # Which write-backs land before the next read needs room depends on the disk's timing: on a
    # loaded machine up to 21% of the bytes written were updated again unread (typically 3-7%),
    # and up to 1.19x the bytes read were written. Without the eviction of landed writes it was
    # 45% and 2x, which these bounds still fail.
    assert unread <= 0.3 * written, (unread, written)
    assert written <= 1.5 * read, (written, read)


def test_updates_in_backward_read_each_shard_at_most_once_a_step(tmp_path):
    """An entry's update in backward runs once its gradient is complete, which autograd may
    reach only after the next module's backward event. Ranked as if its update were a step
    away from then on, its optimizer state was evicted to make room for later reads and read
    straight back for the update: on the 100.7M MLP under a 0.7 GiB budget three of the 41
    large reads of a step were such repeats. Here they were 4-8 in three steps, the first
    update's state every step; now 0, and once in six runs 1: a read-ahead of state that
    a master's read needed sooner evicted, as the policy should."""
    store, train_step = _updating_in_backward(tmp_path, host_mib=12)
    repeated = []
    for _ in range(4):
        train_step()
    for _ in range(3):
        store.timeline.transfers.clear()
        with store.timeline.recording():
            train_step()
        reads = collections.Counter(
            t.shard
            for t in store.timeline.transfers
            if t.op == "read" and t.nbytes >= 256 * 256 * 4
        )
        assert sum(reads.values()) >= 12  # it streams
        repeated += [shard for shard, count in reads.items() if count > 1]
    store.close()
    assert len(repeated) <= 1, repeated


def _updating_in_backward(
    tmp_path, host_mib: int
) -> tuple[infinity.TieredStore, Callable[[], None]]:
    """24 x (Linear(256) + ReLU) with updates in backward under a host budget of `host_mib` MiB
    (1 MiB buffers, as many as fit): the proportions of the 100.7M MLP under 0.7-1.0 GiB."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        *[m for _ in range(24) for m in (torch.nn.Linear(256, 256), torch.nn.ReLU())]
    )
    store = infinity.TieredStore(
        infinity.OffloadConfig(
            offload_param="nvme",
            offload_optimizer="nvme",
            nvme_path=str(tmp_path),
            buffer_size=1 << 20,
            buffer_count=host_mib,
            host_budget=host_mib << 20,
            device_budget=int(1.6 * (1 << 20)),
            step_in_backward=True,
        )
    )
    model, optimizer = store.attach(model, torch.optim.AdamW(model.parameters(), lr=1e-3))

    def train_step() -> None:
        model(torch.randn(16, 256)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()

    return store, train_step
