"""Timeline recording and its views: Chrome trace, PNG plot, summary, torch.profiler ranges."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import infinity
import infinity.core.timeline as timeline_module
import infinity.observability.trace_export as trace_export
from infinity.cli.common.tiny_gpt import GPTConfig
from infinity.core.timeline import PROFILER_RANGES, Span, Transfer, subtract, union
from infinity.observability.timeline import Timeline
from tests.store_helpers import fused_adamw, make_model, train

TINY = GPTConfig(vocab_size=64, context=16, layers=2, width=32, heads=4)
STEPS = 2


def _wait_for_completions(timeline: Timeline, timeout: float = 5.0) -> None:
    """Transfer ends are set by future callbacks on the engine's dispatcher thread, which may
    run just after the training thread's wait returned."""
    deadline = time.monotonic() + timeout
    while any(t.end is None for t in timeline.transfers) and time.monotonic() < deadline:
        time.sleep(0.01)


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """STEPS recorded training steps under torch.profiler (the first records the module
    trace, the later ones prefetch along it)."""
    tmp_path = tmp_path_factory.mktemp("timeline")
    store = infinity.TieredStore(
        infinity.OffloadConfig(
            offload_param="nvme",
            offload_optimizer="nvme",
            nvme_path=str(tmp_path / "swap"),
            buffer_size=1 << 14,
            buffer_count=8,
        )
    )
    (tmp_path / "swap").mkdir()
    model = make_model(TINY)
    model, optimizer = store.attach(model, fused_adamw(model.parameters()))
    try:
        store.placement.drain()  # the initial write-out, made while not recording
        untouched = (
            list(store.timeline.transfers),
            list(store.timeline.spans),
            list(store.timeline.events),
        )
        before = store.stats()
        store.timeline.enabled = True
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            train(model, optimizer, STEPS, config=TINY)
            store.placement.drain()
        store.timeline.enabled = False
        after = store.stats()
        _wait_for_completions(store.timeline)
        chrome = store.timeline.export_chrome(tmp_path / "out" / "trace.json")
        png = store.timeline.plot(tmp_path / "out" / "timeline.png", title="tiny GPT")
        return {
            "store": store,
            "before": before,
            "after": after,
            "untouched": untouched,
            "chrome": chrome,
            "png": png,
            "summary": store.timeline.summary(),
            "profiled": [e.name for e in prof.events()],
            "modules": set(store.placement.settings.module_names),
            "params": {e.name for e in store.registry.entries},
        }
    finally:
        store.close()


def _lanes(trace: dict) -> dict[int, str]:
    return {
        e["tid"]: e["args"]["name"]
        for e in trace["traceEvents"]
        if e["ph"] == "M" and e["name"] == "thread_name"
    }


def test_disabled_timeline_records_nothing(recorded):
    assert recorded["untouched"] == ([], [], [])
    timeline = Timeline()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        record = timeline.io_started("s", "read", 10)
        Timeline.io_finished(record)
        timeline.stall(record, "s", 0.0, 1.0)
        timeline.span("m", "step", 0.0, 1.0)
        timeline.event("fwd", "m")
        with timeline.profile_range(PROFILER_RANGES["stall"]):
            pass
        with timeline.timed("optimizer.step", "step"):
            pass
    assert record is None
    assert not timeline.transfers and not timeline.spans and not timeline.events
    assert not [e.name for e in prof.events() if e.name.startswith("infinity::")]


def test_chrome_trace_is_valid_and_uses_the_documented_names(recorded):
    trace = json.loads(recorded["chrome"].read_text())
    events = trace["traceEvents"]
    doc = trace_export.__doc__
    for name in trace_export.EVENT_NAMES + trace_export.CATEGORIES:
        assert name in doc
    stamps = [e["ts"] for e in events]
    assert all(ts >= 0 for ts in stamps)
    assert stamps == sorted(stamps)
    lanes = _lanes(trace)
    for lane in lanes.values():
        assert re.sub(r" \d+$", "", lane) in doc
    assert {"compute", "stall", "d2h", "nvme read", "nvme write"} <= set(lanes.values())
    complete = [e for e in events if e["ph"] == "X"]
    assert all(e["dur"] >= 0 for e in complete)
    for e in complete:
        assert e["cat"] in trace_export.CATEGORIES
        # an update in backward (step_in_backward) is a step span named by its parameter
        assert (
            e["name"] in trace_export.EVENT_NAMES
            or e["name"] in recorded["modules"]
            or (e["cat"] == "step" and e["name"] in recorded["params"])
        )
    assert {e["ph"] for e in events} <= {"M", "X", "C"}
    # Slices on one lane never overlap (Perfetto would nest or hide them).
    for tid in lanes:
        slices = sorted(
            (e["ts"], e["ts"] + e["dur"])
            for e in complete
            if e["tid"] == tid and lanes[tid] != "compute"
        )
        assert all(a[1] <= b[0] + 1e-3 for a, b in zip(slices, slices[1:])), lanes[tid]


def test_chrome_lanes_hold_the_transfers_and_compute(recorded):
    trace = json.loads(recorded["chrome"].read_text())
    lanes = _lanes(trace)
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    moved = {"nvme.read": 0, "nvme.write": 0}
    for e in complete:
        if e["name"] in moved:
            lane = lanes[e["tid"]]
            assert lane.startswith("nvme " + e["name"].split(".")[1])
            assert set(e["args"]) >= {"shard", "bytes", "prefetch", "stalled", "error"}
            assert not e["args"]["unfinished"]
            if e["args"]["error"] is None:
                moved[e["name"]] += e["args"]["bytes"]
    before, after = recorded["before"], recorded["after"]
    assert moved["nvme.read"] > 0 and moved["nvme.write"] > 0
    assert moved["nvme.read"] == after["bytes_read"] - before["bytes_read"]
    assert moved["nvme.write"] == after["bytes_written"] - before["bytes_written"]
    compute = [e for e in complete if lanes[e["tid"]] == "compute"]
    forward = {e["name"] for e in compute if e["cat"] == "forward"}
    backward = {e["name"] for e in compute if e["cat"] == "backward"}
    assert {"blocks.0.qkv", "blocks.1.fc", "head"} <= forward
    assert {"blocks.0.qkv", "blocks.1.fc"} <= backward
    assert sum(e["name"] == "optimizer.step" and e["cat"] == "step" for e in compute) >= STEPS
    stalls = [e for e in complete if lanes[e["tid"]] == "stall"]
    assert all(e["name"] == "stall" and "shard" in e["args"] for e in stalls)
    counters = [e for e in trace["traceEvents"] if e["ph"] == "C"]
    assert counters and all(v >= 0 for e in counters for v in e["args"].values())
    assert counters[-1]["args"] == {"read": 0, "write": 0}
    assert trace["otherData"]["summary"]["bytes_read"] == moved["nvme.read"]


def test_png_is_written_and_loads(recorded):
    png: Path = recorded["png"]
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000
    import matplotlib.image

    image = matplotlib.image.imread(png)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100


def test_summary_is_consistent(recorded):
    s = recorded["summary"]
    before, after = recorded["before"], recorded["after"]
    assert 0.0 <= s["hidden_fraction"] <= 1.0
    assert 0.0 <= s["overlap_efficiency"] <= 1.0
    assert s["bytes_read"] == after["bytes_read"] - before["bytes_read"]
    assert s["bytes_written"] == after["bytes_written"] - before["bytes_written"]
    assert s["stall_seconds"] == pytest.approx(after["stall_seconds"] - before["stall_seconds"])
    eps = 1e-9
    assert 0 < s["compute_seconds"] <= s["total_seconds"] + eps
    assert 0 < s["io_busy_seconds"] <= s["total_seconds"] + eps
    assert s["overlap_seconds"] <= min(s["compute_seconds"], s["io_busy_seconds"]) + eps
    assert s["compute_seconds"] + s["stall_seconds"] <= s["total_seconds"] + eps
    assert s["forward_seconds"] + s["backward_seconds"] + s["step_seconds"] == pytest.approx(
        s["compute_seconds"]
    )
    counts = s["counts"]
    assert counts["steps"] == STEPS and counts["unfinished"] == 0 and counts["errors"] == 0
    assert counts["forward"] > 0 and counts["backward"] > 0 and counts["reads"] > 0
    assert counts["prefetch_reads"] + counts["demand_reads"] == counts["reads"]
    assert counts["stalled_transfers"] <= counts["stalls"]


def test_torch_profiler_sees_the_documented_ranges(recorded):
    names = set(recorded["profiled"])
    for key in ("read", "write", "step"):
        assert PROFILER_RANGES[key] in names
    if recorded["summary"]["counts"]["stalls"]:
        assert PROFILER_RANGES["stall"] in names
    for name in PROFILER_RANGES.values():
        assert name in timeline_module.__doc__


def test_wrapped_ranges_are_not_duplicated_by_markers():
    timeline = Timeline(enabled=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with timeline.profile_range(PROFILER_RANGES["stall"], "s0"):
            timeline.stall(None, "s0", 1.0, 2.0)  # inside its range: no extra marker
        timeline.stall(None, "s1", 3.0, 4.0)  # unwrapped: a marker
        with timeline.timed("optimizer.step", "step"):
            pass
    names = [e.name for e in prof.events()]
    assert names.count(PROFILER_RANGES["stall"]) == 2
    assert names.count(PROFILER_RANGES["step"]) == 1
    assert [s.phase for s in timeline.spans] == ["stall", "stall", "step"]


def _synthetic() -> Timeline:
    timeline = Timeline()
    timeline.events = [(0.0, "fwd", "a"), (1.0, "fwd", "b"), (2.0, "bwd", "b"), (3.0, "bwd", "a")]
    timeline.spans = [
        Span("s1", "stall", 1.5, 1.7),
        Span("optimizer.step", "step", 4.0, 5.0),
        Span("b", "d2h", 2.5, 2.6),
    ]
    timeline.transfers = [
        Transfer("s1", "read", 100, 0.5, 1.7, prefetch=True, stalled=True),
        Transfer("s2", "read", 50, 0.6, 0.8),
        Transfer("s1", "write", 30, 4.5, 6.0),
        Transfer("s3", "write", 7, 5.5, None),
    ]
    return timeline


def test_compute_spans_cut_out_stalls_and_end_at_the_step():
    spans = [(s.name, s.phase, s.start, s.end) for s in _synthetic().compute_spans()]
    assert spans == [
        ("a", "fwd", 0.0, 1.0),
        ("b", "fwd", 1.0, 1.5),
        ("b", "fwd", 1.7, 2.0),
        ("b", "bwd", 2.0, 3.0),
        ("a", "bwd", 3.0, 4.0),
        ("optimizer.step", "step", 4.0, 5.0),
    ]


def test_summary_and_export_of_a_synthetic_timeline(tmp_path):
    timeline = _synthetic()
    s = timeline.summary()
    # I/O busy: [0.5, 1.7] and [4.5, 6.0]; compute covers [0.5, 1.5] and [4.5, 5.0].
    assert s["io_busy_seconds"] == pytest.approx(2.7)
    assert s["overlap_seconds"] == pytest.approx(1.5)
    assert s["hidden_fraction"] == pytest.approx(1.5 / 2.7)
    assert s["overlap_efficiency"] == pytest.approx(1.5 / 2.7)  # I/O is the shorter
    assert s["compute_seconds"] == pytest.approx(4.8)
    assert s["total_seconds"] == pytest.approx(6.0)
    assert (s["bytes_read"], s["bytes_written"]) == (150, 30)  # the unfinished write is not
    assert s["counts"]["unfinished"] == 1 and s["counts"]["stalled_transfers"] == 1
    trace = json.loads(timeline.export_chrome(tmp_path / "t.json").read_text())
    lanes = _lanes(trace)
    assert sorted(lanes.values()) == [
        "compute",
        "d2h",
        "nvme read",
        "nvme read 2",
        "nvme write",
        "nvme write 2",
        "stall",
    ]
    unfinished = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["args"].get("unfinished")]
    assert len(unfinished) == 1 and unfinished[0]["dur"] == pytest.approx(0.5e6)
    peak = max(e["args"]["read"] for e in trace["traceEvents"] if e["ph"] == "C")
    assert peak == 150
    timeline.plot(tmp_path / "t.png")
    assert (tmp_path / "t.png").read_bytes()[:4] == b"\x89PNG"


def test_empty_timeline_exports_and_summarises(tmp_path):
    timeline = Timeline()
    assert timeline.summary()["total_seconds"] == 0.0
    trace = json.loads(timeline.export_chrome(tmp_path / "empty.json").read_text())
    assert [e["ph"] for e in trace["traceEvents"]] == ["M", "M", "M"]
    timeline.plot(tmp_path / "empty.png")
    assert (tmp_path / "empty.png").stat().st_size > 0


def test_interval_helpers():
    assert union([(3, 4), (0, 1), (0.5, 2), (2, 2.5)]) == [(0, 2.5), (3, 4)]
    assert subtract((0, 10), [(-1, 1), (2, 3), (9, 12)]) == [(1, 2), (3, 9)]
    assert subtract((5, 6), [(0, 1), (7, 8)]) == [(5, 6)]
    assert subtract((5, 6), [(4, 7)]) == []


def test_a_pass_inside_the_step_stays_nested_in_it():
    timeline = Timeline()
    timeline.events = [(0.0, "fwd", "a"), (4.2, "fwd", "a")]  # the second: an LBFGS closure
    timeline.spans = [Span("optimizer.step", "step", 4.0, 5.0), Span("x", "d2h", 5.0, 6.0)]
    spans = [(s.name, s.start, s.end) for s in timeline.compute_spans()]
    assert spans == [("a", 0.0, 4.0), ("optimizer.step", 4.0, 5.0), ("a", 4.2, 5.0)]
