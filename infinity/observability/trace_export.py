"""Views of a recorded :class:`~infinity.core.timeline.Timeline`: a Chrome trace and a PNG
plot.

Chrome trace (``Timeline.export_chrome``; open in https://ui.perfetto.dev or chrome://tracing)
------------------------------------------------------------------------------------------------
A JSON object ``{"traceEvents": [...], "displayTimeUnit": "ms", "otherData": {...}}``. Times
``ts`` and ``dur`` are microseconds since the first record; events are sorted by ``ts``. All
events are in process ``pid`` 1, named ``infinity``; each lane is a thread (``tid``) named by a
``"M"`` ``thread_name`` metadata event and ordered by ``thread_sort_index``.

=================  ====  ==================  ===========  ==========================================
lane (thread)      ph    name                cat          args
=================  ====  ==================  ===========  ==========================================
compute            X     module name         forward      module, phase ("fwd")
compute            X     module name         backward     module, phase ("bwd")
compute            X     optimizer.step      step         module, phase ("step")
compute            X     parameter name      step         same: an update run in backward
stall              X     stall               stall        shard
d2h                X     d2h                 d2h          module
nvme read [k]      X     nvme.read           io           shard, bytes, prefetch, stalled, error,
                                                          unfinished
nvme write [k]     X     nvme.write          io           same as nvme.read
(process counter)  C     bytes in flight     io           read, write (bytes of transfers under way)
=================  ====  ==================  ===========  ==========================================

An update run in backward (``step_in_backward``) is a step span named by its parameter.
Compute spans run from a module's forward/backward event to the next event or optimizer step,
with the training thread's stalls cut out (a span interrupted by a stall is split in two).
Transfers that overlap in time go on sub-lanes ``nvme read``, ``nvme read 2``, ... so each lane
holds properly ordered slices. ``stalled`` marks a transfer the training thread waited for;
``unfinished`` one still in flight when the trace was taken (drawn up to the last record).
``otherData`` holds ``summary`` (``Timeline.summary()``) and ``origin_perf_counter``.

PNG plot (``Timeline.plot``)
----------------------------
Lanes top to bottom: compute (forward, backward, optimizer step in their own colours; stalls in
red), d2h (when recorded), nvme read (prefetch and demand reads in two shades; a red edge marks a
transfer that stalled the training thread), nvme write. The x axis is seconds since the first
record; the title line below the plot gives the hidden fraction and stall time.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from infinity.core.timeline import Timeline, Transfer, summarise

log = logging.getLogger(__name__)

PID = 1
#: Chrome event names and categories used above (the tests check the docstring against these)
EVENT_NAMES = ("optimizer.step", "stall", "d2h", "nvme.read", "nvme.write", "bytes in flight")
CATEGORIES = ("forward", "backward", "step", "stall", "d2h", "io")
_PHASE_CATEGORY = {"fwd": "forward", "bwd": "backward", "step": "step"}
_OP_LANE = {"read": "nvme read", "write": "nvme write"}
_COLOURS = {
    "fwd": "#4c72b0",
    "bwd": "#dd8452",
    "step": "#55a868",
    "stall": "#d62728",
    "d2h": "#8172b3",
    "prefetch": "#64b5cd",
    "demand": "#2a6f97",
    "write": "#937860",
}


def _us(seconds: float) -> float:
    # Rounded to nanoseconds: keeps the JSON short without reordering events.
    return round(seconds * 1e6, 3)


def _transfer_end(transfer: Transfer, horizon: float) -> float:
    return transfer.end if transfer.end is not None else max(horizon, transfer.start)


def sub_lanes(transfers: list[Transfer], horizon: float) -> list[list[Transfer]]:
    """Greedy interval partitioning: the fewest lanes with no two transfers overlapping."""
    lanes: list[list[Transfer]] = []
    ends: list[float] = []
    for transfer in sorted(transfers, key=lambda t: t.start):
        for k, end in enumerate(ends):
            if end <= transfer.start:
                lanes[k].append(transfer)
                ends[k] = _transfer_end(transfer, horizon)
                break
        else:
            lanes.append([transfer])
            ends.append(_transfer_end(transfer, horizon))
    return lanes


def chrome_trace(timeline: Timeline) -> dict[str, Any]:
    """The trace as a dict (``timeline`` should be a snapshot: see ``Timeline.snapshot``)."""
    origin, horizon = timeline.origin(), timeline.horizon()
    meta: list[dict[str, Any]] = [
        {
            "ph": "M",
            "name": "process_name",
            "pid": PID,
            "tid": 0,
            "ts": 0,
            "args": {"name": "infinity"},
        }
    ]
    body: list[dict[str, Any]] = []

    def lane(name: str) -> int:
        tid = len(meta)
        meta.append(
            {
                "ph": "M",
                "name": "thread_name",
                "pid": PID,
                "tid": tid,
                "ts": 0,
                "args": {"name": name},
            }
        )
        meta.append(
            {
                "ph": "M",
                "name": "thread_sort_index",
                "pid": PID,
                "tid": tid,
                "ts": 0,
                "args": {"sort_index": tid},
            }
        )
        return tid

    def complete(
        tid: int, name: str, cat: str, start: float, end: float, args: dict[str, Any]
    ) -> None:
        body.append(
            {
                "ph": "X",
                "name": name,
                "cat": cat,
                "pid": PID,
                "tid": tid,
                "ts": _us(start - origin),
                "dur": _us(max(end - start, 0.0)),
                "args": args,
            }
        )

    compute = lane("compute")
    for span in timeline.compute_spans():
        complete(
            compute,
            span.name,
            _PHASE_CATEGORY.get(span.phase, span.phase),
            span.start,
            span.end,
            {"module": span.name, "phase": span.phase},
        )
    for phase, name in (("stall", "stall"), ("d2h", "d2h")):
        spans = [s for s in timeline.spans if s.phase == phase]
        if not spans:
            continue
        tid = lane(name)
        key = "shard" if phase == "stall" else "module"
        for span in spans:
            complete(tid, name, phase, span.start, span.end, {key: span.name})
    present = {t.op for t in timeline.transfers}
    ops = [op for op in _OP_LANE if op in present] + sorted(present - set(_OP_LANE))
    for op in ops:
        label = _OP_LANE.get(op, op)
        for k, transfers in enumerate(
            sub_lanes([t for t in timeline.transfers if t.op == op], horizon)
        ):
            tid = lane(label if k == 0 else f"{label} {k + 1}")
            for t in transfers:
                complete(
                    tid,
                    f"nvme.{op}" if op in _OP_LANE else op,
                    "io",
                    t.start,
                    _transfer_end(t, horizon),
                    {
                        "shard": t.shard,
                        "bytes": t.nbytes,
                        "prefetch": t.prefetch,
                        "stalled": t.stalled,
                        "error": t.error,
                        "unfinished": t.end is None,
                    },
                )
    body += _counters(timeline.transfers, origin, horizon)
    body.sort(key=lambda e: e["ts"])
    return {
        "traceEvents": meta + body,
        "displayTimeUnit": "ms",
        "otherData": {"summary": summarise(timeline), "origin_perf_counter": origin},
    }


def _counters(transfers: list[Transfer], origin: float, horizon: float) -> list[dict[str, Any]]:
    """ "C" events: bytes of reads and writes under way, after every start and end."""
    changes: list[tuple[float, int, str, int]] = []
    for t in transfers:
        if t.op not in _OP_LANE:
            continue
        # Ends sort before starts at the same instant: no phantom peak between two transfers.
        changes.append((t.start, 1, t.op, t.nbytes))
        changes.append((_transfer_end(t, horizon), 0, t.op, -t.nbytes))
    changes.sort()
    level = {"read": 0, "write": 0}
    out: list[dict[str, Any]] = []
    for at, _, op, delta in changes:
        level[op] += delta
        event = {
            "ph": "C",
            "name": "bytes in flight",
            "cat": "io",
            "pid": PID,
            "tid": 0,
            "ts": _us(at - origin),
            "args": dict(level),
        }
        if out and out[-1]["ts"] == event["ts"]:
            out[-1] = event  # one sample per instant: the state after all its changes
        else:
            out.append(event)
    return out


def write_chrome_trace(timeline: Timeline, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    trace = chrome_trace(timeline)
    path.write_text(json.dumps(trace, separators=(",", ":")))
    log.info("wrote a Chrome trace of %d events to %s", len(trace["traceEvents"]), path)
    return path


def plot_timeline(timeline: Timeline, path: Path, title: str | None = None) -> Path:
    """Draws the lanes with matplotlib's Agg canvas (no pyplot: no global backend state)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    origin, horizon = timeline.origin(), timeline.horizon()
    summary = summarise(timeline)

    def bars(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
        return [(start - origin, max(end - start, 0.0)) for start, end in intervals]

    lanes: list[str] = ["compute"]
    d2h = [(s.start, s.end) for s in timeline.spans if s.phase == "d2h"]
    if d2h:
        lanes.append("d2h")
    ops = [op for op in ("read", "write") if any(t.op == op for t in timeline.transfers)]
    lanes += [_OP_LANE[op] for op in ops]
    height = 0.8
    y = {name: len(lanes) - 1 - i for i, name in enumerate(lanes)}  # first lane on top

    figure = Figure(figsize=(14, 1.2 + 0.9 * len(lanes)), layout="constrained")
    FigureCanvasAgg(figure)
    ax = figure.add_subplot()
    compute = timeline.compute_spans()
    for phase in ("fwd", "bwd", "step"):
        ax.broken_barh(
            bars([(s.start, s.end) for s in compute if s.phase == phase]),
            (y["compute"] - height / 2, height),
            facecolors=_COLOURS[phase],
        )
    stalls = [(s.start, s.end) for s in timeline.spans if s.phase == "stall"]
    ax.broken_barh(bars(stalls), (y["compute"] - height / 2, height), facecolors=_COLOURS["stall"])
    if d2h:
        ax.broken_barh(bars(d2h), (y["d2h"] - height / 2, height), facecolors=_COLOURS["d2h"])
    for op in ops:
        lane_transfers = sub_lanes([t for t in timeline.transfers if t.op == op], horizon)
        row = height / len(lane_transfers)
        base = y[_OP_LANE[op]] + height / 2
        for k, transfers in enumerate(lane_transfers):
            # One broken_barh per (colour, stalled) group: thousands of transfers stay fast.
            groups: dict[tuple[str, bool], list[tuple[float, float]]] = {}
            for t in transfers:
                colour = (
                    _COLOURS["write"]
                    if op == "write"
                    else _COLOURS["prefetch" if t.prefetch else "demand"]
                )
                groups.setdefault((colour, t.stalled), []).append(
                    (t.start, _transfer_end(t, horizon))
                )
            for (colour, stalled), intervals in groups.items():
                ax.broken_barh(
                    bars(intervals),
                    (base - (k + 1) * row, row * 0.9),
                    facecolors=colour,
                    edgecolors=_COLOURS["stall"] if stalled else "none",
                    linewidth=0.6 if stalled else 0.0,
                )
    ax.set_yticks([y[name] for name in lanes], labels=lanes)
    ax.set_ylim(-0.6, len(lanes) - 0.4)
    ax.set_xlim(0.0, max(horizon - origin, 1e-6))
    ax.set_xlabel("seconds since the first record")
    ax.grid(axis="x", alpha=0.3)
    ax.set_title(title or "infinity timeline", loc="left")
    ax.set_title(
        f"I/O hidden behind compute: {summary['hidden_fraction']:.0%}   "
        f"stalls: {summary['stall_seconds']:.3f} s of "
        f"{summary['total_seconds']:.3f} s   read {summary['bytes_read'] / 1e6:.1f} MB"
        f"   written {summary['bytes_written'] / 1e6:.1f} MB",
        loc="right",
        fontsize="small",
    )
    legend = [
        Patch(color=_COLOURS["fwd"], label="forward"),
        Patch(color=_COLOURS["bwd"], label="backward"),
        Patch(color=_COLOURS["step"], label="optimizer step"),
        Patch(color=_COLOURS["stall"], label="stall (waiting on I/O)"),
        Patch(color=_COLOURS["prefetch"], label="prefetch read"),
        Patch(color=_COLOURS["demand"], label="demand read"),
        Patch(color=_COLOURS["write"], label="write"),
        Patch(facecolor="none", edgecolor=_COLOURS["stall"], label="transfer waited for"),
    ]
    if d2h:
        legend.insert(3, Patch(color=_COLOURS["d2h"], label="gradient d2h"))
    ax.legend(handles=legend, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, format="png", dpi=100)
    log.info("wrote a timeline plot to %s", path)
    return path


__all__ = [
    "CATEGORIES",
    "EVENT_NAMES",
    "PID",
    "chrome_trace",
    "plot_timeline",
    "sub_lanes",
    "write_chrome_trace",
]
