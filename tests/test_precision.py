"""Mixed precision (bf16, fp16 with dynamic loss scaling) and gradient clipping."""

from __future__ import annotations

import copy

import torch

import infinity
from infinity import OffloadConfig, TieredStore
from infinity.cli.common.tiny_gpt import synthetic_batches
from infinity.training.precision import LossScaler
from tests.store_helpers import SMALL, assert_equivalent, fused_adamw, make_model, train


def _fast_adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, fused=True)


def _autocast_reference(model, steps, dtype):
    """fp32 masters, forward and backward under autocast: the usual mixed-precision loop."""
    optimizer = _fast_adamw(model.parameters())
    data = synthetic_batches(SMALL, 4, seed=1)
    losses = []
    for _ in range(steps):
        tokens, targets = next(data)
        with torch.autocast("cpu", dtype=dtype):
            loss = model(tokens, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def test_bf16_follows_the_autocast_reference_and_keeps_fp32_masters(tmp_path):
    reference = make_model()
    steps = 20
    plain = _autocast_reference(copy.deepcopy(reference), steps, torch.bfloat16)
    model = copy.deepcopy(reference)
    store = TieredStore(
        OffloadConfig(
            offload_param="nvme",
            offload_optimizer="nvme",
            nvme_path=str(tmp_path),
            buffer_size=1 << 14,
            buffer_count=16,
            precision=infinity.PrecisionConfig(dtype="bf16"),
        )
    )
    model, optimizer = store.attach(model, _fast_adamw(model.parameters()))
    losses = train(model, optimizer, steps)
    # Working copies are bf16 on the device; masters stay fp32 in the shards.
    entry = store.registry.entries[0]
    assert entry.compute_dtype is torch.bfloat16 and entry.dtype is torch.float32
    assert all(s.dtype is torch.float32 for s in store.registry.shards.values())
    state = model.state_dict()
    store.close()
    assert all(v.dtype is torch.float32 for v in state.values())
    # Stated tolerance: bf16 keeps 8 bits of mantissa and computes norms and the loss in bf16
    # where autocast keeps fp32: every loss within 3% of the autocast reference.
    for step, (a, b) in enumerate(zip(plain, losses)):
        assert abs(a - b) <= 0.03 * abs(a), f"step {step}: {b} vs autocast {a}"


def test_fp16_overflow_skips_exactly_that_step_and_lowers_the_scale(tmp_path):
    reference = make_model()
    config = OffloadConfig(
        offload_param="nvme",
        nvme_path=str(tmp_path),
        buffer_size=1 << 16,
        precision=infinity.PrecisionConfig(dtype="fp16", hysteresis=1, initial_scale_power=8),
    )
    model = copy.deepcopy(reference)
    store = TieredStore(config)
    model, optimizer = store.attach(model, fused_adamw(model.parameters()))
    data = synthetic_batches(SMALL, 4, seed=1)
    scales, snapshots = [], []
    for step in range(4):
        tokens, targets = next(data)
        loss = model(tokens, targets)
        if step == 2:
            loss = loss * float("inf")  # a forced overflow
        loss.backward()
        before = {k: v.clone() for k, v in model.state_dict().items()}
        optimizer.step()
        optimizer.zero_grad()
        after = model.state_dict()
        snapshots.append(all(torch.equal(before[k], after[k]) for k in before))
        scales.append(store.scaler.scale)
    stats = store.stats()
    store.close()
    assert snapshots == [False, False, True, False]  # only the overflowed step left params alone
    assert scales == [256.0, 256.0, 128.0, 128.0]
    assert store.skipped_steps == 1 and stats["steps"] == 3


def test_fp16_scaled_training_matches_unscaled_fp16_gradients(tmp_path):
    """The scale is divided out: SGD updates with scale 2**10 match those with scale 1 (up to
    fp16 underflow, which the scale exists to avoid). SGD, unlike Adam, is not invariant to a
    gradient scale, so a missed unscale would move the parameters about 1024x further."""
    initial = {k: v.clone() for k, v in make_model().state_dict().items()}
    losses, states = {}, {}
    for power in (0, 10):
        model = make_model()
        store = TieredStore(
            OffloadConfig(
                offload_param="cpu",
                precision=infinity.PrecisionConfig(dtype="fp16", loss_scale=float(2**power)),
            )
        )
        model, optimizer = store.attach(model, torch.optim.SGD(model.parameters(), lr=0.1))
        losses[power] = train(model, optimizer, 5)
        states[power] = {k: v.clone() for k, v in model.state_dict().items()}
        store.close()
    for a, b in zip(losses[0], losses[10]):
        assert abs(a - b) <= 1e-2 * abs(a)
    for key in states[0]:
        moved_unscaled = states[0][key] - initial[key]
        moved_scaled = states[10][key] - initial[key]
        assert moved_scaled.norm() > 0
        assert (moved_scaled - moved_unscaled).norm() <= 0.05 * moved_unscaled.norm() + 1e-6, key


def test_loss_scaler_rules():
    scaler = LossScaler(
        infinity.PrecisionConfig(
            dtype="fp16", initial_scale_power=4, loss_scale_window=2, hysteresis=2, min_loss_scale=4
        )
    )
    scaler.update(overflow=True)
    assert scaler.scale == 16  # first overflow tolerated (hysteresis 2)
    scaler.update(overflow=True)
    assert scaler.scale == 8
    scaler.update(overflow=False)
    scaler.update(overflow=False)
    assert scaler.scale == 16  # doubled after a clean window
    for _ in range(6):
        scaler.update(overflow=True)
    assert scaler.scale == 4  # never below min_loss_scale


def test_gradient_clipping_matches_clip_grad_norm(tmp_path):
    max_norm = 0.05

    def clipped_train(model, optimizer, steps):
        data = synthetic_batches(SMALL, 4, seed=1)
        losses = []
        for _ in range(steps):
            tokens, targets = next(data)
            loss = model(tokens, targets)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        return losses

    reference = make_model()
    plain = copy.deepcopy(reference)
    plain_losses = clipped_train(plain, fused_adamw(plain.parameters()), 8)
    model = copy.deepcopy(reference)
    store = TieredStore(
        OffloadConfig(
            offload_param="nvme",
            offload_optimizer="nvme",
            nvme_path=str(tmp_path),
            buffer_size=1 << 14,
            buffer_count=16,
            gradient_clipping=max_norm,
        )
    )
    model, optimizer = store.attach(model, fused_adamw(model.parameters()))
    losses = train(model, optimizer, 8)
    assert store.last_grad_norm > max_norm  # clipping was active
    state = {k: v.clone() for k, v in model.state_dict().items()}
    store.close()
    assert_equivalent(plain_losses, losses, plain.state_dict(), state)
