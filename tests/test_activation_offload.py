"""offload_activations: saved activations leave the device and come back, bit for bit."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

import infinity
from infinity.training.activations import ActivationOffloadError
from swap import FaultInjectingBackend

STEPS = 3
MICRO = 2


class MLP(nn.Module):
    def __init__(self, width: int = 256, depth: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.head = nn.Linear(width, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = F.gelu(layer(x))
        return self.head(x)


class Block(nn.Module):
    """Pre-norm attention + MLP: split q/k/v views, transposes, a residual stream."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.fc = nn.Linear(width, 4 * width)
        self.out = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(width, dim=2)
        q, k, v = (t.view(batch, length, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) / (q.shape[-1] ** 0.5)
        attn = scores.softmax(-1) @ v
        x = x + self.proj(attn.transpose(1, 2).reshape(batch, length, width))
        return x + self.out(F.gelu(self.fc(self.norm2(x))))


class Stack(nn.Module):
    def __init__(
        self, width: int = 64, heads: int = 4, layers: int = 3, ckpt: str = "none"
    ) -> None:
        super().__init__()
        self.ckpt = ckpt
        self.inp = nn.Linear(width, width)  # reentrant checkpoint needs inputs requiring grad
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.head = nn.Linear(width, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            if self.ckpt != "none" and torch.is_grad_enabled():
                x = checkpoint(block, x, use_reentrant=self.ckpt == "reentrant")
            else:
                x = block(x)
        return self.head(x)


def make(kind: str, ckpt: str = "none") -> nn.Module:
    torch.manual_seed(0)
    if kind == "mlp":
        return MLP()
    return Stack(ckpt=ckpt)


def batches(kind: str, seed: int = 1):
    generator = torch.Generator().manual_seed(seed)
    while True:
        shape = (128, 256) if kind == "mlp" else (4, 64, 64)
        x = torch.randn(shape, generator=generator)
        y = torch.randn(x.shape[:-1] + (8 if kind == "mlp" else 16,), generator=generator)
        yield x, y


def run(
    model: nn.Module, kind: str, tmp_path, steps: int = STEPS, micro: int = MICRO, **config
) -> tuple[list, list, dict, dict]:
    """Trains an attached copy; returns losses, per-step grads, final params and stats."""
    config = {"device": "cpu", "nvme_path": str(tmp_path), "buffer_size": 1 << 18, **config}
    store = infinity.TieredStore(infinity.OffloadConfig(**config))
    fresh = copy.deepcopy(model)
    model, optimizer = store.attach(fresh, torch.optim.AdamW(fresh.parameters(), lr=1e-3))
    data = batches(kind)
    losses, grads = [], []
    for _ in range(steps):
        for _ in range(micro):
            x, y = next(data)
            loss = F.mse_loss(model(x), y) / micro
            loss.backward()
            losses.append(loss.detach().clone())
        grads.append([p.grad.clone() for p in model.parameters()])
        optimizer.step()
        optimizer.zero_grad()
    stats = store.stats()
    params = {k: v.clone() for k, v in model.state_dict().items()}
    store.close()
    return losses, grads, params, stats


def assert_bit_equal(reference, result) -> None:
    losses, grads, params, _ = result
    ref_losses, ref_grads, ref_params, _ = reference
    differ = [
        (i, (b - a).item())
        for i, (a, b) in enumerate(zip(ref_losses, losses))
        if not torch.equal(a, b)
    ]
    # the first step's grads first: they tell a forward that differs from a backward that does
    for step, (ref_step, step_grads) in enumerate(zip(ref_grads, grads)):
        for index, (a, b) in enumerate(zip(ref_step, step_grads)):
            assert torch.equal(a, b), (
                f"step {step}: grad {index} differs by up to "
                f"{(a - b).abs().max().item():.3g}; losses differing "
                f"(micro-batch, difference): {differ}"
            )
    assert not differ, f"losses differ (micro-batch, difference): {differ}"
    assert ref_params.keys() == params.keys()
    for key in ref_params:
        assert torch.equal(ref_params[key], params[key]), key


@pytest.mark.parametrize("param", ["nvme", "cpu"])
@pytest.mark.parametrize(
    "kind,ckpt",
    [("mlp", "none"), ("stack", "none"), ("stack", "non-reentrant"), ("stack", "reentrant")],
)
def test_offloaded_training_is_bit_equal(tmp_path, kind, ckpt, param):
    model = make(kind, ckpt)
    reference = run(model, kind, tmp_path, offload_param=param)
    assert reference[3]["activations"] is None
    for target in ("cpu", "nvme"):
        result = run(model, kind, tmp_path, offload_param=param, offload_activations=target)
        assert_bit_equal(reference, result)
        stats = result[3]["activations"]
        assert stats["target"] == target and stats["offloaded_bytes"] > 0
        assert stats["fetched_bytes"] == stats["offloaded_bytes"]
        assert stats["current_device_bytes"] == 0
        if target == "nvme":  # the bytes went through the disk
            # each byte once each way (a chunk's copy back is not repeated when polled again)
            assert stats["bytes_written"] == stats["offloaded_bytes"]
            assert stats["bytes_read"] == stats["offloaded_bytes"]
        else:
            assert stats["bytes_written"] == 0 and stats["peak_host_bytes"] > 0


def saved_bytes(model: nn.Module, x: torch.Tensor) -> int:
    """What autograd saves in one forward without offload, storages counted once."""
    storages: dict[int, int] = {}
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x).sum()
    return sum(storages.values())


def test_checkpointing_offloads_only_the_boundaries(tmp_path):
    """With torch.utils.checkpoint only what the outer graph saves passes the hooks: each
    block's input, and the inputs of the layers outside the blocks (inp, head)."""
    plain = run(
        make("stack"),
        "stack",
        tmp_path,
        steps=1,
        micro=1,
        offload_param="cpu",
        offload_activations="cpu",
    )[3]["activations"]
    for ckpt in ("non-reentrant", "reentrant"):
        model = make("stack", ckpt)
        stats = run(
            model,
            "stack",
            tmp_path,
            steps=1,
            micro=1,
            offload_param="cpu",
            offload_activations="cpu",
        )[3]["activations"]
        assert stats["offloaded_tensors"] == len(model.blocks) + 2, (ckpt, stats)
        assert stats["offloaded_tensors"] < plain["offloaded_tensors"] / 4


def test_activations_larger_than_the_device_budget_train(tmp_path):
    torch.manual_seed(0)
    model = MLP(width=512, depth=8)
    x = torch.randn(512, 512)
    device_budget = 4 * 512 * 512 * 4 + (1 << 20)  # a few layers' parameters
    kept = saved_bytes(model, x)
    assert kept > device_budget  # without offload the activations alone exceed the budget
    config = dict(
        device="cpu",
        offload_param="nvme",
        nvme_path=str(tmp_path),
        device_budget=device_budget,
        buffer_size=1 << 20,
        prefetch_depth=1,
    )
    store = infinity.TieredStore(infinity.OffloadConfig(offload_activations="nvme", **config))
    attached, optimizer = store.attach(model, torch.optim.AdamW(model.parameters()))
    for _ in range(2):
        attached(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    stats = store.stats()
    store.close()
    activations = stats["activations"]
    assert activations["offloaded_bytes"] >= 2 * (kept - x.numel() * 4)  # all but the input
    # The activations held on the device at once stay under the budget they exceed in all
    # (they are not charged to it: the budget caches parameters), and with the parameters
    # the device holds less than the activations alone would take.
    assert activations["peak_device_bytes"] < device_budget < kept
    assert activations["peak_device_total_bytes"] < kept
    assert activations["bytes_written"] > 0 and activations["bytes_read"] > 0


def test_parameters_and_small_tensors_stay(tmp_path):
    """linear saves weight.t() (a view of the parameter) and its input: only the input moves;
    and tensors under 64 KiB stay."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256))
    store = infinity.TieredStore(
        infinity.OffloadConfig(device="cpu", offload_param="cpu", offload_activations="cpu")
    )
    attached, _ = store.attach(model)
    attached(torch.randn(128, 256, requires_grad=True)).sum().backward()
    attached(torch.randn(8, 256, requires_grad=True)).sum().backward()  # 8 KiB: stays
    stats = store.stats()["activations"]
    store.close()
    assert stats["offloaded_tensors"] == 1
    assert stats["offloaded_bytes"] == 128 * 256 * 4


def test_activation_offload_alone_with_parameters_on_the_device(tmp_path):
    """offload_param='none', fp32: the store leaves the model as it is but still offloads."""
    model = make("mlp")
    reference = run(model, "mlp", tmp_path, offload_param="none")
    result = run(model, "mlp", tmp_path, offload_param="none", offload_activations="nvme")
    assert_bit_equal(reference, result)
    assert result[3]["activations"]["bytes_written"] > 0


def test_a_failed_read_names_the_activation(tmp_path):
    backend: list[FaultInjectingBackend] = []

    def wrap(inner):
        backend.append(FaultInjectingBackend(inner))
        return backend[-1]

    config = infinity.OffloadConfig(
        device="cpu", offload_param="cpu", offload_activations="nvme", nvme_path=str(tmp_path)
    )
    store = infinity.TieredStore(config, backend_wrapper=wrap)
    model, _ = store.attach(make("mlp"))
    loss = model(torch.randn(128, 256)).sum()
    backend[0].inject("eio", op="read", times=None)
    with pytest.raises(
        ActivationOffloadError, match="from the forward of module 'head'.*from NVMe.*EIO"
    ):
        loss.backward()
    store.close()


def test_host_budget_too_small_for_cpu_activations(tmp_path):
    torch.manual_seed(0)
    model = MLP()
    params = sum(p.numel() * 4 for p in model.parameters())
    store = infinity.TieredStore(
        infinity.OffloadConfig(
            device="cpu",
            offload_param="cpu",
            offload_activations="cpu",
            host_budget=params + 100_000,
            device_budget=params,  # host RAM on top of host_budget, which it leaves alone
        )
    )
    attached, _ = store.attach(model)
    with pytest.raises(infinity.BudgetError, match="Raise host_budget.*offload_activations='nvme'"):
        attached(torch.randn(512, 256)).sum().backward()
    store.close()


def test_bad_setting_names_the_choices():
    with pytest.raises(infinity.ConfigError, match="offload_activations.*'none', 'cpu', 'nvme'"):
        infinity.OffloadConfig(offload_activations="gpu")
    assert (
        infinity.OffloadConfig.from_dict({"offload_activations": "nvme"}).offload_activations
        == "nvme"
    )
