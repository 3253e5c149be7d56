"""Pretrained Hugging Face weights streamed into an attached, meta-built model."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate")
from safetensors.torch import save_file  # noqa: E402

import infinity  # noqa: E402
from infinity.checkpointing.pretrained import CheckpointError  # noqa: E402
from infinity.core.memory import resident_bytes  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

MIB = 1 << 20


def _config() -> transformers.LlamaConfig:
    return transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        attn_implementation="sdpa",
    )


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    torch.manual_seed(0)
    source = transformers.LlamaForCausalLM(_config())
    single = tmp_path_factory.mktemp("single")
    sharded = tmp_path_factory.mktemp("sharded")
    source.save_pretrained(single)
    source.save_pretrained(sharded, max_shard_size="20KB")
    assert (sharded / "model.safetensors.index.json").exists()
    return {"single": single, "sharded": sharded}


def _store(tmp_path) -> infinity.TieredStore:
    return infinity.TieredStore(
        infinity.OffloadConfig(
            offload_param="nvme",
            offload_optimizer="nvme",
            buffer_size=8192,
            buffer_count=8,
            nvme_path=str(tmp_path),
        )
    )


def _empty_llama() -> torch.nn.Module:
    with accelerate.init_empty_weights():  # parameters on the meta device, buffers real
        return transformers.LlamaForCausalLM(_config())


@pytest.mark.parametrize("layout", ["single", "sharded"])
@pytest.mark.parametrize("initialise", [True, False])
def test_meta_built_llama_gives_from_pretrained_logits(tmp_path, checkpoints, layout, initialise):
    reference = transformers.LlamaForCausalLM.from_pretrained(checkpoints[layout])
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(input_ids=tokens).logits
    with _store(tmp_path) as store:
        model = _empty_llama()
        model, optimizer = store.attach(
            model, torch.optim.AdamW(model.parameters(), lr=1e-3), initialise=initialise
        )
        if not initialise:
            assert store.stats()["bytes_written"] == 0  # nothing written before the load
            with pytest.raises(infinity.ParameterAccessError, match="has no values yet"):
                with torch.no_grad():
                    model(input_ids=tokens)
        else:  # initialised as the model's own _init_weights does, norms included
            with torch.no_grad():
                assert torch.isfinite(model(input_ids=tokens).logits).all()
        result = store.load_pretrained(checkpoints[layout])
        assert result.missing_keys == [] and result.unexpected_keys == []
        with torch.no_grad():
            assert torch.equal(model(input_ids=tokens).logits, expected)
        loss = model(input_ids=tokens, labels=tokens).loss  # and it trains
        loss.backward()
        optimizer.step()
        assert torch.isfinite(loss)
        assert not store.placement.audit()


def test_missing_unexpected_and_mismatched_keys(tmp_path, checkpoints):
    torch.manual_seed(0)
    state = transformers.LlamaForCausalLM(_config()).state_dict()
    dropped = "model.layers.1.mlp.up_proj.weight"
    partial = {k: v.contiguous() for k, v in state.items() if k != dropped}
    partial["extra.weight"] = torch.zeros(3)
    save_file(partial, str(tmp_path / "partial.safetensors"))
    wrong = dict(partial, **{"model.norm.weight": torch.zeros(5)})
    save_file(wrong, str(tmp_path / "wrong.safetensors"))
    with _store(tmp_path) as store:
        model, _ = store.attach(_empty_llama(), initialise=False)
        result = store.load_pretrained(tmp_path / "partial.safetensors")
        assert result.missing_keys == [dropped] and result.unexpected_keys == ["extra.weight"]
        with pytest.raises(CheckpointError, match="model.norm.weight has shape"):
            store.load_pretrained(tmp_path / "wrong.safetensors")
        with pytest.raises(CheckpointError, match="neither"):
            store.load_pretrained(tmp_path)


def test_meta_buffers_are_refused_with_the_way_out(tmp_path):
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(_config())
    with pytest.raises(infinity.AttachError, match="init_empty_weights"):
        _store(tmp_path).attach(model)


def test_a_bf16_checkpoint_fills_fp32_masters_and_a_tied_weight_once(tmp_path):
    config = _config()
    config.tie_word_embeddings = True
    torch.manual_seed(0)
    source = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    source.save_pretrained(tmp_path / "bf16")
    with _store(tmp_path) as store:
        with accelerate.init_empty_weights():
            model = transformers.LlamaForCausalLM(config)
        model.tie_weights()
        model, _ = store.attach(model, initialise=False)
        result = store.load_pretrained(tmp_path / "bf16")
        assert result.missing_keys == [] and result.unexpected_keys == []
        assert model.lm_head.weight is model.model.embed_tokens.weight
        expected = dict(source.named_parameters())
        for name, param in model.named_parameters():
            with store.gathered([param]):
                assert param.dtype == torch.float32
                assert torch.equal(param.detach(), expected[name].float()), name


def _damage(path, how: str) -> None:
    data = bytearray(path.read_bytes())
    length = int.from_bytes(data[:8], "little")
    if how == "truncated":
        del data[-100:]
    elif how == "header-length":
        data[:8] = (len(data) * 2).to_bytes(8, "little")
    elif how == "not-json":
        data[8:12] = b"\xff\xfe{["
    elif how == "dtype":
        data[8 : 8 + length] = data[8 : 8 + length].replace(b'"F32"', b'"Q32"', 1)
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "how, cause",
    [
        ("truncated", "past the file's end"),
        ("header-length", "a header of"),
        ("not-json", "not JSON"),
        ("dtype", "dtype 'Q32'"),
    ],
)
def test_a_damaged_file_is_refused_naming_it_and_what_is_wrong(tmp_path, checkpoints, how, cause):
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    for file in checkpoints["sharded"].iterdir():
        (sharded / file.name).write_bytes(file.read_bytes())
    damaged = sorted(sharded.glob("*.safetensors"))[-1]
    _damage(damaged, how)
    with _store(tmp_path) as store:
        model, _ = store.attach(_empty_llama(), initialise=False)
        with pytest.raises(CheckpointError, match=cause) as refused:
            store.load_pretrained(sharded)
    assert str(damaged) in str(refused.value) and "fetch the file again" in str(refused.value)


LOAD_CHILD = r"""
import json, os, struct, sys, zlib
import torch, accelerate, transformers
import infinity
from infinity.core.memory import peak_resident_bytes, resident_bytes

path, nvme = sys.argv[1], sys.argv[2]
config = transformers.LlamaConfig(
    vocab_size=4000, hidden_size=1536, intermediate_size=4096, num_hidden_layers=5,
    num_attention_heads=12, num_key_value_heads=12, max_position_embeddings=64,
    tie_word_embeddings=False, attn_implementation="sdpa")
with accelerate.init_empty_weights():
    model = transformers.LlamaForCausalLM(config)
shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}

def value(name):
    generator = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    return torch.randn(shapes[name], generator=generator)

# The checkpoint, written a tensor at a time (a safetensors header, then the raw bytes).
header, offset = {}, 0
for name, shape in shapes.items():
    nbytes = 4 * torch.Size(shape).numel()
    header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
    offset += nbytes
raw = json.dumps(header).encode()
raw += b" " * (-len(raw) % 8)
with open(path, "wb") as f:
    f.write(struct.pack("<Q", len(raw)) + raw)
    for name in shapes:
        f.write(value(name).numpy().tobytes())

model.requires_grad_(False)  # a frozen base, attached for inference
store = infinity.TieredStore(infinity.OffloadConfig(
    device="cpu", offload_param="nvme", nvme_path=nvme, host_budget="64MiB"))
model, _ = store.attach(model, initialise=False)
before = resident_bytes()
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # VmHWM starts again from the RSS now
result = store.load_pretrained(path)
peak = peak_resident_bytes()
bound = store.stats()["rss_bound"]["bound"]
params = dict(model.named_parameters())
exact = []
for name in ["model.embed_tokens.weight", "model.layers.4.mlp.down_proj.weight", "lm_head.weight"]:
    with store.gathered([params[name]]):
        exact.append(torch.equal(params[name].detach(), value(name)))
store.close(restore_params=[])
print(json.dumps({"file": os.path.getsize(path), "growth": peak - before, "peak": peak,
                  "bound": bound, "exact": exact, "missing": result.missing_keys,
                  "unexpected": result.unexpected_keys}))
"""


@pytest.mark.skipif(
    resident_bytes() == 0 or not os.path.exists("/proc/self/clear_refs"),
    reason="needs /proc/self/statm and /proc/self/clear_refs",
)
def test_a_checkpoint_ten_times_the_host_budget_loads_in_bounded_memory(tmp_path):
    """A 615 MB checkpoint into a frozen base under a 64 MiB host budget, in a process of its
    own: its peak RSS grows by a few read buffers, not by the file (a memory-mapped read kept
    every page it touched resident: +624 MB), and stays within the store's RSS bound."""
    (tmp_path / "nvme").mkdir()
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            LOAD_CHILD,
            str(tmp_path / "model.safetensors"),
            str(tmp_path / "nvme"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    run = json.loads(done.stdout.strip().splitlines()[-1])
    assert run["file"] > 600 * MIB // 1.1
    assert run["missing"] == [] and run["unexpected"] == []
    assert run["exact"] == [True, True, True]
    assert run["growth"] < 200 * MIB, (run["growth"] // MIB, run["file"] // MIB)
    assert run["peak"] <= run["bound"], (run["peak"] // MIB, run["bound"] // MIB)
