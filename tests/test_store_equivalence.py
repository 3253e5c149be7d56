"""Attached training matches plain PyTorch training step for step."""

from __future__ import annotations

import torch

from infinity.cli.common.tiny_gpt import GPTConfig
from tests.store_helpers import (
    SMALL,
    assert_equivalent,
    compare,
    default_adamw,
    fused_adamw,
    make_model,
)

STEPS = 20


def test_params_on_nvme_match_plain(tmp_path):
    result = compare(
        make_model(),
        STEPS,
        {"offload_param": "nvme", "buffer_size": 1 << 16, "buffer_count": 4},
        tmp_path=tmp_path,
    )
    assert_equivalent(*result[:4])
    stats = result[4]
    assert stats["bytes_read"] > 0 and stats["bytes_written"] > 0
    assert stats["steps"] == STEPS


def test_params_on_cpu_match_plain():
    assert_equivalent(*compare(make_model(), STEPS, {"offload_param": "cpu"})[:4])


def test_gradient_accumulation_over_four_micro_batches(tmp_path):
    result = compare(
        make_model(),
        8,
        {"offload_param": "nvme", "buffer_size": 1 << 16},
        tmp_path=tmp_path,
        micro_batches=4,
    )
    assert_equivalent(*result[:4])


def test_lr_scheduler_drives_the_offloaded_optimizer(tmp_path):
    def scheduler(optimizer):
        return torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)

    result = compare(
        make_model(),
        12,
        {"offload_param": "nvme", "buffer_size": 1 << 16},
        tmp_path=tmp_path,
        scheduler_factory=scheduler,
    )
    assert_equivalent(*result[:4])


def test_activation_checkpointing(tmp_path):
    config = GPTConfig(**{**SMALL.__dict__, "checkpoint_blocks": True})
    result = compare(
        make_model(config),
        10,
        {"offload_param": "nvme", "buffer_size": 1 << 16},
        tmp_path=tmp_path,
        config=config,
    )
    assert_equivalent(*result[:4])


def test_parameter_larger_than_buffer_size_streams_in_pieces(tmp_path):
    # The embedding is 64 x 32 fp32 = 8 KiB and the MLP weights 16 KiB: with 4 KiB buffers every
    # large parameter is split into several shards.
    result = compare(
        make_model(),
        10,
        {"offload_param": "nvme", "buffer_size": 4096, "buffer_count": 8},
        tmp_path=tmp_path,
    )
    assert_equivalent(*result[:4])


def test_sgd_momentum_and_adagrad(tmp_path):
    for factory in (
        lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
        lambda p: torch.optim.Adagrad(p, lr=0.05),
    ):
        result = compare(
            make_model(),
            8,
            {"offload_param": "nvme", "buffer_size": 1 << 16},
            tmp_path=tmp_path,
            optimizer_factory=factory,
        )
        assert_equivalent(*result[:4])


def test_default_adamw_takes_the_fused_kernel_and_matches_it(tmp_path):
    # The user passes AdamW with default options; the store runs it fused, which must match a
    # plain fused AdamW run exactly as the loop kernel would match the loop.
    result = compare(
        make_model(),
        10,
        {"offload_param": "nvme", "buffer_size": 1 << 16},
        tmp_path=tmp_path,
        optimizer_factory=default_adamw,
        plain_factory=fused_adamw,
    )
    assert_equivalent(*result[:4])


def test_fused_optimizer_off_keeps_the_users_kernel(tmp_path):
    result = compare(
        make_model(),
        10,
        {"offload_param": "nvme", "buffer_size": 1 << 16, "fused_optimizer": False},
        tmp_path=tmp_path,
        optimizer_factory=default_adamw,
    )
    assert_equivalent(*result[:4])


def test_optimizer_state_and_gradients_on_nvme(tmp_path):
    result = compare(
        make_model(),
        STEPS,
        {
            "offload_param": "nvme",
            "offload_optimizer": "nvme",
            "buffer_size": 1 << 14,
            "buffer_count": 16,
        },
        tmp_path=tmp_path,
    )
    assert_equivalent(*result[:4])
    # Masters, gradients and both Adam moments went through the swap files.
    assert result[4]["bytes_written"] > 3 * result[4]["budgets"]["params"]


def test_optimizer_state_on_nvme_with_params_on_cpu(tmp_path):
    result = compare(
        make_model(),
        10,
        {
            "offload_param": "cpu",
            "offload_optimizer": "nvme",
            "buffer_size": 1 << 14,
            "buffer_count": 8,
        },
        tmp_path=tmp_path,
    )
    assert_equivalent(*result[:4])


def test_generic_optimizers_with_state_on_nvme(tmp_path):
    for factory in (
        lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
        lambda p: torch.optim.Adagrad(p, lr=0.05),
    ):
        result = compare(
            make_model(),
            8,
            {
                "offload_param": "nvme",
                "offload_optimizer": "nvme",
                "buffer_size": 1 << 14,
                "buffer_count": 8,
            },
            tmp_path=tmp_path,
            optimizer_factory=factory,
        )
        assert_equivalent(*result[:4])
