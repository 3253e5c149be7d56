"""The CUDA path's orderings, driven on the CPU by the recording fake of
:mod:`infinity.core.streams`: its copies run only when something waits for their event (as a
GPU's copy engine runs them later), so a path that forgets a wait computes with bytes that are
not there yet, and its log shows the order each path took. Also the device identity (``cuda``
against ``cuda:0``), the reserved-memory check and the pinned pool's exact size."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import pytest
import torch

import infinity
from infinity.core import tiers
from infinity.core.streams import (
    CompletionQueue,
    RecordingStreams,
    device_named,
    indexed_device,
    same_device,
)
from infinity.core.tiers import DeviceTier, reserved_over_budget
from infinity.errors import AttachError
from swap import ALIGNMENT, BufferPool
from tests.store_helpers import fused_adamw, make_model, train


def _copies_not_ordered_after_their_allocation(log: list[tuple]) -> list[tuple]:
    """The host->device copies into memory that was not allocated (or handed over again, as a
    gather slot is), and the copy stream then ordered after the compute stream, since it was
    last freed: a copy that may overwrite a block queued kernels still read."""
    ordered: dict[int, bool] = {}
    wrong = []
    for entry in log:
        if entry[0] == "alloc":
            ordered[entry[1]] = False
        elif entry[0] == "copy-waits-compute":
            ordered = dict.fromkeys(ordered, True)
        elif entry[0] == "free":
            ordered.pop(entry[1], None)
        elif entry[0] == "copy" and entry[1] == "h2d":
            if not all(ordered.get(address) for address in entry[4]):
                wrong.append(entry)
    return wrong


def _first(log: list[tuple], predicate, start: int = 0) -> int:
    for i in range(start, len(log)):
        if predicate(log[i]):
            return i
    raise AssertionError(f"not in the log after {start}: {log[start:]}")


# -- device identity ----------------------------------------------------------------------------
def test_a_cuda_device_gets_the_current_index_at_attach():
    assert device_named("cuda", True, lambda: 3) == torch.device("cuda", 3)
    assert device_named("auto", True, lambda: 0) == torch.device("cuda", 0)
    assert device_named("cuda:1", True, lambda: 0) == torch.device("cuda", 1)
    assert device_named("auto", False, lambda: 0) == torch.device("cpu")
    assert device_named("cpu", True, lambda: 5) == torch.device("cpu")
    with pytest.raises(AttachError, match="CUDA is not available"):
        device_named("cuda", False, lambda: 0)
    # What a tensor made on the device reports is what the store compares with.
    assert indexed_device(torch.device("cuda"), lambda: 0) == torch.device("cuda:0")


def test_devices_compare_by_type_and_index():
    assert torch.device("cuda") != torch.device("cuda:0")  # why same_device exists
    assert same_device(torch.device("cuda"), torch.device("cuda:0"))
    assert same_device(torch.device("cuda:0"), torch.device("cuda:0"))
    assert not same_device(torch.device("cuda:0"), torch.device("cuda:1"))
    assert not same_device(torch.device("cpu"), torch.device("cuda:0"))


def test_activation_offload_takes_tensors_whose_device_is_named_otherwise():
    """``cuda:0`` against ``cuda`` on a GPU; here ``cpu:0`` against the ``cpu`` its tensors
    report, the same mismatch: compared with != nothing was ever offloaded."""
    from infinity.training.activations import ActivationOffload

    offload = ActivationOffload(
        "cpu",
        torch.device("cpu", 0),
        host_room=None,
        engine=None,
        pin_memory=False,
        prefetch_depth=1,
        prefetch_bytes=None,
        param_storages=lambda: [],
        min_bytes=0,
    )
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 1))
    offload.install(model)
    try:
        model(torch.randn(32, 64)).sum().backward()
        assert offload.stats()["offloaded_tensors"] > 0
    finally:
        offload.close()


# -- the device tier's copies ---------------------------------------------------------------------
def test_a_copy_into_reused_memory_waits_for_its_last_reader():
    streams = RecordingStreams()
    tier = DeviceTier(torch.device("cpu"), 1 << 20, copies=2, streams=streams)
    a = torch.empty(256)
    a.untyped_storage().resize_(0)
    tier.fill(a)
    tier.wait(tier.copy_in(a, torch.full((256,), 1.0)))
    streams.note("read", "a")  # a kernel on the compute stream reads a
    tier.empty(a)  # freed while that kernel may still be queued
    b = torch.empty(256)
    b.untyped_storage().resize_(0)
    tier.fill(b)  # may be handed a's block
    event = tier.copy_in(b, torch.full((256,), 2.0))
    log = streams.log
    read = _first(log, lambda e: e == ("read", "a"))
    alloc = _first(log, lambda e: e[0] == "alloc", read)
    ordered = _first(log, lambda e: e[0] == "copy-waits-compute", alloc)
    copy = _first(log, lambda e: e[0] == "copy" and e[2] == event.number, ordered)
    assert read < alloc < ordered < copy
    assert not event.ran  # issued, not run: the compute stream waits for it at its use
    tier.wait(event)
    assert torch.equal(b, torch.full((256,), 2.0))


def test_a_master_goes_over_the_link_in_the_compute_dtype():
    streams = RecordingStreams()
    tier = DeviceTier(torch.device("cpu"), 1 << 20, copies=1, streams=streams)
    dst = torch.empty(1000, dtype=torch.bfloat16)
    dst.untyped_storage().resize_(0)
    tier.fill(dst)
    master = torch.randn(1000)
    tier.wait(tier.copy_in(dst, master))
    moved = [e[3] for e in streams.log if e[0] == "copy"]
    assert moved == [1000 * 2]  # bf16 bytes, not the fp32 master's 4000
    assert tier.bytes_in == 2000
    assert torch.equal(dst, master.to(torch.bfloat16))


def test_a_gradient_copy_waits_for_the_compute_stream_and_returns_an_event():
    streams = RecordingStreams()
    tier = DeviceTier(torch.device("cpu"), 1 << 20, streams=streams)
    grad = torch.randn(100)
    host = torch.zeros(100)
    event = tier.copy_out_async(host, grad)
    assert not host.any()  # not run yet: the host must not read it
    queue = CompletionQueue(streams)
    seen = []
    queue.add(event, lambda: seen.append(host.clone()), "norm")
    assert not seen
    queue.drain()
    assert torch.equal(seen[0], grad)
    log = streams.log
    waits = _first(log, lambda e: e[0] == "copy-waits-compute")
    ran = _first(log, lambda e: e[0] == "ran" and e[2] == event.number, waits)
    _first(log, lambda e: e == ("host", "norm"), ran)


# -- the store under the fake ---------------------------------------------------------------------
def _store(monkeypatch, streams: RecordingStreams | None, **overrides: Any):
    if streams is not None:
        monkeypatch.setattr(tiers, "streams_for", lambda device: streams)
    settings: dict[str, Any] = dict(
        device="cpu",
        offload_param="cpu",
        offload_optimizer="cpu",
        prefetch_depth=2,
        step_in_backward=False,
    )
    settings.update(overrides)
    store = infinity.TieredStore(infinity.OffloadConfig(**settings))
    model = make_model()
    model, optimizer = store.attach(model, fused_adamw(model.parameters()))
    return store, model, optimizer


def _clip(model: torch.nn.Module) -> None:
    """The loop reads the gradients (their norm) and scales them, as a trainer's clipping does."""
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)


@pytest.mark.parametrize("step_in_backward", [False, True])
def test_training_under_the_fake_matches_the_cpu_path_bit_for_bit(monkeypatch, step_in_backward):
    """Every copy runs late, unless waited for: the values equal the CPU path's only if each
    use of a copy's destination waits for it, and each host use of a gradient waits too."""
    plain, plain_model, plain_opt = _store(monkeypatch, None, step_in_backward=step_in_backward)
    want = train(plain_model, plain_opt, 3, after_backward=_clip)
    want_params = {n: p.detach().clone() for n, p in plain_model.named_parameters()}
    plain.close()
    streams = RecordingStreams()
    store, model, optimizer = _store(monkeypatch, streams, step_in_backward=step_in_backward)
    assert train(model, optimizer, 3, after_backward=_clip) == want
    for name, param in model.named_parameters():
        assert torch.equal(param.detach(), want_params[name]), name
    assert store.placement.copies.gathered_ahead > 0  # the device look-ahead ran
    assert _copies_not_ordered_after_their_allocation(streams.log) == []
    store.close()


def test_a_gradients_host_work_starts_after_its_copys_event(monkeypatch):
    streams = RecordingStreams()
    store, model, optimizer = _store(monkeypatch, streams)
    train(model, optimizer, 1)
    log = streams.log
    d2h = {e[2]: i for i, e in enumerate(log) if e[0] == "copy" and e[1] == "d2h"}
    ran = {e[2]: i for i, e in enumerate(log) if e[0] == "ran" and e[1] == "d2h"}
    work = [i for i, e in enumerate(log) if e[0] == "host" and e[1].startswith("grad ")]
    assert d2h and len(work) == len(d2h)
    # Each gradient's host work comes after its own copy ran, in the order they were issued.
    for number, at in zip(sorted(d2h), work):
        assert d2h[number] < ran[number] < at
    # Not one blocking copy per gradient: later gradients' copies were issued before the
    # host work of the first one ran.
    assert any(d2h[n] < work[0] for n in sorted(d2h)[1:])
    store.close()


def test_copies_issued_ahead_are_waited_for_at_their_modules_gather(monkeypatch):
    streams = RecordingStreams()
    store, model, optimizer = _store(monkeypatch, streams)
    train(model, optimizer, 2)
    log = streams.log
    issued = [e[2] for e in log if e[0] == "copy" and e[1] == "h2d"]
    waited = {e[1]: i for i, e in enumerate(log) if e[0] == "wait"}
    runs = {e[2]: i for i, e in enumerate(log) if e[0] == "ran"}
    assert issued and all(n in waited for n in issued)
    # Some copies were issued ahead: another copy was issued between it and its wait.
    copy_at = {e[2]: i for i, e in enumerate(log) if e[0] == "copy"}
    assert any(
        any(copy_at[m] > copy_at[n] and copy_at[m] < waited[n] for m in issued if m != n)
        for n in issued
    )
    assert all(runs[n] <= waited[n] + 1 for n in issued)
    store.close()


def test_a_master_update_waits_for_the_copy_reading_it(monkeypatch):
    streams = RecordingStreams()
    store, model, optimizer = _store(monkeypatch, streams)
    tokens = torch.randint(0, 64, (4, 16))
    model(tokens, tokens).backward()
    shard = store.registry.entries[0].shards[0]
    before = shard.host_copy().clone()
    into = torch.empty_like(before)
    # A device copy still reading the master (as one issued ahead is), not run yet.
    event = streams.copy(lambda: into.copy_(shard.host_copy()), label="reader")
    shard.copy_event = event
    optimizer.step()
    assert not torch.equal(shard.host_copy(), before)  # the master was updated
    assert torch.equal(into, before)  # the copy read the values before the update
    log = streams.log
    _first(log, lambda e: e == ("sync", event.number))
    store.close()


# -- device memory against the budget -------------------------------------------------------------
def test_reserved_memory_beyond_the_budget_is_named(caplog):
    assert reserved_over_budget(100, 100, 80, 100) == 0
    # 60 bytes reserved beyond the most ever allocated, on top of an 80-byte peak: 40 over.
    assert reserved_over_budget(160, 100, 80, 100) == 40
    streams = RecordingStreams(figures=(160, 100))
    tier = DeviceTier(torch.device("cpu"), 100, streams=streams)
    tier.usage.add(80)
    with caplog.at_level(logging.WARNING, logger="infinity.core.tiers"):
        assert tier.check_reserved() == 40
        assert tier.check_reserved() == 40
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "device_budget" in said[0] and "copy stream" in said[0]
    assert DeviceTier(torch.device("cpu"), 100).check_reserved() == 0  # no CUDA: nothing


# -- pinned memory at its exact size --------------------------------------------------------------
class _Pinner:
    def __init__(self) -> None:
        self.registered: dict[int, int] = {}
        self.calls: list[tuple] = []

    def register(self, address: int, nbytes: int) -> None:
        self.calls.append(("register", address, nbytes))
        self.registered[address] = nbytes

    def unregister(self, address: int) -> None:
        self.calls.append(("unregister", address))
        del self.registered[address]


def test_the_pool_pins_exactly_its_bytes_and_unpins_them_at_close():
    pinner = _Pinner()
    # 3 x 20 KiB + a bit: a power-of-two allocator would lock 128 KiB.
    pool = BufferPool(3, 20_000 + 480, pin_memory=True, pinner=pinner, prefault=False)
    assert pool.pinned
    size = (20_480 + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT
    assert pool.pinned_bytes == pool.nbytes == 3 * size
    [(what, address, nbytes)] = pinner.calls
    assert what == "register" and nbytes == 3 * size and address % ALIGNMENT == 0
    assert address == pool.buffers[0].address
    pool.close()
    assert pinner.calls[-1] == ("unregister", address) and not pinner.registered


def test_an_unpinned_pool_registers_nothing():
    pinner = _Pinner()
    with BufferPool(2, ALIGNMENT, pin_memory=False, pinner=pinner) as pool:
        assert not pool.pinned and pool.pinned_bytes == 0
    assert not pinner.calls


def _ranks_under_the_fake(rank: int, world: int) -> dict:
    """ZeRO-3 on two ranks: this rank's run under the fake, and the same run without it."""
    results: dict[str, Any] = {}
    for fake in (False, True):
        streams = RecordingStreams()
        with pytest.MonkeyPatch.context() as patch:
            if fake:  # this rank's own process: the device tier it makes takes the fake
                patch.setattr(tiers, "streams_for", lambda device, s=streams: s)
            store = infinity.TieredStore(
                infinity.OffloadConfig(
                    device="cpu", offload_param="cpu", offload_optimizer="cpu", prefetch_depth=2
                )
            )
            model = make_model(seed=rank)  # the store starts every rank from rank 0's values
            model, optimizer = store.attach(model, fused_adamw(model.parameters()))
            losses = train(model, optimizer, 2, batch=2, seed=1 + rank)
            state = {k: v.clone() for k, v in model.state_dict().items()}
            store.close()
        results["fake" if fake else "plain"] = (losses, state)
    results["copies"] = sum(1 for e in streams.log if e[:2] == ("copy", "h2d"))
    results["unordered"] = _copies_not_ordered_after_their_allocation(streams.log)
    return results


def test_copies_into_the_ranks_gather_slots_wait_for_their_last_reader():
    from tests.dist_helpers import run_ranks

    for rank, result in run_ranks(_ranks_under_the_fake, 2, timeout=240).items():
        assert result["copies"] > 0
        assert result["unordered"] == [], rank
        plain_losses, plain_state = result["plain"]
        fake_losses, fake_state = result["fake"]
        assert fake_losses == plain_losses
        for name, value in plain_state.items():
            assert np.array_equal(fake_state[name], value), name


def test_the_host_tier_pins_its_arena_and_large_tensors_at_their_own_size():
    from infinity.core.tiers import EXACT_PIN_BYTES, HostTier

    pinner = _Pinner()
    arena = 3 * (1 << 20) + ALIGNMENT
    host = HostTier(64 << 20, arena, pin=True, slot_size=1 << 20, pinner=pinner)
    assert [c[2] for c in pinner.calls] == [host.arena_bytes]
    numel = (EXACT_PIN_BYTES * 3) // 4 + 3  # 3 MiB + 12 bytes of fp32: 4 MiB to a power of 2
    master = host.allocate(numel, torch.float32)
    assert master.numel() == numel and master.data_ptr() % ALIGNMENT == 0
    master.fill_(1.5)
    size = (numel * 4 + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT
    assert pinner.calls[-1] == ("register", master.data_ptr(), size)
    small = host.allocate(100, torch.float32)  # below EXACT_PIN_BYTES: torch's allocator
    assert small.numel() == 100 and len(pinner.calls) == 2
    assert host.pinned_bytes == host.arena_bytes + size
    host.close()
    assert not pinner.registered and host.pinned_bytes == 0
    assert float(master[-1]) == 1.5  # still readable: unmapped with its last view
