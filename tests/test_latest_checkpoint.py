"""store.latest_checkpoint(dir): the newest complete checkpoint under a directory (the most steps
done, not the last name in order); saves that did not finish (a process killed during an
asynchronous save) and checkpoints missing a file are passed over and logged; a missing or
empty directory gives None, a wrong one a clear error; across ranks every rank gets rank 0's
answer (its errors too), a checkpoint saved by one process resumes on two, and a torchrun
launch whose restarts would rendezvous on its shared store is warned about."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import infinity
from tests.dist_helpers import run_ranks
from tests.store_helpers import fused_adamw, make_model, train

REPO = Path(__file__).resolve().parents[1]
CPU = {"offload_param": "cpu", "offload_optimizer": "cpu", "device": "cpu"}


def _save_at(directory: Path, saves: dict[str, int]) -> dict[str, dict[str, torch.Tensor]]:
    """Trains one model, saving ``directory/<name>`` after n steps for each name: n in
    ``saves`` (in order); the parameters at each save."""
    model = make_model()
    saved = {}
    with infinity.TieredStore(infinity.OffloadConfig(**CPU)) as store:
        model, optimizer = store.attach(model, fused_adamw(model.parameters()))
        done = 0
        for name, n in saves.items():
            train(model, optimizer, n - done)
            done = n
            store.save_checkpoint(directory / name, extra={"step": n})
            saved[name] = {k: v.clone() for k, v in model.state_dict().items()}
    return saved


def test_the_newest_is_the_most_steps_done_not_the_last_name(tmp_path):
    _save_at(tmp_path, {"z-first": 1, "m-second": 2, "a-third": 3})
    (tmp_path / "logs").mkdir()  # not a checkpoint: ignored
    # Written last is the first one now (a copy, say): the steps done decide.
    os.utime(tmp_path / "z-first" / "metadata.json")
    assert infinity.TieredStore.latest_checkpoint(tmp_path) == tmp_path / "a-third"
    assert infinity.TieredStore.latest_checkpoint(str(tmp_path)) == tmp_path / "a-third"


def test_a_checkpoint_missing_a_file_is_passed_over_and_logged(tmp_path, caplog):
    _save_at(tmp_path, {f"step-{n}": n for n in (1, 2, 3)})
    os.truncate(tmp_path / "step-3" / "data-0.bin", 100)
    (tmp_path / "step-2" / "infinity.json").unlink()
    with caplog.at_level(logging.WARNING, logger="infinity.checkpointing.latest"):
        assert infinity.TieredStore.latest_checkpoint(tmp_path) == tmp_path / "step-1"
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "step-3: it is incomplete: its data file data-0.bin has 100 bytes" in logged, logged
    assert "step-2: it is incomplete: its infinity.json is missing" in logged, logged


def test_missing_or_empty_gives_none_and_a_wrong_directory_a_clear_error(tmp_path):
    latest = infinity.TieredStore.latest_checkpoint
    assert latest(tmp_path / "not-yet") is None  # a job's first start
    assert latest(tmp_path) is None
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(infinity.CheckpointError, match="a-file is not a directory"):
        latest(tmp_path / "a-file")
    _save_at(tmp_path / "runs", {"step-1": 1})
    with pytest.raises(infinity.CheckpointError, match="step-1 is a checkpoint itself: pass"):
        latest(tmp_path / "runs" / "step-1")
    model = make_model()
    with infinity.TieredStore(infinity.OffloadConfig(**CPU)) as store:
        store.attach(model, fused_adamw(model.parameters()))
        with pytest.raises(infinity.CheckpointError, match="no checkpoint given"):
            store.load_checkpoint(latest(tmp_path / "not-yet"))


# Saves step-1, then starts an asynchronous save of step-2 and dies half-way through its
# writing (SIGKILL from the writer thread, as a rank killed mid-save).
_KILLED_ASYNC_SAVE = r"""
import os, signal, sys
import infinity
import infinity.checkpointing.storage as storage
from tests.store_helpers import fused_adamw, make_model, train
model = make_model()
store = infinity.TieredStore(infinity.OffloadConfig(
    offload_param="nvme", offload_optimizer="nvme", buffer_size=8192, buffer_count=8,
    device="cpu", nvme_path=sys.argv[2]))
model, optimizer = store.attach(model, fused_adamw(model.parameters()))
train(model, optimizer, 1)
store.save_checkpoint(os.path.join(sys.argv[1], "step-1"), extra={"step": 1}, async_save=True)
train(model, optimizer, 1)
real = storage.tensor_bytes
calls = [0]
def dying(tensor):
    calls[0] += 1
    if calls[0] == 5:
        os.kill(os.getpid(), signal.SIGKILL)
    return real(tensor)
storage.tensor_bytes = dying
store.save_checkpoint(os.path.join(sys.argv[1], "step-2"), extra={"step": 2}, async_save=True)
train(model, optimizer, 2)
store.wait_for_checkpoint()
"""


def test_an_async_save_killed_half_way_is_never_taken(tmp_path, caplog):
    checkpoints, swap = tmp_path / "ckpt", tmp_path / "swap"
    swap.mkdir()
    done = subprocess.run(
        [sys.executable, "-c", _KILLED_ASYNC_SAVE, str(checkpoints), str(swap)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-1", "step-2.partial"]
    with caplog.at_level(logging.WARNING, logger="infinity.checkpointing.latest"):
        latest = infinity.TieredStore.latest_checkpoint(checkpoints)
    assert latest == checkpoints / "step-1"
    assert "step-2.partial: a save that did not finish" in caplog.text
    model = make_model()
    with infinity.TieredStore(infinity.OffloadConfig(**CPU)) as store:
        store.attach(model, fused_adamw(model.parameters()))
        assert store.load_checkpoint(latest) == {"step": 1}
        assert store.steps == 1


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _resume_latest_on_ranks(rank: int, world: int, checkpoints: str, not_a_dir: str) -> dict:
    # As torchrun --max-restarts 2 launches its workers by default: on the store it shares.
    os.environ.update(TORCHELASTIC_MAX_RESTARTS="2", TORCHELASTIC_USE_AGENT_STORE="True")
    records = _Records()
    logging.getLogger("infinity.checkpointing.latest").addHandler(records)
    found = infinity.TieredStore.latest_checkpoint(checkpoints)
    try:
        infinity.TieredStore.latest_checkpoint(not_a_dir)
        error = ""
    except infinity.CheckpointError as exc:
        error = str(exc)
    model = make_model(seed=10 + rank)  # anything: the checkpoint overwrites it
    with infinity.TieredStore(infinity.OffloadConfig(**CPU)) as store:
        model, _ = store.attach(model, fused_adamw(model.parameters()))
        extra = store.load_checkpoint(found)
        state = {k: v.clone() for k, v in model.state_dict().items()}
    return {
        "found": str(found),
        "error": error,
        "extra": extra,
        "state": state,
        "warnings": records.messages,
    }


def test_across_ranks_all_take_rank_0s_answer_and_one_process_resumes_on_two(tmp_path):
    saved = _save_at(tmp_path / "ckpt", {"step-1": 1, "step-2": 2})  # by one process
    (tmp_path / "a-file").write_text("x")
    results = run_ranks(
        _resume_latest_on_ranks, 2, str(tmp_path / "ckpt"), str(tmp_path / "a-file"), timeout=180
    )
    for result in results.values():
        assert result["found"] == str(tmp_path / "ckpt" / "step-2")
        assert "a-file is not a directory" in result["error"]
        assert "(seen by rank 0)" in result["error"]
        assert result["extra"] == {"step": 2}
        for key, value in saved["step-2"].items():
            assert torch.equal(torch.as_tensor(result["state"][key]), value), key
    # Rank 0 warned, once, that restarts need a store of their own.
    (warning,) = results[0]["warnings"]
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in warning and "2 restart(s)" in warning
    assert results[1]["warnings"] == []
