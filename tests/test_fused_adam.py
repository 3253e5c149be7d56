"""The fused host kernel for Adam/AdamW over state kept in fewer bytes
(``infinity/training/fused_adam.py``): it computes what torch's fused Adam and the chain of torch
operations around it compute, bit for bit; it is used where it applies and only there; and
without a compiler, or turned off, the store updates with torch operations."""

from __future__ import annotations

import logging

import pytest
import torch

import infinity
from infinity import OffloadConfig, TieredStore
from infinity.cli.common.tiny_gpt import GPTConfig
from infinity.training import fused_adam
from infinity.training.fused_adam import AdamSettings, FusedAdam, KernelShard
from tests.store_helpers import make_model, train

MODEL = GPTConfig(vocab_size=64, context=16, layers=2, width=48, heads=4)

needs_kernel = pytest.mark.skipif(
    fused_adam.library() is None, reason="no C compiler here to build the fused kernel"
)


def torch_step(cls, params, grads, state, settings: dict, steps: int):
    """``steps`` of torch's own fused optimizer from ``state`` (exp_avg, exp_avg_sq, step)."""
    param = torch.nn.Parameter(params.clone())
    optimizer = cls([param], fused=True, **settings)
    param.grad = grads.clone()
    optimizer.step()  # creates the state, then replaced
    held = optimizer.state[param]
    held["exp_avg"].copy_(state[0])
    held["exp_avg_sq"].copy_(state[1])
    held["step"].fill_(state[2])
    param.data.copy_(params)
    for _ in range(steps):
        param.grad = grads.clone()
        optimizer.step()
    return param.detach(), held["exp_avg"], held["exp_avg_sq"], optimizer


@needs_kernel
@pytest.mark.parametrize("numel", [7, 300, 2049, 16391, 1 << 20])
@pytest.mark.parametrize(
    "cls, settings",
    [
        (torch.optim.AdamW, {"lr": 1e-3, "weight_decay": 0.01}),
        (torch.optim.Adam, {"lr": 1e-3}),
        (torch.optim.Adam, {"lr": 3e-3, "weight_decay": 0.05, "betas": (0.6, 0.95)}),
        (torch.optim.AdamW, {"lr": 1e-2, "maximize": True, "eps": 1e-6}),
    ],
    ids=["adamw", "adam", "adam-l2-beta1-0.6", "adamw-maximize"],
)
def test_the_kernel_on_fp32_is_torch_s_fused_adam_bit_for_bit(numel, cls, settings):
    generator = torch.Generator().manual_seed(numel)
    params = torch.randn(numel, generator=generator)
    grads = torch.randn(numel, generator=generator) * 1e-2
    exp_avg = torch.randn(numel, generator=generator) * 1e-2
    exp_avg_sq = torch.rand(numel, generator=generator) * 1e-4
    expected_p, expected_m, expected_v, optimizer = torch_step(
        cls, params, grads, (exp_avg, exp_avg_sq, 4.0), settings, steps=1
    )
    kernel = FusedAdam(fused_adam.library(), "fp32")
    p, m, v = params.clone(), exp_avg.clone(), exp_avg_sq.clone()
    adam = AdamSettings.of(optimizer, optimizer.param_groups[0])
    assert adam is not None
    kernel.update(KernelShard(p, grads.clone(), 1.0, (m, v), None, None, None), adam, 5.0)
    assert torch.equal(m, expected_m)
    assert torch.equal(v, expected_v)
    assert torch.equal(p, expected_p)


def nvme_store(path, state_dtype: str, master_dtype: str) -> TieredStore:
    path.mkdir(parents=True, exist_ok=True)
    return TieredStore(
        OffloadConfig(
            device="cpu",
            offload_param="nvme",
            offload_optimizer="nvme",
            nvme_path=str(path),
            buffer_size=1 << 16,
            precision=infinity.PrecisionConfig(
                dtype="bf16" if master_dtype == "bf16" else "fp32",
                master_dtype=master_dtype,
                optimizer_state_dtype=state_dtype,
            ),
        )
    )


def run(path, state_dtype, master_dtype, optimizer_factory, steps=4):
    """Trains the model attached with clipping (a gradient factor), returns its weights, its
    optimizer's state and whether the store had the fused kernel."""
    model = make_model(MODEL)
    store = nvme_store(path, state_dtype, master_dtype)
    model, optimizer = store.attach(model, optimizer_factory(model.parameters()))

    def clip(m: torch.nn.Module) -> None:
        torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05)

    losses = train(model, optimizer, steps, config=MODEL, after_backward=clip)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    state = optimizer.state_dict()["state"]
    fused = optimizer.fused is not None
    store.close(restore_params=False)
    return losses, weights, state, fused


@needs_kernel
@pytest.mark.parametrize(
    "state_dtype, master_dtype",
    [("int8", "bf16"), ("int8", "fp32"), ("bf16", "bf16"), ("fp32", "bf16")],
)
def test_training_through_the_kernel_equals_the_torch_operations_bit_for_bit(
    state_dtype, master_dtype, tmp_path, monkeypatch
):
    calls: list[int] = []
    update = FusedAdam.update

    def counted(self, shard, settings, step):
        calls.append(shard.master.numel())
        update(self, shard, settings, step)

    monkeypatch.setattr(FusedAdam, "update", counted)

    def adamw(params):
        return torch.optim.AdamW(params, lr=3e-3, weight_decay=0.1)

    fused = run(tmp_path / "fused", state_dtype, master_dtype, adamw)
    assert fused[3] and calls  # the steps after the first went through the kernel
    monkeypatch.setenv("INFINITY_FUSED_KERNELS", "0")
    count = len(calls)
    plain = run(tmp_path / "ops", state_dtype, master_dtype, adamw)
    assert not plain[3] and len(calls) == count
    assert fused[0] == plain[0]  # the losses
    for name, value in plain[1].items():
        assert torch.equal(fused[1][name], value), name
    assert fused[2].keys() == plain[2].keys()
    for index, state in plain[2].items():
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(fused[2][index][key], state[key]), (index, key)


@needs_kernel
def test_settings_the_kernel_does_not_compute_update_with_torch_operations(tmp_path, monkeypatch):
    calls: list[int] = []
    monkeypatch.setattr(FusedAdam, "update", lambda *args: calls.append(1))

    def amsgrad(params):
        return torch.optim.AdamW(params, lr=1e-3, amsgrad=True)

    def foreach(params):
        return torch.optim.AdamW(params, lr=1e-3, foreach=True)

    def sgd(params):
        return torch.optim.SGD(params, lr=1e-2, momentum=0.9)

    for name, factory in (("amsgrad", amsgrad), ("foreach", foreach), ("sgd", sgd)):
        losses = run(tmp_path / name, "int8", "bf16", factory, steps=3)[0]
        assert all(torch.isfinite(torch.tensor(losses))), name
    assert calls == []  # never called: the stub would have left the weights as they were


def test_without_a_compiler_the_store_updates_with_torch_operations(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(fused_adam, "_loaded", {})
    monkeypatch.setenv("CC", "")
    monkeypatch.setenv("PATH", str(tmp_path))  # no cc, no gcc
    with caplog.at_level(logging.INFO, logger=fused_adam.__name__):
        assert fused_adam.library() is None
    assert "no C compiler found" in caplog.text
    monkeypatch.setattr(fused_adam, "_loaded", {})
    losses, _, state, fused = run(tmp_path / "run", "int8", "bf16", torch.optim.AdamW, steps=3)
    assert not fused and state and all(torch.isfinite(torch.tensor(losses)))


def test_a_compiler_that_fails_is_reported_and_the_ops_take_over(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(fused_adam, "_loaded", {})
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", "false")
    with caplog.at_level(logging.WARNING, logger=fused_adam.__name__):
        assert fused_adam.library() is None
    assert "could not build the fused optimizer kernel" in caplog.text
    assert not list((tmp_path / "cache").rglob("*.so"))


@needs_kernel
def test_the_kernel_is_built_once_into_the_cache_and_loaded_from_it(tmp_path, monkeypatch):
    monkeypatch.setattr(fused_adam, "_loaded", {})
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert fused_adam.library() is not None
    built = list((tmp_path / "cache" / "infinity" / "kernels").glob("fused_adam-*.so"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    monkeypatch.setattr(fused_adam, "_loaded", {})

    def no_build(*_):
        raise AssertionError("built again")

    monkeypatch.setattr(fused_adam, "_compile", no_build)  # the cached one is loaded
    assert fused_adam.library() is not None
    assert built[0].stat().st_mtime_ns == stamp
    assert not list(built[0].parent.glob("*.partial"))


def test_the_kernel_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("INFINITY_FUSED_KERNELS", "0")
    assert fused_adam.library() is None


@needs_kernel
def test_tensors_of_the_wrong_size_or_kind_are_refused_before_the_kernel_runs():
    kernel = FusedAdam(fused_adam.library(), "int8")
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], fused=True)
    settings = AdamSettings.of(optimizer, optimizer.param_groups[0])
    assert settings is not None
    n = 5000
    codes = torch.zeros(n, dtype=torch.uint8)
    scales = torch.ones(3)
    table = torch.zeros((1 << 20) + (1 << 16), dtype=torch.int32)
    noise = (torch.zeros(1 << 16, dtype=torch.int32), 0)

    def shard(**changed):
        fields = {
            "master": torch.zeros(n, dtype=torch.bfloat16),
            "grad": torch.zeros(n, dtype=torch.bfloat16),
            "grad_factor": 1.0,
            "states": (codes, codes.clone()),
            "scales": (scales, scales.clone()),
            "master_noise": noise,
            "state_noise": (table, ([0], [0])),
        }
        return KernelShard(**{**fields, **changed})

    kernel.update(shard(), settings, 1.0)  # the right layout runs
    for bad, match in [
        ({"states": (codes[:-1], codes)}, "host elements"),
        ({"scales": (torch.ones(2), scales)}, "host elements"),
        ({"grad": torch.zeros(n + 1)}, "host elements"),
        ({"states": (codes.float(), codes)}, "state where"),
        ({"state_noise": (table, ([table.numel() - 100], [0]))}, "past the noise table"),
        ({"master_noise": (torch.zeros(10, dtype=torch.int32), 0)}, "65536"),
    ]:
        with pytest.raises(ValueError, match=match):
            kernel.update(shard(**bad), settings, 1.0)
