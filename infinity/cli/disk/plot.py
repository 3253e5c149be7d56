"""GB/s against block size and against queue depth, one line per backend."""

from __future__ import annotations

import logging
from pathlib import Path

from infinity.cli.common.units import format_size
from infinity.cli.disk.report import FioPoint
from infinity.cli.disk.sweep import DIRECTIONS, PointResult

log = logging.getLogger(__name__)


def _series(results: list[PointResult], direction: str, backend: str, vary: str) -> tuple:
    """The line of ``backend`` that varies ``vary`` ("block_size" or "queue_depth") and holds the
    other setting at that of the backend's best point: one line per backend, through its best."""
    mine = [
        r
        for r in results
        if r.point.backend == backend and r.point.thread_count is None and r.gbps(direction)
    ]
    if not mine:
        return [], [], [], ""
    best = max(mine, key=lambda r: r.median(direction))
    fixed = "queue_depth" if vary == "block_size" else "block_size"
    line = sorted(
        (r for r in mine if getattr(r.point, fixed) == getattr(best.point, fixed)),
        key=lambda r: getattr(r.point, vary),
    )
    xs = [getattr(r.point, vary) for r in line]
    summaries = [s for s in (r.gbps(direction) for r in line) if s is not None]
    ys = [s.median for s in summaries]
    errors = [[s.median - s.min for s in summaries], [s.max - s.median for s in summaries]]
    value = getattr(best.point, fixed)
    label = (
        f"{backend} ({'qd' if fixed == 'queue_depth' else 'bs'}="
        f"{value if fixed == 'queue_depth' else format_size(value)})"
    )
    return xs, ys, errors, label


def _fio_series(points: list[FioPoint], direction: str, vary: str) -> tuple:
    mine = [p for p in points if p.job.rw == direction and p.gbps()]
    medians = {id(p): p.gbps().median for p in mine}  # type: ignore[union-attr]  # filtered
    if not mine:
        return [], [], ""
    best = max(mine, key=lambda p: medians[id(p)])
    attr = {"block_size": "block_size", "queue_depth": "iodepth"}
    fixed = "iodepth" if vary == "block_size" else "block_size"
    line = sorted(
        (p for p in mine if getattr(p.job, fixed) == getattr(best.job, fixed)),
        key=lambda p: getattr(p.job, attr[vary]),
    )
    value = getattr(best.job, fixed)
    label = (
        f"fio ({'qd' if fixed == 'iodepth' else 'bs'}="
        f"{value if fixed == 'iodepth' else format_size(value)})"
    )
    return [getattr(p.job, attr[vary]) for p in line], [medians[id(p)] for p in line], label


def plot(path: Path, results: list[PointResult], fio_points: list[FioPoint], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display; the figure only goes to a file
    import matplotlib.pyplot as plt

    backends = sorted({r.point.backend for r in results})
    fig, axes = plt.subplots(2, 2, figsize=(11, 8), squeeze=False)
    for row, direction in enumerate(DIRECTIONS):
        for col, vary in enumerate(("block_size", "queue_depth")):
            ax = axes[row][col]
            ticks: set[int] = set()
            for backend in backends:
                xs, ys, errors, label = _series(results, direction, backend, vary)
                if xs:
                    ax.errorbar(xs, ys, yerr=errors, marker="o", capsize=3, label=label)
                    ticks.update(xs)
            fx, fy, flabel = _fio_series(fio_points, direction, vary)
            if len(fx) > 1 or (fx and not ticks):
                ax.plot(fx, fy, "k--", marker="x", label=flabel)
                ticks.update(fx)
            ax.set_xscale("log", base=2)
            if ticks:
                ordered = sorted(ticks)
                ax.set_xticks(ordered)
                ax.set_xticklabels(
                    [format_size(t) if vary == "block_size" else str(t) for t in ordered]
                )
            ax.set_xlabel("block size" if vary == "block_size" else "queue depth")
            ax.set_ylabel(f"{direction} GB/s")
            ax.set_ylim(bottom=0)
            ax.grid(True, alpha=0.3)
            ax.set_title(f"{direction}: GB/s vs {ax.get_xlabel()}")
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    log.info("plot written to %s", path)
