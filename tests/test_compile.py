"""torch.compile on an attached model: per-block compile before or after attach, and the whole
model compiled after attach, train as the same compiled model without the store does, and
nothing is compiled again after the second step."""

from __future__ import annotations

import copy

import pytest
import torch
from torch._dynamo.utils import counters

import infinity
from infinity.cli.common.tiny_gpt import synthetic_batches
from tests.store_helpers import SMALL, fused_adamw, make_model

STEPS = 5

pytestmark = pytest.mark.usefixtures("one_thread")


def _compile(model: torch.nn.Module, mode: str) -> torch.nn.Module:
    if mode == "whole":
        return torch.compile(model)
    for block in model.blocks:
        block.compile()
    return model


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[list, int]:
    """Losses, and the graphs compiled after the second step."""
    data = synthetic_batches(SMALL, 4, seed=1)
    losses = []
    compiled_by_step_2 = 0
    for step in range(STEPS):
        if step == 2:
            compiled_by_step_2 = counters["stats"]["unique_graphs"]
        tokens, targets = next(data)
        loss = model(tokens, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, counters["stats"]["unique_graphs"] - compiled_by_step_2


@pytest.mark.parametrize("mode", ["block-before", "block-after", "whole"])
def test_compiled_attached_model_trains_as_the_compiled_plain_one(mode, tmp_path):
    reference = make_model()
    torch._dynamo.reset()
    plain = copy.deepcopy(reference)
    plain_losses, _ = _train(_compile(plain, mode), fused_adamw(plain.parameters()))
    torch._dynamo.reset()
    counters.clear()
    model = copy.deepcopy(reference)
    if mode == "block-before":
        _compile(model, mode)
    config = infinity.OffloadConfig(
        offload_param="nvme",
        offload_optimizer="nvme",
        buffer_size=8192,
        buffer_count=8,
        nvme_path=str(tmp_path),
    )
    with infinity.TieredStore(config) as store:
        model, optimizer = store.attach(model, fused_adamw(model.parameters()))
        if mode != "block-before":
            model = _compile(model, mode)
        losses, recompiled = _train(model, optimizer)
        assert store.stats()["bytes_read"] > 0  # the parameters did stream from NVMe
    assert counters["stats"]["unique_graphs"] > 0  # it did compile
    assert recompiled == 0, f"{recompiled} graphs compiled after step 2"
    for step, (a, b) in enumerate(zip(plain_losses, losses)):
        assert abs(a - b) <= 1e-5, (step, plain_losses, losses)
