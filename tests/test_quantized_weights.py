"""Weights stored quantized for inference: ``precision.storage_dtype`` ``int8`` and ``int4``.

The codecs' round trips stay within half a scale of every element (the scales read back from
the stored bytes); an attached model computes exactly what the same model does in RAM with its
weights replaced by their decoded values; a forward moves the stored bytes, not the given ones,
and the host tier and the swap files hold those; bad settings are refused with the fix.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import infinity
from infinity.errors import ConfigError
from infinity.inference.quantized import WeightQuantization, WeightQuantizer
from swap import align_up

SHARD = 1 << 14  # bytes per buffer: the larger weights are several shards


def rows_with_spread(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """A weight whose rows (and groups) differ in magnitude and offset, with a zero row."""
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(rows, cols, generator=generator)
    values *= torch.logspace(-3, 1, rows)[:, None]
    values += torch.linspace(-0.5, 2.0, cols)[None, :] * 0.1
    values[3] = 0.0
    return values


def test_int8_round_trip_is_within_half_a_scale_per_row() -> None:
    weight = rows_with_spread(37, 96)
    quant = WeightQuantizer("int8", 96)
    stored = torch.empty(quant.stored_bytes(weight.numel()), dtype=torch.uint8)
    assert stored.numel() == 37 * 96 + 4 * 37  # a byte per element and an fp32 scale per row
    quant.encode(weight.reshape(-1), stored)
    scales, minimums, codes = quant.parts(stored, weight.numel())
    assert minimums is None  # symmetric
    assert torch.equal(scales, weight.abs().amax(dim=1) / 127)
    levels = codes.view(torch.int8).to(torch.int32)
    assert levels.min() >= -127 and levels.max() <= 127
    decoded = torch.empty(weight.numel())
    quant.decode(stored, decoded)
    error = (decoded.view(37, 96) - weight).abs()
    assert (error <= scales[:, None] / 2 * (1 + 1e-6)).all()
    assert torch.equal(decoded.view(37, 96)[3], torch.zeros(96))  # a zero row stays zero
    # each row's largest magnitude is exact up to the scale's rounding: the full range is used
    assert (levels.view(37, 96).abs().amax(dim=1)[torch.arange(37) != 3] == 127).all()


@pytest.mark.parametrize("group", [32, 96])
def test_int4_round_trip_is_within_half_a_scale_per_group(group: int) -> None:
    weight = rows_with_spread(21, 192, seed=1)
    weight[5, :group] = 0.75  # a constant group comes back exactly
    quant = WeightQuantizer("int4", group)
    numel = weight.numel()
    groups = numel // group
    stored = torch.empty(quant.stored_bytes(numel), dtype=torch.uint8)
    assert stored.numel() == numel // 2 + 8 * groups  # two codes a byte, scale and minimum
    quant.encode(weight.reshape(-1), stored)
    scales, minimums, codes = quant.parts(stored, numel)
    assert minimums is not None  # asymmetric
    by_group = weight.reshape(groups, group)
    assert torch.equal(minimums, by_group.amin(dim=1))
    decoded = torch.empty(numel)
    quant.decode(stored, decoded)
    error = (decoded.view(groups, group) - by_group).abs()
    assert (error <= scales[:, None] / 2 * (1 + 1e-6) + 1e-7).all()
    first_of_row_five = 5 * 192 // group
    assert torch.equal(decoded.view(groups, group)[first_of_row_five], by_group[first_of_row_five])
    # the even element in the low nibble: element 2k+1's code is byte k's high nibble
    levels = torch.round((by_group - minimums[:, None]) / scales.clamp_min(1e-30)[:, None])
    assert torch.equal(codes & 15, levels.reshape(-1)[0::2].to(torch.uint8))
    assert torch.equal(codes >> 4, levels.reshape(-1)[1::2].to(torch.uint8))


class Net(nn.Module):
    """An embedding, linears with biases, a norm, and a small weight that stays unquantized."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(64, 128)
        self.up = nn.Linear(128, 256)
        self.norm = nn.LayerNorm(256)
        self.down = nn.Linear(256, 128)
        self.tiny = nn.Linear(128, 4, bias=False)  # 512 elements: too small to quantize

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        hidden = self.down(self.norm(torch.nn.functional.gelu(self.up(self.embed(ids)))))
        return torch.cat([hidden, self.tiny(hidden)], dim=-1)


QUANTIZED = ("embed.weight", "up.weight", "down.weight")


def stored_bytes(kind: str, model: nn.Module, group: int) -> int:
    total = 0
    for name, param in model.named_parameters():
        if name not in QUANTIZED:
            total += param.numel() * param.element_size()
        elif kind == "int8":
            total += param.numel() + 4 * param.shape[0]
        else:
            total += param.numel() // 2 + 8 * (param.numel() // group)
    return total


def decoded_in_ram(
    model: nn.Module,
    kind: str,
    group: int,
    dtype: torch.dtype = torch.float32,
    quantized: tuple[str, ...] | None = QUANTIZED,
) -> nn.Module:
    """``model`` in ``dtype`` with its quantized weights (``quantized``, when given, names
    them) replaced by their decoded values."""
    reference = copy.deepcopy(model)
    quantization = WeightQuantization(kind, group)
    with torch.no_grad():
        for name, param in reference.named_parameters():
            quant = quantization.quantizer_for(name, param)
            if quantized is not None:
                assert (quant is not None) == (name in quantized), name
            value = param.to(dtype) if quant is None else quant.round_trip(param, dtype)
            param.data = value
    return reference


def config(tmp_path, kind: str, group: int = 64, **options) -> infinity.OffloadConfig:
    settings = dict(
        device="cpu",
        offload_param="nvme",
        nvme_path=str(tmp_path),
        buffer_size=SHARD,
        buffer_count=8,
        host_budget=24 * SHARD,
        device_budget=9 * SHARD,  # about one module's copies: each forward gathers every one
    )
    settings.update(options)
    dtype = settings.pop("dtype", "fp32")
    return infinity.OffloadConfig(
        **settings,
        precision=infinity.PrecisionConfig(dtype=dtype, storage_dtype=kind, quant_group_size=group),
    )


def ids() -> torch.Tensor:
    return torch.randint(0, 64, (3, 7), generator=torch.Generator().manual_seed(2))


@pytest.mark.parametrize(
    ("kind", "dtype"), [("int8", "fp32"), ("int4", "fp32"), ("int8", "bf16"), ("int4", "bf16")]
)
def test_output_equals_the_decoded_weights_in_ram(tmp_path, kind: str, dtype: str) -> None:
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    plain = Net().eval()
    with torch.no_grad():
        expected = decoded_in_ram(plain, kind, 64, torch_dtype)(ids())
        unquantized = plain.to(torch_dtype)(ids()) if dtype == "fp32" else None
    model = copy.deepcopy(Net().eval())
    with infinity.TieredStore(config(tmp_path, kind, dtype=dtype)) as store:
        store.attach(model)
        with torch.no_grad():
            for _ in range(3):  # recording, then following the trace
                out = model(ids())
                assert out.dtype == torch_dtype
                assert torch.equal(out, expected)
        assert store.stats()["weights"]["quantized_params"] == len(QUANTIZED)
    if unquantized is not None:
        assert not torch.equal(expected, unquantized)  # the weights really were rounded
    # close gives the decoded weights back, in the dtype they came in
    for (name, param), original in zip(model.named_parameters(), plain.parameters()):
        assert param.dtype == torch.float32
        if name in QUANTIZED:
            reference = WeightQuantization(kind, 64).quantizer_for(name, original)
            assert reference is not None
            assert torch.equal(param, reference.round_trip(original.float(), torch_dtype).float())


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_a_forward_moves_the_stored_bytes(tmp_path, kind: str) -> None:
    """A forward gathers each weight at most once: the bytes moved into device copies (decoded
    on the way) plus those lent by the host copies are at most the stored bytes, quantized
    weights and unquantized tensors, and exactly those in the first forward, which finds no
    device copy kept; later ones at least those of the weights whose copies were not kept from
    the last forward. The host tier's slots and the swap files hold the stored bytes."""
    model = Net().eval()
    expected = stored_bytes(kind, model, 64)
    given = sum(p.numel() * p.element_size() for p in model.parameters())
    # an arena of 3 buffers, below the stored bytes: forwards read from the swap files
    with infinity.TieredStore(config(tmp_path, kind, host_budget=None, buffer_count=3)) as store:
        store.attach(model)
        assert store.budgets["arena"] == 3 * SHARD < expected
        assert store.budgets["params"] == expected
        weights = store.stats()["weights"]
        assert weights["stored_bytes"] == expected
        assert weights["given_bytes"] == given
        assert weights["quantized_bytes"] + weights["unquantized_bytes"] == expected
        shards = list(store.registry.shards.values())
        assert all(s.nbytes <= SHARD for s in shards)
        assert store.stats()["current_bytes"]["nvme"] == sum(align_up(s.nbytes) for s in shards)
        forwards = 5
        read_before = 0
        with torch.no_grad():
            for index in range(forwards + 1):
                before = store.stats()
                kept = sum(e.nbytes for e in store.registry.entries if e.resident)
                model(ids())
                after = store.stats()
                moved = (after["bytes_to_device"] - before["bytes_to_device"]) + (
                    after["lent_bytes"] - before["lent_bytes"]
                )
                assert expected - kept <= moved <= expected, (index, moved, expected, kept)
                if index == 0:
                    assert moved == expected
                    # every shard from the swap files at most once (attach left some on the host)
                    assert 0 < after["bytes_read"] <= expected
                if index == 1:  # the recording forward is done; then the trace is followed
                    read_before = after["bytes_read"]
        read = store.stats()["bytes_read"] - read_before
        arena = store.budgets["arena"]
        forwards -= 1
        assert forwards * (expected - arena) <= read <= forwards * expected + arena
        assert forwards * expected + arena < forwards * given // 2


def test_decoded_copies_go_to_the_slab_without_autograd(tmp_path) -> None:
    """On a CPU device without autograd a quantized weight's device copy is decoded into the
    device tier's reusable slab (no fresh memory per gather); with autograd into a copy of its
    own, which backward may keep."""
    model = Net().eval()
    with infinity.TieredStore(
        config(tmp_path, "int8", host_budget=None, device_budget=64 * SHARD)
    ) as store:
        store.attach(model)
        quantized = [e for e in store.registry.entries if e.quantized]
        assert [e.name for e in quantized] == list(QUANTIZED)
        with torch.no_grad():
            model(ids())
            assert all(e.resident and e.slab_offset is not None for e in quantized)
            out = model(ids())
        again = model(ids())  # autograd on: every copy its own
        assert all(e.resident and e.slab_offset is None for e in quantized)
        assert torch.equal(again, out)
        assert store.stats()["device_slab_misses"] == 0


def test_load_pretrained_quantizes_the_checkpoint(tmp_path) -> None:
    safetensors = pytest.importorskip("safetensors.torch")
    plain = Net().eval()
    checkpoint = tmp_path / "weights"
    checkpoint.mkdir()
    safetensors.save_file(
        {k: v.contiguous() for k, v in plain.state_dict().items()},
        str(checkpoint / "model.safetensors"),
    )
    with torch.device("meta"):
        model = Net().eval()
    with torch.no_grad():
        expected = decoded_in_ram(plain, "int4", 64)(ids())
    (tmp_path / "swap").mkdir()
    with infinity.TieredStore(config(tmp_path / "swap", "int4")) as store:
        store.attach(model, initialise=False)
        assert store.stats()["bytes_written"] == 0
        missing, unexpected = store.load_pretrained(checkpoint)
        assert not missing and not unexpected
        with torch.no_grad():
            assert torch.equal(model(ids()), expected)


@pytest.mark.parametrize(
    ("precision", "message"),
    [
        (dict(storage_dtype="int3"), "storage_dtype"),
        (dict(storage_dtype="int4", quant_group_size=0), "quant_group_size"),
        (dict(storage_dtype="int4", quant_group_size=-64), "quant_group_size"),
        (dict(storage_dtype="int4", quant_group_size=63), "even"),
    ],
)
def test_bad_settings_are_refused(precision: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        infinity.PrecisionConfig(**precision)


def test_a_group_size_that_does_not_divide_a_row_is_refused(tmp_path) -> None:
    model = Net()
    store = infinity.TieredStore(config(tmp_path, "int4", group=96))
    with pytest.raises(ConfigError, match=r"'embed.weight'.*divisor of 128 \(e.g. 128\)"):
        store.attach(model)
    store.close()


def test_an_optimizer_is_refused(tmp_path) -> None:
    model = Net()
    store = infinity.TieredStore(config(tmp_path, "int8"))
    with pytest.raises(ConfigError, match="without an optimizer"):
        store.attach(model, torch.optim.SGD(model.parameters(), lr=0.1))
    store.close()
    assert all(p.device.type == "cpu" for p in model.parameters())  # nothing was taken


def test_backward_reaches_the_inputs_and_drops_the_quantized_weights_gradients(
    tmp_path, caplog
) -> None:
    """Backward through quantized weights gives the inputs' gradients those of the decoded
    weights do in RAM; the quantized weights' own gradients are dropped, said once."""
    plain = Net().eval()
    model = copy.deepcopy(plain)
    reference = decoded_in_ram(plain, "int8", 64)
    hidden = torch.randn(3, 7, 128, generator=torch.Generator().manual_seed(4))
    expected = hidden.clone().requires_grad_(True)
    reference.down(reference.norm(reference.up(expected))).sum().backward()
    with infinity.TieredStore(config(tmp_path, "int8")) as store:
        store.attach(model)
        for _ in range(2):
            given = hidden.clone().requires_grad_(True)
            model.down(model.norm(model.up(given))).sum().backward()
            assert given.grad is not None and torch.equal(given.grad, expected.grad)
        assert model.up.weight.grad is None and model.up.bias.grad is not None
        assert torch.equal(model.up.bias.grad, 2 * reference.up.bias.grad)  # accumulated
        with torch.no_grad():
            assert torch.equal(model(ids()), reference(ids()))  # nothing left held
        with pytest.raises(infinity.ParameterAccessError, match="keeps no gradient"):
            model.up.weight.grad = torch.ones(256, 128)
        model.up.weight.grad = None  # nothing to clear, and nothing refused
    warnings = [r for r in caplog.records if "gradient is discarded" in r.getMessage()]
    assert len(warnings) == 1


def test_weights_kept_on_the_device_are_refused(tmp_path) -> None:
    store = infinity.TieredStore(config(tmp_path, "int8", offload_param="none"))
    with pytest.raises(ConfigError, match="offload_param to 'cpu' or 'nvme'"):
        store.attach(Net())
    store.close()


def test_state_dict_gives_the_decoded_weights_and_checkpoints_are_refused(tmp_path) -> None:
    plain = Net().eval()
    model = copy.deepcopy(plain)
    reference = decoded_in_ram(plain, "int8", 64)
    with infinity.TieredStore(config(tmp_path, "int8")) as store:
        store.attach(model)
        state = model.state_dict()
        for name, value in reference.state_dict().items():
            assert torch.equal(state[name], value), name
        with pytest.raises(infinity.CheckpointError, match="load_pretrained"):
            store.save_checkpoint(tmp_path / "checkpoint")
        # a state dict loaded in is stored quantized as it arrives
        model.load_state_dict(Net(seed=1).state_dict())
        with torch.no_grad():
            expected = decoded_in_ram(Net(seed=1).eval(), "int8", 64)(ids())
            assert torch.equal(model(ids()), expected)


def test_a_meta_built_model_is_initialised_and_quantized(tmp_path) -> None:
    with torch.device("meta"):
        model = Net().eval()
    with infinity.TieredStore(config(tmp_path, "int4")) as store:
        store.attach(model)  # reset_parameters() module by module, then stored quantized
        state = model.state_dict()
        with torch.no_grad():
            out = model(ids())
    for name in QUANTIZED:  # initialised (not zeros), then stored in 16 levels a group
        weight = state[name]
        assert weight.dtype == torch.float32 and weight.std() > 0
        for group in weight.reshape(-1, 64):
            assert 1 < group.unique().numel() <= 16
    reference = Net()
    reference.load_state_dict(state)  # the decoded values, in RAM
    with torch.no_grad():
        assert torch.equal(reference.eval()(ids()), out)


def test_host_tier_storage_decodes_too(tmp_path) -> None:
    """offload_param='cpu': the quantized weights live in the host tier only."""
    plain = Net().eval()
    model = copy.deepcopy(plain)
    with torch.no_grad():
        expected = decoded_in_ram(plain, "int8", 64)(ids())
    with infinity.TieredStore(
        config(tmp_path, "int8", offload_param="cpu", host_budget=None)
    ) as store:
        store.attach(model)
        with torch.no_grad():
            assert torch.equal(model(ids()), expected)
        assert store.stats()["bytes_read"] == 0
        assert store.stats()["weights"]["stored_bytes"] == stored_bytes("int8", plain, 64)


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_llama_generates_what_its_decoded_weights_do_in_ram(tmp_path, kind: str) -> None:
    """A Hugging Face Llama: forward and greedy generate equal those of the model with its
    decoded weights in RAM; its norms stay as they are."""
    transformers = pytest.importorskip("transformers")
    llama_config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    plain = transformers.LlamaForCausalLM(llama_config).eval()
    reference = decoded_in_ram(plain, kind, 32, quantized=None)
    model = copy.deepcopy(plain)
    prompt = torch.randint(3, 256, (2, 9), generator=torch.Generator().manual_seed(3))
    greedy = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        logits = reference(prompt).logits
        tokens = reference.generate(prompt, **greedy)
    with infinity.TieredStore(
        config(tmp_path, kind, group=32, host_budget=None, buffer_count=6, device_budget=None)
    ) as store:
        store.attach(model)
        with torch.no_grad():
            for _ in range(2):
                assert torch.equal(model(prompt).logits, logits)
            assert torch.equal(model.generate(prompt, **greedy), tokens)
        weights = store.stats()["weights"]
        # every projection and both embeddings; the norms (1-D) stay fp32
        assert weights["quantized_params"] == 2 + 2 * 7
        norms = sum(p.numel() * 4 for n, p in plain.named_parameters() if "norm" in n)
        assert weights["unquantized_bytes"] == norms


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device (make gpu-check runs it on one)"
)
@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_cuda_moves_the_stored_bytes_and_decodes_on_the_device(tmp_path, kind: str) -> None:
    """On CUDA the stored bytes cross to the device, are decoded there on the copy stream, and
    the output is that of the decoded weights computed on the device."""
    cuda = torch.device("cuda")
    plain = Net().eval()
    reference = decoded_in_ram(plain, kind, 64).to(cuda)
    tokens = ids().to(cuda)
    with torch.no_grad():
        expected = reference(tokens)
    model = copy.deepcopy(plain)
    with infinity.TieredStore(config(tmp_path, kind, device="cuda", host_budget=None)) as store:
        store.attach(model)
        with torch.no_grad():
            before = store.stats()["bytes_to_device"]
            first = model(tokens)
            moved = store.stats()["bytes_to_device"] - before
            second = model(tokens)
        assert moved == stored_bytes(kind, plain, 64)  # the first forward gathers every weight
    assert first.device.type == "cuda"
    assert torch.equal(first, expected) and torch.equal(second, expected)
