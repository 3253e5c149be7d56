"""offload_param='none' with the optimizer offloaded (ZeRO-Offload; DeepSpeed's ZeRO-2 configs):
parameters stay on the device, masters and optimizer state live on the host or on NVMe."""

from __future__ import annotations

import copy

import pytest
import torch

import infinity
from infinity import OffloadConfig, TieredStore
from tests.store_helpers import SMALL, assert_equivalent, compare, fused_adamw, make_model, train


@pytest.mark.parametrize("optimizer_tier", ["cpu", "nvme"])
def test_params_on_device_optimizer_offloaded_matches_plain(tmp_path, optimizer_tier):
    reference = make_model()
    total = sum(p.numel() * p.element_size() for p in reference.parameters())
    kwargs = {"offload_param": "none", "offload_optimizer": optimizer_tier}
    if optimizer_tier == "nvme":
        # Room for a fraction of masters + moments: the step must swap through NVMe.
        kwargs.update(
            nvme_path=str(tmp_path), buffer_size=1 << 14, buffer_count=8, host_budget=1 << 17
        )
    plain_losses, losses, plain_state, state, stats = compare(reference, 20, kwargs)
    assert_equivalent(plain_losses, losses, plain_state, state)
    # Every parameter stays on the device the whole time: the device tier holds all of them.
    assert stats["current_bytes"]["device"] == stats["peak_bytes"]["device"] == total
    if optimizer_tier == "nvme":
        # Masters and both Adam moments live on NVMe, and the step moved them through it.
        assert stats["current_bytes"]["nvme"] >= 3 * total
        assert stats["bytes_read"] > 0 and stats["bytes_written"] > 0
        assert stats["peak_bytes"]["host"] <= stats["budgets"]["host"]
    else:
        assert stats["bytes_written"] == 0 and stats["current_bytes"]["nvme"] == 0


def test_zero2_seed_config_offloads_the_optimizer(tmp_path):
    """DeepSpeed's ZeRO-2 CPU-offload config (fp16, clipping, optimizer on the CPU) is no
    longer a pass-through: the optimizer is the store's and the working copies are fp16."""
    config = OffloadConfig.from_deepspeed(
        {
            "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
            "fp16": {"enabled": True, "initial_scale_power": 8},
            "gradient_clipping": 1.0,
        }
    )
    assert (config.offload_param, config.offload_optimizer) == ("none", "cpu")
    model = make_model()
    store = TieredStore(config)
    attached, optimizer = store.attach(model, fused_adamw(model.parameters()))
    assert optimizer is store.optimizer
    losses = train(attached, optimizer, 3)
    assert all(torch.isfinite(torch.tensor(losses)))
    entry = store.registry.entries[0]
    assert entry.compute_dtype is torch.float16 and entry.dtype is torch.float32
    assert store.stats()["steps"] == 3
    store.close()


def test_mixed_precision_without_offload_is_not_ignored():
    model = make_model()
    store = TieredStore(
        OffloadConfig(offload_param="none", precision=infinity.PrecisionConfig(dtype="bf16"))
    )
    _, optimizer = store.attach(model, fused_adamw(model.parameters()))
    assert optimizer is store.optimizer
    assert store.registry.entries[0].compute_dtype is torch.bfloat16
    store.close()


def test_device_budget_below_the_parameters_names_the_fix():
    model = make_model()
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    before = copy.deepcopy(model.state_dict())
    store = TieredStore(
        OffloadConfig(offload_param="none", offload_optimizer="cpu", device_budget=total // 2)
    )
    with pytest.raises(
        infinity.BudgetError, match="offload_param='none' keeps every parameter on the device"
    ):
        store.attach(model, fused_adamw(model.parameters()))
    store.close()
    for key, value in model.state_dict().items():  # nothing lost
        torch.testing.assert_close(value, before[key])


def test_nothing_offloaded_in_fp32_leaves_the_model_alone():
    model = make_model(SMALL)
    optimizer = fused_adamw(model.parameters())
    store = TieredStore(OffloadConfig(offload_param="none", offload_optimizer="none"))
    assert store.attach(model, optimizer) == (model, optimizer)
    store.close()


def test_host_budget_below_the_masters_names_the_fix():
    model = make_model()
    store = TieredStore(
        OffloadConfig(offload_param="none", offload_optimizer="cpu", host_budget=1000)
    )
    with pytest.raises(infinity.BudgetError, match="offload_optimizer='nvme'"):
        store.attach(model, fused_adamw(model.parameters()))
    store.close()
