"""bf16 masters (``precision.master_dtype='bf16'``): updates in fp32, rounded back stochastically.

Checked on the values themselves: an update far below bf16's spacing moves the weights as an
fp32 master would, on average, where rounding to nearest (a bf16 model trained as it is) leaves
them where they were; the rounding is a deterministic function of the shard and the step (two
runs, and a run resumed from a checkpoint, agree bit for bit) and draws nothing from the global
random streams; and the config refuses what it cannot do, saying what to change.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from infinity import ConfigError, OffloadConfig, PrecisionConfig, TieredStore
from infinity.training.master_rounding import StochasticMasters

ROWS, COLS = 64, 1024
LR = 1e-3  # a quarter of bf16's spacing just below 1.0 (2**-8)


def ones_model() -> nn.Module:
    model = nn.Linear(COLS, ROWS, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    return model


def store_config(tmp_path: Path, master_dtype: str, offload: str) -> OffloadConfig:
    return OffloadConfig().replace(
        device="cpu",
        offload_param=offload,
        offload_optimizer=offload,
        nvme_path=(tmp_path,),
        buffer_size=64 << 10,
        aio={"block_size": 4096},
        precision={"dtype": "bf16", "master_dtype": master_dtype},
    )


def train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> None:
    """Each step's gradient of every weight is 1 (the loss is the sum of the outputs of an
    input of ones): SGD moves every weight by -LR."""
    inputs = torch.ones(1, COLS, dtype=torch.bfloat16)  # the working params' dtype
    for _ in range(steps):
        model(inputs).float().sum().backward()
        optimizer.step()
        optimizer.zero_grad()


def trained_weights(tmp_path: Path, master_dtype: str, steps: int, offload: str) -> torch.Tensor:
    tmp_path.mkdir()
    model = ones_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    store = TieredStore(store_config(tmp_path, master_dtype, offload))
    model, optimizer = store.attach(model, optimizer)
    try:
        train(model, optimizer, steps)
        with store.gathered():
            return model.weight.detach().float().clone()
    finally:
        store.close(restore_params=False)


@pytest.mark.parametrize("offload", ["cpu", "nvme"])
def test_updates_below_the_spacing_move_bf16_masters_as_fp32_ones(
    tmp_path: Path, offload: str
) -> None:
    steps = 10
    expected = 1.0 - steps * LR  # 0.99: what fp32 masters reach
    fp32 = trained_weights(tmp_path / "fp32", "fp32", steps, offload)
    assert torch.allclose(fp32, torch.full_like(fp32, expected), atol=2**-8)
    rounded = trained_weights(tmp_path / "bf16", "bf16", steps, offload)
    # Each weight took a random walk of 10 roundings, each at most a spacing (2**-8 below 1.0,
    # 2**-7 above) and unbiased: it ends within a few spacings of 0.99 ...
    assert (rounded - expected).abs().max() <= 12 * 2**-8
    assert rounded.std().item() < 3 * 2**-8
    # ... and their mean is 0.99: over 65536 weights the mean's noise is about 2e-5, and a
    # rounding that dropped the updates would leave it at 1.0
    assert abs(rounded.mean().item() - expected) < 3e-4
    # A bf16 model trained as it is (masters in bf16, rounded to nearest): 1 - 0.001 rounds
    # back to 1.0 at every step, so nothing moves.
    plain = ones_model().to(torch.bfloat16)
    optimizer = torch.optim.SGD(plain.parameters(), lr=LR)
    inputs = torch.ones(1, COLS, dtype=torch.bfloat16)
    for _ in range(steps):
        plain(inputs).float().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    assert torch.equal(plain.weight, torch.ones_like(plain.weight))


def llama_run(
    tmp_path: Path, steps: int, state_dtype: str, resume_at: int | None = None
) -> list[torch.Tensor]:
    """A tiny Llama trained ``steps`` steps with bf16 masters and Adam state stored in
    ``state_dtype``; with ``resume_at`` the run saves a checkpoint there, and a new store
    resumes it."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=172,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=256,
        max_position_embeddings=32,
    )
    (tmp_path / "swap").mkdir(parents=True)
    offload = OffloadConfig().replace(
        device="cpu",
        offload_param="nvme",
        offload_optimizer="nvme",
        nvme_path=(tmp_path / "swap",),
        buffer_size=16 << 10,
        aio={"block_size": 4096},
        precision={"dtype": "bf16", "master_dtype": "bf16", "optimizer_state_dtype": state_dtype},
    )

    def build() -> tuple[TieredStore, nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config)
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        store = TieredStore(offload)
        model, optimizer = store.attach(model, optimizer)
        return store, model, optimizer

    tokens = torch.randint(0, 256, (steps, 2, 16), generator=torch.Generator().manual_seed(1))
    store, model, optimizer = build()
    rng_before = torch.get_rng_state()
    for step in range(steps):
        if step == resume_at:
            store.save_checkpoint(tmp_path / "ckpt")
            store.close(restore_params=False)
            store, model, optimizer = build()
            store.load_checkpoint(tmp_path / "ckpt")
            rng_before = torch.get_rng_state()
        loss = model(input_ids=tokens[step], labels=tokens[step]).loss
        assert torch.isfinite(loss)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    assert torch.equal(torch.get_rng_state(), rng_before)  # no draw from the global stream
    try:
        with store.gathered():
            return [p.detach().clone() for p in model.parameters()]
    finally:
        store.close(restore_params=False)


def test_rounding_repeats_exactly(tmp_path: Path) -> None:
    first = llama_run(tmp_path / "a", 3, "int8")
    again = llama_run(tmp_path / "b", 3, "int8")
    assert all(p.dtype == torch.bfloat16 for p in first)
    assert all(torch.equal(a, b) for a, b in zip(first, again))


def test_a_resumed_run_follows_the_uninterrupted_one(tmp_path: Path) -> None:
    # compressed state resumes bit for bit too: test_state_dtype's
    # test_a_resumed_run_follows_the_uninterrupted_one_bit_for_bit
    whole = llama_run(tmp_path / "a", 4, "fp32")
    resumed = llama_run(tmp_path / "c", 4, "fp32", resume_at=2)
    assert all(torch.equal(a, c) for a, c in zip(whole, resumed))


def test_round_into_picks_a_neighbour_with_the_odds_of_the_distance() -> None:
    masters = StochasticMasters(1 << 16)
    low, high = 1.0, 1.0 + 2**-7  # neighbours in bf16
    values = torch.full((1 << 16,), low + 0.25 * (high - low))
    negative = -values
    out = torch.empty(1 << 16, dtype=torch.bfloat16)
    masters.round_into(out, values, seed=7)
    assert set(out.float().unique().tolist()) == {low, high}
    assert abs((out.float() == high).float().mean().item() - 0.25) < 0.01
    masters.round_into(out, negative, seed=7)
    assert set(out.float().unique().tolist()) == {-low, -high}
    special = torch.tensor([float("inf"), float("-inf"), float("nan"), 0.0, -0.0] * 4)
    small = torch.empty(special.numel(), dtype=torch.bfloat16)
    masters.round_into(small, special, seed=1)
    assert small.float()[:2].tolist() == [float("inf"), float("-inf")]
    assert small.float()[2].isnan()
    assert small.float()[3:5].tolist() == [0.0, 0.0]


def test_config_refuses_bf16_masters_without_bf16_compute() -> None:
    with pytest.raises(ConfigError, match="precision.dtype='bf16'"):
        PrecisionConfig(master_dtype="bf16")
    with pytest.raises(ConfigError, match="storage_dtype"):
        PrecisionConfig(dtype="bf16", master_dtype="bf16", storage_dtype="fp16")
    with pytest.raises(ConfigError, match="master_dtype"):
        PrecisionConfig(dtype="bf16", master_dtype="fp16")
    with pytest.raises(ConfigError, match="master_dtype"):
        OffloadConfig.from_dict({"precision": {"dtype": "bf16", "master_dtyp": "bf16"}})
