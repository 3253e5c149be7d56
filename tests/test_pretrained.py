"""Pretrained Hugging Face weights streamed into an attached, meta-built model."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate")
from safetensors.torch import save_file  # noqa: E402

import infinity  # noqa: E402
from infinity.checkpointing.pretrained import CheckpointError  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


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
