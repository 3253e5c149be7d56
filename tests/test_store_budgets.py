"""Budgets are enforced, attach-time errors are clear, and stats report exact bytes."""

from __future__ import annotations

import os

import pytest
import torch

import infinity
from infinity import BudgetError, OffloadConfig, TieredStore
from tests.store_helpers import SMALL, assert_equivalent, compare, fused_adamw, make_model, train


def param_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def test_device_peak_stays_within_a_quarter_budget(tmp_path):
    model = make_model()
    budget = param_bytes(model) // 4
    result = compare(
        model,
        6,
        {"offload_param": "nvme", "buffer_size": 1 << 16, "device_budget": budget},
        tmp_path=tmp_path,
    )
    assert_equivalent(*result[:4])
    stats = result[4]
    assert stats["budgets"]["device"] == budget
    assert 0 < stats["peak_bytes"]["device"] <= budget


def test_host_peak_stays_within_budget_with_params_on_nvme(tmp_path):
    model = make_model()
    host_budget = 6 * 4096 * 4  # far below the model's parameter bytes
    assert host_budget < param_bytes(model)
    result = compare(
        model,
        4,
        {
            "offload_param": "nvme",
            "buffer_size": 16384,
            "buffer_count": 8,
            "host_budget": host_budget,
        },
        tmp_path=tmp_path,
    )
    assert_equivalent(*result[:4])
    stats = result[4]
    assert 0 < stats["peak_bytes"]["host"] <= host_budget
    assert stats["current_bytes"]["nvme"] >= param_bytes(model)


def test_device_budget_smaller_than_one_module_is_refused_at_attach(tmp_path):
    model = make_model()
    store = TieredStore(
        OffloadConfig(offload_param="nvme", nvme_path=str(tmp_path), device_budget=1024)
    )
    with pytest.raises(BudgetError) as info:
        store.attach(model, torch.optim.SGD(model.parameters(), lr=0.1))
    message = str(info.value)
    assert "device_budget of 1024" in message and "blocks.0.fc" in message
    # The largest module next to the tied embedding, held through backward: 16896 + 8192.
    assert "take 16896 bytes" in message and "(embed.weight)" in message
    assert "at least 25088" in message
    # Nothing was taken from the model and nothing is left on disk.
    assert all(p.numel() > 0 for p in model.parameters())
    assert os.listdir(tmp_path) == []


def test_host_budget_below_model_with_cpu_offload_is_refused():
    model = make_model()
    store = TieredStore(OffloadConfig(offload_param="cpu", host_budget=1000))
    with pytest.raises(BudgetError, match="host_budget"):
        store.attach(model)


def test_stats_account_every_tier_exactly(tmp_path):
    model = make_model()
    total = param_bytes(model)
    store = TieredStore(
        OffloadConfig(offload_param="nvme", nvme_path=str(tmp_path), buffer_size=1 << 16)
    )
    model, optimizer = store.attach(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    stats = store.stats()
    assert stats["budgets"]["params"] == total
    assert stats["current_bytes"]["device"] == 0
    # Every shard has an aligned NVMe home.
    assert stats["current_bytes"]["nvme"] >= total
    train(model, optimizer, 2)
    stats = store.stats()
    assert stats["steps"] == 2
    assert stats["bytes_written"] >= total and stats["bytes_read"] > 0
    assert stats["io_seconds"] > 0
    for key in ("device", "host", "nvme"):
        assert stats["peak_bytes"][key] >= stats["current_bytes"][key] >= 0
    store.close()


@pytest.mark.parametrize("optimizer_tier", ["cpu", "nvme"])
def test_stats_count_the_copies_between_device_and_host(tmp_path, optimizer_tier):
    model = make_model()
    total = param_bytes(model)
    store = TieredStore(
        OffloadConfig(
            offload_param="nvme",
            offload_optimizer=optimizer_tier,
            nvme_path=str(tmp_path),
            buffer_size=1 << 16,
        )
    )
    model, optimizer = store.attach(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    assert store.stats()["bytes_to_device"] == 0
    x = torch.randint(0, SMALL.vocab_size, (2, SMALL.context))
    model(x).sum().backward()
    stats = store.stats()
    # The device budget holds the whole model: forward gathers every parameter once and
    # backward finds them resident.
    assert stats["bytes_to_device"] == total
    if optimizer_tier == "nvme":
        # Each gradient is copied off the device into its companion shard.
        assert stats["bytes_from_device"] == total
    else:
        # Without a GPU a finished gradient already is a host tensor: kept, not copied.
        assert stats["bytes_from_device"] == 0
    assert stats["device_copy_seconds"] > 0
    optimizer.step()
    optimizer.zero_grad()
    # The updated masters written back, whatever the machine's load: a read that finds the
    # arena full of masters not yet written would drop a cached device copy to write its
    # master back (the device copy is then gathered again in backward).
    store.placement.flush()
    model(x).sum().backward()
    # The step updated the masters, so the next forward gathers every parameter again.
    assert store.stats()["bytes_to_device"] == 2 * total
    store.close()


def test_offload_none_leaves_the_model_alone():
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    store = TieredStore(OffloadConfig(offload_param="none"))
    same_model, same_optimizer = store.attach(model, optimizer)
    assert same_model is model and same_optimizer is optimizer
    store.close()


def test_attach_twice_and_after_close_are_refused(tmp_path):
    store = TieredStore(OffloadConfig(offload_param="cpu"))
    store.attach(make_model())
    with pytest.raises(infinity.AttachError, match="already attached"):
        store.attach(make_model())
    store.close()
    with pytest.raises(infinity.AttachError, match="closed"):
        store.attach(make_model())


def test_context_manager_restores_parameters_and_removes_swap_files(tmp_path):
    model = make_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with TieredStore(OffloadConfig(offload_param="nvme", nvme_path=str(tmp_path))) as store:
        store.attach(model)
        # Between uses a parameter keeps its shape but its storage holds no bytes.
        assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key])
    assert os.listdir(tmp_path) == []


def test_meta_device_model_is_materialised_module_by_module(tmp_path):
    from torch import nn

    def build():
        return nn.Sequential(*[nn.Linear(32, 32) for _ in range(4)], nn.LayerNorm(32))

    torch.manual_seed(0)
    eager = build()
    torch.manual_seed(0)
    with torch.device("meta"):
        lazy = build()
    optimizer = torch.optim.SGD(lazy.parameters(), lr=0.1)  # built over the meta parameters
    store = TieredStore(OffloadConfig(offload_param="nvme", nvme_path=str(tmp_path)))
    lazy, optimizer = store.attach(lazy, optimizer)
    # reset_parameters() ran module by module in construction order: same values, same RNG.
    for key, value in eager.state_dict().items():
        assert torch.equal(lazy.state_dict()[key], value), key
    x = torch.randn(3, 32)
    loss = lazy(x).square().mean()
    loss.backward()
    optimizer.step()
    reference = torch.optim.SGD(eager.parameters(), lr=0.1)
    eager(x).square().mean().backward()
    reference.step()
    for key, value in eager.state_dict().items():
        torch.testing.assert_close(lazy.state_dict()[key], value)
    store.close()


def test_meta_module_without_reset_parameters_waits_for_a_checkpoint(tmp_path):
    """Its parameters stay without values (nothing allocated): a forward says so, naming the
    parameter; a checkpoint load fills them; one never filled is on the meta device again
    after close."""
    from torch import nn

    class Raw(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.empty(4, 4))

        def forward(self, x):
            return x @ self.weight

    with torch.device("meta"):
        model, never = Raw(), Raw()
    store = TieredStore(OffloadConfig(offload_param="nvme", nvme_path=str(tmp_path)))
    model, _ = store.attach(model)
    assert store.placement.audit() == []
    with pytest.raises(infinity.ParameterAccessError, match="'weight' has no values yet"):
        model(torch.ones(2, 4))
    values = torch.arange(16.0).view(4, 4)
    model.load_state_dict({"weight": values})
    assert torch.equal(model(torch.ones(2, 4)), torch.ones(2, 4) @ values)
    store.close()
    assert torch.equal(model.weight.detach(), values)
    store = TieredStore(OffloadConfig(offload_param="nvme", nvme_path=str(tmp_path)))
    never, _ = store.attach(never)
    store.close()
    assert never.weight.is_meta and never.weight.shape == (4, 4)
    assert os.listdir(tmp_path) == []


def test_small_parameters_persist_on_the_device(tmp_path):
    threshold = 64  # LayerNorm weights/biases and the 32-element biases
    result = compare(
        make_model(),
        6,
        {"offload_param": "nvme", "buffer_size": 1 << 16, "param_persistence_threshold": threshold},
        tmp_path=tmp_path,
    )
    assert_equivalent(*result[:4])
    model = make_model()
    store = TieredStore(
        OffloadConfig(
            offload_param="nvme",
            nvme_path=str(tmp_path),
            param_persistence_threshold=threshold,
            device_budget=param_bytes(model) // 4,
        )
    )
    model, optimizer = store.attach(model, torch.optim.SGD(model.parameters(), lr=0.1))
    train(model, optimizer, 2)
    small = [e for e in store.registry.entries if e.numel <= threshold]
    assert small and all(e.resident for e in small)  # refreshed after each step, never evicted
    assert (
        all(not e.resident for e in store.registry.entries if e.numel > threshold and e.holds == 0)
        or store.stats()["peak_bytes"]["device"] <= param_bytes(model) // 4
    )
    store.close()


def test_prefetch_bytes_zero_disables_prefetch(tmp_path):
    result = compare(
        make_model(),
        3,
        {
            "offload_param": "nvme",
            "buffer_size": 1 << 14,
            "buffer_count": 16,
            "prefetch_depth": 3,
            "prefetch_bytes": 0,
        },
        tmp_path=tmp_path,
    )
    assert_equivalent(*result[:4])
    assert result[4]["prefetched_loads"] == 0 and result[4]["demand_loads"] > 0


def test_max_in_cpu_sizes_the_host_cache(tmp_path):
    model = make_model()
    cache = 64 << 10
    store = TieredStore(
        OffloadConfig(
            offload_param="nvme",
            nvme_path=str(tmp_path),
            buffer_size=4096,
            buffer_count=2,
            max_in_cpu=cache,
        )
    )
    store.attach(model)
    assert store.budgets["arena"] == cache and store.budgets["host"] == cache
    store.close()


def test_when_the_arena_caches_everything_steady_steps_touch_no_disk(tmp_path):
    model = make_model()
    store = TieredStore(
        OffloadConfig(
            offload_param="nvme",
            offload_optimizer="nvme",
            nvme_path=str(tmp_path),
            buffer_size=1 << 16,
            buffer_count=64,
        )
    )
    model, optimizer = store.attach(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    train(model, optimizer, 2)  # the first steps create the optimizer state
    before = store.stats()
    train(model, optimizer, 3)
    after = store.stats()
    assert store.placement.settings.write_behind is False
    assert after["bytes_read"] == before["bytes_read"]
    assert after["bytes_written"] == before["bytes_written"]
    store.close()


def test_kept_swap_files_hold_the_final_values_after_lazy_write_back(tmp_path):
    from swap.files import RUN_DIR_PREFIX

    model = make_model()
    store = TieredStore(
        OffloadConfig(
            offload_param="nvme",
            nvme_path=str(tmp_path),
            buffer_size=1 << 16,
            buffer_count=64,
            keep_swap_files=True,
        )
    )
    model, optimizer = store.attach(model, torch.optim.SGD(model.parameters(), lr=0.1))
    train(model, optimizer, 2)
    shard = store.registry.shards["blocks.0.fc.weight"]
    extent = shard.extent
    expected = store.materialize(shard.entry).reshape(-1)[: shard.numel].clone()
    store.close()
    (run_dir,) = [p for p in tmp_path.iterdir() if p.name.startswith(RUN_DIR_PREFIX)]
    segment = extent.segments[0]
    raw = segment.file.path.read_bytes()[segment.offset : segment.offset + shard.nbytes]
    assert torch.equal(torch.frombuffer(bytearray(raw), dtype=torch.float32), expected)


def _arena_for_everything(tmp_path, block: int) -> int:
    """The arena bytes that cache the small GPT's whole state (params and AdamW on NVMe)."""
    probe = TieredStore(
        OffloadConfig(
            offload_param="nvme",
            offload_optimizer="nvme",
            nvme_path=str(tmp_path),
            buffer_size=block,
            buffer_count=4096,
        )
    )
    model = make_model()
    probe.attach(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    needed = probe.budgets["arena"]
    probe.close()
    return needed


def test_a_nearly_sufficient_arena_writes_back_only_what_it_evicts(tmp_path):
    """Steady steps write back about what they must evict to read, not every updated shard:
    writing all of them would move the parameters and both Adam moments every step."""
    block = 1 << 16
    needed = _arena_for_everything(tmp_path, block)
    model = make_model()
    updated_per_step = 3 * param_bytes(model)  # master weights and two moments
    # Updates in optimizer.step(): in backward no gradient needs the arena, and this one then
    # caches everything.
    result = compare(
        make_model(),
        6,
        {
            "offload_param": "nvme",
            "offload_optimizer": "nvme",
            "buffer_size": block,
            "buffer_count": int(0.8 * needed) // block,
            "step_in_backward": False,
        },
        tmp_path=tmp_path,
    )
    assert_equivalent(*result[:4])
    stats = result[4]
    assert stats["bytes_read"] > 0  # the arena really is too small
    # Beyond the state's first write as it is created, what is written is what gets read back
    # (evicted, then needed again), where writing every updated shard would be 6 x 3 x params.
    assert stats["bytes_written"] <= stats["bytes_read"] + updated_per_step, stats


def test_write_backs_a_pass_waited_for_start_ahead_in_the_next_forward(tmp_path):
    """Backward's gradients evict shards the step made dirty, and each such eviction waits for
    a write. The next forward starts those same writes ahead (the disk idles under compute
    there): the passes then wait for fewer, with the same results. A shard written ahead that
    this pass ends up not evicting is written again after the step: on this model that costs
    2-8% more bytes (the timing of earlier writes moves which shards are evicted)."""
    block = 1 << 16
    needed = _arena_for_everything(tmp_path, block)
    plain = make_model()
    plain_losses = train(plain, fused_adamw(plain.parameters()), 6)
    runs = {}
    for ahead in (True, False):
        store = TieredStore(
            OffloadConfig(
                offload_param="nvme",
                offload_optimizer="nvme",
                nvme_path=str(tmp_path),
                buffer_size=block,
                buffer_count=int(0.8 * needed) // block,
                step_in_backward=False,
            )
        )
        model = make_model()
        model, optimizer = store.attach(model, fused_adamw(model.parameters()))
        store.placement.prefetching.write_ahead_enabled = ahead
        losses = train(model, optimizer, 6)
        runs[ahead] = (losses, {k: v.clone() for k, v in model.state_dict().items()}, store.stats())
        store.close()
    for losses, state, _ in runs.values():
        assert_equivalent(plain_losses, losses, plain.state_dict(), state)
    with_ahead, without = runs[True][2], runs[False][2]
    assert without["forced_pass_writes"] > 0 and without["write_ahead_writes"] == 0
    assert with_ahead["write_ahead_writes"] > 0
    assert with_ahead["forced_pass_writes"] < without["forced_pass_writes"]
    assert with_ahead["bytes_written"] <= 1.15 * without["bytes_written"]


def test_step_reads_ahead_without_evicting_shards_it_has_still_to_update(tmp_path):
    """The step's read-ahead, and the write-backs it starts to make room for the next reads,
    take free room and the room of shards it already updated. Taking the room of one it has
    still to update would write that shard's gradient (or moments) out and read it back within
    the same step. (Only an update that cannot start without room may still do that.)"""
    block = 1 << 16
    needed = _arena_for_everything(tmp_path, block)
    plain = make_model()
    plain_losses = train(plain, fused_adamw(plain.parameters()), 6)
    store = TieredStore(
        OffloadConfig(
            offload_param="nvme",
            offload_optimizer="nvme",
            nvme_path=str(tmp_path),
            buffer_size=block,
            buffer_count=int(0.7 * needed) // block,
            step_in_backward=False,
        )
    )
    model = make_model()
    model, optimizer = store.attach(model, fused_adamw(model.parameters()))
    placement = store.placement
    ahead_writes: list[str] = []  # shards they wrote while the step had still to update them
    state = {"ahead": False}
    load_async, clean_ahead, store_async = (
        placement.load_async,
        placement.clean_ahead,
        placement.store_async,
    )

    def tracked_load(shard, *args, read_ahead=False, **kwargs):
        state["ahead"] = read_ahead
        try:
            return load_async(shard, *args, read_ahead=read_ahead, **kwargs)
        finally:
            state["ahead"] = False

    def tracked_clean(*args, **kwargs):
        state["ahead"] = True
        try:
            return clean_ahead(*args, **kwargs)
        finally:
            state["ahead"] = False

    def tracked_store(shard):
        if (
            state["ahead"]
            and placement.phase.masters_due
            and shard.entry.index not in placement.phase.stepped
        ):
            ahead_writes.append(shard.id)
        return store_async(shard)

    placement.load_async, placement.clean_ahead = tracked_load, tracked_clean
    placement.store_async = tracked_store
    losses = train(model, optimizer, 6)
    assert_equivalent(plain_losses, losses, plain.state_dict(), model.state_dict())
    stats = store.stats()
    assert stats["bytes_read"] > 0 and stats["step_read_ahead_loads"] > 0
    assert not ahead_writes
    store.close()


class _HeadModel(torch.nn.Module):
    """An embedding and a head of 1 MiB each (fp32), tied or each its own parameter."""

    def __init__(self, tied: bool) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(1024, 256)
        self.mid = torch.nn.Linear(256, 256)
        self.head = torch.nn.Linear(256, 1024, bias=False)
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mid(self.embed(tokens))))


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_the_transient_reserve_counts_a_second_gradient_only_for_a_tied_weight(tmp_path, tied):
    """Autograd's gradient of the largest parameter is reserved once; a weight two modules use
    gets two contributions and their sum. Shards of 256 KiB keep the first step's optimizer
    state (two of a shard) below either."""
    model = _HeadModel(tied)
    store = TieredStore(
        OffloadConfig(
            offload_param="nvme",
            offload_optimizer="nvme",
            nvme_path=str(tmp_path),
            host_budget="64MiB",
            buffer_size="256KiB",
        )
    )
    model, optimizer = store.attach(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    try:
        budgets = store.stats()["budgets"]
        slack = 32 << 20
        assert budgets["transient_reserved"] == slack + (3 if tied else 1) * (1 << 20)
        tokens = torch.randint(0, 1024, (2, 8))
        losses = []
        for _ in range(3):
            loss = model(tokens).square().mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        assert losses[2] < losses[0]
    finally:
        store.close()
