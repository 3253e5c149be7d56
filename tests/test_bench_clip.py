"""A tiny end-to-end run of the clipping benchmark (`make bench` runs a full-size one)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


def test_clip_benchmark_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Every config runs in its own process and is reported; the plain run really clips (its
    norm is positive and above a max_norm chosen under it); the attached runs count their I/O."""
    from tools.benchmarks import bench_clip

    out = tmp_path / "clip.json"
    assert (
        bench_clip.main(
            [
                "--layers",
                "2",
                "--width",
                "64",
                "--batch",
                "4",
                "--steps",
                "1",
                "--warmup",
                "1",
                "--repeats",
                "1",
                "--host-budget",
                "0.05",
                "--arena",
                "0.003",
                "--device-budget",
                "0.001",
                "--buffer-size",
                str(256 << 10),
                "--max-norm",
                "0.01",
                "--nvme-path",
                str(tmp_path),
                "--json",
                str(out),
            ]
        )
        == 0
    )
    report = json.loads(out.read_text())
    assert set(report["runs"]) == {"plain", "plain+clip", "nvme", "nvme+clip"}
    for name, results in report["runs"].items():
        assert len(results) == 1 and results[0]["step_s"] > 0, name
        assert len(results[0]["norms"]) == (1 if name.endswith("+clip") else 0), name
        if name.startswith("nvme"):
            assert results[0]["read_bytes"] >= 0 and results[0]["write_bytes"] >= 0, name
    configs = report["summary"]["configs"]
    assert configs["plain+clip"]["mean_norm"] > 0.01
    assert configs["plain+clip"]["clipped_steps"] == 1
    assert configs["nvme+clip"]["mean_norm"] >= 0  # 0 while attached params expose no grads
    nvme = report["summary"]["pairs"]["nvme+clip"]
    assert nvme["ratio"] > 0 and "extra_read_bytes" in nvme and "goal_met" in nvme
    printed = capsys.readouterr().out
    for name in ("plain", "plain+clip", "nvme", "nvme+clip"):
        assert f"\n{name} " in printed, name
    assert "nvme+clip / nvme: step time" in printed and "goal: at most 1.02x" in printed
    assert list(tmp_path.iterdir()) == [out]  # the runs' swap files are gone
