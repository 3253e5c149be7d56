"""Bad input at store construction and attach: one clear error before any step, nothing left.

Every case checks the same contract: exactly one exception of the documented class whose message
names the bad value and says what to do; the nvme_path directory is unchanged; the model keeps its
own Parameter objects with their values, has no hook left on any module or parameter and still
trains without the store; and a new store attaches to the same model and trains like plain torch.
The config module's own unit tests live in test_config.py; the swap layer's path checks in
test_swap_setup.py. Here everything goes through ``TieredStore``.
"""

from __future__ import annotations

import copy
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import swap.probe
from infinity import AttachError, BudgetError, ConfigError, OffloadConfig, TieredStore
from swap import NvmePathError, SwapSpaceError

#: small swap buffers keep every store here fast; the per-test nvme_path is added to these
BASE: dict[str, Any] = {
    "device": "cpu",
    "offload_param": "nvme",
    "buffer_size": 1 << 16,
    "buffer_count": 2,
    "aio": {"block_size": 1 << 16},
}
FAKED = "the file system refuses O_DIRECT (faked by the test)"
HOOK_DICTS = (
    "_forward_pre_hooks",
    "_forward_hooks",
    "_backward_pre_hooks",
    "_backward_hooks",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)


def make_model(width: int = 32, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width))


def config(nvme_path: Path | str, /, **changes: Any) -> OffloadConfig:
    """BASE on ``nvme_path`` with ``changes`` (sections merged, an nvme_path change wins), built
    the way a JSON config is."""
    data = {"nvme_path": str(nvme_path), **copy.deepcopy(BASE)}
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key].update(value)
        else:
            data[key] = value
    return OffloadConfig.from_dict(data)


def sgd_steps(
    model: nn.Module, optimizer: torch.optim.Optimizer, steps: int, width: int = 32
) -> list[float]:
    generator = torch.Generator().manual_seed(7)
    losses = []
    for _ in range(steps):
        x = torch.randn(4, width, generator=generator)
        loss = model(x).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def tree(directory: Path) -> list[tuple[str, int]]:
    """Every entry under ``directory`` (hidden ones too) with its size: any leftover shows."""
    out = []
    for root, dirs, files in os.walk(directory):
        for name in dirs + files:
            path = Path(root) / name
            out.append((str(path.relative_to(directory)), path.lstat().st_size))
    return sorted(out)


@dataclass
class Snapshot:
    params: dict[str, tuple[nn.Parameter, torch.Tensor]]
    x: torch.Tensor
    output: torch.Tensor
    dirs: dict[Path, list[tuple[str, int]]]


def snapshot(model: nn.Module, *dirs: Path, width: int = 32) -> Snapshot:
    x = torch.randn(3, width, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        output = model(x)
    return Snapshot(
        {n: (p, p.detach().clone()) for n, p in model.named_parameters()},
        x,
        output,
        {d: tree(d) for d in dirs if d.is_dir()},
    )


def assert_no_hooks(model: nn.Module) -> None:
    for name, module in model.named_modules():
        for attr in HOOK_DICTS:
            assert not getattr(module, attr, None), f"{name or 'root'}.{attr} left behind"
    for name, param in model.named_parameters():
        assert not getattr(param, "_post_accumulate_grad_hooks", None), f"{name} grad hook"
        assert not param._backward_hooks, f"{name} backward hook"


def assert_intact(model: nn.Module, before: Snapshot, reattach_dir: Path, width: int = 32) -> None:
    """Nothing left on disk or on the model, values unchanged, and a new store works."""
    for directory, listing in before.dirs.items():
        assert tree(directory) == listing, f"{directory} changed"
    assert_no_hooks(model)
    params = dict(model.named_parameters())
    assert params.keys() == before.params.keys()
    for name, (original, values) in before.params.items():
        param = params[name]
        assert param is original, f"{name} was replaced"
        assert param.untyped_storage().nbytes() == values.numel() * values.element_size(), name
        assert param.dtype == values.dtype and param.device == values.device
        assert torch.equal(param.detach(), values), f"{name} changed"
    # Usable without any store: forward gives what it gave, backward reaches every parameter.
    output = model(before.x)
    assert torch.equal(output.detach(), before.output)
    output.square().mean().backward()
    assert all(p.grad is not None for p in model.parameters())
    model.zero_grad(set_to_none=True)
    # And a new store attaches and trains exactly like plain torch.
    plain = copy.deepcopy(model)
    plain_losses = sgd_steps(plain, torch.optim.SGD(plain.parameters(), lr=0.1), 2, width)
    before_reattach = tree(reattach_dir)
    store = TieredStore(config(reattach_dir))
    attached, optimizer = store.attach(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert attached is model
    losses = sgd_steps(model, optimizer, 2, width)
    store.close()
    assert losses == pytest.approx(plain_losses, rel=1e-6, abs=1e-7)
    for (name, value), (_, reference) in zip(model.named_parameters(), plain.named_parameters()):
        torch.testing.assert_close(value, reference, msg=lambda m, name=name: f"{name}: {m}")
    assert_no_hooks(model)
    assert tree(reattach_dir) == before_reattach


def refused(
    error_type: type[BaseException],
    caplog: pytest.LogCaptureFixture,
    call: Any,
    *args: Any,
    chained: bool = False,
) -> BaseException:
    """Runs ``call(*args)`` and returns its error: exactly ``error_type`` (not a subclass, not
    a second error raised while cleaning up after the first), with no error logged."""
    with caplog.at_level(logging.WARNING):
        with pytest.raises(BaseException) as info:
            call(*args)
    error = info.value
    assert type(error) is error_type, f"{type(error).__name__}: {error}"
    if not chained:
        assert error.__context__ is None, f"raised while handling {error.__context__!r}"
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    return error


# -- the config ----------------------------------------------------------------------------------
#: (changes to BASE, the error's field, words its message must hold: the value and the fix)
CONFIG_CASES = [
    ({"buffer_count": 0}, "buffer_count", ["buffer_count=0", ">= 1", "use 2 or more"]),
    ({"buffer_count": 2.5}, "buffer_count", ["buffer_count=2.5", "got a float"]),
    ({"buffer_size": 1000}, "buffer_size", ["buffer_size=1000", ">= 4096", "'64MiB'"]),
    ({"buffer_size": "64XB"}, "buffer_size", ["buffer_size='64XB'", "KiB"]),
    ({"max_in_cpu": -1}, "max_in_cpu", ["max_in_cpu=-1", ">= 0", "use 0"]),
    ({"device_budget": 0}, "device_budget", ["device_budget=0", "use null"]),
    ({"host_budget": "lots"}, "host_budget", ["host_budget='lots'", "'64MiB'"]),
    ({"prefetch_depth": -1}, "prefetch_depth", ["prefetch_depth=-1", "use 0 to disable"]),
    ({"gradient_clipping": "1.0"}, "gradient_clipping", ["gradient_clipping='1.0'", "got a str"]),
    ({"gradient_clipping": float("inf")}, "gradient_clipping", ["gradient_clipping=inf", "finite"]),
    ({"pin_memory": "yes"}, "pin_memory", ["pin_memory='yes'", "true or false"]),
    ({"offload_param": "disk"}, "offload_param", ["offload_param='disk'", "'none', 'cpu', 'nvme'"]),
    ({"offload_optimizer": "NVME"}, "offload_optimizer", ["'NVME'", "did you mean 'nvme'"]),
    ({"device": "gpu"}, "device", ["device='gpu'", "'cuda:N'"]),
    ({"nvme_path": 5}, "nvme_path", ["nvme_path=5", "a path or a list of paths"]),
    ({"nvme_path": [""]}, "nvme_path", ["nvme_path=['']", "non-empty", "use []"]),
    (
        {"aio": {"block_size": "1MB"}},
        "aio.block_size",
        ["aio.block_size=1000000", "multiple of 4096", "10**6"],
    ),
    ({"aio": {"queue_depth": 0}}, "aio.queue_depth", ["aio.queue_depth=0", "1..1024"]),
    ({"aio": {"queue_depth": 4096}}, "aio.queue_depth", ["aio.queue_depth=4096", "1..1024"]),
    ({"aio": {"thread_count": 0}}, "aio.thread_count", ["aio.thread_count=0", "null"]),
    (
        {"aio": {"backend": "spdk"}},
        "aio.backend",
        ["aio.backend='spdk'", "'auto', 'uring', 'threads', 'buffered'"],
    ),
    ({"aio": "fast"}, "aio", ["'fast'", "JSON object"]),
    (
        {"precision": {"dtype": "fp8"}},
        "precision.dtype",
        ["precision.dtype='fp8'", "'fp32', 'bf16', 'fp16'"],
    ),
    (
        {"precision": {"initial_scale_power": 64}},
        "precision.initial_scale_power",
        ["initial_scale_power=64", "0..63"],
    ),
    (
        {"precision": {"min_loss_scale": 0}},
        "precision.min_loss_scale",
        ["min_loss_scale=0", "positive scale"],
    ),
    (
        {"precision": {"loss_scale": -1.0}},
        "precision.loss_scale",
        ["loss_scale=-1.0", "use 0 for dynamic"],
    ),
    (
        {"batch": {"train_batch_size": 10, "micro_batch_size": 3}},
        "batch.train_batch_size",
        ["train_batch_size=10", "multiple of", "= 3"],
    ),
    # unknown keys: the closest valid key is suggested
    (
        {"bufer_size": 1 << 16},
        "bufer_size",
        ["unknown key 'bufer_size'", "did you mean 'buffer_size'"],
    ),
    (
        {"aio": {"queue_dept": 4}},
        "queue_dept",
        ["'queue_dept' in aio", "did you mean 'queue_depth'"],
    ),
    ({"precision": {"dtpye": "bf16"}}, "dtpye", ["'dtpye' in precision", "did you mean 'dtype'"]),
    ({"zzz": 1}, "zzz", ["unknown key 'zzz'", "valid keys are", "buffer_count"]),
]


@pytest.mark.parametrize(
    "changes,field,words", CONFIG_CASES, ids=[f"{c[1]}-{i}" for i, c in enumerate(CONFIG_CASES)]
)
def test_bad_config_value_is_one_clear_error(tmp_path, caplog, changes, field, words):
    model = make_model()
    before = snapshot(model, tmp_path)

    def build_and_attach() -> None:
        TieredStore(config(tmp_path, **changes)).attach(model)

    error = refused(ConfigError, caplog, build_and_attach)
    assert error.field == field
    message = str(error)
    for word in words:
        assert word in message, f"{word!r} not in {message!r}"
    assert_intact(model, before, tmp_path)


def test_python_api_wrong_types_name_the_fix(tmp_path, caplog):
    model = make_model()
    before = snapshot(model, tmp_path)
    error = refused(
        ConfigError,
        caplog,
        lambda: TieredStore(
            OffloadConfig(device="cpu", nvme_path=tmp_path, buffer_count="2")
        ).attach(model),
    )
    assert "buffer_count='2'" in str(error) and "got a str, write it as a number" in str(error)
    error = refused(
        ConfigError,
        caplog,
        lambda: TieredStore(OffloadConfig(device="cpu", nvme_path=tmp_path, pin_memory=1)).attach(
            model
        ),
    )
    assert "pin_memory=1" in str(error) and "true or false" in str(error)
    error = refused(
        ConfigError,
        caplog,
        lambda: TieredStore(
            OffloadConfig(device="cpu", nvme_path=tmp_path, precision={"dtype": "bf16"})
        ),
    )
    assert "precision=" in str(error) and "PrecisionConfig" in str(error)
    error = refused(
        ConfigError,
        caplog,
        lambda: TieredStore(OffloadConfig(device="cpu").replace(precision={"dtpye": "bf16"})),
    )
    assert "did you mean 'dtype'" in str(error)
    assert_intact(model, before, tmp_path)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_device_without_cuda_is_refused_at_construction(tmp_path, caplog):
    model = make_model()
    before = snapshot(model, tmp_path)
    error = refused(
        AttachError, caplog, lambda: TieredStore(config(tmp_path, device="cuda:1")).attach(model)
    )
    assert "'cuda:1'" in str(error) and "CUDA is not available" in str(error)
    assert "device='auto' or 'cpu'" in str(error)
    assert_intact(model, before, tmp_path)


# -- nvme_path -----------------------------------------------------------------------------------
def test_missing_nvme_path(tmp_path, caplog):
    model = make_model()
    before = snapshot(model, tmp_path)
    missing = tmp_path / "no" / "such"
    error = refused(NvmePathError, caplog, TieredStore(config(missing)).attach, model)
    assert f"nvme_path {missing} does not exist" in str(error)
    assert f"mkdir -p {missing}" in str(error)
    assert not missing.exists() and not missing.parent.exists()
    assert_intact(model, before, tmp_path)


def test_nvme_path_is_a_file(tmp_path, caplog):
    model = make_model()
    plain = tmp_path / "plain"
    plain.write_bytes(b"keep me")
    before = snapshot(model, tmp_path)
    error = refused(NvmePathError, caplog, TieredStore(config(plain)).attach, model)
    assert f"nvme_path {plain} is not a directory" in str(error)
    assert "point nvme_path at a directory" in str(error)
    assert plain.read_bytes() == b"keep me"
    assert_intact(model, before, tmp_path)


def test_read_only_nvme_path(tmp_path, mount_tmpfs, caplog):
    read_only = mount_tmpfs("1m", ro=True)
    model = make_model()
    before = snapshot(model, read_only, tmp_path)
    error = refused(NvmePathError, caplog, TieredStore(config(read_only)).attach, model)
    # named as read-only (not misreported as too small by the free-space preflight)
    assert f"nvme_path {read_only} is on a read-only file system" in str(error)
    assert "writable drive" in str(error)
    assert_intact(model, before, tmp_path)


def test_no_direct_io_with_auto_falls_back_to_buffered(
    tmp_path, caplog, monkeypatch, fresh_probe_cache
):
    monkeypatch.setattr(swap.probe, "probe_direct_io", lambda directory: FAKED)
    model = make_model()
    plain = copy.deepcopy(model)
    plain_losses = sgd_steps(plain, torch.optim.SGD(plain.parameters(), lr=0.1), 3)
    # one 4 KiB slot per weight and two slots in all: the arena cannot cache the model
    store = TieredStore(config(tmp_path, aio={"backend": "auto"}, buffer_size=4096))
    with caplog.at_level(logging.WARNING, logger="swap.probe"):
        model, optimizer = store.attach(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert store.stats()["backend"] == "buffered" and not store.engine.backend.direct
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(FAKED in w and "'buffered'" in w and str(tmp_path) in w for w in warnings)
    assert sgd_steps(model, optimizer, 3) == pytest.approx(plain_losses, rel=1e-6, abs=1e-7)
    assert store.stats()["bytes_read"] > 0  # it really swapped through the fallback
    store.close()
    assert tree(tmp_path) == []


@pytest.mark.parametrize("backend", ["uring", "threads"])
def test_no_direct_io_with_an_explicit_direct_backend_is_refused(
    tmp_path, caplog, monkeypatch, fresh_probe_cache, backend
):
    monkeypatch.setattr(swap.probe, "probe_direct_io", lambda directory: FAKED)
    model = make_model()
    before = snapshot(model, tmp_path)
    store = TieredStore(config(tmp_path, aio={"backend": backend}))
    with caplog.at_level(logging.WARNING):
        with pytest.raises(NvmePathError) as info:
            store.attach(model)
    message = str(info.value)
    assert f"aio backend '{backend}' needs O_DIRECT" in message and str(tmp_path) in message
    assert "use backend 'auto' or 'buffered'" in message
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    monkeypatch.undo()  # a real probe again for the new store
    swap.probe.clear_probe_cache()
    assert_intact(model, before, tmp_path)


def test_nearly_full_nvme_path_is_refused_with_both_numbers(tmp_path, mount_tmpfs, caplog):
    small = mount_tmpfs("1m")
    width = 512  # two 1 MiB weight matrices: more than the 1 MiB file system holds
    model = make_model(width)
    before = snapshot(model, small, tmp_path, width=width)
    store = TieredStore(config(small, aio={"block_size": 4096}))
    error = refused(SwapSpaceError, caplog, store.attach, model)
    free = shutil.disk_usage(small).free
    assert error.available == free and error.needed > free
    assert error.needed >= sum(p.numel() * 4 for p in model.parameters())
    message = str(error)
    assert f"nvme_path {small} has {free} bytes free" in message
    assert f"needs {error.needed} bytes" in message
    assert "free space, add directories to nvme_path, or offload less" in message
    assert_intact(model, before, tmp_path, width=width)


# -- buffers and budgets -------------------------------------------------------------------------
def test_buffer_count_one_works_and_warns_that_it_serialises_io(tmp_path, caplog):
    model = make_model()
    plain = copy.deepcopy(model)
    plain_losses = sgd_steps(plain, torch.optim.SGD(plain.parameters(), lr=0.1), 3)
    store = TieredStore(config(tmp_path, buffer_count=1, buffer_size=4096))
    with caplog.at_level(logging.WARNING, logger="infinity.store"):
        model, optimizer = store.attach(model, torch.optim.SGD(model.parameters(), lr=0.1))
    warnings = [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and r.name == "infinity.store"
    ]
    assert len(warnings) == 1 and "buffer_count=1" in warnings[0]
    assert "serialised" in warnings[0] and "buffer_count >= 2" in warnings[0]
    assert sgd_steps(model, optimizer, 3) == pytest.approx(plain_losses, rel=1e-6, abs=1e-7)
    store.close()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="infinity.store"):
        with TieredStore(config(tmp_path, buffer_count=2)) as store:
            store.attach(make_model())
    assert not [r for r in caplog.records if "buffer_count" in r.getMessage()]


def _param_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters(recurse=False))


@pytest.mark.parametrize("case", ["device", "host-nvme", "host-cpu"])
def test_budget_smaller_than_needed_is_refused_with_the_bytes(tmp_path, caplog, case):
    model = make_model()
    before = snapshot(model, tmp_path)
    layer = _param_bytes(model[0])  # 32 x 32 weights + 32 biases, fp32
    if case == "device":
        cfg = config(tmp_path, device_budget=1024)
        words = [
            "device_budget of 1024 bytes",
            "module '0'",
            f"take {layer} bytes",
            f"set device_budget to at least {layer}",
        ]
    elif case == "host-nvme":
        cfg = config(tmp_path, host_budget=1000)
        words = [
            "host_budget of 1000 bytes",
            "less than one buffer (65536 bytes)",
            "raise host_budget to at least",
            "or lower buffer_size",
        ]
    else:
        cfg = config(tmp_path, offload_param="cpu", host_budget=1000)
        total = sum(p.numel() * 4 for p in model.parameters())
        words = [
            f"every parameter in host memory ({total} bytes)",
            "host_budget is 1000",
            "raise host_budget to at least",
            "or use offload_param='nvme'",
        ]
    error = refused(BudgetError, caplog, TieredStore(cfg).attach, model)
    for word in words:
        assert word in str(error), f"{word!r} not in {str(error)!r}"
    assert_intact(model, before, tmp_path)


# -- the model and the optimizer -----------------------------------------------------------------
def test_optimizer_with_a_parameter_not_in_the_model(tmp_path, caplog):
    model = make_model()
    stray = nn.Parameter(torch.zeros(3, 5))
    optimizer = torch.optim.SGD(
        [{"params": list(model.parameters())}, {"params": [stray], "lr": 0.5}], lr=0.1
    )
    before = snapshot(model, tmp_path)
    error = refused(AttachError, caplog, TieredStore(config(tmp_path)).attach, model, optimizer)
    assert "param_groups[1]" in str(error) and "shape (3, 5)" in str(error)
    assert "build the optimizer from model.parameters()" in str(error)
    assert torch.equal(stray, torch.zeros(3, 5))
    assert_intact(model, before, tmp_path)


def test_optimizer_that_is_not_an_optimizer(tmp_path, caplog):
    model = make_model()
    before = snapshot(model, tmp_path)
    error = refused(
        AttachError, caplog, TieredStore(config(tmp_path)).attach, model, model.parameters()
    )
    assert "torch.optim.Optimizer" in str(error) and "got generator" in str(error)
    assert_intact(model, before, tmp_path)


@pytest.mark.parametrize("thing", [None, "state_dict", "function"])
def test_attaching_something_that_is_not_a_module(tmp_path, caplog, thing):
    model = make_model()
    before = snapshot(model, tmp_path)
    value = {None: None, "state_dict": model.state_dict(), "function": make_model}[thing]
    error = refused(AttachError, caplog, TieredStore(config(tmp_path)).attach, value)
    assert f"attach expects an nn.Module, got {type(value).__name__}" in str(error)
    assert_intact(model, before, tmp_path)


def test_attaching_one_store_twice(tmp_path, caplog):
    model, other = make_model(), make_model(seed=1)
    before = snapshot(other, tmp_path)
    store = TieredStore(config(tmp_path))
    model, optimizer = store.attach(model, torch.optim.SGD(model.parameters(), lr=0.1))
    files = tree(tmp_path)
    error = refused(AttachError, caplog, store.attach, other)
    assert "already attached to a model" in str(error) and "one store per model" in str(error)
    assert tree(tmp_path) == files  # the first attach is unharmed and still trains
    sgd_steps(model, optimizer, 1)
    store.close()
    error = refused(AttachError, caplog, store.attach, other)
    assert "closed; create a new TieredStore" in str(error)
    assert_intact(other, before, tmp_path)


def test_attaching_one_model_to_two_stores(tmp_path, caplog):
    model = make_model()
    first = TieredStore(config(tmp_path))
    model, optimizer = first.attach(model, torch.optim.SGD(model.parameters(), lr=0.1))
    files = tree(tmp_path)
    for part in (model, model[2]):  # the model, or any module of it
        error = refused(AttachError, caplog, TieredStore(config(tmp_path)).attach, part)
        assert "already attached to another TieredStore" in str(error)
        assert "close that store first" in str(error)
        assert tree(tmp_path) == files
    sgd_steps(model, optimizer, 1)  # the first store is unharmed
    first.close()
    assert_intact(model, snapshot(model, tmp_path), tmp_path)


class NeedsAScheduleOptimizer(torch.optim.SGD):
    """An optimizer whose constructor takes an argument it does not keep in ``defaults``: the
    store cannot rebuild it, and finds out only after the model's values moved to NVMe and its
    hooks were installed (the latest point an attach can fail)."""

    def __init__(self, params: Any, lr: float, *, schedule: str) -> None:
        super().__init__(params, lr=lr)
        self.schedule = schedule


def test_a_failure_late_in_attach_undoes_everything(tmp_path, caplog):
    model = make_model()
    before = snapshot(model, tmp_path)
    store = TieredStore(config(tmp_path))
    optimizer = NeedsAScheduleOptimizer(model.parameters(), lr=0.1, schedule="cosine")
    error = refused(TypeError, caplog, store.attach, model, optimizer, chained=True)
    assert "NeedsAScheduleOptimizer" in str(error)
    assert store.hooks is not None  # it did get that far: hooks were installed, then removed
    assert_intact(model, before, tmp_path)
