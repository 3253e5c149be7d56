"""Stress: random sequences of store operations on an attached model, against a plain model.

A hypothesis state machine drives a small attached model (params and Adam state on NVMe, an
arena of a few slots, a device budget of two layers, so eviction and write-back happen all the
time) through gathers and releases, prefetches, device drops, writes, reads, drains and whole
training steps, and checks after every operation that the bookkeeping is exact
(``Placement.audit``: legal states, byte counts per tier equal to what holds them, budgets
kept). Values are compared with a plain copy of the model trained by the same optimizer.

The store is driven by one training thread (its operations are not thread-safe); ``stats()``
and the timeline are read concurrently from a second thread here, as a monitoring thread
would, while the engine completes transfers on its own threads.
"""

from __future__ import annotations

import copy
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from torch import nn

from infinity import OffloadConfig, TieredStore
from infinity.core.overwrite import write_entry
from infinity.errors import BudgetError

WIDTH = 32  # a weight is 4 KiB: one slot
LAYERS = 4
ENTRIES = 2 * LAYERS
SLOT = WIDTH * WIDTH * 4
#: the whole run: examples x steps, each step one operation. The suite runs 3,000 operations;
#: ``make stress`` runs 50 examples (15,000 operations, ten minutes or more here).
EXAMPLES = int(os.environ.get("INFINITY_STRESS_EXAMPLES", "10"))
STEPS = 300
MIN_OPERATIONS = EXAMPLES * STEPS * 2 // 3  # examples end early when a rule cannot run

operations = 0  # counted across examples; the test checks the total
training_steps = 0


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x.square().mean()


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a, b, rtol=1e-5, atol=1e-6)


class StoreMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.path = Path(tempfile.mkdtemp(prefix="infinity-stress-"))
        torch.manual_seed(0)
        model = Net()
        self.plain = copy.deepcopy(model)
        self.plain_opt = torch.optim.Adam(self.plain.parameters(), lr=1e-2, fused=True)
        self.reference = dict(self.plain.named_parameters())  # name -> plain parameter
        self.store = TieredStore(
            OffloadConfig(
                offload_param="nvme",
                offload_optimizer="nvme",
                nvme_path=str(self.path),
                buffer_size=SLOT,
                buffer_count=6,
                device_budget=2 * (SLOT + WIDTH * 4),
                prefetch_depth=1,
            )
        )
        self.model, self.opt = self.store.attach(
            model, torch.optim.Adam(model.parameters(), lr=1e-2)
        )
        self.placement = self.store.placement
        self.entries = self.store.registry.entries
        self.held: list = []  # entries gathered by a rule and not yet released, with repeats
        self.since_step = 0
        self.store.timeline.enabled = True  # records for the monitor to read
        self.store.timeline.profile = False  # torch.profiler ranges would only cost time here
        self.monitor_errors: list[BaseException] = []
        self.stop = threading.Event()
        self.monitor = threading.Thread(target=self._monitor, name="stats-monitor", daemon=True)
        self.monitor.start()

    def _monitor(self) -> None:
        """Reads stats and the timeline while the training thread works, as a monitoring
        thread would; what it reads must always be coherent."""
        try:
            rounds = 0
            while not self.stop.wait(0.01):  # a real monitor polls; it must not hog the GIL
                stats = self.store.stats()
                for tier in ("device", "host"):
                    assert 0 <= stats["current_bytes"][tier] <= stats["budgets"][tier]
                rounds += 1
                if rounds % 10 == 0:
                    self.store.timeline.summary()
        except BaseException as exc:
            self.monitor_errors.append(exc)

    def _count(self) -> None:
        global operations
        operations += 1
        self.since_step += 1

    # -- rules ------------------------------------------------------------------------------
    @precondition(lambda self: len(self.held) < 2)
    @rule(index=st.integers(0, ENTRIES - 1))
    def gather(self, index: int) -> None:
        entry = self.entries[index]
        self._count()
        held_bytes = sum(e.device_bytes for e in set(self.held) if e is not entry)
        if held_bytes + entry.device_bytes > self.placement.device.budget:
            with pytest.raises(BudgetError):
                self.placement.gather(entry)
            return
        self.placement.gather(entry)
        self.held.append(entry)
        assert _close(entry.param.data, self.reference[entry.name].detach())

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def release(self, data) -> None:
        self._count()
        entry = self.held.pop(data.draw(st.integers(0, len(self.held) - 1)))
        self.placement.release(entry)

    @rule(index=st.integers(0, ENTRIES - 1))
    def prefetch(self, index: int) -> None:
        self._count()
        shard = self.entries[index].shards[0]
        self.placement.reap(shard)
        self.placement.load_async(shard, prefetch=True)

    @rule(index=st.integers(0, ENTRIES - 1))
    def drop_device(self, index: int) -> None:
        self._count()
        entry = self.entries[index]
        if entry in self.held:
            with pytest.raises(RuntimeError, match="in use"):
                self.placement.drop_device(entry)
        else:
            self.placement.drop_device(entry)

    @rule(index=st.integers(0, ENTRIES - 1), seed=st.integers(0, 2**31 - 1))
    def write(self, index: int, seed: int) -> None:
        self._count()
        entry = self.entries[index]
        self._release_all(entry)
        value = torch.randn(entry.shape, generator=torch.Generator().manual_seed(seed)) * 0.1
        write_entry(self.store, entry, value)
        with torch.no_grad():
            self.reference[entry.name].copy_(value)

    @rule(index=st.integers(0, ENTRIES - 1))
    def read(self, index: int) -> None:
        self._count()
        entry = self.entries[index]
        assert _close(self.store.materialize(entry), self.reference[entry.name].detach())

    @rule()
    def drain(self) -> None:
        self._count()
        assert self.placement.drain() is None

    # A step costs ~30 cheap operations: interleave a few of those between steps.
    @precondition(lambda self: self.since_step >= 3)
    @rule(seed=st.integers(0, 2**31 - 1))
    def train_step(self, seed: int) -> None:
        global training_steps
        self._count()
        training_steps += 1
        self.since_step = 0
        self._release_all()
        x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(seed))
        grad_scale = float(seed % 7 + 1)  # random gradients: the loss scaled per step
        loss = self.model(x) * grad_scale
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()
        plain_loss = self.plain(x) * grad_scale
        plain_loss.backward()
        self.plain_opt.step()
        self.plain_opt.zero_grad()
        assert loss.item() == pytest.approx(plain_loss.item(), rel=1e-5, abs=1e-7)

    def _release_all(self, only=None) -> None:
        for entry in [e for e in self.held if only is None or e is only]:
            self.held.remove(entry)
            self.placement.release(entry)

    # -- invariants ---------------------------------------------------------------------------
    @invariant()
    def bookkeeping_is_exact(self) -> None:
        assert self.placement.audit() == []
        for entry in self.held:
            assert entry.resident and entry.holds > 0
        assert self.placement.device.usage.peak <= self.placement.device.budget
        assert self.placement.host.usage.peak <= self.placement.host.budget

    def teardown(self) -> None:
        self.stop.set()
        self.monitor.join(5)
        try:
            self._release_all()
            for entry in self.entries:
                assert _close(self.store.materialize(entry), self.reference[entry.name].detach())
            stats = self.store.stats()
            assert stats["io_errors"] == 0 and stats["quarantined_bytes"] == 0
        finally:
            self.store.close()
            leftover = list(self.path.rglob("*"))
            shutil.rmtree(self.path, ignore_errors=True)
        assert not leftover, leftover
        assert not self.monitor.is_alive(), "the stats monitor thread hung"
        if self.monitor_errors:
            raise self.monitor_errors[0]


def test_random_operations_keep_the_store_exact():
    global operations, training_steps
    operations = training_steps = 0
    started = time.monotonic()
    run_state_machine_as_test(
        StoreMachine,
        settings=settings(
            max_examples=EXAMPLES,
            stateful_step_count=STEPS,
            deadline=None,
            suppress_health_check=list(HealthCheck),
        ),
    )
    elapsed = time.monotonic() - started
    print(f"{operations} operations ({training_steps} training steps) in {elapsed:.1f} s")
    assert operations >= MIN_OPERATIONS, f"only {operations} operations in {elapsed:.0f} s"
