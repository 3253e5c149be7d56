"""store.predict(): the recorded trace replayed through the store's own placement over tensors
that hold no bytes.

Bytes and peak bytes per tier are decided by the same code as in the real store, so for the same
configuration they must be equal, provided the two see transfers complete at the same moments:
the real store's engine here completes every transfer before returning it (a test-only wrapper),
and the simulated disk is fast enough that every transfer is done at once. Predictions for other
budgets are checked against real runs with those budgets the same way.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

import pytest
import torch

import infinity
from infinity.cli.common.tiny_gpt import synthetic_batches
from infinity.core.memory import peak_resident_bytes
from infinity.core.trace import Trace
from infinity.planning import planner
from infinity.planning.planner import DiskProfile, PlanError, device_profile
from infinity.planning.simulated_time import Contention
from tests.store_helpers import SMALL, make_model

SHARD = 1 << 14
INSTANT = DiskProfile(read_gbps=math.inf, write_gbps=math.inf)  # done when issued


def _synchronous(store: infinity.TieredStore) -> None:
    """Makes every swap transfer complete before it is handed back, as the instant simulated
    disk does, so that no decision depends on when a transfer finishes."""
    engine = store.engine
    read, write = engine.read, engine.write

    def read_done(*args: Any, **kwargs: Any) -> Any:
        future = read(*args, **kwargs)
        future.result()
        return future

    def write_done(*args: Any, **kwargs: Any) -> Any:
        future = write(*args, **kwargs)
        future.result()
        return future

    engine.read, engine.write = read_done, write_done


def _config(**changes: Any) -> infinity.OffloadConfig:
    base = dict(
        device="cpu",
        offload_param="nvme",
        offload_optimizer="nvme",
        buffer_size=SHARD,
        buffer_count=16,
        host_budget=16 * SHARD,
        verify_checksums=False,
        fused_optimizer=False,
    )
    return infinity.OffloadConfig(**{**base, **changes})


def _run(
    config: infinity.OffloadConfig, steps: int = planner.ITERATIONS
) -> tuple[infinity.TieredStore, dict[str, Any], torch.nn.Module]:
    """Trains the small GPT ``steps`` steps with a synchronous engine; returns the open store
    and the bytes each step after the first ``planner.WARMUP`` moved (what a prediction
    averages), as lists, and as their means rounded to whole bytes."""
    model = make_model()
    store = infinity.TieredStore(config)
    model, optimizer = store.attach(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    _synchronous(store)
    data = synthetic_batches(SMALL, 4, seed=1)
    per_step: dict[str, list[int]] = {"bytes_read": [], "bytes_written": []}
    for step in range(steps):
        before = store.stats()
        tokens, targets = next(data)
        model(tokens, targets).backward()
        optimizer.step()
        optimizer.zero_grad()
        after = store.stats()
        if step >= planner.WARMUP:
            for key in per_step:
                per_step[key].append(after[key] - before[key])
    moved: dict[str, Any] = {key: round(sum(v) / len(v)) for key, v in per_step.items() if v}
    moved["per_step"] = per_step
    return store, moved, model


@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"offload_optimizer": "cpu", "host_budget": 64 * SHARD},
        {"buffer_count": 24, "host_budget": 24 * SHARD, "prefetch_depth": 4},
    ],
    ids=["nvme-tight", "optimizer-on-cpu", "wider-arena"],
)
def test_prediction_equals_the_store_for_the_same_config(changes: dict) -> None:
    store, moved, _ = _run(_config(**changes))
    try:
        prediction = store.predict(disk=INSTANT)
        stats = store.stats()
    finally:
        store.close()
    assert prediction["fits"]
    # each replayed iteration moves what the same step of the run moved
    assert prediction["iterations"]["bytes_read"] == moved["per_step"]["bytes_read"]
    assert prediction["iterations"]["bytes_written"] == moved["per_step"]["bytes_written"]
    assert prediction["bytes_read"] == moved["bytes_read"] > 0
    assert prediction["bytes_written"] == moved["bytes_written"]
    assert prediction["peak_bytes"]["host"] == stats["peak_bytes"]["host"]
    assert prediction["peak_bytes"]["device"] == stats["peak_bytes"]["device"]
    assert prediction["budgets"] == stats["budgets"]


def test_prediction_for_other_budgets_equals_runs_with_them() -> None:
    """Recorded at one arena, predicted at two others: each equals a real run there."""
    store, _, _ = _run(_config())
    try:
        predictions = {
            count: store.predict(disk=INSTANT, buffer_count=count, host_budget=count * SHARD)
            for count in (12, 28)
        }
    finally:
        store.close()
    for count, prediction in predictions.items():
        other, moved, _ = _run(_config(buffer_count=count, host_budget=count * SHARD))
        stats = other.stats()
        other.close()
        assert (prediction["bytes_read"], prediction["bytes_written"]) == (
            moved["bytes_read"],
            moved["bytes_written"],
        ), count
        assert prediction["iterations"]["bytes_written"] == moved["per_step"]["bytes_written"], (
            count
        )
        assert prediction["peak_bytes"]["host"] == stats["peak_bytes"]["host"], count
    assert predictions[12]["bytes_read"] > predictions[28]["bytes_read"]


def test_time_follows_the_disk_and_the_device() -> None:
    store, _, _ = _run(_config(), steps=2)
    try:
        slow = store.predict(disk=DiskProfile(1e-4, 1e-4))
        fast = store.predict(disk=DiskProfile(100.0, 100.0))
        quicker = store.predict(
            disk=DiskProfile(100.0, 100.0), device=device_profile("H100", here_tflops=0.1)
        )
    finally:
        store.close()
    # At 100 kB/s the step's megabytes take half a minute, most of it waiting for the disk.
    moved = slow["bytes_read"] + slow["bytes_written"]
    assert slow["step_seconds"] >= moved / 1e5 * 0.99
    assert slow["stall_seconds"] > 0.5 * slow["step_seconds"]
    assert fast["step_seconds"] < slow["step_seconds"]
    # A faster device shortens forward and backward; the step's CPU update is the same.
    assert quicker["phase_seconds"]["forward"] < fast["phase_seconds"]["forward"]
    assert set(fast["phase_seconds"]) == {"forward", "backward", "step"}
    assert math.isclose(sum(fast["phase_seconds"].values()), fast["step_seconds"], rel_tol=1e-9)
    # the slow disk bounds the step; each replayed iteration's time lies in the spread
    assert slow["bound"] == "disk" and fast["bound"] != "disk"
    low, high = slow["step_seconds_spread"]
    assert low <= slow["step_seconds"] <= high
    assert (low, high) == (
        min(slow["iterations"]["step_seconds"]),
        max(slow["iterations"]["step_seconds"]),
    )


def test_contention_slows_compute_beside_the_disk_and_the_recorded_share_comes_out() -> None:
    store, _, _ = _run(_config(), steps=3)
    measured = Contention(compute_slowdown=2.0, io_retained=0.5, source="measured in a test")
    slow_disk = DiskProfile(0.05, 0.05)
    optimizer = store.optimizer
    assert optimizer is not None
    try:
        read, written, working, waited = planner.recording_of(store).iteration_io or (0, 0, 0, 0)
        stats = store.stats()
        assert 0 < read <= stats["bytes_read"] and 0 < written <= stats["bytes_written"]
        assert working > 0 and waited >= 0
        # A recording that moved nothing: its compute ran alone.
        optimizer.last_iteration_io = (0, 0, 1.0, 0.0)
        plain = store.predict(disk=slow_disk)
        contended = store.predict(disk=slow_disk, contention=measured)
        on_gpu = store.predict(
            disk=slow_disk, device=device_profile("H100", here_tflops=0.1), contention=measured
        )
        # 25 MB at 0.05 GB/s kept the disk busy for 0.5 of the recorded 2 s: a quarter of the
        # compute ran beside it, slowed 2x, so 1/1.25 of the recorded compute is its own.
        optimizer.last_iteration_io = (25 * 10**6, 0, 2.0, 0.0)
        beside = store.predict(disk=slow_disk, contention=Contention(2.0, 1.0, "quarter"))
        alone = store.predict(disk=slow_disk)
    finally:
        store.close()
    assert "not measured" in plain["contention"]["source"]
    assert contended["contention"]["source"] == "measured in a test"
    assert contended["contention"]["recorded_disk_share"] == 0.0
    assert contended["step_seconds"] > plain["step_seconds"]
    assert on_gpu["contention"]["source"].startswith("not applied: H100")
    assert on_gpu["contention"]["compute_slowdown"] == 1.0
    assert math.isclose(beside["contention"]["recorded_disk_share"], 0.25)
    for resource in ("compute", "CPU optimizer"):
        assert math.isclose(
            1.25 * beside["resource_seconds"][resource], alone["resource_seconds"][resource]
        ), resource


def test_a_disk_slower_with_reads_and_writes_mixed_slows_the_prediction() -> None:
    store, _, _ = _run(_config(), steps=2)
    try:
        plain = store.predict(disk=DiskProfile(0.05, 0.05))
        implied = store.predict(disk=DiskProfile(0.05, 0.05, combined_gbps=0.05))
        mixed = store.predict(disk=DiskProfile(0.05, 0.05, combined_gbps=0.025))
    finally:
        store.close()
    # a combined rate equal to what the two directions imply changes nothing
    assert implied["step_seconds"] == plain["step_seconds"]
    assert mixed["disk"]["combined_gbps"] == 0.025
    # the step reads and writes at once for part of it, not all: slower, at most twice
    assert plain["step_seconds"] < mixed["step_seconds"] < 2 * plain["step_seconds"]
    assert (mixed["bytes_read"], mixed["bytes_written"]) == (
        plain["bytes_read"],
        plain["bytes_written"],
    )


def test_recorded_disk_share_is_the_bytes_at_the_disk_s_speed_over_the_working_time() -> None:
    recording = planner.Recording(trace=Trace(), training=True)
    disk = DiskProfile(1.0, 2.0, shared=True)
    none = Contention()
    assert planner.recorded_disk_share(recording, disk, none) == 0.0  # not recorded
    recording.iteration_io = (10**9 // 2, 10**9, 4.0, 0.0)  # 0.5 s + 0.5 s of the disk in 4 s
    assert math.isclose(planner.recorded_disk_share(recording, disk, none), 0.25)
    side_by_side = DiskProfile(1.0, 2.0, shared=False)  # the longer direction
    assert math.isclose(planner.recorded_disk_share(recording, side_by_side, none), 0.125)
    # beside compute the disk keeps half its speed: busy twice as long
    assert math.isclose(planner.recorded_disk_share(recording, disk, Contention(1.5, 0.5)), 0.5)
    # the disk's 0.25 s while the training thread waited ran alone, not beside compute
    recording.iteration_io = (10**9 // 2, 10**9, 4.0, 0.25)
    assert math.isclose(planner.recorded_disk_share(recording, disk, none), 0.1875)
    recording.iteration_io = (10**9, 0, 4.0, 2.0)  # it waited longer than the disk worked
    assert planner.recorded_disk_share(recording, disk, none) == 0.0
    recording.iteration_io = (10**10, 0, 1.0, 0.0)
    assert planner.recorded_disk_share(recording, disk, none) == 1.0  # at most all of it


def test_predicted_rss_is_at_least_attach_s_own_peak() -> None:
    """A model built whole in memory is whole while attach writes it out: a budget whose tiers
    stay below that peak is predicted at it (it did not depend on the budget when measured)."""
    store, _, _ = _run(_config(), steps=2)
    try:
        attach_peak = store.stats()["rss_bound"]["attach_peak"]
        recording = planner.recording_of(store)
        prediction = store.predict(disk=INSTANT)
    finally:
        store.close()
    # VmHWM can read a little lower later than it did at attach: the kernel counts RSS in
    # per-CPU batches and sums them approximately (a read 68 KiB below an earlier one was seen)
    assert 0 < attach_peak <= peak_resident_bytes() + (1 << 20)
    assert recording.attach_peak_rss == attach_peak
    peaks = prediction["peak_bytes"]
    # the heap kept nothing for reuse, so training's peak is the recorded base plus the tiers
    assert not recording.heap_reuse and recording.bounded_base_rss > 0
    training = recording.base_rss + peaks["host"] + peaks["device"]
    assert prediction["rss_peak_bytes"] == max(training, attach_peak)


class _Line:
    """A memory plan's heap line and what reuse wants, as numbers."""

    def __init__(self, line: int, wanted: int) -> None:
        self.line, self.wanted = line, wanted

    def heap_line(self, process: int) -> int:
        assert process == 300
        return self.line

    def heap_reuse_wanted(self, largest: int, host_device: bool) -> int:
        return self.wanted


def test_training_rss_keeps_reused_heap_only_where_the_line_leaves_room() -> None:
    trace = Trace()
    # the recording's heap kept 360 bytes for reuse: 700 besides the tiers, 340 bounded
    reused = planner.Recording(
        trace, True, base_rss=700, bounded_base_rss=340, process_rss=300, heap_reuse=True
    )
    rss = planner.training_rss
    assert rss(reused, None, 1000, 10, True) == 1340  # no host budget: no reuse
    assert rss(reused, _Line(1400, 100), 1000, 10, True) == 1340  # 60 under the line < 100
    assert rss(reused, _Line(2000, 100), 1000, 10, True) == 1700  # room: it keeps them
    assert rss(reused, _Line(1500, 100), 1000, 10, True) == 1500  # ends where RSS passes it
    # a recording with a bounded heap: its peak as measured, whatever the first step saw
    bounded = dataclasses.replace(reused, base_rss=400, heap_reuse=False)
    assert rss(bounded, _Line(2000, 100), 1000, 10, True) == 1400
    assert rss(bounded, _Line(1400, 100), 1000, 10, True) == 1400
    # no bounded base known (an older or extrapolated recording): as measured
    unknown = dataclasses.replace(reused, bounded_base_rss=0)
    assert rss(unknown, _Line(1400, 100), 1000, 10, True) == 1700


def test_a_budget_without_room_for_heap_reuse_pays_its_temporaries_faults() -> None:
    """A recording whose heap reused freed blocks faulted fewer pages after its first step than
    in it; a candidate whose budget leaves no room for reuse faults them all every step, at the
    recorded seconds per fault, and one with room is predicted as recorded."""
    store, _, _ = _run(_config(), steps=3)
    try:
        recorded = planner.recording_of(store)
        events = len(recorded.trace.events)
        trace = dataclasses.replace(
            recorded.trace, recorded_faults=[1000] * events, faults=[200.0] * events
        )
        counted = dataclasses.replace(
            recorded, trace=trace, heap_reuse=True, fault_seconds=1e-4, bounded_base_rss=1
        )
        # the line is drawn above the recorded process: a huge one leaves room, a huge first-
        # step base none
        room = dataclasses.replace(counted, process_rss=1 << 40)
        no_room = dataclasses.replace(counted, process_rss=1, bounded_base_rss=1 << 40)
        uncounted = dataclasses.replace(no_room, trace=recorded.trace, fault_seconds=0.0)

        def predicted(recording: planner.Recording) -> dict[str, Any]:
            model = planner._clone(store.model, store.registry.entries)
            return planner.simulate(model, recording, store.config, INSTANT)

        kept, faulted, unknown = predicted(room), predicted(no_room), predicted(uncounted)
    finally:
        store.close()
    extra = events * 800 * 1e-4
    assert kept["heap"]["reuse"] is True and kept["heap"]["extra_seconds"] == 0.0
    assert faulted["heap"]["reuse"] is False
    assert math.isclose(faulted["heap"]["extra_seconds"], extra)
    assert math.isclose(faulted["step_seconds"] - kept["step_seconds"], extra, rel_tol=1e-6)
    assert math.isclose(
        faulted["resource_seconds"]["compute"] - kept["resource_seconds"]["compute"], extra
    )
    assert (faulted["bytes_read"], faulted["bytes_written"]) == (
        kept["bytes_read"],
        kept["bytes_written"],
    )
    # without fault counts the prediction says what it left out
    assert unknown["heap"]["extra_seconds"] == 0.0
    assert unknown["heap"]["note"].startswith("not modelled")
    assert math.isclose(unknown["step_seconds"], kept["step_seconds"], rel_tol=1e-6)
    assert planner.fault_compute(counted) == [800 * 1e-4] * events
    assert planner.fault_compute(uncounted) is None


def test_a_budget_that_cannot_hold_one_module_does_not_fit() -> None:
    store, _, _ = _run(_config(), steps=2)
    try:
        prediction = store.predict(disk=INSTANT, device_budget=1024)
    finally:
        store.close()
    assert not prediction["fits"]
    assert "device_budget of 1024 bytes cannot hold module 'blocks.0.fc'" in prediction["error"]
    assert "set device_budget to at least" in prediction["error"]


def test_predict_needs_a_followed_iteration() -> None:
    model = make_model()
    with infinity.TieredStore(_config()) as store:
        model, optimizer = store.attach(model, torch.optim.AdamW(model.parameters()))
        with pytest.raises(PlanError, match="two training steps"):
            store.predict(disk=INSTANT)


def test_disk_profile_from_bench_json(tmp_path) -> None:
    path = tmp_path / "bench.json"
    path.write_text(
        '{"best": {"uring": {"read": {"gbps": 2.5}, "write": {"gbps": 3.5}}, '
        '"threads": {"read": {"gbps": 2.0}}}}'
    )
    disk = DiskProfile.from_bench_json(path)
    assert (disk.read_gbps, disk.write_gbps, disk.shared) == (2.5, 3.5, True)
    assert disk.scaled(4).read_gbps == 10.0
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(PlanError, match="infinity-bench --json"):
        DiskProfile.from_bench_json(tmp_path / "bad.json")


class _Clock:
    """A perf_counter that moves only when told: each update the optimizer makes takes one
    second, one module's forward a quarter, and nothing else any time."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("in_backward", [True, False], ids=["updates-in-backward", "in-step"])
def test_update_seconds_count_once_as_updates_in_either_mode(monkeypatch, in_backward) -> None:
    """Updates that run in backward take the training thread's time between two module
    events; they belong to the optimizer's per-element rate, not to the backward's compute, or
    the replay counts them twice (once in the trace, once as updates) and a recorded rate from
    the first step alone stands for every later one."""
    clock = _Clock()
    monkeypatch.setattr(time, "perf_counter", clock)
    model = make_model()
    config = _config(
        offload_param="cpu",
        offload_optimizer="cpu",
        host_budget=None,
        step_in_backward=in_backward,
        fused_optimizer=True,
    )
    store = infinity.TieredStore(config)
    try:
        model, optimizer = store.attach(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
        calls = [0]
        inner_step = optimizer.inner.step

        def one_second(*args: Any, **kwargs: Any) -> Any:
            calls[0] += 1
            clock.now += 1.0
            return inner_step(*args, **kwargs)

        optimizer.inner.step = one_second
        # and the forward of one module a quarter of a second: the model's compute
        computing = next(m for m in model.modules() if list(m.parameters(recurse=False)))

        def quarter_second(*args: Any) -> None:
            clock.now += 0.25

        computing.register_forward_hook(quarter_second)
        data = synthetic_batches(SMALL, 4, seed=1)
        per_step = []
        for _ in range(4):
            before = calls[0]
            tokens, targets = next(data)
            model(tokens, targets).backward()
            optimizer.step()
            optimizer.zero_grad()
            per_step.append(calls[0] - before)
        assert store.update_timing.in_backward is in_backward
        trace = store.follower.traces[(True, True)]
        assert sum(trace.compute) == 0.25  # the model's compute, without any update
        elements = sum(p.numel() for p in model.parameters())
        # the rate times the elements of a step is the step's updates' seconds
        assert optimizer.step_seconds_per_element * elements == pytest.approx(per_step[-1])
        prediction = store.predict(disk=INSTANT)
    finally:
        store.close()
    assert prediction["step_seconds"] == pytest.approx(0.25 + per_step[-1], rel=0.02)


def test_frozen_parameters_leave_the_device_after_their_modules_backward() -> None:
    """A LoRA-style model (most parameters frozen): in backward the hooks drop a frozen
    parameter's hold once its module's backward is done, as no gradient hook would. The replay
    does the same, so a device budget that holds a few modules at a time fits in the
    prediction as it does in the run, with the same peak."""
    model = make_model()
    for name, param in model.named_parameters():
        param.requires_grad_("norm" in name)  # in every block, as LoRA's adapters are
    # every parameter's bytes are 4 x the embeddings and 8 blocks; a third of them at a time
    device_budget = sum(p.numel() for p in model.parameters()) * 4 // 3
    store = infinity.TieredStore(_config(device_budget=device_budget))
    try:
        model, optimizer = store.attach(
            model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
        )
        _synchronous(store)
        data = synthetic_batches(SMALL, 4, seed=1)
        for _ in range(planner.ITERATIONS):
            tokens, targets = next(data)
            model(tokens, targets).backward()
            optimizer.step()
            optimizer.zero_grad()
        prediction = store.predict(disk=INSTANT)
        stats = store.stats()
    finally:
        store.close()
    assert prediction["fits"], prediction.get("error")
    assert prediction["peak_bytes"]["device"] == stats["peak_bytes"]["device"]


def _train_with(
    config: infinity.OffloadConfig, clip: bool, steps: int
) -> tuple[infinity.TieredStore, dict]:
    """Trains the small GPT ``steps`` steps with the plain loop, or one that clips the
    gradients' global norm between backward and ``optimizer.step()``; returns the open store
    and its stats()."""
    model = make_model()
    store = infinity.TieredStore(config)
    model, optimizer = store.attach(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    data = synthetic_batches(SMALL, 4, seed=1)
    for _ in range(steps):
        tokens, targets = next(data)
        model(tokens, targets).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        optimizer.step()
        optimizer.zero_grad()
    return store, store.stats()


#: an arena with the room to update in backward (_config's has not)
ROOMY = {"buffer_count": 32, "host_budget": 32 * SHARD}


@pytest.mark.parametrize(
    ("loop", "recorded", "predicted", "expected"),
    [
        ("plain", {}, {}, "in backward"),
        ("clip_grad_norm_", {}, {}, "in optimizer.step()"),
        ("plain", {"gradient_clipping": 1.0}, {}, "in optimizer.step()"),
        # recorded with updates in backward, predicted and run with a config against them
        ("plain", {}, {"gradient_clipping": 1.0}, "in optimizer.step()"),
        ("plain", {}, {"step_in_backward": False}, "in optimizer.step()"),
        ("plain", {}, {"buffer_count": 16, "host_budget": 16 * SHARD}, "in optimizer.step()"),
        # recorded with a clipping loop, predicted for a roomier arena: still the loop's choice
        (
            "clip_grad_norm_",
            {},
            {"buffer_count": 48, "host_budget": 48 * SHARD},
            "in optimizer.step()",
        ),
    ],
    ids=[
        "plain",
        "clip-grad-norm",
        "gradient-clipping",
        "clipping-predicted",
        "in-step",
        "arena-too-small",
        "clip-grad-norm-wider",
    ],
)
def test_predicted_update_mode_is_the_one_the_run_chooses(loop, recorded, predicted, expected):
    """step_in_backward='auto' decides from the config and from what the loop does between
    backward and optimizer.step(); the replay does nothing there, so a prediction takes the
    loop's part from the recorded steps and the config's from the candidate."""
    clip = loop == "clip_grad_norm_"
    store, stats = _train_with(_config(**ROOMY, **recorded), clip, steps=3)
    try:
        assert stats["update_mode"] == (
            "in optimizer.step()" if clip or recorded else "in backward"
        )
        prediction = store.predict(disk=INSTANT, **predicted)
    finally:
        store.close()
    if predicted:
        other, run_stats = _train_with(_config(**{**ROOMY, **recorded, **predicted}), clip, 3)
        other.close()
    else:  # predicted for the recorded config: the recorded run is the run with it
        run_stats = stats
    assert run_stats["update_mode"] == expected
    assert prediction["update_mode"] == run_stats["update_mode"]
    assert prediction["update_mode_reasons"] == run_stats["update_mode_reasons"]
