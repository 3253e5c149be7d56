"""A Hugging Face model built on empty weights and attached with ``initialise=True`` gets the
values the model's own initialisation gives (``_init_weights``, norms included), the same
values, bit for bit, as the model built normally from the same seed.

peft LoRA adapters on such a model get peft's own initialisation (``reset_lora_parameters``: A
as peft draws it, B zeros), the same values, bit for bit, as peft gives them on the model built
normally from the same state of the generator, and attach draws from the global generator what
the normal build draws."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate")

import infinity  # noqa: E402
from infinity.errors import AttachError  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def _config(**overrides) -> transformers.LlamaConfig:
    settings = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attn_implementation="sdpa",
    )
    settings.update(overrides)
    return transformers.LlamaConfig(**settings)


def _store(tmp_path, **overrides) -> infinity.TieredStore:
    settings = dict(
        offload_param="nvme",
        offload_optimizer="nvme",
        buffer_size=8192,
        buffer_count=8,
        nvme_path=str(tmp_path),
    )
    settings.update(overrides)
    return infinity.TieredStore(infinity.OffloadConfig(**settings))


def _values(store: infinity.TieredStore, model: nn.Module) -> dict[str, torch.Tensor]:
    """The attached model's parameters, as close hands them back."""
    store.close()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("tied", [False, True])
def test_same_seed_same_values_as_the_model_built_normally(tmp_path, tied):
    config = _config(tie_word_embeddings=tied)
    torch.manual_seed(0)
    plain = transformers.LlamaForCausalLM(config)
    plain_next = torch.rand(4)  # where the build left torch's generator
    torch.manual_seed(0)
    with accelerate.init_empty_weights():
        model = transformers.LlamaForCausalLM(config)
    model.tie_weights()  # as accelerate's recipe does: on empty weights the build leaves it
    store = _store(tmp_path)
    model, _ = store.attach(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    assert torch.equal(torch.rand(4), plain_next)  # the same draws, no more, no fewer
    got = _values(store, model)
    expected = dict(plain.named_parameters())
    assert set(got) == set(expected)
    for name, value in got.items():
        assert torch.equal(value, expected[name]), name
    if tied:
        assert model.lm_head.weight is model.model.embed_tokens.weight


def test_statistics_are_the_models_own_init_and_it_trains(tmp_path):
    config = _config(hidden_size=256, intermediate_size=512, initializer_range=0.05)
    torch.manual_seed(1)
    with accelerate.init_empty_weights():
        model = transformers.LlamaForCausalLM(config)
    store = _store(tmp_path, buffer_size=1 << 16)
    model, optimizer = store.attach(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(2))
    losses = []
    for _ in range(2):
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[1] < losses[0]
    store.close()
    torch.manual_seed(1)
    with accelerate.init_empty_weights():
        fresh = transformers.LlamaForCausalLM(config)
    store = _store(tmp_path)
    fresh, _ = store.attach(fresh)
    values = _values(store, fresh)
    for name, value in values.items():
        if name.endswith("norm.weight"):
            assert torch.equal(value, torch.ones_like(value)), name
        else:  # Linear and Embedding weights: normal(0, initializer_range)
            assert abs(value.mean().item()) < 0.005, name
            assert abs(value.std().item() - 0.05) < 0.005, name


class _Wrapper(nn.Module):
    """An HF model inside a plain module, beside a layer of its own (reset_parameters) and a
    parameter nothing initialises."""

    def __init__(self, config):
        super().__init__()
        self.llm = transformers.LlamaForCausalLM(config)
        self.head = nn.Linear(64, 8)
        self.extra = nn.Parameter(torch.empty(3))


def test_modules_outside_the_model_keep_their_reset_and_the_rest_waits(tmp_path):
    config = _config()
    torch.manual_seed(3)
    plain = _Wrapper(config)
    torch.manual_seed(3)
    with accelerate.init_empty_weights():
        model = _Wrapper(config)
    store = _store(tmp_path)
    model, _ = store.attach(model)
    assert store.placement.uninitialised == {store.registry.entry_of(model.extra).index}
    got = _values(store, model)
    for name, value in plain.named_parameters():
        if name != "extra":
            assert torch.equal(got[name], value), name
    assert model.extra.is_meta  # never given values: back on the meta device


def test_initialise_false_still_leaves_everything_for_a_checkpoint(tmp_path):
    with accelerate.init_empty_weights():
        model = transformers.LlamaForCausalLM(_config())
    store = _store(tmp_path)
    model, _ = store.attach(model, initialise=False)
    assert len(store.placement.uninitialised) == len(list(model.parameters()))
    assert store.stats()["bytes_written"] == 0
    store.close()


# -- peft LoRA adapters ---------------------------------------------------------------------------
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]


def _peft():
    return pytest.importorskip("peft")


def _lora(**settings):
    return _peft().LoraConfig(**{"r": 16, "target_modules": TARGETS, **settings})


def _empty_peft_model(dtype: torch.dtype = torch.float32, **settings) -> nn.Module:
    with accelerate.init_empty_weights():
        base = transformers.LlamaForCausalLM(_config()).to(dtype)
    return _peft().get_peft_model(base, _lora(**settings))


@pytest.mark.parametrize(
    "dtype, settings",
    [
        (torch.float32, {}),
        (torch.float32, {"init_lora_weights": "gaussian"}),
        (torch.float32, {"init_lora_weights": False}),
        (torch.float32, {"target_modules": ["embed_tokens", "q_proj", "lm_head"], "r": 4}),
        (torch.float32, {"lora_bias": True}),
        (torch.bfloat16, {}),  # drawn in float32, cast to bfloat16 and back, as peft does
    ],
    ids=["default", "gaussian", "no-init", "embedding", "bias", "bf16-base"],
)
def test_same_generator_state_same_values_as_peft_on_the_model_built_normally(
    tmp_path, dtype, settings
):
    torch.manual_seed(0)
    plain = _peft().get_peft_model(
        transformers.LlamaForCausalLM(_config()).to(dtype), _lora(**settings)
    )
    torch.manual_seed(0)
    model = _empty_peft_model(dtype, **settings)
    assert all(p.is_meta for p in model.parameters())
    torch.manual_seed(0)  # the state peft started from: it drew into tensors it moved to meta
    store = _store(tmp_path)
    trained = [p for p in model.parameters() if p.requires_grad]
    model, _ = store.attach(model, torch.optim.AdamW(trained, lr=1e-3))
    got = _values(store, model)
    expected = dict(plain.named_parameters())
    assert set(got) == set(expected)
    adapters = [name for name in got if "lora_" in name]
    assert adapters
    for name, value in got.items():
        assert value.dtype == expected[name].dtype, name
        assert torch.equal(value, expected[name]), name
    if settings.get("init_lora_weights", True) is not False:
        assert all(not got[n].any() for n in adapters if "lora_B" in n or "embedding_A" in n)


def test_attach_draws_what_the_normal_build_draws_and_the_model_starts_as_its_base(tmp_path):
    """Without seeding again: peft's draws into the adapters it moved to the meta device count,
    and attach adds the base model's own, as building it normally does, and no others."""
    torch.manual_seed(0)
    _peft().get_peft_model(transformers.LlamaForCausalLM(_config()), _lora())
    plain_next = torch.rand(4)
    torch.manual_seed(0)
    model = _empty_peft_model()
    after_peft = torch.get_rng_state()
    store = _store(tmp_path)
    model, _ = store.attach(model)
    assert torch.equal(torch.rand(4), plain_next)
    torch.set_rng_state(after_peft)  # the base values attach replayed from there
    base = transformers.LlamaForCausalLM(_config())
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(model(input_ids=tokens).logits, base(input_ids=tokens).logits)
    got = _values(store, model)
    a = torch.cat([v.reshape(-1) for n, v in got.items() if "lora_A" in n])
    assert a.abs().max() <= 1 / 64**0.5  # kaiming_uniform_(a=sqrt(5)): U(-1/sqrt(fan_in), ...)
    assert abs(a.std().item() - 1 / (3 * 64) ** 0.5) < 0.01
    assert all(not v.any() for n, v in got.items() if "lora_B" in n)


class _Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(32, 64)
        self.down = nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def test_a_model_without_its_own_init_gets_peft_adapters_too(tmp_path):
    """No ``_init_weights``: the base from its modules' reset_parameters(), the adapters as peft
    makes them, so the adapted model computes what its base does."""
    torch.manual_seed(0)
    with accelerate.init_empty_weights():
        base = _Mlp()
    model = _peft().get_peft_model(base, _lora(r=4, target_modules=["up", "down"]))
    store = _store(tmp_path)
    model, _ = store.attach(model)
    x = torch.randn(3, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        adapted = model(x)
        with model.disable_adapter():
            plain = model(x)
    assert torch.equal(adapted, plain)
    got = _values(store, model)
    assert all(not v.any() for n, v in got.items() if "lora_B" in n)
    assert all(v.abs().sum() > 0 for n, v in got.items() if "lora_A" in n or "base_layer" in n)


def test_the_adapters_without_their_config_get_peft_default_with_a_warning(tmp_path, caplog):
    torch.manual_seed(0)
    model = _empty_peft_model(init_lora_weights="gaussian").base_model.model
    model.peft_config = None  # the PeftModel, which keeps the LoraConfig, not attached
    store = _store(tmp_path)
    with caplog.at_level(logging.WARNING, logger="infinity.store"):
        model, _ = store.attach(model)
    assert "LoRA adapter 'default' has no peft_config" in caplog.text
    got = _values(store, model)
    a = torch.cat([v.reshape(-1) for n, v in got.items() if "lora_A" in n])
    assert a.abs().max() <= 1 / 64**0.5  # peft's default, not gaussian(std=1/r)
    assert all(not v.any() for n, v in got.items() if "lora_B" in n)


@pytest.mark.parametrize(
    "settings, cause",
    [({"init_lora_weights": "eva"}, "init_lora_weights='eva'"), ({"use_dora": True}, "Dora")],
)
def test_an_initialisation_from_the_base_weights_is_refused_with_the_ways_out(
    tmp_path, settings, cause
):
    model = _empty_peft_model(**settings)
    store = _store(tmp_path)
    with pytest.raises(AttachError, match=cause) as refused:
        store.attach(model)
    assert "init_lora_weights=True or 'gaussian'" in str(refused.value)
    assert "initialise=False" in str(refused.value)
    store.close()
    store = _store(tmp_path)
    model, _ = store.attach(model, initialise=False)  # left for a checkpoint: no error
    store.close()
