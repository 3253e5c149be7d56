"""The store under injected I/O faults (swap.faults.FaultInjectingBackend under its engine).

For every fault kind x read/write: a training step either succeeds with the right values (a
transient fault is retried; short transfers are continued by the engine; slow ones are slower),
or fails with an error naming file, offset and cause, and in every case the store stays
consistent (``Placement.audit``), no thread hangs, ``close()`` removes every file, and once the
fault is cleared the store reads back exactly the last values written and training goes on.
"""

from __future__ import annotations

import copy
import faulthandler
import os
import random
import re
import threading
from pathlib import Path

import pytest
import torch
from torch import nn

from infinity import OffloadConfig, TieredStore
from infinity.config import AioConfig
from infinity.core.overwrite import write_entry
from infinity.core.residency import Residency as R
from infinity.errors import BudgetError
from swap import FaultInjectingBackend, IntegrityError, SwapIOError, TransferTimeoutError
from tests.waiting import until

WIDTH = 64  # a weight is 16 KiB: four pages, so "short" faults apply to its transfers
LAYERS = 4
SHARD = WIDTH * WIDTH * 4
#: short, so an injected hang costs little; not shorter: a request whose completion thread waits
#: for the GIL behind the training thread (first fused-Adam call: ~0.5 s here) must not time out
HANG_TIMEOUT = 1.0
#: the cases without hangs: on a loaded machine a 4 KiB write has taken over a second, which
#: must not turn a slow or failed request into a timeout those cases do not expect
REQUEST_TIMEOUT = 30.0
#: the error a persistent fault of each kind surfaces as
ERRORS = {
    "eio": SwapIOError,
    "enospc": SwapIOError,
    "hang": TransferTimeoutError,
    "drop": IntegrityError,
}
CASES = [
    (kind, op)
    for kind in ("eio", "short", "enospc", "slow", "hang", "drop")
    for op in ("read", "write")
    if not (kind == "enospc" and op == "read")
]


class Net(nn.Module):
    def __init__(self, layers: int = LAYERS) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x.square().mean()


def batch(step: int) -> torch.Tensor:
    return torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(step))


@pytest.fixture(autouse=True)
def no_hang():
    """A hang anywhere fails the run with every thread's stack instead of stalling CI."""
    faulthandler.dump_traceback_later(120, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


class Rig:
    """An attached Net (params, and with ``optimizer`` its Adam state, on NVMe) over a
    fault-injecting backend, next to a plain copy trained on the same batches."""

    def __init__(
        self,
        path: Path,
        optimizer: bool = True,
        buffer_count: int = 8,
        queue_depth: int = 64,
        optimizer_tier: str = "nvme",
        hangs: bool = False,
        **config,
    ) -> None:
        torch.manual_seed(0)
        model = Net()
        self.path = path
        self.plain = copy.deepcopy(model)
        self.plain_opt = torch.optim.Adam(self.plain.parameters(), lr=1e-2, fused=True)
        self.faults: FaultInjectingBackend | None = None

        def wrap(backend):
            self.faults = FaultInjectingBackend(backend, seed=0)
            return self.faults

        # Faults in optimizer.step()'s pipeline; test_step_in_backward covers them in backward.
        config.setdefault("step_in_backward", False)
        config = OffloadConfig(
            offload_param="nvme",
            offload_optimizer=optimizer_tier if optimizer else "none",
            nvme_path=str(path),
            buffer_size=SHARD,
            buffer_count=buffer_count,
            device_budget=2 * (SHARD + WIDTH * 4),
            prefetch_depth=1,
            aio=AioConfig(queue_depth=queue_depth),
            **config,
        )
        self.store = TieredStore(
            config,
            backend_wrapper=wrap,
            engine_overrides={
                "request_timeout": HANG_TIMEOUT if hangs else REQUEST_TIMEOUT,
                "close_timeout": 5.0,
            },
        )
        self.threads = set(threading.enumerate())
        self.model, self.opt = self.store.attach(
            model, torch.optim.Adam(model.parameters(), lr=1e-2) if optimizer else None
        )
        self.placement = self.store.placement
        self.entries = self.store.registry.entries
        self.step_count = 0

    def step(self) -> float:
        x = batch(self.step_count)
        self.step_count += 1  # counted when started: plain_step() replays it, failed or not
        loss = self.model(x)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()
        return loss.item()

    def plain_step(self) -> float:
        """The last step started on the store, on the plain copy."""
        loss = self.plain(batch(self.step_count - 1))
        loss.backward()
        self.plain_opt.step()
        self.plain_opt.zero_grad()
        return loss.item()

    def values(self) -> dict[str, torch.Tensor]:
        return {e.name: self.store.materialize(e) for e in self.entries}

    def plain_values(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.plain.named_parameters()}

    def check(self) -> None:
        assert self.placement.audit() == []

    def close(self) -> None:
        self.store.close()  # a hang is caught by no_hang
        self.assert_released()

    def assert_released(self) -> None:
        assert not any(self.path.rglob("*")), f"left behind: {list(self.path.rglob('*'))}"
        until(
            lambda: (
                not [t for t in threading.enumerate() if t not in self.threads and t.is_alive()]
            ),
            what="the end of the store's threads after close",
        )


def assert_same(values: dict, reference: dict, exact: bool = True) -> None:
    assert values.keys() == reference.keys()
    for name in values:
        if exact:
            assert torch.equal(values[name], reference[name]), name
        else:
            torch.testing.assert_close(
                values[name],
                reference[name],
                rtol=1e-5,
                atol=1e-6,
                msg=lambda m, name=name: f"{name}: {m}",
            )


def assert_names_the_place(error: BaseException, root: Path) -> None:
    """The error names a swap file under ``root`` and an offset in it."""
    assert isinstance(error.path, Path) and root in error.path.parents, error
    assert isinstance(error.offset, int) and error.offset >= 0, error
    assert str(error.path) in str(error) and str(error.offset) in str(error), error


# -- transient faults: retried, training unaffected ---------------------------------------------


@pytest.mark.parametrize("kind,op", [c for c in CASES if c != ("drop", "write")])
def test_a_transient_fault_does_not_change_training(tmp_path, kind, op):
    rig = Rig(tmp_path, hangs=kind == "hang")
    try:
        for _ in range(2):  # warm up: traces recorded, Adam state on NVMe
            assert rig.step() == pytest.approx(rig.plain_step(), abs=1e-6)
        rig.faults.inject(kind, op, times=1, delay=0.05)
        for _ in range(3):
            assert rig.step() == pytest.approx(rig.plain_step(), abs=1e-6)
            rig.check()
        stats = rig.store.stats()
        assert rig.faults.injected[kind] == 1
        assert stats["io_failures"] == 0
        if kind in ("eio", "enospc", "hang"):
            assert stats["io_errors"] >= 1 and stats["io_retries"] >= 1
            assert stats["io_recoveries"] >= 1
        if kind in ("short", "slow"):
            assert stats["io_errors"] == 0  # continued by the engine / only late
        if kind == "hang":
            assert stats["io_timeouts"] >= 1
            if op == "read":  # the kernel might still fill that slot: never reused
                assert stats["quarantined_bytes"] > 0
        assert_same(rig.values(), rig.plain_values(), exact=False)
    finally:
        rig.close()


def test_a_dropped_read_is_caught_by_verification_and_read_again(tmp_path):
    rig = Rig(tmp_path)
    try:
        rig.step()
        rig.plain_step()
        # No more drops than retries: all of them may hit the same shard in a row.
        rig.faults.inject("drop", "read", times=rig.placement.completions.max_retries)
        for _ in range(2):
            assert rig.step() == pytest.approx(rig.plain_step(), abs=1e-6)
        rig.placement.drain()
        stats = rig.store.stats()
        # A dropped read leaves the slot as it was: unless that happened to hold the same
        # bytes, verification fails it and a retry (or the next load) reads the right ones.
        assert stats["integrity_errors"] == stats["io_errors"]
        assert stats["io_failures"] == 0
        assert_same(rig.values(), rig.plain_values(), exact=False)
    finally:
        rig.close()


# -- persistent faults on single operations, against an exact reference ---------------------------


def _random_ops(rig: Rig, reference: dict, rng: random.Random, count: int) -> BaseException | None:
    """Writes, reads, gathers and device drops of random entries until one raises; the
    reference follows every write that returned (an entry is one shard, so a write either
    happens or not)."""
    store, placement = rig.store, rig.placement
    for _ in range(count):
        entry = rng.choice(rig.entries)
        op = rng.choice(["write", "write", "read", "gather", "drop", "evict"])
        try:
            if op == "write":
                value = torch.randn(
                    entry.shape, generator=torch.Generator().manual_seed(rng.randrange(1 << 30))
                )
                write_entry(store, entry, value)
                reference[entry.name] = value
            elif op == "read":
                assert torch.equal(store.materialize(entry), reference[entry.name])
            elif op == "gather":
                placement.gather(entry)
                try:
                    assert torch.equal(entry.param.data, reference[entry.name])
                finally:
                    placement.release(entry)
            elif op == "drop":
                placement.drop_device(entry)
            else:
                _evict_everything(rig)
        except (SwapIOError, TransferTimeoutError, IntegrityError) as exc:
            return exc
        rig.check()
    return None


@pytest.mark.parametrize("kind,op", [c for c in CASES if c != ("drop", "write")])
def test_a_persistent_fault_fails_cleanly_and_nothing_is_lost(tmp_path, kind, op):
    # 4 slots for 5 shards: evictions all the time. Hung reads keep their slots quarantined
    # (until the engine closes): room for that.
    rig = Rig(
        tmp_path, optimizer=False, buffer_count=8 if kind == "hang" else 4, hangs=kind == "hang"
    )
    rng = random.Random(f"{kind}-{op}")
    try:
        reference = rig.values()
        assert _random_ops(rig, reference, rng, 10) is None
        rig.faults.inject(kind, op, times=None, delay=0.02)
        error = _random_ops(rig, reference, rng, 60)
        if kind in ("short", "slow"):
            assert error is None  # continued, or merely late: nothing fails
        else:
            assert isinstance(error, ERRORS[kind]), error
            assert_names_the_place(error, tmp_path)
            stats = rig.store.stats()
            assert stats["io_failures"] >= 1
            assert stats["io_retries"] >= rig.placement.completions.max_retries
        rig.check()
        # No dirty host copy was dropped, no read returned wrong bytes: once the fault is
        # gone every entry reads back as last written, and work goes on from there.
        rig.faults.clear()
        assert_same(rig.values(), reference)
        assert _random_ops(rig, reference, rng, 30) is None
        assert_same(rig.values(), reference)
        rig.check()
    finally:
        rig.close()


@pytest.mark.parametrize(
    "kind,op", [("eio", "read"), ("eio", "write"), ("hang", "read"), ("enospc", "write")]
)
def test_a_training_step_under_a_persistent_fault(tmp_path, kind, op):
    """The step fails with the named error; the parameters are then each either as before the
    step or as after it (tiles already updated stay so), never anything else; training goes
    on once the fault is gone (hung reads keep their slots quarantined until the engine
    closes, as nothing says the kernel is done with them: the arena has room for that here)."""
    rig = Rig(tmp_path, buffer_count=16 if kind == "hang" else 8, hangs=kind == "hang")
    try:
        rig.step()
        rig.plain_step()
        rig.faults.inject(kind, op, times=None)
        error = None
        for _ in range(3):  # the fault may first hit an I/O a later step waits for
            before = rig.plain_values()
            try:
                rig.step()
            except (ERRORS[kind], BudgetError) as exc:
                error = exc
                break
            rig.plain_step()
        if isinstance(error, BudgetError):
            # Hung reads quarantined their slots until the arena ran out: named as such.
            assert kind == "hang" and "quarantined behind reads that timed out" in str(error)
            assert str(tmp_path) in str(error)
        else:
            assert error is not None
            assert_names_the_place(error, tmp_path)
        rig.check()
        rig.faults.clear()
        rig.plain_step()
        after = rig.plain_values()
        for name, value in rig.values().items():
            assert torch.allclose(value, before[name], rtol=1e-5, atol=1e-6) or torch.allclose(
                value, after[name], rtol=1e-5, atol=1e-6
            ), name
        rig.opt.zero_grad()
        for _ in range(2):
            assert torch.isfinite(torch.tensor(rig.step()))
        rig.check()
    finally:
        rig.close()


# -- integrity: what verification catches under an attached model ---------------------------------


def _evict_everything(rig: Rig) -> None:
    """Leaves every parameter shard on NVMe only, so the next use reads it from its file."""
    placement = rig.placement
    for entry in rig.entries:
        placement.drop_device(entry, force=True)
    placement.flush()
    for shard in list(placement.in_arena):
        if shard.state is R.HOST_NVME:
            placement.room.evict_host(shard)


def test_a_flipped_byte_in_a_swap_file_is_named_and_never_trained_on(tmp_path):
    rig = Rig(tmp_path)
    try:
        rig.step()
        rig.plain_step()
        good = rig.values()
        _evict_everything(rig)
        entry = rig.entries[2]  # layers.1.weight
        shard = entry.shards[0]
        assert shard.state is R.NVME
        segment = shard.extent.segments[0]
        with open(segment.file.path, "r+b") as handle:
            handle.seek(segment.offset + 100)
            byte = handle.read(1)
            handle.seek(segment.offset + 100)
            handle.write(bytes([byte[0] ^ 0x10]))
            handle.flush()
            os.fsync(handle.fileno())
        with pytest.raises(IntegrityError) as caught:
            rig.model(batch(99))
        error = caught.value
        assert error.path == segment.file.path and error.offset == segment.offset
        assert error.expected == [shard.id, shard.version]
        assert "matches nothing this engine wrote" in str(error)
        stats = rig.store.stats()
        assert (
            stats["io_retries"] == rig.placement.completions.max_retries
            and stats["io_failures"] == 1
        )
        assert shard.state is R.NVME and not entry.resident
        rig.check()
        # Rewriting the value (from a checkpoint; here the copy taken before) heals it, without
        # reading the bad copy first.
        rig.placement.prepare_overwrite(shard)
        write_entry(rig.store, entry, good[entry.name])
        assert_same(rig.values(), good)
        rig.step()
        rig.plain_step()
        assert_same(rig.values(), rig.plain_values(), exact=False)
    finally:
        rig.close()


def test_a_swapped_extent_is_refused_before_any_io(tmp_path):
    rig = Rig(tmp_path, optimizer=False)
    try:
        good = rig.values()
        _evict_everything(rig)
        a, b = rig.entries[0].shards[0], rig.entries[2].shards[0]
        a.extent, b.extent = b.extent, a.extent
        with pytest.raises(
            IntegrityError,
            match=f"expects shard {a.id} version {a.version}, "
            f"but the last write there was shard {b.id}",
        ):
            rig.store.materialize(rig.entries[0])
        a.extent, b.extent = b.extent, a.extent
        assert_same(rig.values(), good)
    finally:
        rig.close()


def test_a_dropped_write_is_detected_at_the_next_read(tmp_path):
    """A write that reports success without landing cannot be noticed when it happens; the
    next read of that shard fails verification naming the stale version, instead of
    training on it. Rewriting the shard recovers."""
    rig = Rig(tmp_path, optimizer=False, buffer_count=4)
    try:
        entry = rig.entries[0]
        rig.faults.inject("drop", "write", times=1)
        value = torch.randn(entry.shape, generator=torch.Generator().manual_seed(1))
        write_entry(rig.store, entry, value)
        _evict_everything(rig)
        with pytest.raises(IntegrityError, match="the last write did not land") as caught:
            rig.store.materialize(entry)
        assert_names_the_place(caught.value, tmp_path)
        rig.check()
        rig.placement.prepare_overwrite(entry.shards[0])
        write_entry(rig.store, entry, value)
        _evict_everything(rig)
        assert torch.equal(rig.store.materialize(entry), value)
    finally:
        rig.close()


# -- eviction and teardown ------------------------------------------------------------------------


def test_failed_write_backs_keep_dirty_copies_and_eviction_names_the_error(tmp_path):
    """Every write fails: the arena fills with dirty shards that cannot be cleaned. Eviction
    never drops one; the load that finds no room raises the write error, not a budget error."""
    rig = Rig(tmp_path, optimizer=False, buffer_count=4)
    try:
        reference = rig.values()
        rig.faults.inject("eio", "write", times=None)
        with pytest.raises(SwapIOError, match="write of") as caught:
            for index, entry in enumerate(rig.entries):
                value = torch.full(entry.shape, float(index))
                write_entry(rig.store, entry, value)
                reference[entry.name] = value
        assert_names_the_place(caught.value, tmp_path)
        dirty = [s for s in rig.placement.in_arena if s.state is R.HOST]
        assert dirty, "the failed shards must stay dirty on the host"
        rig.check()
        rig.faults.clear()
        rig.placement.flush()
        assert not [s for s in rig.placement.in_arena if s.state is R.HOST]
        _evict_everything(rig)
        assert_same(rig.values(), reference)
    finally:
        rig.close()


def test_close_under_a_persistent_fault_still_releases_everything(tmp_path):
    rig = Rig(tmp_path, optimizer=False, buffer_count=4)
    _evict_everything(rig)
    rig.faults.inject("eio", "read", times=None)
    with pytest.raises(SwapIOError):
        rig.store.close()  # a parameter could not be read back: raised after releasing all
    rig.assert_released()
    rig.store.close()  # closed: a no-op


def test_a_hung_read_quarantines_its_slot_until_the_engine_lets_go(tmp_path):
    rig = Rig(tmp_path, optimizer=False, buffer_count=4, hangs=True)
    try:
        reference = rig.values()
        _evict_everything(rig)
        rig.faults.inject("hang", "read", times=1)
        entry = rig.entries[0]
        # read again once the hung request timed out (not when the hang ends: it never does)
        assert torch.equal(rig.store.materialize(entry), reference[entry.name])
        placement = rig.placement
        assert len(placement.completions.quarantine) == 1
        offset, nbytes, shard_id = placement.completions.quarantine[0]
        assert shard_id == entry.shards[0].id and entry.shards[0].arena_offset != offset
        assert rig.store.stats()["quarantined_bytes"] == SHARD
        # The slot stays allocated while any other shard needs room.
        for other in rig.entries:
            assert torch.equal(rig.store.materialize(other), reference[other.name])
            assert all(s.arena_offset != offset for s in placement.in_arena)
        rig.check()
    finally:
        rig.close()


@pytest.mark.parametrize("optimizer_tier", ["nvme", "cpu"])
def test_a_step_that_failed_part_way_is_finished_by_calling_step_again(tmp_path, optimizer_tier):
    """A persistent read fault stops optimizer.step() after some shards were updated; the
    error says how many, and once the fault is gone a second optimizer.step() updates exactly
    the rest (none twice, gradients in host memory or on NVMe): the parameters then match the
    plain run."""
    # Host gradients: an arena of three weights, so the step reads masters back from NVMe.
    rig = Rig(
        tmp_path, optimizer_tier=optimizer_tier, buffer_count=8 if optimizer_tier == "nvme" else 3
    )
    try:
        rig.step()
        rig.plain_step()
        x = batch(rig.step_count)
        rig.step_count += 1
        rig.model(x).backward()
        rig.faults.inject("eio", "read", times=None, after=3 if optimizer_tier == "nvme" else 1)
        with pytest.raises(SwapIOError) as caught:
            rig.opt.step()
        note = " ".join(getattr(caught.value, "__notes__", []))
        match = re.search(r"after updating (\d+) of (\d+) shards", note)
        assert match, note
        assert 0 < int(match.group(1)) < int(match.group(2)), note
        rig.check()
        rig.faults.clear()
        rig.opt.step()  # finishes the step
        rig.opt.zero_grad()
        rig.plain_step()
        assert_same(rig.values(), rig.plain_values(), exact=False)
        rig.step()
        rig.plain_step()
        assert_same(rig.values(), rig.plain_values(), exact=False)
    finally:
        rig.close()
