"""The text report on stdout: one table for the engine grid, one for fio, then a summary."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from infinity.cli.common.aggregate import Summary, summarize
from infinity.cli.common.units import format_size
from infinity.cli.disk.fio import FioJob, FioResult
from infinity.cli.disk.gil_probe import InterferenceResult
from infinity.cli.disk.recommend import Recommendation
from infinity.cli.disk.sweep import DIRECTIONS, PointResult

NOISY = 0.30  # (max - min) / median above which a cell is flagged
TARGET_RATIO = 0.8  # the loop should keep this much of its speed while swap I/O runs
BUSY_WAIT = 0.05  # idle loop waiting this share of its time for a CPU: the machine is shared


@dataclass
class FioPoint:
    """Every repeat of one fio job; an entry is a result or the error text."""

    job: FioJob
    runs: list[FioResult | str] = field(default_factory=list)

    def results(self) -> list[FioResult]:
        return [r for r in self.runs if isinstance(r, FioResult)]

    def gbps(self) -> Summary | None:
        return summarize(r.gbps for r in self.results())

    def cpu(self) -> Summary | None:
        return summarize(r.cpu_per_gib for r in self.results())

    def device_request(self) -> Summary | None:
        return summarize(r.device_request_bytes for r in self.results())

    def as_dict(self) -> dict:
        gbps, cpu, request = self.gbps(), self.cpu(), self.device_request()
        return {
            "rw": self.job.rw,
            "block_size": self.job.block_size,
            "iodepth": self.job.iodepth,
            "size": self.job.size,
            "ioengine": self.job.ioengine,
            "repeats": [
                r.as_dict() if isinstance(r, FioResult) else {"error": r} for r in self.runs
            ],
            "summary": {
                "gbps": gbps.as_dict() if gbps else None,
                "cpu_s_per_gib": cpu.as_dict() if cpu else None,
                "device_request_bytes": request.as_dict() if request else None,
            },
        }


def cell(summary: Summary | None, width: int = 19) -> str:
    """``median [min-max]``, flagged with ``!`` when the repeats disagree a lot."""
    if summary is None:
        return "failed".ljust(width)
    if summary.n == 1:
        text = f"{summary.median:5.2f}"
    else:
        text = f"{summary.median:5.2f} [{summary.min:.2f}-{summary.max:.2f}]"
        if summary.spread > NOISY:
            text += "!"
    return text.ljust(width)


def number(summary: Summary | None, fmt: str = "{:.3f}") -> str:
    return fmt.format(summary.median) if summary else "-"


def request_sizes(write: Summary | None, read: Summary | None) -> str:
    def kib(s: Summary | None) -> str:
        return f"{s.median / 1024:.0f}" if s else "-"

    return f"{kib(write)}/{kib(read)}"


def engine_table(results: Iterable[PointResult], repeats: int) -> list[str]:
    lines = [
        f"Swap engine, GB/s: median [min-max] over {repeats} repeat(s), "
        f"'!' = repeats spread > {NOISY:.0%}.",
        "cpu = process CPU s/GiB (user+kernel, all threads); bk = of which the backend's own "
        "threads, as the engine counts them.",
        "fresh = first write into the newly preallocated file; write = overwrite (steady "
        "state); dev KiB = mean size of the requests the disk saw, write/read.",
        f"{'backend':<9}{'block':>6}{'qd':>4}{'thr':>5}"
        f" | {'write GB/s':<19}{'cpu':>6}{'bk':>6}"
        f" | {'read GB/s':<19}{'cpu':>6}{'bk':>6} | {'fresh':>6} {'dev KiB':>10}",
    ]
    lines.append("-" * len(lines[-1]))
    for result in results:
        p = result.point
        threads = (
            str(p.thread_count) if p.thread_count else ("=qd" if p.backend != "uring" else "-")
        )
        row = f"{p.backend:<9}{format_size(p.block_size):>6}{p.queue_depth:>4}{threads:>5}"
        for direction in DIRECTIONS:
            row += (
                f" | {cell(result.gbps(direction))}{number(result.cpu(direction)):>6}"
                f"{number(result.backend_cpu(direction)):>6}"
            )
        row += (
            f" | {number(result.gbps('write_fresh'), '{:.2f}'):>6} "
            f"{request_sizes(result.device_request('write'), result.device_request('read')):>10}"
        )
        errors = [run["error"] for run in result.runs if "error" in run]
        if errors:
            row += f"  ({len(errors)} failed: {errors[0][:60]})"
        lines.append(row)
    return lines


def fio_table(points: list[FioPoint], engine_results: list[PointResult], size: int) -> list[str]:
    if not points:
        return []
    ioengine = points[0].job.ioengine
    lines = [
        f"fio ({ioengine}, direct=1, {format_size(size)} per job), GB/s median [min-max]; "
        "'ours' = the uring point with the same block size and queue depth.",
        f"{'block':>6}{'iodepth':>8} | {'write GB/s':<19}{'cpu':>6}{'ours':>6}"
        f" | {'read GB/s':<19}{'cpu':>6}{'ours':>6} | {'dev KiB':>10}",
    ]
    lines.append("-" * len(lines[-1]))
    grid = sorted({(p.job.block_size, p.job.iodepth) for p in points})
    by_key = {(p.job.rw, p.job.block_size, p.job.iodepth): p for p in points}
    ours = {
        (r.point.block_size, r.point.queue_depth): r
        for r in engine_results
        if r.point.backend == "uring" and r.point.thread_count is None
    }
    for bs, depth in grid:
        row = f"{format_size(bs):>6}{depth:>8}"
        for direction in DIRECTIONS:
            point = by_key.get((direction, bs, depth))
            mine = ours.get((bs, depth))
            row += (
                f" | {cell(point.gbps() if point else None)}"
                f"{number(point.cpu() if point else None):>6}"
                f"{number(mine.gbps(direction) if mine else None, '{:.2f}'):>6}"
            )
        write, read = by_key.get(("write", bs, depth)), by_key.get(("read", bs, depth))
        sizes = request_sizes(
            write.device_request() if write else None, read.device_request() if read else None
        )
        row += f" | {sizes:>10}"
        lines.append(row)
    return lines


def best_by_backend(results: list[PointResult]) -> dict[str, dict]:
    """Per backend and direction: the point with the highest median and its numbers."""
    out: dict[str, dict] = {}
    for result in results:
        entry = out.setdefault(result.point.backend, {})
        for direction in DIRECTIONS:
            median = result.median(direction)
            if median > entry.get(direction, {}).get("gbps", 0.0):
                cpu, device = result.cpu(direction), result.device_request(direction)
                entry[direction] = {
                    "gbps": median,
                    "point": result.point.label,
                    "cpu_s_per_gib": cpu.median if cpu else None,
                    "device_request_bytes": device.median if device else None,
                }
    return out


def best_fio(points: list[FioPoint]) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for point in points:
        summary = point.gbps()
        if summary and summary.median > out.get(point.job.rw, {}).get("gbps", 0.0):
            device = point.device_request()
            out[point.job.rw] = {
                "gbps": summary.median,
                "block_size": point.job.block_size,
                "iodepth": point.job.iodepth,
                "device_request_bytes": device.median if device else None,
            }
    return out


def ratios_to(best: dict[str, dict], reference: dict[str, dict]) -> dict[str, float]:
    """Our best GB/s over a reference's (fio's, aiofiles') per direction."""
    out = {}
    for direction in DIRECTIONS:
        ours = max((b[direction]["gbps"] for b in best.values() if direction in b), default=0.0)
        if ours and direction in reference:
            out[direction] = ours / reference[direction]["gbps"]
    return out


def request_size_notes(best: dict[str, dict], fio_best: dict[str, dict]) -> list[str]:
    """A warning when the disk saw much smaller requests from fio than from the engine: then the
    ratio reflects how the two programs' buffers sit in physical memory (a virtio disk splits a
    request at its segment limit), not how fast either submits."""
    notes = []
    for direction in DIRECTIONS:
        ours = max(
            (b[direction] for b in best.values() if direction in b),
            key=lambda e: e["gbps"],
            default=None,
        )
        theirs = fio_best.get(direction)
        if (
            not ours
            or not theirs
            or not ours.get("device_request_bytes")
            or not theirs.get("device_request_bytes")
        ):
            continue
        if theirs["device_request_bytes"] < 0.5 * ours["device_request_bytes"]:
            notes.append(
                f"  note: {direction}: the disk saw "
                f"{theirs['device_request_bytes'] / 1024:.0f} KiB requests from fio but "
                f"{ours['device_request_bytes'] / 1024:.0f} KiB "
                "from the engine (fio's buffers are split at the segment limit); part of "
                "the ratio is memory layout, not the I/O path"
            )
    return notes


def aiofiles_lines(best: dict[str, dict], aiofiles: dict) -> list[str]:
    """The aiofiles baseline (infinity/cli/disk/aiofiles_baseline.py) and our best over it."""
    if not aiofiles["available"]:
        return [f"  {aiofiles['note']}"]
    summary = aiofiles["summary"]
    parts = [
        f"{d} {summary[d]['gbps']:.2f} GB/s ({summary[d]['cpu_s_per_gib']:.3f} CPU s/GiB)"
        for d in DIRECTIONS
        if d in summary
    ]
    lines = [
        "  aiofiles  " + "; ".join(parts),
        f"    ({aiofiles['label']})",
        "  ours/aiofiles " + "; ".join(f"{d} {r:.2f}" for d, r in ratios_to(best, summary).items()),
    ]
    if aiofiles["note"]:
        lines.append(f"    note: {aiofiles['note']}")
    return lines


def summary_lines(
    best: dict[str, dict],
    fio_best: dict[str, dict],
    fio_note: str,
    ratios: dict[str, float],
    interference: list[InterferenceResult],
    recommendation: Recommendation | None,
    config: dict | None,
    aiofiles: dict | None = None,
) -> list[str]:
    lines = ["Summary (medians)"]
    for backend, entry in best.items():
        parts = []
        for direction in DIRECTIONS:
            if direction in entry:
                e = entry[direction]
                cpu = "" if e["cpu_s_per_gib"] is None else f", {e['cpu_s_per_gib']:.3f} CPU s/GiB"
                parts.append(f"{direction} {e['gbps']:.2f} GB/s ({e['point']}{cpu})")
        lines.append(f"  {backend:<9} best " + "; ".join(parts))
    if fio_best:
        parts = [
            f"{d} {fio_best[d]['gbps']:.2f} GB/s (bs={format_size(fio_best[d]['block_size'])} "
            f"iodepth={fio_best[d]['iodepth']})"
            for d in DIRECTIONS
            if d in fio_best
        ]
        lines.append("  fio       best " + "; ".join(parts))
        lines.append("  ours/fio  " + "; ".join(f"{d} {r:.2f}" for d, r in ratios.items()))
        lines.extend(request_size_notes(best, fio_best))
    else:
        lines.append(f"  fio       not measured: {fio_note}")
    if aiofiles is not None:
        lines.extend(aiofiles_lines(best, aiofiles))
    if interference:
        lines.append(
            "  interference: pure-Python loop speed during the I/O / idle (target >= "
            f"{TARGET_RATIO}); [on-CPU: the same over the time the loop had a CPU, "
            "i.e. GIL waits only; GIL: the share of its time the loop waited for the GIL]; "
            "the GB/s reached meanwhile, and that as a share of the same stream's GB/s "
            f"alone, run next to it in each round (target >= {TARGET_RATIO})"
        )
    for result in interference:
        parts = []
        for direction in DIRECTIONS:
            ratio, gbps = result.ratio(direction), result.bandwidth(direction)
            on_cpu = result.ratio(direction, on_cpu=True)
            gil = result.gil_wait(direction)
            if ratio and gbps:
                flag = "" if ratio.median >= TARGET_RATIO else " (below target)"
                text = f"{direction} {ratio.median:.2f}{flag}"
                extra = [f"{on_cpu.median:.2f} on-CPU"] if on_cpu else []
                if gil:
                    extra.append(f"GIL {gil.median:.0%}")
                if extra:
                    text += f" [{', '.join(extra)}]"
                text += f" at {gbps.median:.2f} GB/s"
                share, alone = result.share(direction), result.bandwidth_alone(direction)
                if share and alone:
                    low = "!" if share.median < TARGET_RATIO else ""
                    text += f" ({share.median:.0%} of {alone.median:.2f} alone{low})"
                parts.append(text)
        label = result.point.label.replace(" t=", " threads=")
        if result.point.backend == "fio":
            label += " (another process, no GIL: the machine's own share)"
        lines.append(f"    {label}: " + "; ".join(parts))
    waits = [w for r in interference for w in (r.idle_cpu_wait(),) if w]
    if waits and max(w.median for w in waits) > BUSY_WAIT:
        lines.append(
            f"    note: even idle, the loop waited {max(w.median for w in waits):.0%} of "
            "the time for a CPU: other processes keep this machine busy, so these "
            "ratios are noisy (see idle_windows in --json)"
        )
    if recommendation and config:
        c = recommendation.candidate
        lines.append(
            f"  recommended: {c.backend} bs={format_size(c.block_size)} "
            f"qd={c.queue_depth}, buffers {config['buffer_count']} x "
            f"{format_size(config['buffer_size'])} "
            f"(read {c.read_gbps:.2f}, write {c.write_gbps:.2f} GB/s)"
        )
        lines.append(f"    why: {recommendation.reason}")
    return lines
