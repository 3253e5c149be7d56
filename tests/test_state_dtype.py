"""Optimizer state kept in fewer bytes (``precision.optimizer_state_dtype``): the codecs' error
bounds, fp32 bit-exact against plain PyTorch, the bytes each step moves, checkpoints."""

from __future__ import annotations

import copy

import pytest
import torch

import infinity
from infinity import ConfigError, OffloadConfig, TieredStore
from infinity.cli.common.tiny_gpt import GPTConfig
from infinity.training.optimizer import DecodeScratch
from infinity.training.state_codecs import CHUNK, INT8_BLOCK, Bf16Codec, Int8Codec
from tests.store_helpers import assert_equivalent, compare, fused_adamw, make_model, train

MODEL = GPTConfig(vocab_size=64, context=16, layers=4, width=64, heads=4)


def state_config(tmp_path, dtype: str, **extra) -> OffloadConfig:
    tmp_path.mkdir(parents=True, exist_ok=True)
    return OffloadConfig(
        device="cpu",
        offload_param="nvme",
        offload_optimizer="nvme",
        nvme_path=str(tmp_path),
        buffer_size=1 << 16,
        precision=infinity.PrecisionConfig(optimizer_state_dtype=dtype),
        **extra,
    )


def spread(n: int, seed: int = 0) -> torch.Tensor:
    """Values over seven orders of magnitude, both signs, some zeros, a partial last block."""
    generator = torch.Generator().manual_seed(seed)
    magnitude = torch.logspace(-7, 0, n)[torch.randperm(n, generator=generator)]
    values = torch.randn(n, generator=generator) * magnitude
    values[::97] = 0
    return values


def encoded(codec, values: torch.Tensor, key: str, seed: int | None) -> torch.Tensor:
    numel, dtype = codec.stored(values.numel())
    stored = torch.empty(numel, dtype=dtype)
    codec.encode(values, stored, key, seed)
    return stored


def round_trip(codec, values: torch.Tensor, key: str, seed: int | None = 0) -> torch.Tensor:
    return codec.decode(encoded(codec, values, key, seed), values.numel(), key)


def block_max(values: torch.Tensor) -> torch.Tensor:
    """Each element's block's largest magnitude."""
    n = values.numel()
    padded = torch.nn.functional.pad(values.abs(), (0, -n % INT8_BLOCK))
    return padded.view(-1, INT8_BLOCK).amax(1).repeat_interleave(INT8_BLOCK)[:n]


def test_int8_momentum_round_trip_is_within_a_code_step_per_block():
    values = spread(5 * INT8_BLOCK + 123)
    decoded = round_trip(Int8Codec(), values, "exp_avg")
    largest = block_max(values)
    coded = values.abs() >= largest * 2.0**-15  # the 16 octaves below each block's largest
    error = (decoded - values).abs()
    # One code step: an eighth of the value, at the bottom of an octave.
    assert (error[coded] <= values.abs()[coded] / 8 + 1e-30).all()
    # Smaller values are zero or the smallest level, never more than that level.
    assert (decoded[~coded].abs() <= largest[~coded] * 2.0**-15 * 1.25).all()
    assert (decoded[values == 0] == 0).all()
    assert (decoded * values >= 0).all()  # signs kept


def test_int8_second_moment_round_trip_never_decodes_a_nonzero_value_as_zero():
    values = spread(5 * INT8_BLOCK + 123).square()
    values[7] = 1e-30  # far below the 32 octaves the codes cover
    decoded = round_trip(Int8Codec(), values, "exp_avg_sq")
    largest = block_max(values)
    coded = values >= largest * 2.0**-31
    assert (((decoded - values).abs() <= values / 8)[coded]).all()
    nonzero = values > 0
    assert (decoded[nonzero] > 0).all()
    assert decoded[7] >= values[7]  # too small for the scale: the smallest level, not zero
    assert (decoded[~nonzero] == 0).all()


def test_bf16_round_trip_is_within_one_bf16_step():
    values = spread(3 * INT8_BLOCK)
    decoded = round_trip(Bf16Codec(), values, "exp_avg")
    assert ((decoded - values).abs() <= values.abs() * 2.0**-7).all()
    assert (decoded[values == 0] == 0).all()


@pytest.mark.parametrize("codec", [Bf16Codec(), Int8Codec()], ids=["bf16", "int8"])
def test_a_second_moment_still_decays_through_the_codec(codec):
    """Rounded to nearest, v * 0.999 would stay v in bf16 (and in 8-bit codes) for ever:
    stochastic rounding decays it as fp32 does, in expectation."""
    value = torch.full((64, INT8_BLOCK), 1.0)
    value[:, 0] = 2.0  # each block's largest stays put: the others move relative to it
    for step in range(500):
        value[:, 1:] *= 0.999
        value = round_trip(codec, value.view(-1), "exp_avg_sq", step).view(64, INT8_BLOCK)
    # Each value wanders (a code step is 6-12% of it), their mean follows fp32's.
    decayed = value[:, 1:].mean().item()
    assert decayed == pytest.approx(0.999**500, rel=0.03)


@pytest.mark.parametrize("codec", [Bf16Codec(), Int8Codec()], ids=["bf16", "int8"])
@pytest.mark.parametrize("key", ["exp_avg", "exp_avg_sq"])
def test_the_noise_of_an_encode_is_its_seeds_alone(codec, key):
    """A shard's state is rounded with the noise of its seed whatever was encoded before it
    (by this codec or another one): a resumed store, which has encoded nothing yet, or a step
    whose updates run in another order, round as the uninterrupted run did."""
    values = spread(2 * CHUNK + 123, seed=1).abs() if key == "exp_avg_sq" else spread(2 * CHUNK)
    first = encoded(codec, values, key, seed=7)
    encoded(codec, spread(3 * INT8_BLOCK, seed=2), key, seed=8)  # other encodes in between
    assert torch.equal(encoded(codec, values, key, seed=7), first)
    fresh = Bf16Codec() if codec.name == "bf16" else Int8Codec()
    assert torch.equal(encoded(fresh, values, key, seed=7), first)
    assert not torch.equal(encoded(codec, values, key, seed=9), first)  # the seed is the noise


@pytest.mark.parametrize("codec", [Bf16Codec(), Int8Codec()], ids=["bf16", "int8"])
@pytest.mark.parametrize("key", ["exp_avg", "exp_avg_sq"])
def test_decoded_state_encoded_without_a_seed_gives_its_codes_back(codec, key):
    """What a load does with a checkpoint's decoded state: rounded to nearest, each value goes
    back to its own code, bit for bit. With noise, about one in ten million int8 values moves to a
    neighbouring code (the decode's product with the block's scale, divided by it again, is off
    by an ulp): a resumed run would start from other state."""
    values = spread(2 * CHUNK + 123)
    if key == "exp_avg_sq":
        values = values.square()
    codes = encoded(codec, values, key, seed=3)
    decoded = codec.decode(codes, values.numel(), key)
    for _ in range(3):
        assert torch.equal(encoded(codec, decoded, key, seed=None), codes)


def test_fp32_state_on_nvme_is_bit_exact_against_plain_pytorch(tmp_path):
    result = compare(
        make_model(MODEL),
        4,
        {
            "device": "cpu",
            "offload_param": "nvme",
            "offload_optimizer": "nvme",
            "buffer_size": 1 << 16,
            "precision": infinity.PrecisionConfig(optimizer_state_dtype="fp32"),
        },
        tmp_path=tmp_path,
        config=MODEL,
    )
    assert_equivalent(*result[:4], loss_tol=0.0)
    assert result[4]["compression"]["state_read"] == 0


def test_fewer_state_bytes_read_and_written_per_step(tmp_path):
    """The same loop with each dtype: the state's transfers shrink by its bytes per element,
    and so do the step's bytes (the masters and gradients move as before)."""
    moved = {}
    for dtype in ("fp32", "bf16", "int8"):
        model = make_model(MODEL)
        store = TieredStore(state_config(tmp_path / dtype, dtype))
        model, optimizer = store.attach(model, fused_adamw(model.parameters()))
        train(model, optimizer, 3, config=MODEL)
        stats = store.stats()
        moved[dtype] = (stats["bytes_read"], stats["bytes_written"], stats["compression"])
        store.close(restore_params=False)
    fp32_read, fp32_written, _ = moved["fp32"]
    for dtype, per_element in (("bf16", 2), ("int8", 1 + 4 / INT8_BLOCK)):
        read, written, state = moved[dtype]
        assert state["state_read"] > 0 and state["state_written"] > 0
        assert state["state_read"] == pytest.approx(
            state["state_read_as_fp32"] * per_element / 4, rel=0.01
        )
        assert state["state_written"] == pytest.approx(
            state["state_written_as_fp32"] * per_element / 4, rel=0.01
        )
        # What the state saved is about what the step saved: the rest moves alike, but for
        # what the arena's room freed by smaller state keeps cached.
        saved_read = state["state_read_as_fp32"] - state["state_read"]
        saved_written = state["state_written_as_fp32"] - state["state_written"]
        assert fp32_read - read == pytest.approx(saved_read, rel=0.25)
        assert fp32_written - written == pytest.approx(saved_written, rel=0.25)


@pytest.mark.parametrize("dtype", ["bf16", "int8"])
def test_a_checkpoint_of_compressed_state_saves_its_values_and_loads_back(dtype, tmp_path):
    model = make_model(MODEL)
    store = TieredStore(state_config(tmp_path / "a", dtype))
    model, optimizer = store.attach(model, fused_adamw(model.parameters()))
    train(model, optimizer, 3, config=MODEL)
    before = optimizer.state_dict()
    store.save_checkpoint(tmp_path / "checkpoint")
    after_save = train(model, optimizer, 2, config=MODEL, seed=5)
    store.close(restore_params=False)

    # The same dtype: the values come back as they were (encoding decoded values is exact).
    again = make_model(MODEL, seed=9)
    store = TieredStore(state_config(tmp_path / "b", dtype))
    again, again_optimizer = store.attach(again, fused_adamw(again.parameters()))
    store.load_checkpoint(tmp_path / "checkpoint")
    loaded = again_optimizer.state_dict()
    for index, state in before["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(loaded["state"][index][key], state[key], rtol=0, atol=0)
    resumed = train(again, again_optimizer, 2, config=MODEL, seed=5)
    assert resumed == after_save  # the same noise for the same shard, key and step
    store.close(restore_params=False)

    # The checkpoint holds fp32 values: a store keeping fp32 state loads the same state, and
    # the plain optimizer takes it from there.
    plain_model = make_model(MODEL, seed=9)
    store = TieredStore(state_config(tmp_path / "c", "fp32"))
    plain_model, fp32_optimizer = store.attach(plain_model, fused_adamw(plain_model.parameters()))
    store.load_checkpoint(tmp_path / "checkpoint")
    as_fp32 = fp32_optimizer.state_dict()
    for index, state in before["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert as_fp32["state"][index][key].dtype == torch.float32
            torch.testing.assert_close(as_fp32["state"][index][key], state[key], rtol=0, atol=0)
    store.close()
    plain = fused_adamw(plain_model.parameters())
    plain.load_state_dict(copy.deepcopy(as_fp32))
    assert train(plain_model, plain, 2, config=MODEL, seed=5) == pytest.approx(after_save, rel=1e-3)


@pytest.mark.parametrize("master_dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16", "int8"])
def test_a_resumed_run_follows_the_uninterrupted_one_bit_for_bit(dtype, master_dtype, tmp_path):
    """Saved after two steps, the run goes on for two more; a new store on a new model loads the
    checkpoint and takes the same two steps: the weights and the optimizer state are equal, bit
    for bit. (Compressed state used to round with noise drawn in the order of the process's
    encodes, which a new store starts afresh, and its load re-encoded the decoded values with
    noise: the weights differed by a few bf16 steps.)"""
    precision = {"dtype": "bf16", "master_dtype": master_dtype, "optimizer_state_dtype": dtype}

    def attached(path, seed):
        model = make_model(MODEL, seed=seed)
        store = TieredStore(state_config(path, dtype).replace(precision=precision))
        return (store, *store.attach(model, fused_adamw(model.parameters())))

    store, model, optimizer = attached(tmp_path / "a", seed=0)
    train(model, optimizer, 2, config=MODEL)
    store.save_checkpoint(tmp_path / "checkpoint")
    train(model, optimizer, 2, config=MODEL, seed=5)
    whole = {k: v.clone() for k, v in model.state_dict().items()}
    whole_state = optimizer.state_dict()["state"]
    store.close(restore_params=False)

    store, model, optimizer = attached(tmp_path / "b", seed=9)  # other weights until the load
    store.load_checkpoint(tmp_path / "checkpoint")
    train(model, optimizer, 2, config=MODEL, seed=5)
    resumed = {k: v.clone() for k, v in model.state_dict().items()}
    resumed_state = optimizer.state_dict()["state"]
    store.close(restore_params=False)
    assert resumed.keys() == whole.keys()
    for name, value in whole.items():
        assert torch.equal(resumed[name], value), name
    assert resumed_state.keys() == whole_state.keys()
    for index, state in whole_state.items():
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(resumed_state[index][key], state[key]), (index, key)


def test_compressed_state_with_the_state_in_memory_is_refused():
    with pytest.raises(ConfigError, match="offload_optimizer='nvme'") as info:
        OffloadConfig(
            offload_optimizer="cpu",
            precision=infinity.PrecisionConfig(optimizer_state_dtype="int8"),
        )
    assert info.value.field == "precision.optimizer_state_dtype"
    with pytest.raises(ConfigError, match="'fp32', 'bf16', 'int8'"):
        OffloadConfig.from_dict(
            {"offload_optimizer": "nvme", "precision": {"optimizer_state_dtype": "int4"}}
        )
    with pytest.raises(ConfigError, match="did you mean 'optimizer_state_dtype'"):
        OffloadConfig.from_dict({"precision": {"optimizer_state_dtyp": "bf16"}})


@pytest.mark.parametrize("dtype", ["bf16", "int8"])
def test_state_decoded_into_reused_buffers_trains_as_fresh_tensors_do(dtype, tmp_path, monkeypatch):
    def run(path):
        model = make_model(MODEL)
        store = TieredStore(state_config(path, dtype))
        model, optimizer = store.attach(model, fused_adamw(model.parameters()))
        losses = train(model, optimizer, 3, config=MODEL)
        params = {k: v.clone() for k, v in model.state_dict().items()}
        store.close(restore_params=False)
        return losses, params

    # the torch operations' path: the fused kernel (test_fused_adam.py) decodes into no scratch
    monkeypatch.setenv("INFINITY_FUSED_KERNELS", "0")
    held: list[int] = []
    release = DecodeScratch.release

    def recording_release(self: DecodeScratch) -> None:
        held.append(self.nbytes)
        release(self)

    monkeypatch.setattr(DecodeScratch, "release", recording_release)
    reused = run(tmp_path / "reused")
    # the steps after the first decoded into the buffers, and each step's end let them go
    assert len(held) >= 3 and max(held) > 0
    monkeypatch.setattr(DecodeScratch, "take", lambda self, key, numel: None)
    fresh = run(tmp_path / "fresh")
    assert reused[0] == fresh[0]
    assert reused[1].keys() == fresh[1].keys()
    for key in reused[1]:
        assert torch.equal(reused[1][key], fresh[1][key]), key
