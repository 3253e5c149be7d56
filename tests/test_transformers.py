"""Hugging Face causal LMs trained with parameters and optimizer state on NVMe.

Each test builds a tiny model from a config (random init: no hub download, no tokenizer), trains
a deep copy plainly and an attached deep copy with the same loop and the model's own loss
(``model(input_ids=..., labels=...).loss``), and compares every loss (within 1e-5), the final
state_dict (allclose rtol 1e-5, atol 1e-6) and the logits of a probe batch afterwards.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable

import pytest
import torch

transformers = pytest.importorskip("transformers")

import infinity  # noqa: E402
from tests.store_helpers import assert_equivalent  # noqa: E402

VOCAB, CONTEXT, BATCH, STEPS = 128, 16, 4, 8
# buffer_count x buffer_size is 256 KiB of staging arena; masters, gradients and both Adam
# moments of these models take 4 x 105 KiB (Llama) or 4 x 120 KiB (GPT-2), so shards go to the
# swap files and come back within a step; the 128 x 32 embeddings (16 KiB) fill whole buffers.
NVME = {
    "offload_param": "nvme",
    "offload_optimizer": "nvme",
    "buffer_size": 1 << 14,
    "buffer_count": 16,
}


def llama() -> torch.nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2 * CONTEXT,
        attention_dropout=0.0,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def gpt2() -> torch.nn.Module:
    config = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_positions=2 * CONTEXT,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=1,
        eos_token_id=2,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


MODELS = {"llama": llama, "gpt2": gpt2}


def batches(steps: int, seed: int = 1) -> list[torch.Tensor]:
    """Counting sequences (each token is the previous one plus a per-sequence stride, mod the
    vocabulary) from random starts: learnable, so the loss falls within a few steps."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        start = torch.randint(0, VOCAB, (BATCH, 1), generator=generator)
        stride = torch.randint(1, 4, (BATCH, 1), generator=generator)
        out.append((start + stride * torch.arange(CONTEXT)) % VOCAB)
    return out


def adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    # fused: what the store runs for default-options AdamW; the plain run uses the same kernel.
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)


def train(model, optimizer, data, scheduler_factory: Callable | None = None):
    """The loop as a user writes it: returns the losses and the learning rate of each step."""
    model.train()
    scheduler = scheduler_factory(optimizer) if scheduler_factory else None
    losses, lrs = [], []
    for input_ids in data:
        lrs.append(optimizer.param_groups[0]["lr"])
        loss = model(input_ids=input_ids, labels=input_ids, use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if scheduler is not None:
            scheduler.step()
        losses.append(loss.item())
    return losses, lrs


def probe_logits(model) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=batches(1, seed=7)[0], use_cache=False).logits


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def stores():
    """Stores opened by a test; closed at teardown even when the test fails."""
    opened: list[infinity.TieredStore] = []
    yield opened
    for store in opened:
        store.close()


def run_pair(
    stores, tmp_path, reference, steps: int = STEPS, scheduler_factory: Callable | None = None
):
    """Trains a plain and an attached copy of ``reference``; checks they agree and returns
    (store, attached model, plain model, plain losses, plain lrs, attached lrs)."""
    data = batches(steps)
    plain = copy.deepcopy(reference)
    plain_losses, plain_lrs = train(plain, adamw(plain), data, scheduler_factory)
    attached = copy.deepcopy(reference)
    store = infinity.TieredStore(infinity.OffloadConfig(nvme_path=str(tmp_path), **NVME))
    stores.append(store)
    model, optimizer = store.attach(attached, adamw(attached))
    assert model is attached and optimizer is not None
    losses, lrs = train(model, optimizer, data, scheduler_factory)
    assert_equivalent(plain_losses, losses, plain.state_dict(), model.state_dict())
    torch.testing.assert_close(probe_logits(model), probe_logits(plain), rtol=1e-5, atol=1e-5)
    return store, model, plain, plain_losses, plain_lrs, lrs


def assert_trained(reference, plain, losses) -> None:
    """The run did something worth comparing: finite losses that fall, parameters that moved."""
    assert all(math.isfinite(x) for x in losses)
    assert 4.0 < losses[0] < 6.0  # about ln(128) = 4.85 from random init
    assert losses[-1] < losses[0] - 0.15, losses
    before = reference.state_dict()
    moved = [k for k, v in plain.state_dict().items() if not torch.equal(v, before[k])]
    assert len(moved) == len(before), set(before) - set(moved)


@pytest.mark.parametrize("name", MODELS)
def test_causal_lm_with_params_and_optimizer_state_on_nvme(stores, tmp_path, name):
    reference = MODELS[name]()
    store, model, plain, losses, _, _ = run_pair(stores, tmp_path, reference)
    assert_trained(reference, plain, losses)
    stats = store.stats()
    assert stats["steps"] == STEPS
    params = sum(p.numel() * p.element_size() for p in reference.parameters())
    assert stats["budgets"]["params"] == params
    # Masters, gradients and both Adam moments went through the swap files, and came back.
    assert stats["bytes_written"] > 3 * params
    assert stats["bytes_read"] > params
    # Every shard's Adam state is in companions on the host tier or NVMe, not in the optimizer.
    shards = list(store.registry.shards.values())
    assert shards and all(
        {"optim:exp_avg", "optim:exp_avg_sq"} <= set(s.companions) for s in shards
    )
    in_memory = [
        v
        for state in store.optimizer.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor) and v.dim() > 0
    ]
    assert len(in_memory) == 2 * len(shards) and all(v.numel() == 0 for v in in_memory)
    # Tied embeddings stay one Parameter, registered once, as each model's config says.
    tied = reference.config.tie_word_embeddings
    embed = model.get_input_embeddings().weight
    assert (model.lm_head.weight is embed) == tied
    assert len(store.registry.entries) == len(list(reference.parameters()))
    if tied:
        state = model.state_dict()
        torch.testing.assert_close(
            state["lm_head.weight"], state["transformer.wte.weight"], rtol=0, atol=0
        )


def test_linear_warmup_schedule_drives_the_offloaded_optimizer(stores, tmp_path):
    def scheduler(optimizer):
        return transformers.get_linear_schedule_with_warmup(
            optimizer, num_warmup_steps=3, num_training_steps=STEPS
        )

    reference = llama()
    _, _, plain, losses, plain_lrs, lrs = run_pair(
        stores, tmp_path, reference, scheduler_factory=scheduler
    )
    # The schedule reached the wrapped optimizer's param_groups, step for step: 0 first (a
    # no-op step), up to the peak after warmup, then linearly down.
    expected = [1e-2 * s / 3 if s < 3 else 1e-2 * (STEPS - s) / (STEPS - 3) for s in range(STEPS)]
    assert lrs == pytest.approx(expected) and plain_lrs == pytest.approx(expected)
    assert_trained(reference, plain, losses)
