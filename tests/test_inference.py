"""Inference from NVMe: an attached model without an optimizer streams its weights.

Each test builds a tiny Hugging Face causal LM from a config (random init, no download), runs it
in RAM, and runs a deep copy attached with its parameters on NVMe under a host budget well below
the weights, so every forward reads most of them from the swap files. Outputs must equal the
in-RAM ones bit for bit (the schedule moves bytes, never changes the arithmetic), and the bytes
read must be those of the weights, each once per forward.
"""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

import infinity  # noqa: E402
from infinity.errors import AttachError  # noqa: E402

VOCAB = 256
SHARD = 1 << 14  # bytes per shard: every weight matrix is a few shards or one


def llama() -> torch.nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def gpt2() -> torch.nn.Module:
    config = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_embd=64,
        n_layer=3,
        n_head=4,
        n_positions=64,
        bos_token_id=1,
        eos_token_id=2,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).eval()


MODELS = {"llama": llama, "gpt2": gpt2}


def weight_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def attached(
    model: torch.nn.Module, arena_share: float = 0.25, device_share: float = 0.5, **precision: str
) -> infinity.TieredStore:
    """Attaches ``model`` (no optimizer) with an arena of about ``arena_share`` of its weights
    and a device budget of ``device_share`` of them."""
    arena = max(4 * SHARD, int(weight_bytes(model) * arena_share) // SHARD * SHARD)
    config = infinity.OffloadConfig(
        device="cpu",
        offload_param="nvme",
        buffer_size=SHARD,
        buffer_count=arena // SHARD,
        host_budget=arena,
        device_budget=int(weight_bytes(model) * device_share),
        precision=infinity.PrecisionConfig(**precision),
    )
    store = infinity.TieredStore(config)
    store.attach(model)
    return store


def prompt(batch: int, length: int = 12, seed: int = 3) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (batch, length), generator=generator)


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_forward_and_greedy_generate_equal_in_ram(name: str, batch: int) -> None:
    plain = MODELS[name]()
    model = copy.deepcopy(plain)
    ids = prompt(batch)
    with torch.no_grad():
        logits = plain(ids).logits
        tokens = plain.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
    with attached(model) as store, torch.no_grad():
        for _ in range(3):  # recording, then following the trace
            assert torch.equal(model(ids).logits, logits)
        assert torch.equal(
            model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0), tokens
        )
        stats = store.stats()
        assert stats["bytes_read"] > weight_bytes(plain)  # really streamed from the files
        assert stats["trace_departures"] == 0  # prefill and decode steps share one trace
        assert stats["lent_gathers"] > 0  # a CPU device computes on the host copies
        assert stats["peak_bytes"]["device"] <= store.budgets["device"]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_sampling_generate_equals_in_ram(name: str) -> None:
    plain = MODELS[name]()
    model = copy.deepcopy(plain)
    ids = prompt(2)
    kwargs = dict(max_new_tokens=6, do_sample=True, top_k=20, temperature=0.9, pad_token_id=0)
    with torch.no_grad():
        torch.manual_seed(7)
        tokens = plain.generate(ids, **kwargs)
    with attached(model), torch.no_grad():
        model(ids)
        torch.manual_seed(7)
        assert torch.equal(model.generate(ids, **kwargs), tokens)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_each_weight_read_once_per_forward(name: str) -> None:
    """After the recording forward, every forward is prefetched (no read waits on demand) and
    reads each weight at most once: over several forwards the bytes are at most the weights'
    times the count, plus the window read ahead into the next forward (an arena's worth), and
    at least that less what the device and host tiers keep cached across forwards. A prefetch
    that evicted the shards of the module about to run (which its gather then read again) read
    about 1.3x the weights per forward here."""
    model = MODELS[name]()
    weights = weight_bytes(model)
    ids = prompt(1)
    with attached(model, arena_share=0.3, device_share=0.15) as store, torch.no_grad():
        model(ids)
        model(ids)
        before = store.stats()
        forwards = 5
        for _ in range(forwards):
            model(ids)
        after = store.stats()
    read = after["bytes_read"] - before["bytes_read"]
    arena, device = store.budgets["arena"], store.budgets["device"]
    assert forwards * (weights - arena - device) <= read <= forwards * weights + arena, (
        read / (forwards * weights),
        arena / weights,
    )
    assert after["demand_loads"] == before["demand_loads"]


def test_bf16_storage_gives_the_bf16_weights_output() -> None:
    """``storage_dtype='bf16'``: the weights are kept in bf16 between uses (half the bytes
    read) and converted to the compute dtype on the way in. With fp32 compute the output is
    that of the model whose weights are rounded to bf16; with bf16 compute, that of the
    attached bf16 model whose masters are fp32."""
    plain = llama()
    rounded = copy.deepcopy(plain)
    with torch.no_grad():
        for param in rounded.parameters():
            param.copy_(param.to(torch.bfloat16))
    ids = prompt(2)
    with torch.no_grad():
        expected = rounded(ids).logits

    forwards = 4

    def run(**precision: str) -> tuple[torch.Tensor, int]:
        """The output, and the bytes read by ``forwards`` forwards after two."""
        model = copy.deepcopy(plain)
        with attached(model, device_share=0.15, **precision) as store, torch.no_grad():
            model(ids)
            model(ids)
            before = store.stats()["bytes_read"]
            for _ in range(forwards):
                out = model(ids).logits
            read = store.stats()["bytes_read"] - before
            arena = store.budgets["arena"]
        for param, original in zip(model.parameters(), plain.parameters()):
            assert param.dtype == original.dtype  # given back as it came, at close
        return out, read, arena

    bf16_weights = weight_bytes(plain) // 2
    out, read, arena = run(storage_dtype="bf16")
    assert out.dtype == torch.float32 and torch.equal(out, expected)
    assert 0 < read <= forwards * bf16_weights + arena  # the bf16 bytes, each at most once
    full_bf16, full_read, arena = run(dtype="bf16")
    half_bf16, half_read, _ = run(dtype="bf16", storage_dtype="bf16")
    assert half_bf16.dtype == torch.bfloat16 and torch.equal(half_bf16, full_bf16)
    assert 0 < half_read <= forwards * bf16_weights + arena < full_read


def test_bf16_storage_with_an_optimizer_needs_the_masters_on_nvme() -> None:
    """With an optimizer, storage_dtype is that of compute copies kept beside the masters on
    NVMe (tests/test_compute_copies.py): refused where the masters are not there."""
    model = llama()
    optimizer = torch.optim.AdamW(model.parameters())
    config = infinity.OffloadConfig(
        device="cpu",
        offload_param="cpu",
        precision=infinity.PrecisionConfig(dtype="bf16", storage_dtype="bf16"),
    )
    with (
        infinity.TieredStore(config) as store,
        pytest.raises(AttachError, match="storage_dtype='bf16' with an optimizer.*'nvme'"),
    ):
        store.attach(model, optimizer)


def test_close_after_inference_gives_the_values_back() -> None:
    """Device copies lent by the host copies are given back before close restores the
    parameters: each is a plain tensor with its values afterwards."""
    plain = gpt2()
    model = copy.deepcopy(plain)
    store = attached(model)
    with torch.no_grad():
        model(prompt(1))
        model(prompt(1))
    assert store.placement.lending.lent_gathers > 0
    # The weights are more than the host budget (a quarter of them): named, they come back.
    store.close(restore_params=model)
    for (name, param), original in zip(model.named_parameters(), plain.parameters()):
        assert type(param) is torch.nn.Parameter
        assert torch.equal(param.detach(), original.detach()), name


@pytest.mark.parametrize("no_autograd", [torch.no_grad, torch.inference_mode])
def test_training_after_inference_equals_plain(no_autograd) -> None:
    """Evaluation without autograd between training steps (the device copies it makes are the
    host copies) leaves training exactly as without the store: training forwards get copies
    of their own, which the weights autograd saves for backward stay valid in."""
    plain = llama()
    model = copy.deepcopy(plain)
    ids = prompt(4, length=16)
    config = infinity.OffloadConfig(
        device="cpu",
        offload_param="nvme",
        offload_optimizer="nvme",
        buffer_size=SHARD,
        buffer_count=24,
        host_budget=24 * SHARD,
    )
    losses = {}
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    with infinity.TieredStore(config) as store:
        model, optimizer = store.attach(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        for which, net, opt in (("plain", plain, plain_opt), ("attached", model, optimizer)):
            out = []
            for _ in range(3):
                with no_autograd():
                    out.append(net(ids).logits.sum().item())
                net.train()
                loss = net(input_ids=ids, labels=ids).loss
                loss.backward()
                opt.step()
                opt.zero_grad()
                net.eval()
                out.append(loss.item())
            losses[which] = out
        assert store.placement.lending.lent_gathers > 0
    assert losses["attached"] == pytest.approx(losses["plain"], rel=1e-5, abs=1e-6)
