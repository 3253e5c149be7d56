"""The module hooks and state_dict hooks under the ways real training loops use a model.

Each test runs the same loop on a deep copy of one model twice, plainly and attached, and
compares what the loop recorded (losses, outputs) and the final parameters: losses within 1e-5,
everything else allclose (rtol 1e-5, atol 1e-6).
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

import infinity
from infinity.cli.common.tiny_gpt import GPTConfig, TinyGPT, synthetic_batches

GPT = GPTConfig(vocab_size=64, context=16, layers=3, width=32, heads=4)
# The model (~170 KB) is larger than the staging arena (2 x 64 KiB) and the device budget, so
# shards are evicted to NVMe and device copies are dropped and gathered again within a step.
NVME = {
    "offload_param": "nvme",
    "buffer_size": 1 << 16,
    "buffer_count": 2,
    "device_budget": 1 << 16,
}
CPU = {"offload_param": "cpu", "device_budget": 1 << 16}
MODES = {"nvme": NVME, "cpu": CPU}
RTOL, ATOL, LOSS_TOL = 1e-5, 1e-6, 1e-5


# -- models -------------------------------------------------------------------------------------
def gpt(config: GPTConfig = GPT, seed: int = 0) -> TinyGPT:
    torch.manual_seed(seed)
    return TinyGPT(config)


class SharedWeights(nn.Module):
    """One weight Parameter registered in two child Linears, and a parameter that the parent
    owns directly and uses functionally while a child module also owns it."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)
        self.b.weight = self.a.weight  # shared by two different modules
        self.inner = nn.Linear(16, 8)
        self.w = self.inner.weight  # the parent owns it too, and uses it itself
        self.head = nn.Linear(8, 4)
        self.head.alias = self.head.weight  # two names for one Parameter in one module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x)) + torch.sigmoid(self.b(x))
        h = torch.tanh(self.inner(h)) + torch.tanh(F.linear(h, self.w))
        return self.head(h)


class Twice(nn.Module):
    """The same Linear applied twice in one forward."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 16)
        self.lin = nn.Linear(16, 16)
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        h = torch.tanh(self.lin(h))
        h = torch.tanh(self.lin(h)) + h
        return self.out(h)


class Frozen(nn.Module):
    """A trained Linear whose weight is frozen (its bias trains), between trained layers."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.mid = nn.Linear(32, 32)
        self.mid.weight.requires_grad_(False)
        self.frozen_norm = nn.LayerNorm(32)
        self.frozen_norm.requires_grad_(False)
        self.out = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        h = self.frozen_norm(torch.tanh(self.mid(h)))
        return self.out(h)


class CheckpointedGPT(TinyGPT):
    """TinyGPT whose blocks, and final norm (a module with parameters of its own at the root of a
    checkpoint), run under torch.utils.checkpoint with the chosen ``use_reentrant``."""

    def __init__(self, config: GPTConfig, reentrant: bool) -> None:
        super().__init__(config)
        self.reentrant = reentrant

    def forward(self, tokens, targets=None):
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.embed(tokens) + self.position(positions)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=self.reentrant)
        x = checkpoint(self.norm, x, use_reentrant=self.reentrant)
        logits = self.head(x)
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def seeded(factory: Callable[[], nn.Module], seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return factory()


def vectors(steps: int, seed: int = 1, batch: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(batch, 16, generator=generator),
            torch.randint(0, 4, (batch,), generator=generator),
        )
        for _ in range(steps)
    ]


def gpt_batches(steps: int, config: GPTConfig = GPT, batch: int = 4):
    data = synthetic_batches(config, batch, seed=1)
    return [next(data) for _ in range(steps)]


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    # fused: the store may run Adam's fused CPU kernel, whose rounding differs from the loop's
    # in the last bit; Adam blows that up on parameters whose true gradient is zero (attention
    # key biases), so both sides use the same kernel.
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)


# -- the harness ----------------------------------------------------------------------------------
@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """These models are tiny: one intra-op thread is as fast, and several threads fighting over
    a busy machine's cores made this file several times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def attach(
    stores: list, model: nn.Module, optimizer: torch.optim.Optimizer | None, mode: dict, tmp_path
) -> tuple[infinity.TieredStore, nn.Module, torch.optim.Optimizer]:
    kwargs = dict(mode)
    if kwargs["offload_param"] == "nvme":
        kwargs["nvme_path"] = str(tmp_path)
    store = infinity.TieredStore(infinity.OffloadConfig(**kwargs))
    stores.append(store)
    model, optimizer = store.attach(model, optimizer)
    return store, model, optimizer


def assert_records_equal(plain: list, attached: list) -> None:
    assert len(plain) == len(attached)
    for i, (a, b) in enumerate(zip(plain, attached)):
        if isinstance(a, float):
            assert abs(a - b) <= LOSS_TOL, f"record {i}: {b} vs plain {a}"
        else:
            assert b.shape == a.shape and b.numel() > 0
            torch.testing.assert_close(
                b, a, rtol=RTOL, atol=ATOL, msg=lambda m, i=i: f"record {i}: {m}"
            )


def assert_state_equal(plain: dict, attached: dict) -> None:
    assert list(attached.keys()) == list(plain.keys())
    for key, value in plain.items():
        got = attached[key]
        assert isinstance(got, torch.Tensor) and got.shape == value.shape, key
        torch.testing.assert_close(
            got, value, rtol=RTOL, atol=ATOL, msg=lambda m, key=key: f"{key}: {m}"
        )


def run_pair(
    stores,
    tmp_path,
    reference: nn.Module,
    loop: Callable,
    mode: dict,
    optimizer_factory: Callable = adamw,
    seed: int = 123,
):
    """Runs ``loop(model, optimizer) -> records`` on a plain copy and an attached copy of
    ``reference`` (same RNG seed) and checks records and final parameters agree."""
    plain = copy.deepcopy(reference)
    torch.manual_seed(seed)
    plain_records = loop(plain, optimizer_factory(plain))
    attached = copy.deepcopy(reference)
    store, model, optimizer = attach(stores, attached, optimizer_factory(attached), mode, tmp_path)
    torch.manual_seed(seed)
    records = loop(model, optimizer)
    assert_records_equal(plain_records, records)
    assert_state_equal(plain.state_dict(), model.state_dict())
    return store, model, plain


def gpt_loop(batches, **kwargs):
    def loop(model, optimizer):
        losses = []
        for tokens, targets in batches:
            loss = model(tokens, targets)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        return losses

    return loop


def vector_loop(batches):
    def loop(model, optimizer):
        losses = []
        for x, y in batches:
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        return losses

    return loop


# -- tests ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_tied_weights_are_one_entry_and_train_like_plain(stores, tmp_path, mode):
    reference = gpt()
    store, model, plain = run_pair(
        stores, tmp_path, reference, gpt_loop(gpt_batches(5)), MODES[mode]
    )
    # The tied Parameter is registered once: one entry, under the first name.
    tied = [e for e in store.registry.entries if e.param is model.embed.weight]
    assert len(tied) == 1 and tied[0].name == "embed.weight"
    assert len(store.registry.entries) == len(list(reference.parameters()))
    assert all(e.name != "head.weight" for e in store.registry.entries)
    assert model.head.weight is model.embed.weight
    state = model.state_dict()
    assert "embed.weight" in state and "head.weight" in state
    assert state["embed.weight"].shape == (GPT.vocab_size, GPT.width)
    torch.testing.assert_close(state["head.weight"], state["embed.weight"], rtol=0, atol=0)
    torch.testing.assert_close(
        state["head.weight"], plain.head.weight.detach(), rtol=RTOL, atol=ATOL
    )
    if mode == "nvme":
        stats = store.stats()
        assert stats["bytes_read"] > 0 and stats["bytes_written"] > 0


@pytest.mark.parametrize("mode", MODES)
def test_parameter_shared_by_two_modules(stores, tmp_path, mode):
    reference = seeded(SharedWeights)
    store, model, _ = run_pair(stores, tmp_path, reference, vector_loop(vectors(6)), MODES[mode])
    assert model.b.weight is model.a.weight and model.w is model.inner.weight
    assert len(store.registry.entries) == len(list(reference.parameters())) == 7
    # state_dict has every name of every shared Parameter, with its real values.
    state = model.state_dict()
    assert list(state) == list(reference.state_dict())
    assert "head.alias" in state and "b.weight" in state and "w" in state
    torch.testing.assert_close(state["head.alias"], state["head.weight"], rtol=0, atol=0)
    torch.testing.assert_close(state["b.weight"], state["a.weight"], rtol=0, atol=0)
    torch.testing.assert_close(state["w"], state["inner.weight"], rtol=0, atol=0)
    # ...and loads back under all of them (strict) into a fresh plain and attached pair.
    new_state = {k: v + 1.0 for k, v in state.items()}
    plain = seeded(SharedWeights, seed=3)
    plain.load_state_dict(new_state)
    model.load_state_dict(new_state)
    x = vectors(1)[0][0]
    with torch.no_grad():
        torch.testing.assert_close(model(x), plain(x), rtol=RTOL, atol=ATOL)
    assert_state_equal(plain.state_dict(), model.state_dict())


@pytest.mark.parametrize("mode", MODES)
def test_module_called_twice_in_one_forward(stores, tmp_path, mode):
    store, model, _ = run_pair(
        stores, tmp_path, seeded(Twice), vector_loop(vectors(6)), MODES[mode]
    )
    # Every hold was released after each backward pass.
    assert all(e.holds == 0 for e in store.registry.entries)
    assert not store.hooks.backward_holds


@pytest.mark.parametrize("mode", MODES)
def test_no_grad_inference_between_training_steps(stores, tmp_path, mode):
    batches = gpt_batches(6)
    probe = gpt_batches(1, batch=2)[0][0]

    def loop(model, optimizer):
        records = []
        for i, (tokens, targets) in enumerate(batches):
            loss = model(tokens, targets)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            records.append(loss.item())
            if i % 2 == 0:
                with torch.no_grad():
                    records.append(model(probe))
                    records.append(model(probe, probe).item())
        return records

    store, _, _ = run_pair(stores, tmp_path, gpt(), loop, MODES[mode])
    assert all(e.holds == 0 for e in store.registry.entries)


def test_inference_between_backward_and_step(stores, tmp_path):
    """An inference pass while gradients wait for the step must not disturb them."""
    batches = gpt_batches(4)
    probe = gpt_batches(1, batch=2)[0][0]

    def loop(model, optimizer):
        records = []
        for tokens, targets in batches:
            loss = model(tokens, targets)
            loss.backward()
            with torch.no_grad():
                records.append(model(probe))
            optimizer.step()
            optimizer.zero_grad()
            records.append(loss.item())
        return records

    run_pair(stores, tmp_path, gpt(), loop, NVME)


@pytest.mark.parametrize("mode", MODES)
def test_eval_train_switching_with_dropout(stores, tmp_path, mode):
    config = GPTConfig(**{**GPT.__dict__, "dropout": 0.2})
    batches = gpt_batches(6, config)
    probe_tokens, probe_targets = gpt_batches(1, config, batch=2)[0]

    def loop(model, optimizer):
        records = []
        for i, (tokens, targets) in enumerate(batches):
            model.train()
            loss = model(tokens, targets)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            records.append(loss.item())
            model.eval()
            if i % 2:
                with torch.no_grad():
                    records.append(model(probe_tokens))
            else:
                # An eval forward with grad enabled whose graph is dropped without backward.
                records.append(model(probe_tokens, probe_targets).detach())
        model.train()
        return records

    plain_model = gpt(config)
    _, model, _ = run_pair(stores, tmp_path, plain_model, loop, MODES[mode])
    assert model.training
    # Dropout is active in training mode and off in eval mode, on the attached model too.
    tokens = probe_tokens
    with torch.no_grad():
        model.eval()
        first, second = model(tokens), model(tokens)
        torch.testing.assert_close(first, second, rtol=0, atol=0)
        model.train()
        assert not torch.equal(model(tokens), model(tokens))


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non_reentrant"])
def test_activation_checkpointing(stores, tmp_path, reentrant):
    reference = seeded(lambda: CheckpointedGPT(GPT, reentrant))
    store, _, _ = run_pair(stores, tmp_path, reference, gpt_loop(gpt_batches(5)), NVME)
    assert all(e.holds == 0 for e in store.registry.entries)
    assert not store.hooks.backward_holds


def test_reentrant_checkpointing_on_cpu(stores, tmp_path):
    reference = seeded(lambda: CheckpointedGPT(GPT, True))
    run_pair(stores, tmp_path, reference, gpt_loop(gpt_batches(4)), CPU)


@pytest.mark.parametrize("mode", MODES)
def test_state_dict_returns_the_trained_values(stores, tmp_path, mode):
    _, model, plain = run_pair(stores, tmp_path, gpt(), gpt_loop(gpt_batches(4)), MODES[mode])
    state, expected = model.state_dict(), plain.state_dict()
    assert list(state) == list(expected)
    for key, value in expected.items():
        assert type(state[key]) is torch.Tensor and state[key].shape == value.shape, key
        torch.testing.assert_close(state[key], value, rtol=RTOL, atol=ATOL)
    # A prefix and a destination dict work as in torch.
    prefixed = model.state_dict(prefix="model.")
    assert list(prefixed) == ["model." + k for k in expected]
    torch.testing.assert_close(
        prefixed["model.blocks.1.fc.weight"], expected["blocks.1.fc.weight"], rtol=RTOL, atol=ATOL
    )
    # Parameters hold placeholders again afterwards: state_dict did not leave them gathered.
    assert model.blocks[0].fc.weight.untyped_storage().nbytes() == 0


@pytest.mark.parametrize("mode", MODES)
def test_load_state_dict_values_are_used_by_the_next_forward(stores, tmp_path, mode):
    batches = gpt_batches(3)
    new_state = gpt(seed=7).state_dict()
    probe = gpt_batches(1, batch=2)[0][0]

    other = gpt(seed=8)
    block_state = other.blocks[1].state_dict()
    norm_state = other.norm.state_dict()

    def loop(model, optimizer):
        records = gpt_loop(batches[:2])(model, optimizer)
        result = model.load_state_dict(new_state, strict=True)
        assert result.missing_keys == [] and result.unexpected_keys == []
        with torch.no_grad():
            records.append(model(probe))
        # Into a submodule: strict, and nothing reported missing.
        result = model.blocks[1].load_state_dict(block_state, strict=True)
        assert result.missing_keys == [] and result.unexpected_keys == []
        with torch.no_grad():
            records.append(model(probe))
        records += gpt_loop(batches[2:])(model, optimizer)
        # assign=True (last: in plain torch it swaps in new Parameters the optimizer lacks).
        model.norm.load_state_dict(norm_state, assign=True)
        with torch.no_grad():
            records.append(model(probe))
        return records

    store, model, _ = run_pair(stores, tmp_path, gpt(), loop, MODES[mode])
    # The attached model copied into the Parameters it registered instead of replacing them.
    assert store.registry.entry_of(model.norm.weight) is not None


def test_load_state_dict_right_after_attach(stores, tmp_path):
    new_state = gpt(seed=7).state_dict()
    plain = gpt()
    plain.load_state_dict(new_state)
    _, model, _ = attach(stores, gpt(), None, NVME, tmp_path)
    model.load_state_dict(new_state)
    probe = gpt_batches(1, batch=2)[0][0]
    with torch.no_grad():
        torch.testing.assert_close(model(probe), plain(probe), rtol=RTOL, atol=ATOL)
    assert_state_equal(plain.state_dict(), model.state_dict())


def _load_error(model: nn.Module, state: dict, strict: bool = True) -> str:
    with pytest.raises(RuntimeError) as info:
        model.load_state_dict(state, strict=strict)
    return str(info.value)


@pytest.mark.parametrize("mode", MODES)
def test_load_state_dict_errors_are_the_normal_ones(stores, tmp_path, mode):
    plain = gpt()
    _, model, _ = attach(stores, gpt(), None, MODES[mode], tmp_path)
    good = gpt(seed=7).state_dict()

    bad_shape = dict(good)
    bad_shape["blocks.1.fc.weight"] = torch.zeros(3, 5)
    message = _load_error(model, bad_shape)
    assert message == _load_error(plain, bad_shape)
    assert (
        "size mismatch for blocks.1.fc.weight: copying a param with shape "
        "torch.Size([3, 5]) from checkpoint, the shape in current model is "
        "torch.Size([128, 32])." in message
    )

    missing = {k: v for k, v in good.items() if k != "blocks.0.qkv.bias"}
    assert _load_error(model, missing) == _load_error(plain, missing)
    assert 'Missing key(s) in state_dict: "blocks.0.qkv.bias"' in _load_error(model, missing)

    extra = {**good, "blocks.0.nope": torch.zeros(1)}
    assert _load_error(model, extra) == _load_error(plain, extra)

    not_tensor = {**good, "norm.bias": [1.0, 2.0]}
    assert _load_error(model, not_tensor) == _load_error(plain, not_tensor)

    # strict=False reports the same incompatible keys as torch.
    result = model.load_state_dict(missing, strict=False)
    expected = plain.load_state_dict(missing, strict=False)
    assert result.missing_keys == expected.missing_keys == ["blocks.0.qkv.bias"]
    assert result.unexpected_keys == expected.unexpected_keys == []
    # Whatever torch loaded despite the errors, the attached model loaded too.
    assert_state_equal(plain.state_dict(), model.state_dict())
    probe = gpt_batches(1, batch=2)[0][0]
    with torch.no_grad():
        torch.testing.assert_close(model(probe), plain(probe), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("mode", MODES)
def test_to_device_and_dtype_after_attach(stores, tmp_path, mode):
    batches = gpt_batches(4)

    def loop(model, optimizer):
        records = gpt_loop(batches[:2])(model, optimizer)
        assert model.to(torch.device("cpu")) is model
        assert model.to(torch.float32) is model
        assert model.to("cpu", torch.float32) is model
        model.float()
        records += gpt_loop(batches[2:])(model, optimizer)
        return records

    run_pair(stores, tmp_path, gpt(), loop, MODES[mode])


@pytest.mark.parametrize("mode", MODES)
def test_frozen_parameters_stay_frozen(stores, tmp_path, mode):
    reference = seeded(Frozen)
    _, model, plain = run_pair(stores, tmp_path, reference, vector_loop(vectors(6)), MODES[mode])
    state = model.state_dict()
    for key in ("mid.weight", "frozen_norm.weight", "frozen_norm.bias"):
        torch.testing.assert_close(state[key], reference.state_dict()[key], rtol=0, atol=0)
    assert not torch.equal(state["mid.bias"], reference.state_dict()["mid.bias"])
    assert not model.mid.weight.requires_grad and model.mid.bias.requires_grad


@pytest.mark.parametrize("mode", MODES)
def test_param_group_edits_are_honoured(stores, tmp_path, mode):
    batches = gpt_batches(6)

    def two_groups(model):
        decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
        rest = [p for n, p in model.named_parameters() if p.dim() < 2]
        return torch.optim.AdamW(
            [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
            lr=1e-2,
            fused=True,
        )

    def loop(model, optimizer):
        records = []
        for i, (tokens, targets) in enumerate(batches):
            if i == 2:
                optimizer.param_groups[0]["lr"] = 3e-2
                optimizer.param_groups[1]["lr"] = 0.0  # these parameters stop moving
            if i == 4:
                for group in optimizer.param_groups:
                    group["lr"] = 1e-3
                    group["betas"] = (0.8, 0.99)
            loss = model(tokens, targets)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            records.append(loss.item())
            if i == 3:
                records.append(model.state_dict()["norm.bias"].clone())
        assert [g["lr"] for g in optimizer.param_groups] == [1e-3, 1e-3]
        return records

    run_pair(stores, tmp_path, gpt(), loop, MODES[mode], optimizer_factory=two_groups)


@pytest.mark.parametrize("mode", MODES)
def test_gradient_accumulation_without_zero_grad(stores, tmp_path, mode):
    batches = gpt_batches(6)

    def loop(model, optimizer):
        records = []
        for i, (tokens, targets) in enumerate(batches):
            loss = model(tokens, targets)
            loss.backward()
            optimizer.step()
            # zero_grad only every other step: the second step sees the sum of two backwards.
            if i % 2 == 1:
                optimizer.zero_grad()
            records.append(loss.item())
        # zero_grad(set_to_none=False) keeps zero grads: Adam still moves every parameter.
        optimizer.zero_grad(set_to_none=False)
        optimizer.step()
        return records

    run_pair(stores, tmp_path, gpt(), loop, MODES[mode])


def test_close_restores_real_parameters_and_empties_the_swap_directory(stores, tmp_path):
    swap_dir = tmp_path / "swap"
    swap_dir.mkdir()
    reference = gpt()
    store, model, plain = run_pair(stores, swap_dir, reference, gpt_loop(gpt_batches(4)), NVME)
    assert any(os.scandir(swap_dir))  # the swap files exist while attached
    store.close()
    assert list(swap_dir.rglob("*")) == []
    for (name, param), (_, expected) in zip(model.named_parameters(), plain.named_parameters()):
        assert isinstance(param, nn.Parameter) and param.shape == expected.shape, name
        torch.testing.assert_close(param.detach(), expected.detach(), rtol=RTOL, atol=ATOL)
    assert model.head.weight is model.embed.weight
    # The hooks are gone: the model is an ordinary module again and trains like one.
    tokens, targets = gpt_batches(1)[0]
    for m in (model, plain):
        m(tokens, targets).backward()
    for (name, param), (_, expected) in zip(model.named_parameters(), plain.named_parameters()):
        assert param.grad is not None, name
        torch.testing.assert_close(param.grad, expected.grad, rtol=RTOL, atol=ATOL)


# -- loops that go beyond the list above, each of which broke the hooks once ----------------------
@pytest.mark.parametrize("mode", MODES)
def test_backward_twice_over_a_retained_graph(stores, tmp_path, mode):
    batches = gpt_batches(4)

    def loop(model, optimizer):
        records = []
        for tokens, targets in batches:
            loss = model(tokens, targets)
            loss.backward(retain_graph=True)
            (0.5 * loss).backward()  # every module's parameters are needed a second time
            optimizer.step()
            optimizer.zero_grad()
            records.append(loss.item())
        return records

    run_pair(stores, tmp_path, gpt(), loop, MODES[mode])


@pytest.mark.parametrize("mode", MODES)
def test_inference_mode_between_training_steps(stores, tmp_path, mode):
    batches = gpt_batches(4)
    probe = gpt_batches(1, batch=2)[0][0]

    def loop(model, optimizer):
        records = []
        for tokens, targets in batches:
            with torch.inference_mode():
                records.append(model(probe).clone())
            loss = model(tokens, targets)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            records.append(loss.item())
        return records

    store, model, _ = run_pair(stores, tmp_path, gpt(), loop, MODES[mode])
    with torch.inference_mode():
        model(probe)
    # The device copies kept after an inference pass are normal tensors, usable by training.
    cached = [e.param.data for e in store.registry.entries if e.resident]
    assert cached and not any(t.is_inference() for t in cached)


@pytest.mark.parametrize("mode", MODES)
def test_training_continues_after_a_backward_that_raised(stores, tmp_path, mode):
    """A loop that skips a batch whose backward failed (as loops skip an out-of-memory batch):
    the failed pass's holds, frozen parameters' included, must not outlive it."""
    reference = gpt()
    reference.blocks[1].fc.weight.requires_grad_(False)
    batches = gpt_batches(5)
    fail = [False]

    def boom(grad):
        if fail[0]:
            raise ValueError("backward failed")

    def loop(model, optimizer):
        handle = model.blocks[0].register_forward_hook(
            lambda module, args, out: out.register_hook(boom) and None
        )
        records = []
        for i, (tokens, targets) in enumerate(batches):
            fail[0] = i == 1
            loss = model(tokens, targets)
            try:
                loss.backward()
            except ValueError:
                optimizer.zero_grad()
                continue
            optimizer.step()
            optimizer.zero_grad()
            records.append(loss.item())
        handle.remove()
        return records

    # Updates in optimizer.step(): with updates in backward, the ones the failed pass ran stay
    # applied (test_update_timing covers that).
    store, _, _ = run_pair(
        stores, tmp_path, reference, loop, {**MODES[mode], "step_in_backward": False}
    )
    assert all(e.holds == 0 for e in store.registry.entries)
    assert not store.hooks.backward_holds and not store.hooks._callback_queued


class Encoder(nn.Module):
    """torch's own transformer layers: MultiheadAttention calls ``out_proj``'s weight through a
    functional kernel, and the encoder layer's inference fast path fuses all its sub-layers."""

    def __init__(self) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.attn = nn.MultiheadAttention(16, 4, batch_first=True)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.encoder(x)
        h = h + self.attn(h, h, h, need_weights=False)[0]
        return self.head(h.mean(dim=1))


@pytest.mark.parametrize("mode", MODES)
def test_torch_transformer_layers(stores, tmp_path, mode):
    batches = [
        (
            torch.randn(4, 6, 16, generator=torch.Generator().manual_seed(i)),
            torch.randint(0, 4, (4,), generator=torch.Generator().manual_seed(i)),
        )
        for i in range(4)
    ]

    def loop(model, optimizer):
        records = vector_loop(batches)(model, optimizer)
        model.eval()
        with torch.no_grad():  # the fused fast path
            records.append(model(batches[0][0]))
        model.train()
        records += vector_loop(batches[:2])(model, optimizer)
        return records

    run_pair(stores, tmp_path, seeded(Encoder), loop, MODES[mode])


class Unfrozen(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 4)
        self.b.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


@pytest.mark.parametrize("mode", MODES)
def test_parameter_unfrozen_after_attach_trains(stores, tmp_path, mode):
    batches = vectors(6)

    def loop(model, optimizer):
        records = vector_loop(batches[:3])(model, optimizer)
        model.b.requires_grad_(True)  # gradual unfreezing
        return records + vector_loop(batches[3:])(model, optimizer)

    reference = seeded(Unfrozen)
    _, model, _ = run_pair(stores, tmp_path, reference, loop, MODES[mode])
    assert not torch.equal(model.state_dict()["b.weight"], reference.b.weight.detach())


class Queries(nn.Module):
    """Returns its own parameter (a learned query table), used by its parent."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(16))

    def forward(self) -> torch.Tensor:
        return self.table


class UsesQueries(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.queries = Queries()
        self.lin = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x * self.queries())


@pytest.mark.parametrize("mode", MODES)
def test_module_returning_its_own_parameter(stores, tmp_path, mode):
    def loop(model, optimizer):
        records = vector_loop(vectors(4))(model, optimizer)
        with torch.no_grad():
            records.append(model.queries().clone())
        return records

    store, model, _ = run_pair(stores, tmp_path, seeded(UsesQueries), loop, MODES[mode])
    if store.placement is not None:
        # What the parent got is a copy: evicting the parameter's device bytes cannot pull
        # values out from under it.
        with torch.no_grad():
            returned = model.queries()
        entry = store.registry.entries[0]
        store.placement.drop_device(entry)
        assert returned.untyped_storage().nbytes() == returned.numel() * 4
