"""A Hugging Face model built on empty weights and attached with ``initialise=True`` gets the
values the model's own initialisation gives (``_init_weights``, norms included), the same
values, bit for bit, as the model built normally from the same seed."""

from __future__ import annotations

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate")

import infinity  # noqa: E402

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
