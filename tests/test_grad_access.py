"""The loop sees its gradients: ``p.grad`` after backward, ``clip_grad_norm_``,
``clip_grad_value_``, norm logging and assignment, with gradients wherever the store keeps them."""

from __future__ import annotations

import copy
import math

import pytest
import torch

import infinity
from infinity.cli.common.tiny_gpt import synthetic_batches
from infinity.errors import ParameterAccessError
from tests.store_helpers import SMALL, compare, fused_adamw, make_model, train

# Small buffers: the embedding and the MLP weights are cut into several shards each, and the
# arena (8 x 8 KiB) holds a fraction of masters, gradients and Adam moments, so gradients go
# to the swap files and come back.
NVME = {
    "offload_param": "nvme",
    "offload_optimizer": "nvme",
    "buffer_size": 8 << 10,
    "buffer_count": 8,
}
CPU = {"offload_param": "cpu", "offload_optimizer": "cpu"}


class Clip:
    """clip_grad_norm_ after each backward, as nanoGPT's loop calls it; keeps the norms."""

    def __init__(self, max_norm: float) -> None:
        self.max_norm = max_norm
        self.norms: list[float] = []

    def __call__(self, model: torch.nn.Module) -> None:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), self.max_norm)
        self.norms.append(float(norm))


def _equal_states(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), f"{key} differs by {(a[key] - b[key]).abs().max()}"


@pytest.mark.parametrize(
    "offload, micro_batches", [("cpu", 1), ("cpu", 2), ("nvme", 1), ("nvme", 2)]
)
def test_clip_grad_norm_in_the_loop_gives_the_plain_run(tmp_path, offload, micro_batches):
    steps = 4
    clip = Clip(0.05)  # below every step's norm: each step is clipped
    plain_losses, losses, plain_state, state, stats = compare(
        make_model(),
        steps,
        dict(CPU if offload == "cpu" else NVME),
        tmp_path=tmp_path,
        micro_batches=micro_batches,
        after_backward=clip,
    )
    plain_norms, norms = clip.norms[:steps], clip.norms[steps:]
    assert min(plain_norms) > 0.05  # it did clip
    if offload == "cpu":
        # One shard per parameter: the same norms, factors and updates, bit for bit.
        assert norms == plain_norms
        assert losses == plain_losses
        _equal_states(plain_state, state)
    else:
        # Parameters cut into shards: the norm is summed from the shards' in another order.
        assert stats["bytes_read"] > 0
        for a, b in zip(plain_norms, norms):
            assert math.isclose(a, b, rel_tol=1e-6)
        for a, b in zip(plain_losses, losses):
            assert abs(a - b) <= 1e-6
        for key in plain_state:
            torch.testing.assert_close(state[key], plain_state[key], rtol=0, atol=1e-6)


def test_clip_grad_norm_under_bf16_matches_the_gradient_clipping_setting(tmp_path):
    """bf16 has no plain twin bit for bit; the store's own clipping is the reference."""
    steps = 3
    precision = infinity.PrecisionConfig(dtype="bf16")
    runs = []
    for in_loop in (False, True):
        clip = Clip(0.05)
        config = infinity.OffloadConfig(
            **NVME,
            nvme_path=str(tmp_path),
            precision=precision,
            gradient_clipping=0.0 if in_loop else 0.05,
        )
        model = make_model()
        with infinity.TieredStore(config) as store:
            model, optimizer = store.attach(model, fused_adamw(model.parameters()))
            norms = []

            def log_norm(m: torch.nn.Module, in_loop: bool = in_loop, clip: Clip = clip) -> None:
                if in_loop:
                    clip(m)

            losses = train(model, optimizer, steps, after_backward=log_norm)
            norms = clip.norms if in_loop else None
            runs.append(
                (
                    losses,
                    {k: v.clone() for k, v in model.state_dict().items()},
                    norms,
                    store.last_grad_norm,
                )
            )
    (setting_losses, setting_state, _, _), (loop_losses, loop_state, loop_norms, _) = runs
    assert all(p.dtype == torch.float32 for p in loop_state.values())
    for a, b in zip(setting_losses, loop_losses):
        assert abs(a - b) <= 1e-6 * max(1.0, abs(a))
    for key in setting_state:
        torch.testing.assert_close(loop_state[key], setting_state[key], rtol=0, atol=1e-6)
    assert all(n > 0.05 for n in loop_norms)


@pytest.mark.parametrize("config", [CPU, NVME], ids=["cpu", "nvme"])
def test_p_grad_reads_the_plain_gradient(tmp_path, config):
    reference = make_model()
    plain = copy.deepcopy(reference)
    attached = copy.deepcopy(reference)
    data = list(zip(range(2), synthetic_batches(SMALL, 4, seed=3)))
    for _, (tokens, targets) in data:  # two micro-batches: the gradients accumulate
        plain(tokens, targets).backward()
    store = infinity.TieredStore(infinity.OffloadConfig(**config, nvme_path=str(tmp_path)))
    model, _ = store.attach(attached, fused_adamw(attached.parameters()))
    try:
        for _, (tokens, targets) in data:
            model(tokens, targets).backward()
        names = dict(plain.named_parameters())
        for name, param in model.named_parameters():
            grad = param.grad
            assert grad is not None and grad.shape == param.shape and grad.device == param.device
            assert torch.equal(grad.clone(), names[name].grad), name
            assert torch.equal(grad + 0, names[name].grad)
            assert float(grad.norm()) == pytest.approx(float(names[name].grad.norm()), rel=1e-6)
            assert bool(torch.isfinite(grad).all())
        total = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
        plain_total = torch.nn.utils.get_total_norm([p.grad for p in plain.parameters()])
        assert float(total) == pytest.approx(float(plain_total), rel=1e-6)
        assert "tensor(" in repr(next(model.parameters()).grad)
    finally:
        store.close()


def test_clip_grad_value_and_in_place_edits_of_p_grad_reach_the_step(tmp_path):
    def edit(model: torch.nn.Module) -> None:
        torch.nn.utils.clip_grad_value_(model.parameters(), 0.01)
        params = list(model.parameters())
        params[0].grad[:3] = 0  # __setitem__ on the gradient
        params[1].grad.add_(1e-3)  # any other in-place op
        params[2].grad.data.mul_(0.5)  # through .data
        params[3].grad = params[3].grad * 2  # assignment

    for config in (CPU, NVME):
        plain_losses, losses, plain_state, state, _ = compare(
            make_model(), 3, dict(config), tmp_path=tmp_path, after_backward=edit
        )
        assert losses == plain_losses
        _equal_states(plain_state, state)


def test_clearing_gradients_from_the_loop(tmp_path):
    """p.grad = None and model.zero_grad() drop the store's gradient (the step skips the
    parameter, as the plain optimizer does); zero_() keeps a zero gradient (it still steps)."""

    def drop_some(model: torch.nn.Module) -> None:
        params = list(model.parameters())
        params[0].grad = None
        params[1].grad.zero_()
        model.blocks[0].zero_grad()

    plain_losses, losses, plain_state, state, _ = compare(
        make_model(), 3, dict(NVME), tmp_path=tmp_path, after_backward=drop_some
    )
    assert losses == plain_losses
    for key in plain_state:
        torch.testing.assert_close(state[key], plain_state[key], rtol=0, atol=1e-6)


def test_the_setting_and_the_loop_do_not_clip_twice(tmp_path):
    clip = Clip(0.05)
    config = dict(NVME, gradient_clipping=0.05)
    plain_losses, losses, plain_state, state, _ = compare(
        make_model(), 3, config, tmp_path=tmp_path, after_backward=clip
    )
    for a, b in zip(plain_losses, losses):
        assert abs(a - b) <= 1e-6
    for key in plain_state:
        torch.testing.assert_close(state[key], plain_state[key], rtol=0, atol=1e-6)


def test_stale_views_and_writes_through_views_raise(tmp_path):
    model = make_model()
    with infinity.TieredStore(infinity.OffloadConfig(**NVME, nvme_path=str(tmp_path))) as store:
        model, optimizer = store.attach(model, fused_adamw(model.parameters()))
        tokens, targets = next(synthetic_batches(SMALL, 4, seed=1))
        model(tokens, targets).backward()
        weight = model.blocks[0].fc.weight
        grad = weight.grad
        with pytest.raises(ParameterAccessError, match="copy, not the store"):
            grad.view(-1)[:4].zero_()
        flat = grad.view(-1)
        assert torch.equal(flat, grad.clone().view(-1))  # reading a view works
        optimizer.step()
        optimizer.zero_grad()
        assert weight.grad is None
        with pytest.raises(ParameterAccessError, match="read p.grad again"):
            grad.sum()


def test_norms_are_answered_without_reading_gradients_back(tmp_path):
    """The first clip_grad_norm_ reads the gradients on NVMe back once (norms were not kept);
    from then on the gradient hook keeps them and the call reads nothing."""
    model = make_model()
    with infinity.TieredStore(infinity.OffloadConfig(**NVME, nvme_path=str(tmp_path))) as store:
        model, optimizer = store.attach(model, fused_adamw(model.parameters()))
        read_by_clip = []

        def clip(m: torch.nn.Module) -> None:
            before = store.stats()["bytes_read"]
            torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05)
            read_by_clip.append(store.stats()["bytes_read"] - before)

        train(model, optimizer, 4, after_backward=clip)
    assert read_by_clip[0] > 0
    assert read_by_clip[1:] == [0, 0, 0]
