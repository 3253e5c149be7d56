"""The demo (`make demo`, `infinity-train`): a tiny end-to-end run and its input errors."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from infinity.cli import demo

TINY = [
    "--layers",
    "2",
    "--width",
    "64",
    "--vocab",
    "128",
    "--context",
    "32",
    "--batch",
    "4",
    "--steps",
    "8",
    "--lr",
    "3e-3",
    "--seed",
    "1",
]
#: table rows that must be there, each with a number in it
ROWS = (
    "steps",
    "loss",
    "step time",
    "swap read",
    "swap written",
    "achieved",
    "overlap",
    "stalls",
    "peak device",
    "peak host",
    "peak nvme",
    "peak RSS",
    "wall time",
)


def test_tiny_run_trains_from_nvme_reports_and_cleans_up(tmp_path: Path, monkeypatch, capsys):
    nvme, out = tmp_path / "nvme", tmp_path / "out"
    nvme.mkdir()
    results: list[demo.DemoResult] = []
    real_run = demo.run
    monkeypatch.setattr(demo, "run", lambda args: results.append(real_run(args)) or results[-1])

    code = demo.main([*TINY, "--nvme-path", str(nvme), "--out", str(out)])

    assert code == 0
    stdout = capsys.readouterr().out
    table = {line.split("  ", 1)[0].strip(): line for line in stdout.splitlines()}
    for row in ROWS:
        assert row in table, f"no {row!r} row in:\n{stdout}"
        assert re.search(r"\d", table[row].split("  ", 1)[1]), table[row]

    result = results[0]
    assert len(result.losses) == 8
    assert result.losses[-1] < result.losses[0] - 0.3, result.losses
    stats = result.stats
    trained = stats["bytes_read"] - result.attached["bytes_read"]
    assert trained > 0 and stats["bytes_written"] > result.attached["bytes_written"]
    assert stats["peak_bytes"]["device"] <= stats["budgets"]["device"]
    assert stats["peak_bytes"]["host"] <= stats["budgets"]["host"]
    assert stats["peak_bytes"]["nvme"] > 0
    assert result.disk["read"] > 0 and result.disk["write"] > 0
    assert result.nvme_paths == [nvme]

    if result.timeline is not None:
        assert 0.0 <= result.timeline["overlap_efficiency"] <= 1.0
    for path in result.outputs.values():
        assert path.is_file() and path.stat().st_size > 0 and path.parent == out
        assert str(path) in stdout
    trace = [p for p in result.outputs.values() if p.suffix == ".json"]
    if trace:
        assert json.loads(trace[0].read_text())["traceEvents"]

    assert result.leftovers == []
    assert list(nvme.iterdir()) == [], "swap files left behind"
    assert "nothing left" in table["swap files"]


def test_missing_nvme_path_is_a_user_error(tmp_path: Path, capsys):
    missing = tmp_path / "no" / "such" / "drive"
    code = demo.main(
        [*TINY, "--steps", "1", "--nvme-path", str(missing), "--out", str(tmp_path / "out")]
    )
    assert code == 2
    err = capsys.readouterr().err
    assert str(missing) in err and "does not exist" in err
    assert "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_config_typo_reports_the_config_error(tmp_path: Path, capsys):
    config = tmp_path / "offload.json"
    config.write_text(json.dumps({"offload_parm": "nvme"}))
    code = demo.main([*TINY, "--steps", "1", "--config", str(config), "--nvme-path", str(tmp_path)])
    assert code == 2
    err = capsys.readouterr().err
    assert "offload_parm" in err and "did you mean 'offload_param'" in err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--host-budget", "12 parsecs"], "--host-budget"),
        (["--steps", "0"], "--steps"),
        (["--width", "66"], "multiple of 4"),
    ],
)
def test_bad_flags_exit_2_with_the_flag_named(tmp_path: Path, capsys, argv, message):
    assert demo.main([*TINY, "--nvme-path", str(tmp_path), *argv]) == 2
    assert message in capsys.readouterr().err


def test_paths_split_on_commas_and_repeat():
    assert demo.split_paths(["/a,/b", " /c "]) == [Path("/a"), Path("/b"), Path("/c")]
