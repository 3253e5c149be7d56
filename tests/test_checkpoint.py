"""Checkpoints: a run resumed in a fresh process continues bit for bit (params and optimizer on
NVMe and on the host, an LR scheduler and gradient accumulation, fp16 with its loss scaler);
across ranks, and to another number of ranks; a save killed half-way leaves the previous
checkpoint loadable; a flipped byte is detected; nothing in a checkpoint is unpickled."""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import infinity
from infinity.cli.common.tiny_gpt import synthetic_batches
from tests.dist_helpers import run_ranks
from tests.store_helpers import SMALL, make_model

REPO = Path(__file__).resolve().parents[1]
STEPS = 6  # the uninterrupted run
SAVED_AT = 3  # steps done when the checkpoint is taken
MICRO = 2  # micro-batches per step


def _config(kind: str, swap: str) -> infinity.OffloadConfig:
    common = {"buffer_size": 8192, "buffer_count": 8, "device": "cpu"}
    if kind == "nvme":
        return infinity.OffloadConfig(
            offload_param="nvme", offload_optimizer="nvme", nvme_path=swap, **common
        )
    if kind == "cpu":
        return infinity.OffloadConfig(offload_param="cpu", offload_optimizer="cpu", **common)
    if kind == "fp16":
        return infinity.OffloadConfig(
            offload_param="nvme",
            offload_optimizer="nvme",
            nvme_path=swap,
            precision=infinity.PrecisionConfig(dtype="fp16", initial_scale_power=8),
            **common,
        )
    raise ValueError(kind)


def _train(
    kind: str, swap: str, checkpoint: str, mode: str, rank: int = 0, world: int = 1, seed: int = 0
) -> list[float]:
    """``mode``: "whole" trains STEPS steps and saves after SAVED_AT; "resume" loads and trains
    the rest. Each rank takes its share of every micro-batch."""
    model = make_model(seed=seed)
    store = infinity.TieredStore(_config(kind, swap))
    model, optimizer = store.attach(
        model, torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
    data = synthetic_batches(SMALL, 4, seed=1)
    batches = [[next(data) for _ in range(MICRO)] for _ in range(STEPS)]
    first = 0
    if mode == "resume":
        extra = store.load_checkpoint(checkpoint)
        scheduler.load_state_dict(extra["scheduler"])
        first = extra["step"]
    losses = []
    share = 4 // world
    for step in range(first, STEPS):
        if mode.startswith("whole") and step == SAVED_AT:
            store.save_checkpoint(
                checkpoint,
                extra={"scheduler": scheduler.state_dict(), "step": step},
                async_save=mode == "whole-async",
            )
        total = torch.zeros(())
        for tokens, targets in batches[step]:
            tokens = tokens[rank * share : (rank + 1) * share]
            targets = targets[rank * share : (rank + 1) * share]
            loss = model(tokens, targets) / MICRO
            loss.backward()
            total += loss.detach()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        if world > 1:
            torch.distributed.all_reduce(total)
            total /= world
        losses.append(total.item())
    store.close()
    return losses


def _in_fresh_process(*args: str) -> list[float]:
    code = (
        "import json, sys; from tests.test_checkpoint import _train; "
        "print(json.dumps(_train(*sys.argv[1:])))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, *args], cwd=REPO, capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("kind", ["nvme", "cpu", "fp16"])
def test_resume_in_a_fresh_process_is_bit_exact(kind, tmp_path):
    checkpoint = str(tmp_path / "ckpt")
    whole = _train(kind, str(tmp_path), checkpoint, "whole")
    resumed = _in_fresh_process(kind, str(tmp_path), checkpoint, "resume")
    assert resumed == whole[SAVED_AT:]
    files = sorted(p.name for p in Path(checkpoint).iterdir())
    assert files == ["data-0.bin", "infinity.json", "metadata.json"]
    if kind == "fp16":
        state = json.loads((Path(checkpoint) / "infinity.json").read_text())
        assert state["scaler"] is not None


def _ranks_train(rank: int, world: int, swap: str, checkpoint: str, mode: str) -> list[float]:
    return _train("nvme", os.path.join(swap, f"r{rank}"), checkpoint, mode, rank, world, seed=rank)


@pytest.mark.parametrize(
    "saved_by, resumed_by, mode",
    # one save, resumed by as many ranks and by one; an async save; one rank's save on two
    [(2, (2, 1), "whole"), (2, (2,), "whole-async"), (1, (2,), "whole")],
    ids=["2-to-2-and-1", "2-to-2-async", "1-to-2"],
)
def test_resume_across_ranks_and_to_another_number_of_ranks(saved_by, resumed_by, mode, tmp_path):
    checkpoint = str(tmp_path / "ckpt")
    for rank in range(2):
        (tmp_path / f"r{rank}").mkdir()
    if saved_by == 1:
        whole = _train("nvme", str(tmp_path / "r0"), checkpoint, mode)
    else:
        whole = run_ranks(_ranks_train, saved_by, str(tmp_path), checkpoint, mode, timeout=240)[0]
    assert len(list(Path(checkpoint).glob("data-*.bin"))) == saved_by
    for ranks in resumed_by:
        if ranks == 1:
            resumed = _in_fresh_process("nvme", str(tmp_path / "r0"), checkpoint, "resume")
        else:
            results = run_ranks(
                _ranks_train, ranks, str(tmp_path), checkpoint, "resume", timeout=240
            )
            assert results[0] == results[1]
            resumed = results[0]
        tolerance = 0.0 if saved_by == ranks else 1e-5
        for a, b in zip(whole[SAVED_AT:], resumed):
            assert abs(a - b) <= tolerance * abs(a), (ranks, whole[SAVED_AT:], resumed)


_KILLED_SAVE = r"""
import os, signal, sys
import torch
import infinity
import infinity.checkpointing.storage as storage
from tests.store_helpers import make_model
model = make_model()
store = infinity.TieredStore(infinity.OffloadConfig(offload_param="cpu", device="cpu"))
model, optimizer = store.attach(model, torch.optim.AdamW(model.parameters()))
store.save_checkpoint(sys.argv[1], extra={"which": "first"})
real = storage.tensor_bytes
calls = [0]
def dying(tensor):
    calls[0] += 1
    if calls[0] == 5:
        os.kill(os.getpid(), signal.SIGKILL)  # half-way through the second save
    return real(tensor)
storage.tensor_bytes = dying
with store.gathered(modify=True):
    for p in model.parameters():
        p.data.add_(1.0)
store.save_checkpoint(sys.argv[1], extra={"which": "second"})
"""


def test_a_save_killed_half_way_leaves_the_previous_checkpoint_loadable(tmp_path):
    checkpoint = tmp_path / "ckpt"
    done = subprocess.run(
        [sys.executable, "-c", _KILLED_SAVE, str(checkpoint)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]
    assert (tmp_path / "ckpt.partial").exists()  # what the killed save had written
    reference = make_model()
    model = make_model(seed=3)
    with infinity.TieredStore(infinity.OffloadConfig(offload_param="cpu", device="cpu")) as store:
        model, _ = store.attach(model, torch.optim.AdamW(model.parameters()))
        assert store.load_checkpoint(checkpoint) == {"which": "first"}
        state = {k: v.clone() for k, v in model.state_dict().items()}
    for key, value in reference.state_dict().items():
        assert torch.equal(state[key], value), key
    # The next save replaces the leftover of the killed one.
    model = make_model()
    with infinity.TieredStore(infinity.OffloadConfig(offload_param="cpu", device="cpu")) as store:
        store.attach(model, torch.optim.AdamW(model.parameters()))
        store.save_checkpoint(checkpoint)
    assert not (tmp_path / "ckpt.partial").exists()


def _saved(tmp_path: Path) -> Path:
    model = make_model()
    with infinity.TieredStore(infinity.OffloadConfig(offload_param="cpu", device="cpu")) as store:
        store.attach(model, torch.optim.AdamW(model.parameters()))
        store.save_checkpoint(tmp_path / "ckpt")
    return tmp_path / "ckpt"


def _load(checkpoint: Path) -> None:
    model = make_model()
    with infinity.TieredStore(infinity.OffloadConfig(offload_param="cpu", device="cpu")) as store:
        store.attach(model, torch.optim.AdamW(model.parameters()))
        store.load_checkpoint(checkpoint)


def test_a_flipped_byte_or_a_truncated_file_is_detected(tmp_path):
    checkpoint = _saved(tmp_path)
    data = checkpoint / "data-0.bin"
    original = data.read_bytes()
    # A byte inside a chunk (pieces start at multiples of 4096, with padding between).
    location = max(
        json.loads((checkpoint / "metadata.json").read_text())["storage"].values(),
        key=lambda loc: loc["offset"],
    )
    flipped = bytearray(original)
    flipped[location["offset"] + location["length"] // 2] ^= 0x10
    data.write_bytes(bytes(flipped))
    with pytest.raises(infinity.CheckpointError, match="data-0.bin is corrupt"):
        _load(checkpoint)
    data.write_bytes(original[: location["offset"] + location["length"] // 2])
    with pytest.raises(infinity.CheckpointError, match="data-0.bin is truncated"):
        _load(checkpoint)
    data.write_bytes(original)
    _load(checkpoint)
    with pytest.raises(infinity.CheckpointError, match="not a checkpoint"):
        _load(tmp_path / "nothing")


class _Payload:
    def __reduce__(self):
        return (os.system, (f"touch {_Payload.marker}",))


def test_a_planted_pickle_is_never_executed(tmp_path):
    checkpoint = _saved(tmp_path)
    marker = tmp_path / "pwned"
    _Payload.marker = marker
    # DCP's own reader would unpickle .metadata; ours reads JSON only.
    (checkpoint / ".metadata").write_bytes(pickle.dumps(_Payload()))
    _load(checkpoint)
    assert not marker.exists()


def test_a_checkpoint_of_another_model_is_refused_by_name(tmp_path):
    checkpoint = _saved(tmp_path)
    other = torch.nn.Linear(3, 3)
    with infinity.TieredStore(infinity.OffloadConfig(offload_param="cpu", device="cpu")) as store:
        store.attach(other, torch.optim.AdamW(other.parameters()))
        with pytest.raises(infinity.CheckpointError, match="another model: missing"):
            store.load_checkpoint(checkpoint)


def test_extra_takes_json_and_tensors_but_nothing_pickled(tmp_path):
    model = make_model()
    with infinity.TieredStore(infinity.OffloadConfig(offload_param="cpu", device="cpu")) as store:
        store.attach(model, torch.optim.AdamW(model.parameters()))
        extra = {
            "step": 7,
            "lrs": (0.1, 0.2),
            3: "int key",
            "t": torch.arange(4.0),
            "nan": float("nan"),
        }
        store.save_checkpoint(tmp_path / "ckpt", extra=extra)
        back = store.load_checkpoint(tmp_path / "ckpt")
        assert back["step"] == 7 and back["lrs"] == (0.1, 0.2) and back[3] == "int key"
        assert torch.equal(back["t"], extra["t"]) and back["nan"] != back["nan"]
        with pytest.raises(infinity.CheckpointError, match="cannot go into a checkpoint"):
            store.save_checkpoint(tmp_path / "ckpt2", extra={"f": lambda: 1})


def test_export_loads_with_from_pretrained_and_gives_the_trained_logits(tmp_path):
    transformers = pytest.importorskip("transformers")
    from infinity.cli.export import main as export_main

    config = transformers.LlamaConfig(
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
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    store = infinity.TieredStore(
        infinity.OffloadConfig(
            offload_param="nvme",
            offload_optimizer="nvme",
            buffer_size=8192,
            buffer_count=8,
            nvme_path=str(tmp_path),
        )
    )
    with store:
        model, optimizer = store.attach(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        for _ in range(2):
            model(input_ids=tokens, labels=tokens).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        with torch.no_grad():
            trained = model(input_ids=tokens).logits
        store.save_checkpoint(tmp_path / "ckpt")
    # Small output files, so the export is sharded with an index.
    assert (
        export_main([str(tmp_path / "ckpt"), str(tmp_path / "out"), "--max-shard-size", "20KB"])
        == 0
    )
    assert (tmp_path / "out" / "model.safetensors.index.json").exists()
    assert (tmp_path / "out" / "config.json").exists()
    exported = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "out")
    with torch.no_grad():
        torch.testing.assert_close(exported(input_ids=tokens).logits, trained)
    assert export_main([str(tmp_path / "ckpt"), str(tmp_path / "half"), "--dtype", "bf16"]) == 0
    half = transformers.LlamaForCausalLM.from_pretrained(
        tmp_path / "half", torch_dtype=torch.bfloat16
    )
    assert next(half.parameters()).dtype == torch.bfloat16


@pytest.mark.parametrize("kind", ["nvme", "cpu"])
def test_an_async_save_is_the_state_at_the_call_while_training_goes_on(kind, tmp_path):
    """Saved asynchronously, then three more steps before it finishes: the checkpoint still
    resumes into exactly the losses of the uninterrupted run."""
    data = synthetic_batches(SMALL, 4, seed=1)
    batches = [next(data) for _ in range(6)]

    def run(store, model, optimizer, steps):
        losses = []
        for tokens, targets in steps:
            loss = model(tokens, targets)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        return losses

    model = make_model()
    # A staging cap of a few chunks: most are copied out during the next forward, the rest by
    # the step, just before it changes them.
    # Updates in optimizer.step(): the save is taken between backward and the step's updates.
    config = _config(kind, str(tmp_path)).replace(
        checkpoint_staging=16 << 10, step_in_backward=False
    )
    with infinity.TieredStore(config) as store:
        model, optimizer = store.attach(model, torch.optim.AdamW(model.parameters(), lr=3e-3))
        run(store, model, optimizer, batches[:3])
        # Saved between backward and step: the step changes every shard right away, so what
        # the save has not copied out yet is copied just before each tile's update.
        loss = model(*batches[3])
        loss.backward()
        store.save_checkpoint(tmp_path / "ckpt", extra={"at": 3}, async_save=True)
        optimizer.step()
        optimizer.zero_grad()
        whole = [loss.item()] + run(store, model, optimizer, batches[4:])
        store.wait_for_checkpoint()
        figures = store._checkpoints.last
    assert figures["bytes_written"] > 0 and figures["copied_before_change"] > 0
    model = make_model(seed=4)
    with infinity.TieredStore(
        _config(kind, str(tmp_path)).replace(step_in_backward=False)
    ) as store:
        model, optimizer = store.attach(model, torch.optim.AdamW(model.parameters(), lr=3e-3))
        assert store.load_checkpoint(tmp_path / "ckpt") == {"at": 3}
        assert run(store, model, optimizer, batches[3:]) == whole
