"""A configuration run for real and set against its prediction: the measuring loop and the
ratios that ``infinity-plan --validate`` and the planner's benchmarks (bench_plan, plan_matrix)
share."""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from typing import Any

from infinity.core.memory import peak_resident_bytes

#: how far a prediction may be from the run: step time, bytes read and written per step, peak RSS
GOALS = {"step_s": 0.15, "read_bytes": 0.05, "write_bytes": 0.05, "peak_rss": 0.10}
#: each measured key, and the key of a prediction (``store.predict``) it is compared with
PREDICTED_KEYS = {
    "step_s": "step_seconds",
    "read_bytes": "bytes_read",
    "write_bytes": "bytes_written",
    "peak_rss": "rss_peak_bytes",
}


def store_deltas(before: dict, after: dict, steps: int) -> dict:
    """Per-step I/O and device-tier traffic between two ``store.stats()`` snapshots taken
    ``steps`` steps apart."""

    def per_step(key: str) -> float:
        return (after[key] - before[key]) / steps

    return {
        "read_bytes": per_step("bytes_read"),
        "write_bytes": per_step("bytes_written"),
        "stall_s": per_step("stall_seconds"),
        "to_device_bytes": per_step("bytes_to_device"),
        "from_device_bytes": per_step("bytes_from_device"),
        "device_copy_s": per_step("device_copy_seconds"),
    }


def measure_steps(
    store: Any, step: Callable[[], object], warmup: int, steps: int
) -> dict[str, Any]:
    """Runs ``step`` (one training step: forward, backward, ``optimizer.step()``,
    ``zero_grad()``) ``warmup`` times, then ``steps`` times timed, on a model attached to
    ``store``. Returns the median step's seconds and each one's, the store's bytes per step
    over the timed steps (:func:`store_deltas`, with the counters they come from), the
    process's peak RSS, the tiers' peak bytes and where the updates ran."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    for _ in range(warmup):
        step()
    before = store.stats()
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    after = store.stats()
    return {
        "step_s": statistics.median(times),
        "steps_s": times,
        **store_deltas(before, after, steps),
        "counters": {
            key: {"before": before[key], "after": after[key]}
            for key in ("bytes_read", "bytes_written")
        },
        "steps": steps,
        "warmup": warmup,
        "peak_rss": peak_resident_bytes(),
        "peak_bytes": after["peak_bytes"],
        "update_mode": after.get("update_mode"),
        "update_mode_reasons": after.get("update_mode_reasons", []),
    }


def prediction_ratio(predicted: float, measured: float) -> float:
    """Predicted over measured; nothing predicted and nothing measured is exact."""
    if not measured:
        return 1.0 if not predicted else float("inf")
    return predicted / measured


def compare(
    prediction: dict[str, Any], measured: dict[str, Any], goals: dict[str, float] = GOALS
) -> dict[str, dict[str, Any]]:
    """For each key of ``goals``: the predicted and measured values, their ratio and whether
    it is within the goal."""
    out = {}
    for key, goal in goals.items():
        predicted = prediction[PREDICTED_KEYS[key]]
        ratio = prediction_ratio(predicted, measured[key])
        out[key] = {
            "predicted": predicted,
            "measured": measured[key],
            "ratio": ratio,
            "goal": goal,
            "met": abs(ratio - 1) <= goal,
        }
    return out


def reset_peak() -> None:
    """The process's peak RSS (VmHWM) starts again from its RSS now, so that what ran before
    (a disk measurement's buffers, a phase already reported) is not counted in the next peak;
    a no-op where the kernel does not offer it. Collects garbage first: a closed buffer pool's
    memory goes back only once the transfers' objects that still viewed it are collected."""
    gc.collect()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
