"""make bench-finetune's tool: a tiny copy of both shapes end to end through InfinityTrainer,
its JSON, and the refusals it reports instead of a traceback."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("peft")

import infinity
from swap import SwapSpaceError
from tools.benchmarks import bench_finetune

PROJECT = Path(__file__).resolve().parents[1]
# 5.5 M trained params (the 8b shape), 7.6 M frozen (13b-lora): more than a 24 MiB budget holds
TINY = ["--layers", "1", "--vocab", "1024", "--narrow", "8", "--host-budget", "24MiB"]


@pytest.mark.slow
def test_both_shapes_train_three_steps_and_report_against_their_floors(tmp_path):
    out = tmp_path / "out.json"
    done = subprocess.run(
        [sys.executable, "-m", "tools.benchmarks.bench_finetune", *TINY]
        + ["--nvme-path", str(tmp_path / "nvme"), "--json", str(out)],
        cwd=PROJECT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    shapes = {r["shape"]: r for r in json.loads(out.read_text())["shapes"]}
    assert set(shapes) == {"8b", "13b-lora"}
    full, lora = shapes["8b"], shapes["13b-lora"]
    assert full["frozen_params"] == 0 and lora["frozen_params"] > 10 * lora["trained_params"]
    for result in shapes.values():
        assert "refused" not in result
        assert len(result["steps"]) == 3 and len(result["losses"]) == 3
        assert all(math.isfinite(loss) for loss in result["losses"])
        assert result["compute_floor"]["floor_s"] > 0
        for step in result["steps"]:
            assert step["peak_rss"] > 0 and step["peak_disk"] > 0
            floor = max(step["io_floor_s"], step["compute_floor_s"])
            assert step["vs_max_floor"] == pytest.approx(step["step_s"] / floor)
        # the swap files never took more than the store's preflight counted, nor much less
        # (test_disk_accounting.py checks them exactly; here the files' rounding counts more)
        accounting = result["disk_accounting"]
        assert (
            0.9 * accounting["preflight_bytes"]
            <= accounting["peak_allocated_bytes"]
            <= accounting["preflight_bytes"]
        )
        # the trained state does not fit the budget's arena: every step reads from the disk
        assert all(step["bytes_read"] > 0 for step in result["steps"][1:])
    # the full fine-tune writes its updated state back each step; the frozen base is only read
    assert all(step["bytes_written"] > 0 for step in full["steps"])
    assert sum(s["bytes_written"] for s in lora["steps"]) < sum(
        s["bytes_written"] for s in full["steps"]
    )
    assert not any((tmp_path / "nvme").iterdir())  # the run's files are gone


def test_too_little_free_disk_is_refused_saying_what_it_needs(tmp_path, monkeypatch):
    free = shutil.disk_usage(tmp_path)._replace(free=10 << 20)
    monkeypatch.setattr(bench_finetune.shutil, "disk_usage", lambda _: free)
    out = tmp_path / "out.json"
    code = bench_finetune.main(
        [*TINY, "--shape", "8b", "--nvme-path", str(tmp_path), "--json", str(out)]
    )
    assert code == 2
    (result,) = json.loads(out.read_text())["shapes"]
    assert result["disk_needed"] > result["disk_free"] == 10 << 20
    assert "GB free" in result["refused"] and "steps" not in result


def test_a_store_refusing_the_attach_is_reported_not_raised(tmp_path, monkeypatch, capsys):
    def refuse(*_, **__):
        raise SwapSpaceError("needs 96.4 GB on the swap directory")

    monkeypatch.setattr(bench_finetune.infinity.TieredStore, "attach", refuse)
    out = tmp_path / "out.json"
    code = bench_finetune.main(
        [*TINY, "--shape", "13b-lora", "--nvme-path", str(tmp_path), "--json", str(out)]
    )
    assert code == 2
    (result,) = json.loads(out.read_text())["shapes"]
    assert "the store refused the attach: SwapSpaceError: needs 96.4 GB" in result["refused"]
    assert "refused: the store refused" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == [out]  # its swap directory removed


def test_lora_adapters_on_empty_weights_start_as_peft_makes_them(tmp_path):
    """The shape's model on empty weights, adapters included; attach gives them peft's values."""
    args = bench_finetune.parse_args(TINY)
    shape = bench_finetune.SHAPES["13b-lora"].narrowed(8)
    model = bench_finetune.build(shape, args, 1, empty=True)
    assert all(p.is_meta for p in model.parameters())
    store = infinity.TieredStore(
        infinity.OffloadConfig(offload_param="nvme", nvme_path=str(tmp_path), host_budget="64MiB")
    )
    model, _ = store.attach(model)
    store.close()
    adapters = {n: p for n, p in model.named_parameters() if "lora_" in n}
    assert len(adapters) == 2 * len(bench_finetune.LORA_TARGETS)
    assert all(p.requires_grad and not p.is_meta for p in adapters.values())
    assert all(p.abs().sum() > 0 for n, p in adapters.items() if "lora_A" in n)
    assert all(not p.any() for n, p in adapters.items() if "lora_B" in n)  # starts as its base
