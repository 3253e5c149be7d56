"""The KV cache of ``generate`` offloaded to host RAM or NVMe.

A tiny Llama (random weights, a few layers) generates greedily with the default in-RAM cache and
with ours, under a budget smaller than the whole cache: the token ids must be equal (attention
sees the same tensors), the device must have held at most two layers' K/V at once (the cache's
own counters), and the bytes must really have gone through the tier.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

import infinity  # noqa: E402
from infinity.errors import BudgetError, ConfigError  # noqa: E402
from infinity.inference.kv_cache import OffloadedKVCache  # noqa: E402
from swap import NvmePathError  # noqa: E402

VOCAB = 256
LAYERS = 4
KV_HEADS = 2
HEAD_DIM = 16
NEW_TOKENS = 12
PROMPT = 10
SHARD = 1 << 14


def llama() -> torch.nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=64,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def prompt(batch: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(3)
    return torch.randint(3, VOCAB, (batch, PROMPT), generator=generator)


def layer_bytes(batch: int, tokens: int) -> int:
    """One layer's K and V in fp32 at ``tokens`` tokens."""
    return 2 * batch * KV_HEADS * tokens * HEAD_DIM * 4


def generate(model: torch.nn.Module, ids: torch.Tensor, **kwargs: object) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(
            ids,
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
            pad_token_id=0,
            **kwargs,
        )


def budget_for(batch: int) -> int:
    """Room for two layers at the longest context, well under the whole cache."""
    return 2 * layer_bytes(batch, PROMPT + NEW_TOKENS)


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("target", ["host", "nvme"])
def test_greedy_generate_equals_in_ram(target: str, batch: int, tmp_path: Path) -> None:
    model = llama()
    ids = prompt(batch)
    expected = generate(model, ids)
    budget = budget_for(batch)
    whole_cache = LAYERS * layer_bytes(batch, PROMPT + NEW_TOKENS - 1)
    assert whole_cache > budget
    options = {"nvme_path": tmp_path} if target == "nvme" else {}
    with infinity.offloaded_kv_cache(target=target, budget=budget, **options) as cache:
        out = generate(model, ids, cache=cache)
        stats = cache.stats()
    assert torch.equal(out, expected)
    assert stats["kv_resident_layers_peak"] <= 2
    assert stats["kv_resident_bytes_peak"] <= budget
    # the whole cache was written, and read back every step after the prefill
    assert stats["kv_stored_bytes"] == whole_cache
    assert stats["kv_bytes_written"] >= whole_cache
    assert stats["kv_bytes_read"] >= (NEW_TOKENS - 1) * LAYERS * layer_bytes(batch, PROMPT)
    assert stats["kv_prefetched"] > 0
    # only the first layer of the first decode step is fetched when needed
    assert stats["kv_demand_fetches"] <= 1
    if target == "nvme":
        assert not any(tmp_path.rglob("*kv*.swap")), "swap files are removed at close"


def test_nvme_bytes_are_on_disk_while_generating(tmp_path: Path) -> None:
    """The NVMe tier writes through the swap engine: the files exist and grow during
    generate, and the engine counts the bytes read back."""
    model = llama()
    ids = prompt(2)
    seen: list[int] = []

    def files_bytes(*_: object) -> None:
        seen.append(sum(p.stat().st_size for p in tmp_path.rglob("*") if p.is_file()))

    handle = model.register_forward_hook(files_bytes)
    try:
        with infinity.offloaded_kv_cache(
            target="nvme", budget=budget_for(2), nvme_path=tmp_path
        ) as cache:
            generate(model, ids, cache=cache)
            # The tier counts a transfer when it issues it, the engine when it lands: let the
            # last writes and the fetch started after the last step land first.
            cache.residency.settle()
            cache.tier.flush()
            engine = cache.tier.engine.stats()  # type: ignore[attr-defined]
            stats = cache.stats()
    finally:
        handle.remove()
    assert max(seen) > 0
    assert stats["kv_bytes_read"] > 0 and stats["kv_bytes_written"] > 0
    assert engine.bytes_read == stats["kv_bytes_read"]
    assert engine.bytes_written == stats["kv_bytes_written"]


def test_a_tight_budget_fetches_one_layer_at_a_time() -> None:
    """Room for one layer at the longest context: prefetch stops once two layers no longer fit
    together, and layers come one at a time; the same output."""
    model = llama()
    ids = prompt(2)
    expected = generate(model, ids)
    budget = layer_bytes(2, PROMPT + NEW_TOKENS)
    with infinity.offloaded_kv_cache(target="host", budget=budget) as cache:
        out = generate(model, ids, cache=cache)
        stats = cache.stats()
    assert torch.equal(out, expected)
    assert stats["kv_resident_bytes_peak"] <= budget
    assert stats["kv_prefetch_skipped"] > 0
    # each skipped prefetch is a fetch on demand (but the last, after the last step)
    assert stats["kv_demand_fetches"] >= stats["kv_prefetch_skipped"]


def test_segments_are_compacted() -> None:
    model = llama()
    ids = prompt(1)
    expected = generate(model, ids)
    with infinity.offloaded_kv_cache(target="host", budget=budget_for(1), max_segments=3) as c:
        out = generate(model, ids, cache=c)
        stats = c.stats()
    assert torch.equal(out, expected)
    assert stats["kv_compactions"] > 0


def test_a_layer_over_the_budget_is_refused() -> None:
    model = llama()
    with infinity.offloaded_kv_cache(target="host", budget=layer_bytes(1, PROMPT) - 1) as cache:
        with pytest.raises(BudgetError, match="raise the budget"):
            generate(model, prompt(1), cache=cache)


def test_beam_search_equals_in_ram() -> None:
    model = llama()
    ids = prompt(2)
    expected = generate(model, ids, num_beams=3)
    with infinity.offloaded_kv_cache(target="host", budget=budget_for(6)) as cache:
        assert torch.equal(generate(model, ids, num_beams=3, cache=cache), expected)


def test_bad_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="'host', 'nvme'"):
        infinity.offloaded_kv_cache(target="disk", budget=1 << 20)
    with pytest.raises(ConfigError, match="did you mean 'nvme'"):
        infinity.offloaded_kv_cache(target="nvm", budget=1 << 20)
    with pytest.raises(ConfigError, match="needs nvme_path"):
        infinity.offloaded_kv_cache(target="nvme", budget=1 << 20)
    with pytest.raises(NvmePathError, match="does not exist"):
        infinity.offloaded_kv_cache(target="nvme", nvme_path=tmp_path / "missing")
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(NvmePathError, match="not a directory"):
        infinity.offloaded_kv_cache(target="nvme", nvme_path=tmp_path / "file")
    with pytest.raises(ConfigError, match="did you mean 'budget'"):
        infinity.offloaded_kv_cache(target="host", budgt=1 << 20)
    with pytest.raises(ConfigError, match="budget"):
        infinity.offloaded_kv_cache(target="host", budget=0)
    assert infinity.KVOffloadConfig(budget="1MiB").budget == 1 << 20


def test_nvme_path_read_only_is_refused(tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        import os

        if os.access(locked, os.W_OK):
            pytest.skip("running as a user who can write anywhere")
        with pytest.raises(NvmePathError, match="not writable"):
            infinity.offloaded_kv_cache(target="nvme", nvme_path=locked)
    finally:
        locked.chmod(0o700)


def weight_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


@pytest.mark.parametrize("target", ["host", "nvme"])
def test_with_weights_streamed_by_an_attached_store(target: str, tmp_path: Path) -> None:
    """Weights streamed from NVMe by a store, the cache offloaded beside them: the store makes
    the cache (its nvme_path and aio settings, its device) and the output is the in-RAM one."""
    plain = llama()
    model = copy.deepcopy(plain)
    ids = prompt(2)
    expected = generate(plain, ids)
    weights = weight_bytes(plain)
    arena = max(4 * SHARD, weights // 4 // SHARD * SHARD)
    config = infinity.OffloadConfig(
        device="cpu",
        offload_param="nvme",
        nvme_path=(tmp_path,),
        buffer_size=SHARD,
        buffer_count=arena // SHARD,
        host_budget=arena,
        device_budget=weights // 2,
    )
    with infinity.TieredStore(config) as store:
        store.attach(model)
        with store.kv_cache(target=target, budget=budget_for(2)) as cache:
            out = generate(model, ids, cache=cache)
            stats = cache.stats()
        store_stats = store.stats()
    assert torch.equal(out, expected)
    assert store_stats["bytes_read"] > weights  # the weights really streamed
    assert stats["kv_resident_layers_peak"] <= 2 and stats["kv_bytes_read"] > 0


@pytest.mark.parametrize("target", ["host", "nvme"])
def test_generate_tool_offloads_the_kv_cache(
    target: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``infinity-generate --offload-kv``: the same ids as the model in RAM, and the cache's
    bytes per generated token reported beside the weights'."""
    pytest.importorskip("accelerate")
    import json

    from infinity.cli import generate as generate_tool

    model = llama()
    saved = tmp_path / "model"
    model.save_pretrained(saved)
    ids = prompt(2)
    expected = generate(model, ids)
    swap = tmp_path / "swap"
    swap.mkdir()
    argv = ["--model", str(saved), "--nvme-path", str(swap), "--device", "cpu"]
    argv += ["--max-new-tokens", str(NEW_TOKENS), "--ignore-eos", "--disk-gbps", "1"]
    for row in ids.tolist():
        argv += ["--token-ids", ",".join(map(str, row))]
    plain_argv = list(argv)
    argv += ["--offload-kv", target, "--kv-budget", str(budget_for(2))]
    assert generate_tool.main([*argv, "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["sequences"] == expected.tolist()
    assert summary["offload_kv"] == target
    assert summary["kv_bytes_read_per_token"] > 0 and summary["kv_bytes_written_per_token"] > 0
    assert summary["kv_resident_layers_peak"] <= 2
    assert generate_tool.main(argv) == 0
    assert f"kv cache    on {target}:" in capsys.readouterr().out
    code = generate_tool.main([*plain_argv, "--kv-budget", "1MiB"])  # without --offload-kv
    assert code == 2
    assert "--kv-budget needs --offload-kv" in capsys.readouterr().err


def test_a_corrupted_swap_file_is_reported(tmp_path: Path) -> None:
    """Bytes of the cache changed on disk after the prefill: the next read fails verification
    and generate raises the swap engine's IntegrityError instead of attending to garbage."""
    from swap import IntegrityError

    model = llama()
    forwards: list[int] = []
    caches: list[OffloadedKVCache] = []

    def corrupt_after_prefill(*_: object) -> None:
        forwards.append(1)
        if len(forwards) == 1:
            caches[0].tier.flush()  # the prefill's writes have landed: none undoes the damage
            for file in tmp_path.rglob("*"):
                if file.is_file() and file.stat().st_size:
                    with file.open("r+b") as handle:
                        handle.write(b"\xff" * min(1 << 20, file.stat().st_size))

    handle = model.register_forward_hook(corrupt_after_prefill)
    try:
        with infinity.offloaded_kv_cache(
            target="nvme", budget=budget_for(2), nvme_path=tmp_path
        ) as cache:
            caches.append(cache)
            with pytest.raises(IntegrityError):
                generate(model, prompt(2), cache=cache)
            with pytest.raises(IntegrityError):  # every layer was overwritten
                cache.residency.take(LAYERS - 1)
    finally:
        handle.remove()
    assert len(forwards) >= 1
