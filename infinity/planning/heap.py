"""What a candidate's heap does, as the planner predicts it: whether its store keeps freed
blocks for reuse after the first step (``infinity.core.memory.HeapWatch``), what that puts in
its peak RSS, and what the page faults of a heap that keeps none add to its compute.

A recording made under a budget with room for reuse ran faster, and held more, than a
candidate without room will: the 100.7 M MLP faulted 103k pages in its first (bounded) step's
forward and backward and about half as many in the steps after it, which reused blocks, and
each fault cost about a microsecond of compute on two cores.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from infinity.core.budgets import MemoryPlan
    from infinity.planning.planner import Recording


def heap_reuse_starts(
    recording: Recording, plan: MemoryPlan | None, tiers: int, largest: int, host_device: bool
) -> bool | None:
    """Whether a candidate's store keeps freed heap blocks after its first step: its budget
    (``plan``) leaves the room the store asks before it starts (``MemoryPlan.heap_line``,
    ``heap_reuse_wanted``) above the recorded process's first-step RSS besides the tiers, plus
    the candidate's ``tiers``. None: no host budget (glibc's own thresholds, which reuse), or
    a recording that does not tell (no first-step base)."""
    if plan is None or not (recording.bounded_base_rss and recording.process_rss):
        return None
    bounded = min(recording.bounded_base_rss, recording.base_rss) + tiers
    room = plan.heap_line(recording.process_rss) - bounded
    return room >= plan.heap_reuse_wanted(largest, host_device)


def training_rss(
    recording: Recording, plan: MemoryPlan | None, tiers: int, largest: int, host_device: bool
) -> int:
    """A candidate's peak RSS in training: the recording's process besides its tiers, plus the
    candidate's ``tiers``. Where the recording's heap kept freed blocks for reuse and the
    candidate's budget (``plan``) leaves no room for them, the store keeps none (the 100.7 M
    MLP kept 0.36 GiB under a 1.6 GiB budget and none under 1.35 GiB, with the same tiers):
    reuse starts after the first step only if the line leaves room for it, and ends for good
    where RSS passes the line (``infinity.core.memory.HeapWatch``)."""
    if not (recording.heap_reuse and recording.bounded_base_rss):
        # Nothing kept to take out. (The first step's RSS besides the tiers is no base for the
        # steps after it by itself: taken as one, it put the validation matrix's peaks for the
        # demo GPT and the Llama 11-19% low.)
        return recording.base_rss + tiers
    bounded = min(recording.bounded_base_rss, recording.base_rss) + tiers
    if plan is None or not heap_reuse_starts(recording, plan, tiers, largest, host_device):
        return bounded  # reuse never starts
    line = plan.heap_line(recording.process_rss)
    kept = max(0, recording.base_rss - recording.bounded_base_rss)
    # reuse that passes the line ends there, after RSS reached it
    return bounded + kept if bounded + kept <= line else max(bounded, line)


def fault_compute(recording: Recording) -> list[float] | None:
    """Seconds per trace event that a run whose heap keeps no freed blocks spends faulting
    beyond what the recording's later iterations did: the faults of the recorded iteration (the
    first, before reuse could start) less the median of the ones after it, at the recorded
    process's seconds per fault. None where the recording does not tell (no fault counts: one
    extrapolated from a smaller copy)."""
    trace = recording.trace
    counted = len(trace.recorded_faults) == len(trace.faults) == len(trace.events)
    if not (recording.fault_seconds and counted and any(trace.recorded_faults)):
        return None
    return [
        max(0.0, first - later) * recording.fault_seconds
        for first, later in zip(trace.recorded_faults, trace.faults, strict=True)
    ]


def heap_report(
    recording: Recording, reuse: bool | None, extra: list[float] | None, host_device: bool
) -> dict[str, Any]:
    """A prediction's ``heap``: whether the recording's and the candidate's heaps keep freed
    blocks for reuse (``reuse`` None: no host budget, glibc's own thresholds), the recorded
    seconds per page fault and what the candidate's faults added to a step; ``note`` where an
    effect of reuse on compute is left out."""
    heap: dict[str, Any] = {
        "recorded_reuse": recording.heap_reuse,
        "reuse": reuse,
        "fault_seconds": recording.fault_seconds,
        "extra_seconds": sum(extra) if extra else 0.0,
    }
    if not host_device:
        return heap  # compute runs on the device, not on faulting host pages
    if reuse is False and recording.heap_reuse and extra is None:
        heap["note"] = (
            "not modelled: the recording counted no page faults, so what this budget's "
            "temporaries fault afresh without heap reuse is not in the step (it errs fast)"
        )
    elif reuse and not recording.heap_reuse:
        heap["note"] = (
            "not modelled: the recording's heap kept no blocks, so what reuse would save in "
            "compute is not taken off the step (it errs slow)"
        )
    return heap
