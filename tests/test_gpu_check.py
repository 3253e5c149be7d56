"""What ``make gpu-check`` and the GPU machine's environment need that can be checked here:
without a GPU the check says so and exits non-zero without a traceback, and the store works
where the ``liburing`` package cannot be imported (the thread backend, said once)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tools.benchmarks import gpu_check

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the check runs for real")
def test_gpu_check_without_a_gpu_says_so_fails_and_still_writes_its_json(tmp_path):
    out = tmp_path / "figures" / "check.json"
    env_out = tmp_path / "env-out"
    done = subprocess.run(
        [sys.executable, "-m", "tools.benchmarks.gpu_check", "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "OUT": str(env_out)},
    )
    assert done.returncode == 2
    assert "no CUDA device here" in done.stdout
    assert "Traceback" not in done.stderr
    for path in (out, env_out / "gpu_check.json"):
        figures = json.loads(path.read_text())
        assert figures["gpu"] is False and "no CUDA device here" in figures["reason"]


def test_a_stage_that_runs_past_its_timeout_is_recorded_not_lost(tmp_path):
    """Each stage runs in a process of its own: one killed at its limit (here 1 s, less than
    importing torch takes) leaves a result that says so, and the stages after it still run."""
    args = argparse.Namespace(nvme_path=None)
    result = gpu_check._run_child("race", 1, args, tmp_path)
    assert not result["ok"]
    assert result.get("timed_out") or result.get("returncode") != 0
    assert (tmp_path / "gpu_check_race.log").exists()


def test_overlap_is_measured_on_the_devices_timeline():
    """Copy time under kernels, from the profiler's device events (microseconds)."""
    events = [
        {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 0, "dur": 100},
        {"ph": "X", "cat": "kernel", "name": "gelu", "ts": 150, "dur": 50},
        # 40 of its 80 us under the first kernel, 20 in the gap, 20 under the second
        {
            "ph": "X",
            "cat": "gpu_memcpy",
            "name": "Memcpy HtoD (Pinned -> Device)",
            "ts": 60,
            "dur": 110,
        },
        {
            "ph": "X",
            "cat": "gpu_memcpy",
            "name": "Memcpy DtoH (Device -> Pinned)",
            "ts": 300,
            "dur": 10,
        },
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 5, "dur": 1},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaEventSynchronize", "ts": 7, "dur": 1},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 9, "dur": 1},
        {"ph": "i", "cat": "kernel", "name": "marker", "ts": 0},
    ]
    figures = gpu_check.timeline_figures(events, steps=2)
    assert figures["kernel_s"] == pytest.approx(150e-6)
    assert figures["h2d_s"] == pytest.approx(110e-6)
    assert figures["h2d_overlapped_s"] == pytest.approx(60e-6)
    assert figures["d2h_overlap_fraction"] == 0
    assert figures["synchronizations_per_step"] == 1


_WITHOUT_LIBURING = r"""
import logging, sys
sys.modules["liburing"] = None  # as on a machine without the package: importing it fails
logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
import torch, infinity
from tests.store_helpers import make_model, SMALL
from infinity.cli.common.tiny_gpt import synthetic_batches
model = make_model()
store = infinity.TieredStore(infinity.OffloadConfig(
    offload_param="nvme", offload_optimizer="nvme", buffer_size=8192, buffer_count=8,
    nvme_path=sys.argv[1]))
model, optimizer = store.attach(model, torch.optim.AdamW(model.parameters()))
tokens, targets = next(synthetic_batches(SMALL, 4))
for _ in range(2):
    loss = model(tokens, targets)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
print("backend", store.stats()["backend"], "loss", loss.item())
store.close()
"""


def test_the_store_works_without_the_liburing_package(tmp_path):
    done = subprocess.run(
        [sys.executable, "-c", _WITHOUT_LIBURING, str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "backend threads" in done.stdout
    said = [line for line in done.stderr.splitlines() if "liburing" in line]
    assert len(said) == 1 and "thread" in said[0], said
