"""The disk holds what the run stores: frozen parameters once in their storage dtype, with no
gradient, master or state; gradients only where updates run in ``optimizer.step()``; optimizer
state in its ``optimizer_state_dtype``. The bytes on NVMe by kind are checked against the
arithmetic over the parameters' sizes and dtypes, and the preflight's bytes against what the
swap files take on the disk (``st_blocks``, what ``du`` shows).

A small Llama (about 0.4 M parameters, its shards cut at 16 KiB so that parameters span several)
stands for the 0.1 B one the accounting was first measured on: the arithmetic is per shard, so
its size changes nothing checked here, and a 0.1 B model takes minutes a step on two cores."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch

from infinity import OffloadConfig, TieredStore
from swap import EngineSettings, SwapEngine, SwapSpaceError, align_up
from swap.buffers import BufferPool

transformers = pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate")

SLOT = 16 << 10
VOCAB = 512


def llama(hidden: int = 64, layers: int = 2, vocab: int = VOCAB) -> torch.nn.Module:
    config = transformers.LlamaConfig(
        hidden_size=hidden,
        intermediate_size=hidden * 43 // 16,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=vocab,
        max_position_embeddings=64,
    )
    with accelerate.init_empty_weights():  # parameters on meta, buffers real
        return transformers.LlamaForCausalLM(config)


def attach(
    tmp_path: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    precision: dict,
    step_in_backward: bool | str = "auto",
    buffer_count: int = 8,
    slot: int = SLOT,
    host_budget: int = 3 << 20,
) -> tuple[TieredStore, torch.nn.Module, torch.optim.Optimizer]:
    """Attached on empty weights, the values written by load_state_dict, as a pretrained
    checkpoint's would be (nothing initialised, nothing allocated before)."""
    store = TieredStore(
        OffloadConfig().replace(
            offload_param="nvme",
            offload_optimizer="nvme",
            nvme_path=(tmp_path,),
            buffer_size=slot,
            buffer_count=buffer_count,
            host_budget=host_budget,
            step_in_backward=step_in_backward,
            aio={"block_size": 4096},
            precision=precision,
        )
    )
    model, optimizer = store.attach(model, optimizer, initialise=False)
    generator = torch.Generator().manual_seed(0)
    model.load_state_dict(
        {
            name: torch.randn(p.shape, generator=generator) * 0.02
            for name, p in model.named_parameters()
        },
        strict=False,
    )
    return store, model, optimizer


def train(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int, vocab: int = VOCAB
) -> None:
    tokens = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(1))
    for _ in range(steps):
        loss = model(input_ids=tokens, labels=tokens).loss
        assert torch.isfinite(loss)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def shard_sizes(store: TieredStore, names: set[str]) -> list[int]:
    """Element counts of the shards of the parameters named ``names``."""
    return [s.numel for e in store.registry.entries if e.name in names for s in e.shards]


def int8_bytes(numel: int) -> int:
    return numel + 4 * -(-numel // 2048)  # a code per element, an fp32 scale per 2048


def check_stored(stats: dict, expected: dict[str, int]) -> None:
    """The preflight counted ``expected`` exactly; the extents hold the values written at
    attach exactly, and of the gradients and state what eviction wrote, never more (one the
    arena kept until the step consumed it never reached the disk)."""
    assert stats["disk"]["needs"] == expected
    stored = stats["disk"]["stored"]
    for kind in ("masters", "frozen", "compute"):
        assert stored[kind] == expected[kind], kind
    for kind in ("grads", "state"):
        assert stored[kind] <= expected[kind], kind
        assert (stored[kind] > 0) == (expected[kind] > 0), kind


def check_files(stats: dict, tmp_path: Path) -> None:
    """The preflight's bytes and the swap files' blocks agree within 5%, and the report's
    blocks are what the file system says."""
    disk = stats["disk"]
    blocks = sum(p.stat().st_blocks * 512 for p in tmp_path.rglob("swap-*.bin"))
    assert disk["allocated_bytes"] == blocks > 0
    assert disk["peak_allocated_bytes"] >= blocks
    assert abs(disk["preflight_bytes"] - disk["peak_allocated_bytes"]) <= 0.05 * blocks
    assert disk["preflight_bytes"] == disk["needs"]["total"]


def test_full_fine_tune_bf16_storage_int8_state(tmp_path: Path) -> None:
    model = llama()
    optimizer: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    names = {n for n, _ in model.named_parameters()}
    precision = {"dtype": "bf16", "storage_dtype": "bf16", "optimizer_state_dtype": "int8"}
    store, model, optimizer = attach(tmp_path, model, optimizer, precision)
    try:
        train(model, optimizer, 2)
        stats = store.stats()
        sizes = shard_sizes(store, names)
        # 'auto' ran its first step in optimizer.step(): every gradient was stored, in fp32
        expected = {
            "masters": sum(align_up(4 * n) for n in sizes),
            "frozen": 0,
            "compute": sum(align_up(2 * n) for n in sizes),
            "grads": sum(align_up(4 * n) for n in sizes),
            "state": sum(2 * align_up(int8_bytes(n)) for n in sizes),
        }
        expected["total"] = sum(expected.values())
        check_stored(stats, expected)
        check_files(stats, tmp_path)
    finally:
        store.close(restore_params=False)


def test_bf16_masters_store_no_compute_copy(tmp_path: Path) -> None:
    """precision.master_dtype='bf16': 2-byte masters that forward reads as they are (no compute
    copy), bf16 gradients, and the state fp32 to the update, stored in int8: 4 bytes per
    trained parameter besides the gradient, against 8 with fp32 masters."""
    model = llama()
    optimizer: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    names = {n for n, _ in model.named_parameters()}
    precision = {"dtype": "bf16", "master_dtype": "bf16", "optimizer_state_dtype": "int8"}
    # shards of half the bytes (cut so that fp32 state would fit a buffer): fewer buffers, so
    # that gradients and state are evicted as in the other runs
    store, model, optimizer = attach(tmp_path, model, optimizer, precision, buffer_count=4)
    try:
        train(model, optimizer, 2)
        stats = store.stats()
        sizes = shard_sizes(store, names)
        expected = {
            "masters": sum(align_up(2 * n) for n in sizes),
            "frozen": 0,
            "compute": 0,
            "grads": sum(align_up(2 * n) for n in sizes),
            "state": sum(2 * align_up(int8_bytes(n)) for n in sizes),
        }
        expected["total"] = sum(expected.values())
        check_stored(stats, expected)
        check_files(stats, tmp_path)
        assert all(e.dtype == torch.bfloat16 for e in store.registry.entries)
    finally:
        store.close(restore_params=False)


def test_lora_stores_the_frozen_base_once_in_bf16(tmp_path: Path) -> None:
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(llama(), peft.LoraConfig(r=8, target_modules=["q_proj", "v_proj"]))
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert trained and frozen
    optimizer: torch.optim.Optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=1e-3
    )
    store, model, optimizer = attach(
        tmp_path, model, optimizer, {"dtype": "bf16", "storage_dtype": "bf16"}
    )
    try:
        written = store.stats()["bytes_written"]
        train(model, optimizer, 2)
        stats = store.stats()
        lora, base = shard_sizes(store, trained), shard_sizes(store, frozen)
        expected = {
            "masters": sum(align_up(4 * n) for n in lora),  # fp32 masters of the adapters
            "frozen": sum(align_up(2 * n) for n in base),  # the base once, in bf16
            "compute": sum(align_up(2 * n) for n in lora),
            "grads": sum(align_up(4 * n) for n in lora),
            "state": sum(2 * align_up(4 * n) for n in lora),  # fp32 Adam moments
        }
        expected["total"] = sum(expected.values())
        check_stored(stats, expected)
        check_files(stats, tmp_path)
        for entry in store.registry.entries:
            if entry.name in frozen:
                assert entry.dtype == torch.bfloat16
                assert all(not s.companions for s in entry.shards)  # no grad, state, copy
        # The steps wrote the adapters' bytes (and what eviction wrote of the base: nothing,
        # it is never dirty).
        assert stats["bytes_written"] - written <= 2 * (
            expected["masters"] + expected["compute"] + expected["grads"] + expected["state"]
        )
    finally:
        store.close(restore_params=False)


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_a_0_1b_model_stores_exactly_what_it_keeps(tmp_path: Path, kind: str) -> None:
    """The accounting at the size it was measured on: a 0.1 B Llama (hidden 1024, 3 layers,
    vocab 32000: 103 M parameters, two thirds of them in the embedding and the head), one
    step, as a full fine-tune (bf16 masters; fp32 moments, as the int8 ones are checked above
    and cost the suite a minute here) and as a LoRA of its frozen base (fp32 masters of the
    adapters, fp32 moments, the base once in bf16)."""
    vocab = 32000
    model = llama(hidden=1024, layers=3, vocab=vocab)
    if kind == "lora":
        peft = pytest.importorskip("peft")
        model = peft.get_peft_model(model, peft.LoraConfig(r=8, target_modules=["q_proj"]))
        precision = {"dtype": "bf16", "storage_dtype": "bf16"}
    else:
        precision = {"dtype": "bf16", "master_dtype": "bf16"}
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert 100e6 < sum(p.numel() for p in model.parameters()) < 110e6
    optimizer: torch.optim.Optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=1e-3
    )
    store, model, optimizer = attach(
        tmp_path, model, optimizer, precision, slot=1 << 20, host_budget=96 << 20
    )
    try:
        train(model, optimizer, 1, vocab)
        stats = store.stats()
        sizes, base = shard_sizes(store, trained), shard_sizes(store, frozen)
        if kind == "lora":
            expected = {
                "masters": sum(align_up(4 * n) for n in sizes),
                "frozen": sum(align_up(2 * n) for n in base),
                "compute": sum(align_up(2 * n) for n in sizes),
                "grads": sum(align_up(4 * n) for n in sizes),
                "state": sum(2 * align_up(4 * n) for n in sizes),
            }
        else:
            assert not base
            expected = {
                "masters": sum(align_up(2 * n) for n in sizes),
                "frozen": 0,
                "compute": 0,
                "grads": sum(align_up(2 * n) for n in sizes),
                "state": sum(2 * align_up(4 * n) for n in sizes),  # fp32 to the update
            }
        expected["total"] = sum(expected.values())
        check_stored(stats, expected)
        check_files(stats, tmp_path)
    finally:
        store.close(restore_params=False)


def test_updates_in_backward_store_no_gradient(tmp_path: Path) -> None:
    model = llama()
    optimizer: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    names = {n for n, _ in model.named_parameters()}
    store, model, optimizer = attach(tmp_path, model, optimizer, {}, step_in_backward=True)
    try:
        train(model, optimizer, 2)
        stats = store.stats()
        assert stats["update_mode"] == "in backward"
        sizes = shard_sizes(store, names)
        expected = {
            "masters": sum(align_up(4 * n) for n in sizes),
            "frozen": 0,
            "compute": 0,  # fp32: the masters are what forward reads
            "grads": 0,
            "state": sum(2 * align_up(4 * n) for n in sizes),
        }
        expected["total"] = sum(expected.values())
        check_stored(stats, expected)
        check_files(stats, tmp_path)
    finally:
        store.close(restore_params=False)


def test_auto_frees_the_first_steps_gradients_once_updates_run_in_backward(
    tmp_path: Path,
) -> None:
    """'auto' runs its first step in optimizer.step(), which stores gradients (the preflight
    counts them); once updates run in backward none is stored, and their blocks go back."""
    model = llama()
    optimizer: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # an arena with room for updates in backward (24 slots), not for every offloaded byte
    store, model, optimizer = attach(tmp_path, model, optimizer, {}, buffer_count=24)
    try:
        train(model, optimizer, 1)
        stats = store.stats()
        assert stats["update_mode"] == "in backward"
        disk = stats["disk"]
        assert disk["needs"]["grads"] > 0 and disk["stored"]["grads"] == 0
        blocks = sum(p.stat().st_blocks * 512 for p in tmp_path.rglob("swap-*.bin"))
        assert disk["allocated_bytes"] == blocks < disk["peak_allocated_bytes"]
        train(model, optimizer, 2)
        stats = store.stats()
        assert stats["disk"]["stored"]["grads"] == 0
        # what the extents hold is what the preflight counted less the gradients, at most
        assert stats["disk"]["extent_bytes"] <= disk["preflight_bytes"] - disk["needs"]["grads"]
    finally:
        store.close(restore_params=False)


# -- swap files that grow as extents are taken ---------------------------------------------------
def test_growing_files_take_the_extents_bytes(tmp_path: Path) -> None:
    settings = EngineSettings(backend="threads", file_size=64 << 20, grow_files=True)
    engine = SwapEngine([tmp_path], settings)
    try:
        extents = [engine.allocate(n) for n in (10_000, 70_000, 4096)]
        space = engine.space
        assert space.disk_bytes == sum(align_up(e.nbytes) for e in extents) == 90_112
        assert space.file_bytes == 64 << 20  # its largest size, not what it takes
        engine.free(extents[1])  # its blocks go back to the file system (a hole)
        assert space.disk_bytes == 90_112 - 73_728
        assert engine.allocate(60_000).segments[0].offset == extents[1].segments[0].offset
        assert space.disk_bytes == 90_112 - 73_728 + 61_440
        assert space.peak_disk_bytes == 90_112
    finally:
        engine.close()


def test_growing_file_on_a_full_disk_names_the_cause_and_keeps_what_it_holds(
    mount_tmpfs,
) -> None:
    small = mount_tmpfs("1m")
    settings = EngineSettings(backend="threads", file_size=64 << 20, grow_files=True)
    engine = SwapEngine([small], settings)
    try:
        with BufferPool(1, 200_704) as pool:
            buffer = pool.acquire()
            written = []
            with pytest.raises(SwapSpaceError) as info:
                for _ in range(8):  # 1 MiB holds five extents of 49 pages
                    extent = engine.allocate(200_000)
                    data = torch.randint(0, 255, (200_000,), dtype=torch.uint8).numpy()
                    buffer.array[:200_000] = data
                    engine.write_sync(extent, buffer)
                    written.append((extent, data))
            error = info.value
            message = str(error)
            assert "full" in message and "Free space" in message and "nvme_path" in message
            assert error.needed == 200_704 and error.available < 200_704
            assert 1 <= len(written) <= 5
            for extent, data in written:
                buffer.array[:] = 0
                engine.read_sync(extent, buffer)
                assert (buffer.array[:200_000] == data).all()
            # the range the failed extent took went back: once there is room, it is used
            assert engine.space.allocated_bytes == sum(align_up(e.nbytes) for e, _ in written)
    finally:
        engine.close()


def test_growing_file_without_fallocate_is_sized_whole(tmp_path, monkeypatch) -> None:
    def no_fallocate(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.EOPNOTSUPP, "Operation not supported")

    monkeypatch.setattr(os, "posix_fallocate", no_fallocate)
    settings = EngineSettings(backend="threads", file_size=1 << 20, grow_files=True)
    engine = SwapEngine([tmp_path], settings)
    try:
        extent = engine.allocate(10_000)
        assert extent.segments[0].file.path.stat().st_size == 1 << 20  # sparse, sized whole
    finally:
        engine.close()


def test_store_on_a_disk_that_fills_mid_run_names_the_cause_and_loses_nothing(
    tmp_path: Path, mount_tmpfs
) -> None:
    """The preflight passed, then something else filled the disk: the run's next extent fails
    with the cause and the ways out, every value is still there, and once space is freed the
    run goes on."""
    small = mount_tmpfs("8m")
    model = llama()
    optimizer: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    store, model, optimizer = attach(small, model, optimizer, {})
    try:
        before = {k: v.clone() for k, v in model.state_dict().items()}
        filler = small / "filler"
        fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
        try:
            with pytest.raises(OSError):
                while True:
                    os.write(fd, b"x" * 65536)
        finally:
            os.close(fd)
        with pytest.raises(SwapSpaceError) as info:
            train(model, optimizer, 1)  # the first extent it takes (a gradient's) fails
        message = str(info.value)
        assert "the file system is full" in message and str(small) in message
        assert "Free space there, add another directory to nvme_path" in message
        optimizer.zero_grad()
        after = model.state_dict()  # read back through the tiers: nothing was lost
        assert before.keys() == after.keys()
        assert all(torch.equal(before[k], after[k]) for k in before)
        filler.unlink()
        train(model, optimizer, 1)
        assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())
    finally:
        store.close(restore_params=False)
