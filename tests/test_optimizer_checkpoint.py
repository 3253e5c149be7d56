"""optimizer.state_dict() / load_state_dict() in the user's optimizer's own layout, with the
optimizer state in host memory or on NVMe: a checkpoint moves between the store and plain
PyTorch both ways and training resumes exactly."""

from __future__ import annotations

import copy

import pytest
import torch

from infinity import OffloadConfig, TieredStore
from tests.store_helpers import make_model, train


def _adamw(params):
    # torch's fused kernel, which the store runs inside: the plain runs compute bit for bit
    # the same updates, so the comparisons can be tight.
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, fused=True)


def _config(tmp_path, optimizer_tier: str) -> OffloadConfig:
    tmp_path.mkdir(exist_ok=True)
    # 4 KiB buffers: the embedding and LM head are several shards each, and 8 buffers hold
    # a fraction of the state, so most of it lives on NVMe when optimizer_tier is nvme.
    return OffloadConfig(
        offload_param="nvme",
        offload_optimizer=optimizer_tier,
        nvme_path=str(tmp_path),
        buffer_size=1 << 12,
        buffer_count=8,
        host_budget=1 << 16,
    )


def _run(model, optimizer, steps, seed):
    return train(model, optimizer, steps, seed=seed)


def _assert_same_state(got: dict, want: dict) -> None:
    assert got["param_groups"] == want["param_groups"]
    assert got["state"].keys() == want["state"].keys()
    for index, state in want["state"].items():
        assert list(got["state"][index]) == list(state), index
        for key, value in state.items():
            torch.testing.assert_close(
                got["state"][index][key],
                value,
                rtol=1e-5,
                atol=1e-6,
                msg=lambda m, index=index, key=key: f"param {index} {key}: {m}",
            )


@pytest.mark.parametrize("optimizer_tier", ["cpu", "nvme"])
def test_state_dict_matches_plain_and_resumes_both_ways(tmp_path, optimizer_tier):
    reference = make_model()
    plain = copy.deepcopy(reference)
    plain_optimizer = _adamw(plain.parameters())
    _run(plain, plain_optimizer, 3, seed=1)

    attached = copy.deepcopy(reference)
    store = TieredStore(_config(tmp_path / "a", optimizer_tier))
    attached, optimizer = store.attach(attached, _adamw(attached.parameters()))
    _run(attached, optimizer, 3, seed=1)
    saved = optimizer.state_dict()
    if optimizer_tier == "nvme":
        assert store.stats()["current_bytes"]["nvme"] > 0
    # Real tensors, whole parameters, the plain optimizer's layout and values.
    _assert_same_state(saved, plain_optimizer.state_dict())
    model_state = {k: v.clone() for k, v in attached.state_dict().items()}

    # Store -> plain: the checkpoint resumes in plain PyTorch exactly as the plain run goes on.
    resumed = make_model()
    resumed.load_state_dict(model_state)
    resumed_optimizer = _adamw(resumed.parameters())
    resumed_optimizer.load_state_dict(copy.deepcopy(saved))
    want = _run(plain, plain_optimizer, 3, seed=2)
    assert _run(resumed, resumed_optimizer, 3, seed=2) == pytest.approx(want, abs=1e-5)

    # Plain -> store: a fresh store loads the plain checkpoint and goes on the same way.
    store.close()
    fresh = make_model()
    fresh.load_state_dict(model_state)
    store = TieredStore(_config(tmp_path / "b", optimizer_tier))
    fresh, fresh_optimizer = store.attach(fresh, _adamw(fresh.parameters()))
    fresh_optimizer.load_state_dict(copy.deepcopy(saved))
    assert _run(fresh, fresh_optimizer, 3, seed=2) == pytest.approx(want, abs=1e-5)
    _assert_same_state(fresh_optimizer.state_dict(), plain_optimizer.state_dict())
    for name, value in plain.state_dict().items():
        torch.testing.assert_close(fresh.state_dict()[name], value, rtol=1e-5, atol=1e-6)
    store.close()


def test_load_state_dict_replaces_state_on_nvme_and_keeps_schedulers_working(tmp_path):
    """Loading an older checkpoint overwrites the moments already on NVMe (not merged with
    them), and param_groups stay the inner optimizer's own after the load."""
    model = make_model()
    store = TieredStore(_config(tmp_path, "nvme"))
    model, optimizer = store.attach(model, _adamw(model.parameters()))
    _run(model, optimizer, 1, seed=1)
    early = copy.deepcopy(optimizer.state_dict())
    _run(model, optimizer, 2, seed=2)
    assert optimizer.state_dict()["state"][0]["step"] != early["state"][0]["step"]
    optimizer.load_state_dict(copy.deepcopy(early))
    _assert_same_state(optimizer.state_dict(), early)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    _run(model, optimizer, 1, seed=3)
    scheduler.step()
    assert optimizer.inner.param_groups[0]["lr"] == pytest.approx(5e-3)
    store.close()


def test_mismatched_state_dict_is_refused(tmp_path):
    model = make_model()
    store = TieredStore(_config(tmp_path, "nvme"))
    model, optimizer = store.attach(model, _adamw(model.parameters()))
    other = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3))])
    with pytest.raises(ValueError, match="param groups of sizes"):
        optimizer.load_state_dict(other.state_dict())
    store.close()
