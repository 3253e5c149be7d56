"""The store on a CUDA device: training equals plain CUDA training (offloaded to NVMe and to
the host, bf16 and fp16 with loss scaling, accumulation, activation checkpointing), the device
budget holds on the device, host<->device copies are asynchronous from pinned memory, a
slot is not reused before its copy finished, the device is named with its index (activation
offload active with ``device='cuda'``), the arena is pinned at its exact size, and gradients
and look-ahead copies go through the copy stream. Skipped without a GPU; ``make gpu-check`` runs
them on a GPU machine."""

from __future__ import annotations

import copy

import pytest
import torch

import infinity
from infinity.cli.common.tiny_gpt import GPTConfig, TinyGPT, synthetic_batches
from tests.store_helpers import SMALL, make_model

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device (make gpu-check runs these on one)"
)

CUDA = torch.device("cuda")


def _loop(model, optimizer, steps=4, micro_batches=1, config=SMALL, autocast=None):
    data = synthetic_batches(config, 4, seed=1)
    losses = []
    for _ in range(steps):
        total = 0.0
        for _ in range(micro_batches):
            tokens, targets = (t.to(CUDA) for t in next(data))
            if autocast is not None:
                with torch.autocast("cuda", dtype=autocast):
                    loss = model(tokens, targets) / micro_batches
            else:
                loss = model(tokens, targets) / micro_batches
            loss.backward()
            total += loss.item()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total)
    return losses


def _store(tmp_path, **overrides):
    settings = {
        "offload_param": "nvme",
        "offload_optimizer": "nvme",
        "buffer_size": 8192,
        "buffer_count": 8,
        "nvme_path": str(tmp_path),
        "device": "cuda",
        **overrides,
    }
    return infinity.TieredStore(infinity.OffloadConfig(**settings))


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1)


@pytest.mark.parametrize("where", ["nvme", "cpu"])
@pytest.mark.parametrize("micro_batches", [1, 2])
def test_training_on_cuda_equals_plain_cuda(where, micro_batches, tmp_path):
    torch.backends.cuda.matmul.allow_tf32 = False
    reference = make_model()
    plain = copy.deepcopy(reference).to(CUDA)
    expected = _loop(plain, _adamw(plain.parameters()), micro_batches=micro_batches)
    model = copy.deepcopy(reference)
    with _store(tmp_path, offload_param=where, offload_optimizer=where) as store:
        model, optimizer = store.attach(model, _adamw(model.parameters()))
        got = _loop(model, optimizer, micro_batches=micro_batches)
        assert store.stats()["pinned_bytes"] > 0 or where == "cpu"
    for a, b in zip(expected, got):
        assert abs(a - b) <= 1e-5 * max(1.0, abs(a)), (expected, got)


@pytest.mark.parametrize("dtype, name", [(torch.bfloat16, "bf16"), (torch.float16, "fp16")])
def test_mixed_precision_on_cuda_follows_autocast(dtype, name, tmp_path):
    reference = make_model()
    plain = copy.deepcopy(reference).to(CUDA)
    expected = _loop(plain, _adamw(plain.parameters()), autocast=dtype)
    model = copy.deepcopy(reference)
    with _store(tmp_path, precision=infinity.PrecisionConfig(dtype=name)) as store:
        model, optimizer = store.attach(model, _adamw(model.parameters()))
        got = _loop(model, optimizer)
        assert store.skipped_steps == 0 or name == "fp16"
    for a, b in zip(expected, got):
        assert abs(a - b) <= 0.03 * abs(a), (expected, got)


def test_activation_checkpointing_on_cuda(tmp_path):
    config = GPTConfig(
        vocab_size=64, context=16, layers=4, width=32, heads=4, checkpoint_blocks=True
    )
    torch.manual_seed(0)
    reference = TinyGPT(config)
    plain = copy.deepcopy(reference).to(CUDA)
    expected = _loop(plain, _adamw(plain.parameters()), config=config)
    model = copy.deepcopy(reference)
    with _store(tmp_path) as store:
        model, optimizer = store.attach(model, _adamw(model.parameters()))
        got = _loop(model, optimizer, config=config)
    for a, b in zip(expected, got):
        assert abs(a - b) <= 1e-5 * max(1.0, abs(a)), (expected, got)


def test_the_device_budget_holds_on_the_device(tmp_path):
    """Peak device memory attached: at most the budget plus what the plain run needs beyond
    its parameters (activations, gradients, workspaces)."""
    config = GPTConfig(vocab_size=256, context=64, layers=8, width=256, heads=4)
    torch.manual_seed(0)
    reference = TinyGPT(config)
    params = sum(p.numel() * 4 for p in reference.parameters())
    plain = copy.deepcopy(reference).to(CUDA)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    _loop(plain, _adamw(plain.parameters()), steps=2, config=config)
    plain_peak = torch.cuda.max_memory_allocated() - base
    del plain
    torch.cuda.empty_cache()
    budget = params // 4
    model = copy.deepcopy(reference)
    with _store(tmp_path, device_budget=budget, buffer_size=1 << 20) as store:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        model, optimizer = store.attach(model, _adamw(model.parameters()))
        _loop(model, optimizer, steps=2, config=config)
        peak = torch.cuda.max_memory_allocated() - base
        assert store.stats()["peak_bytes"]["device"] <= budget
    assert peak <= budget + (plain_peak - params), (peak, budget, plain_peak, params)


def test_host_to_device_copies_are_asynchronous_from_pinned_memory(tmp_path):
    model = make_model()
    with _store(tmp_path) as store:
        store.attach(model, _adamw(model.parameters()))
        tier = store.placement.device
        source = torch.empty(64 << 20, dtype=torch.uint8, pin_memory=True)
        target = torch.empty(64 << 20, dtype=torch.uint8, device=CUDA)
        # The copy stream is kept busy (a kernel spinning for a few seconds): a copy_in that
        # returns before the copy has run cannot have waited for it.
        with torch.cuda.stream(tier.streams.copy_stream):
            torch.cuda._sleep(5_000_000_000)
        event = tier.copy_in(target, source)
        assert event is not None and source.is_pinned()
        assert not event.query()
        event.synchronize()
        assert store.stats()["pinned_bytes"] > 0


def test_a_slot_is_not_reused_before_its_copy_finished(tmp_path):
    model = make_model()
    with _store(tmp_path) as store:
        model, optimizer = store.attach(model, _adamw(model.parameters()))
        placement = store.placement
        entry = store.registry.entries[0]
        placement.gather(entry, hold=False)
        shard = entry.shards[0]
        if (
            shard.copy_event is not None
            and shard in placement.in_arena
            and shard.state is infinity.Residency.DEVICE_HOST_NVME
        ):
            event = shard.copy_event
            placement.free_slot(shard)
            assert event.query()  # freeing the slot waited for the copy out of it
            placement.registry.set_state(shard, infinity.Residency.DEVICE_NVME)
        _loop(model, optimizer, steps=1)


def test_prefetch_under_a_tight_budget_keeps_stream_order(tmp_path):
    """Prefetch copies on the side stream while the compute stream runs, with a small device
    budget and arena forcing evictions every step: any missing wait shows as wrong values."""
    reference = make_model()
    plain = copy.deepcopy(reference).to(CUDA)
    expected = _loop(plain, _adamw(plain.parameters()), steps=5)
    model = copy.deepcopy(reference)
    per_block = sum(p.numel() * 4 for p in reference.blocks[0].parameters())
    with _store(
        tmp_path, device_budget=3 * per_block + (64 << 10), prefetch_depth=2, buffer_count=6
    ) as store:
        model, optimizer = store.attach(model, _adamw(model.parameters()))
        got = _loop(model, optimizer, steps=5)
        assert store.stats()["prefetched_loads"] > 0
    for a, b in zip(expected, got):
        assert abs(a - b) <= 1e-5 * max(1.0, abs(a)), (expected, got)


@pytest.mark.parametrize("name", ["cuda", "cuda:0"])
def test_activation_offload_is_active_whatever_the_device_is_called(name, tmp_path):
    model = make_model()
    with _store(tmp_path, device=name, offload_activations="cpu") as store:
        model, optimizer = store.attach(model, _adamw(model.parameters()))
        assert store.device.index == torch.cuda.current_device()
        _loop(model, optimizer, steps=1)
        assert store.stats()["activations"]["offloaded_tensors"] > 0


def test_the_arena_is_pinned_at_its_exact_size(tmp_path):
    model = make_model()
    with _store(tmp_path, buffer_count=3, buffer_size=20_480) as store:
        store.attach(model, _adamw(model.parameters()))
        host = store.placement.host
        # Registered by the pool (cudaHostRegister), not torch's pinned allocator: CUDA sees it
        # as page-locked, and the figure is the arena's own size.
        assert host.arena is not None and host.arena.tensor.is_pinned()
        assert store.stats()["pinned_bytes"] == host.arena_bytes + host.pinned_standalone


def test_gradients_and_look_ahead_copies_leave_through_the_copy_stream(tmp_path):
    model = make_model()
    with _store(tmp_path, offload_param="cpu", offload_optimizer="cpu", prefetch_depth=2) as store:
        model, optimizer = store.attach(model, _adamw(model.parameters()))
        _loop(model, optimizer, steps=2)
        assert store.placement.copies.gathered_ahead > 0
        assert store.placement.device.bytes_out > 0
        assert not len(store.placement.gradients.arriving)  # all landed by the step
