"""What ``make gpu-check`` and the GPU machine's environment need that can be checked here:
without a GPU the check says so and exits non-zero without a traceback, and the store works
where the ``liburing`` package cannot be imported (the thread backend, said once)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the check runs for real")
def test_gpu_check_without_a_gpu_says_so_and_fails(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "tools.benchmarks.gpu_check", "--out", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 2
    assert "no CUDA device here" in done.stdout
    assert "Traceback" not in done.stderr


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
