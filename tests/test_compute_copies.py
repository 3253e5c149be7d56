"""Compute copies (``precision.storage_dtype`` with an optimizer): bf16 copies of the fp32
masters on NVMe, which forward and backward read instead of the masters."""

from __future__ import annotations

import copy

import pytest
import torch

import infinity
from infinity import AttachError, OffloadConfig, TieredStore
from infinity.cli.common.tiny_gpt import GPTConfig, synthetic_batches
from infinity.core.shards import COMPUTE_KEY
from tests.store_helpers import fused_adamw, make_model, train

MODEL = GPTConfig(vocab_size=64, context=16, layers=4, width=64, heads=4)


def config(tmp_path, name: str, **precision) -> OffloadConfig:
    path = tmp_path / name
    path.mkdir()
    return OffloadConfig(
        device="cpu",
        offload_param="nvme",
        offload_optimizer="nvme",
        nvme_path=str(path),
        buffer_size=1 << 16,
        buffer_count=6,
        step_in_backward=False,
        precision=infinity.PrecisionConfig(**precision),
    )


def pass_reads(store: TieredStore, model: torch.nn.Module, optimizer, steps: int) -> list[int]:
    """Bytes each forward + backward read (the step's reads apart)."""
    data = synthetic_batches(MODEL, 4, seed=3)
    reads = []
    for _ in range(steps):
        tokens, targets = next(data)
        before = store.stats()["bytes_read"]
        model(tokens, targets).backward()
        reads.append(store.stats()["bytes_read"] - before)
        optimizer.step()
        optimizer.zero_grad()
    return reads


def test_bf16_compute_copies_train_as_bf16_mixed_precision_and_read_half_the_bytes(tmp_path):
    """The device copy is the master cast to bf16 either way: the same training, bit for bit.
    But gathers read the bf16 copy from NVMe instead of the fp32 master."""
    reference = make_model(MODEL)
    results = {}
    for name, precision in (
        ("masters", {"dtype": "bf16"}),
        ("copies", {"dtype": "bf16", "storage_dtype": "bf16"}),
    ):
        model = copy.deepcopy(reference)
        store = TieredStore(config(tmp_path, name, **precision))
        model, optimizer = store.attach(model, fused_adamw(model.parameters()))
        losses = train(model, optimizer, 3, config=MODEL)
        reads = pass_reads(store, model, optimizer, 3)
        stats = store.stats()
        assert store.placement.audit() == []
        params = {k: v.clone() for k, v in model.state_dict().items()}
        # The masters stay fp32; each param shard has its bf16 copy beside it, or none.
        copies = [s.companions.get(COMPUTE_KEY) for s in store.registry.entries[0].shards]
        store.close()
        results[name] = (losses, reads, params, stats, copies)
    losses, reads, params, stats, copies = results["copies"]
    assert losses == results["masters"][0]
    for key, value in params.items():
        assert value.dtype == torch.float32
        assert torch.equal(value, results["masters"][2][key]), key
    assert all(c is not None and c.dtype == torch.bfloat16 for c in copies)
    assert results["masters"][4] == [None] * len(copies)
    compression = stats["compression"]
    assert (
        compression["compute_copies"] and not results["masters"][3]["compression"]["compute_copies"]
    )
    assert compression["compute_read"] > 0
    assert 2 * compression["compute_read"] == compression["compute_read_as_masters"]
    assert compression["compute_written"] > 0
    # Forward and backward read about half: what the copies saved, less nothing else.
    assert sum(reads) < 0.75 * sum(results["masters"][1])


def test_compute_copies_follow_every_write_of_the_masters(tmp_path):
    """A load_state_dict, an in-place edit under store.gathered(modify=True) and a checkpoint
    load each give the compute copies the new values: a forward never sees old ones."""
    reference = make_model(MODEL)
    model = copy.deepcopy(reference)
    store = TieredStore(config(tmp_path, "store", dtype="bf16", storage_dtype="bf16"))
    model, optimizer = store.attach(model, fused_adamw(model.parameters()))
    train(model, optimizer, 2, config=MODEL)
    store.save_checkpoint(tmp_path / "checkpoint")
    tokens, targets = next(synthetic_batches(MODEL, 4, seed=7))

    def expected(values: dict[str, torch.Tensor]) -> torch.Tensor:
        """The loss of the plain model in bf16 with the weights ``values`` (rounded: the
        compute copies' values)."""
        plain = copy.deepcopy(reference).to(torch.bfloat16)
        plain.load_state_dict(values)
        with torch.no_grad():
            return plain(tokens, targets)

    def loss() -> torch.Tensor:
        with torch.no_grad():
            return model(tokens, targets)

    trained = {k: v.clone() for k, v in model.state_dict().items()}
    assert torch.equal(loss(), expected(trained))

    other = {k: v * 0.5 for k, v in reference.state_dict().items()}
    model.load_state_dict(other)
    assert torch.equal(loss(), expected(other))

    with store.gathered(modify=True), torch.no_grad():
        model.head.weight.mul_(-1.0)
    edited = {k: v.clone() for k, v in model.state_dict().items()}
    # (Edited in bf16 on the device: the changed elements' masters are the bf16 values.)
    assert torch.equal(edited["head.weight"], -other["head.weight"].to(torch.bfloat16).float())
    assert torch.equal(loss(), expected(edited))

    store.load_checkpoint(tmp_path / "checkpoint")
    assert torch.equal(loss(), expected(trained))
    assert store.placement.audit() == []
    store.close()
    # Compute copies are derived: the checkpoint holds masters and optimizer state only.
    saved = (tmp_path / "checkpoint").rglob("*")
    assert not any(COMPUTE_KEY in path.name for path in saved)


@pytest.mark.parametrize(
    ("offload", "dtype", "match"),
    [
        ("cpu", "bf16", "set offload_param='nvme'"),
        # The copies are what forward computes with: only in their own dtype.
        ("nvme", "fp32", "set precision.dtype='bf16' too"),
    ],
)
def test_compute_copies_need_masters_on_nvme_and_their_compute_dtype(offload, dtype, match):
    model = make_model(MODEL)
    store = TieredStore(
        OffloadConfig(
            device="cpu",
            offload_param=offload,
            precision=infinity.PrecisionConfig(dtype=dtype, storage_dtype="bf16"),
        )
    )
    with pytest.raises(AttachError, match=match):
        store.attach(model, fused_adamw(model.parameters()))
    store.close()
