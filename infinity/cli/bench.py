"""infinity-bench: read and write bandwidth of the swap layer on a directory, next to fio's.

    infinity-bench --path /mnt/nvme/tmp            # the full sweep (a few minutes)
    infinity-bench --quick                         # a first look in under a minute
    infinity-bench --json out.json --plot out.png --write-config aio.json

Each grid point (backend x block size x queue depth [x threads]) moves ``--size`` bytes through
``--buffers`` pool buffers in flight, writing then reading back with O_DIRECT so the page cache
is out of the way. The disk is noisy, so every point is repeated and the repeats are interleaved:
each round visits every point (engine and fio) once in a shuffled order, and the report gives
medians with min and max. After the grid, ``aiofiles`` (the obvious Python choice) moves the same
bytes at the recommended block size as a baseline (infinity/cli/disk/aiofiles_baseline.py).
Everything written under ``--path`` is removed at the end.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from infinity.cli.common.machine import DiskCounters, machine_info
from infinity.cli.common.units import format_size, parse_list, parse_size
from infinity.cli.disk import aiofiles_baseline, report
from infinity.cli.disk.fio import FioError, FioJob, FioRunner, find_fio
from infinity.cli.disk.gil_probe import (
    InterferenceResult,
    measure_fio_interference,
    measure_interference,
)
from infinity.cli.disk.recommend import (
    Candidate,
    Recommendation,
    choose_point,
    recommend,
    write_config,
)
from infinity.cli.disk.sweep import (
    DIRECTIONS,
    IN_FLIGHT,
    Point,
    PointResult,
    TransferSweep,
    fill_pattern,
    measure_point,
    transfer_sizes,
)
from swap import BufferPool
from swap.errors import SwapError
from swap.files import RUN_DIR_PREFIX
from swap.leftovers import describe, find_leftovers
from swap.probe import choose_backend

log = logging.getLogger("infinity.bench")

FULL = {
    "size": "1G",
    "block_sizes": "256K,1M,4M,8M",
    "queue_depths": "1,2,4,8,16",
    "thread_counts": "qd,2",
    "repeats": 3,
    "fio_block_sizes": "256K,1M,4M,8M",
    "fio_depths": "1,4,16",
    "sweep_total": "512M",
}
QUICK = {
    "size": "256M",
    "block_sizes": "256K,1M,4M",
    "queue_depths": "1,4,16",
    "thread_counts": "qd",
    "repeats": 1,
    "fio_block_sizes": "4M",
    "fio_depths": "16",
    "sweep_total": "128M",
}


def _thread_count(text: str) -> int | None:
    return None if text.strip() in ("qd", "auto", "none") else int(text)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="infinity-bench",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--path", type=Path, help="directory to measure (default: a new temp dir)")
    p.add_argument(
        "--quick",
        action="store_true",
        help="a first look: 256M, fewer points, 1 repeat, fio at one setting",
    )
    p.add_argument("--size", help="bytes per transfer pass (default 1G, quick 256M)")
    p.add_argument(
        "--backends",
        help="comma list of uring,threads,buffered (default: uring,threads, whichever work here)",
    )
    p.add_argument("--block-sizes", help=f"default {FULL['block_sizes']}")
    p.add_argument("--queue-depths", help=f"default {FULL['queue_depths']}")
    p.add_argument(
        "--thread-counts",
        help="threads backend only; 'qd' = one per queue slot "
        f"(default {FULL['thread_counts']}, quick {QUICK['thread_counts']})",
    )
    p.add_argument("--repeats", type=int, help="rounds over all points (default 3, quick 1)")
    p.add_argument("--buffer-size", default="64M", help="pool buffer size (default 64M)")
    p.add_argument("--buffers", type=int, default=4, help="pool buffers in flight (default 4)")
    p.add_argument(
        "--fio",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="measure fio next to the engine (default on)",
    )
    p.add_argument(
        "--fio-block-sizes",
        help=f"default {FULL['fio_block_sizes']}, quick {QUICK['fio_block_sizes']}",
    )
    p.add_argument(
        "--fio-depths", help=f"default {FULL['fio_depths']}, quick {QUICK['fio_depths']}"
    )
    p.add_argument(
        "--interference",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="GIL interference measurement (default: on, off with --quick)",
    )
    p.add_argument(
        "--idle-seconds",
        type=float,
        default=1.0,
        help="length of each idle reference loop of --interference",
    )
    p.add_argument(
        "--sweep-limit",
        default="256M",
        help="largest transfer size of the buffer-size sweep (default 256M)",
    )
    p.add_argument("--sweep-total", help="bytes per point of the buffer-size sweep")
    p.add_argument("--json", type=Path, help="write every measurement to this JSON file")
    p.add_argument("--plot", type=Path, help="draw GB/s vs block size and queue depth (PNG)")
    p.add_argument(
        "--write-config",
        type=Path,
        help="write the recommended aio/buffer settings (runtime's native JSON)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the round order shuffle")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging, swap layer too")
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    preset = QUICK if args.quick else FULL
    for key, value in preset.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.interference is None:
        args.interference = not args.quick
    try:
        args.size = parse_size(args.size)
        args.block_sizes = parse_list(args.block_sizes)
        args.queue_depths = parse_list(args.queue_depths, int)
        args.thread_counts = parse_list(args.thread_counts, _thread_count)
        args.fio_block_sizes = parse_list(args.fio_block_sizes)
        args.fio_depths = parse_list(args.fio_depths, int)
        args.buffer_size = parse_size(args.buffer_size)
        args.sweep_limit = parse_size(args.sweep_limit)
        args.sweep_total = parse_size(args.sweep_total)
        args.backends = parse_list(args.backends, str.strip) if args.backends else None
    except ValueError as exc:
        p.error(str(exc))
    if any(bs % 4096 for bs in args.block_sizes + args.fio_block_sizes) or args.size % 4096:
        p.error("sizes must be multiples of 4096 (O_DIRECT)")
    if args.repeats < 1 or args.buffers < 1 or min(args.queue_depths) < 1:
        p.error("--repeats, --buffers and queue depths must be >= 1")
    args.buffer_size = min(args.buffer_size, args.size)
    return args


def resolve_backends(requested: list[str] | None, path: Path) -> list[str]:
    """The backends to sweep. By default uring and threads where they work; 'buffered' (the page
    cache) only when asked for, or when the file system refuses O_DIRECT and nothing else works."""
    names = requested or ["uring", "threads"]
    usable = []
    for name in names:
        try:
            usable.append(choose_backend(name, path))
        except SwapError as exc:
            log.warning("backend %s skipped: %s", name, exc)
    if not usable and not requested:
        log.warning(
            "no O_DIRECT backend works on %s: measuring 'buffered' (page cache; the read "
            "pass drops the cache first)",
            path,
        )
        usable = ["buffered"]
    return list(dict.fromkeys(usable))


def grid(args: argparse.Namespace, backends: list[str]) -> list[Point]:
    points = []
    for backend in backends:
        for bs in args.block_sizes:
            for qd in args.queue_depths:
                counts = args.thread_counts if backend != "uring" else [None]
                # More threads than queue slots never run; as many is the default (None).
                for tc in dict.fromkeys(None if tc is None or tc >= qd else tc for tc in counts):
                    points.append(Point(backend, bs, qd, tc))
    return points


@dataclass
class Run:
    args: argparse.Namespace
    path: Path
    points: list[PointResult] = field(default_factory=list)
    fio_points: list[report.FioPoint] = field(default_factory=list)
    fio_note: str = ""
    fio_version: str = ""
    sweep: TransferSweep | None = None
    interference: list[InterferenceResult] = field(default_factory=list)
    recommendation: Recommendation | None = None
    disk: DiskCounters | None = None
    aiofiles: dict | None = None


def candidates(results: list[PointResult]) -> list[Candidate]:
    out = []
    for r in results:
        cpus = [c.median for c in (r.cpu("read"), r.cpu("write")) if c]
        out.append(
            Candidate(
                r.point.backend,
                r.point.block_size,
                r.point.queue_depth,
                r.point.thread_count,
                r.median("read"),
                r.median("write"),
                sum(cpus) / len(cpus) if cpus else 0.0,
            )
        )
    return out


def run_grid(run: Run, pool: BufferPool, fio: FioRunner | None, bar: tqdm) -> None:
    args = run.args
    # fio's read directly follows its write, as the engine's does, so both read data that was
    # just written (a virtual disk's host cache may still hold it).
    pairs = [tuple(run.fio_points[i : i + 2]) for i in range(0, len(run.fio_points), 2)]
    tasks: list[PointResult | tuple[report.FioPoint, ...]] = [*run.points, *pairs]
    rng = random.Random(args.seed)
    for round_index in range(args.repeats):
        order = tasks[:]
        rng.shuffle(order)
        for position, task in enumerate(order):
            if isinstance(task, PointResult):
                bar.set_postfix_str(task.point.label)
                try:
                    outcome = measure_point(task.point, run.path, pool, args.size, run.disk)
                except Exception as exc:  # one failing point must not end a long run
                    log.warning("%s failed: %s", task.point.label, exc)
                    outcome = {"error": str(exc)}
                outcome.update(round=round_index, position=position)
                task.runs.append(outcome)
            else:
                for fio_point in task:
                    job = fio_point.job
                    bar.set_postfix_str(
                        f"fio {job.rw} bs={format_size(job.block_size)} qd={job.iodepth}"
                    )
                    try:
                        fio_point.runs.append(fio.run(job))  # type: ignore[union-attr]
                    except FioError as exc:
                        log.warning(
                            "fio %s bs=%d iodepth=%d failed: %s",
                            job.rw,
                            job.block_size,
                            job.iodepth,
                            exc,
                        )
                        fio_point.runs.append(str(exc))
            bar.update()


def run_sweep(run: Run, choice: Candidate, bar: tqdm) -> None:
    args = run.args
    point = Point(choice.backend, choice.block_size, choice.queue_depth, choice.thread_count)
    sizes = transfer_sizes(choice.unit, min(args.sweep_limit, max(args.size, choice.unit)))
    bar.set_postfix_str(f"buffer sizes, {point.label}")
    bar.total += args.repeats * len(sizes)
    run.sweep = TransferSweep(point, run.path, sizes, min(args.sweep_total, args.size))
    try:
        rng = random.Random(args.seed + 1)
        for _ in range(args.repeats):
            for size in rng.sample(sizes, len(sizes)):
                run.sweep.measure(size)
                bar.update()
    finally:
        run.sweep.close()


def run_interference(run: Run, pool: BufferPool, fio: FioRunner | None, bar: tqdm) -> None:
    args = run.args
    for backend in dict.fromkeys(r.point.backend for r in run.points):
        mine = [r for r in run.points if r.point.backend == backend and r.median("read") > 0]
        if not mine:
            continue
        # The point the recommendation would pick for this backend (fastest, near-ties to the
        # least CPU per GiB), so the report's figures are those of the configuration run.
        choice = choose_point(candidates(mine))
        best = next(
            r
            for r in mine
            if (r.point.backend, r.point.block_size, r.point.queue_depth, r.point.thread_count)
            == (choice.backend, choice.block_size, choice.queue_depth, choice.thread_count)
        )
        # And the same point without checksums: how much of the loop's loss is verification
        # (the hasher thread's hand-offs of the GIL) rather than the I/O path.
        points = [best.point, dataclasses.replace(best.point, verify=False)]
        bar.total += 2 * args.repeats
        for point in points:
            bar.set_postfix_str(f"interference, {point.label}")
            try:
                result = measure_interference(
                    point,
                    run.path,
                    pool,
                    args.size,
                    args.repeats,
                    args.idle_seconds,
                    on_step=bar.update,
                )
                result.io_reference = {d: best.median(d) for d in DIRECTIONS}
                run.interference.append(result)
            except Exception as exc:  # the other measurements are still worth reporting
                log.warning("interference measurement with %s failed: %s", point.label, exc)
    if fio is not None and run.fio_points and run.recommendation:
        choice = run.recommendation.candidate
        bar.total += 2 * args.repeats
        bar.set_postfix_str("interference, fio (reference)")
        try:
            result = measure_fio_interference(
                fio,
                choice.block_size,
                choice.queue_depth,
                args.size,
                args.repeats,
                args.idle_seconds,
                on_step=bar.update,
            )
            for fio_point in run.fio_points:
                job, gbps = fio_point.job, fio_point.gbps()
                if (job.block_size, job.iodepth) == (
                    choice.block_size,
                    choice.queue_depth,
                ) and gbps:
                    result.io_reference[job.rw] = gbps.median
            run.interference.append(result)
        except FioError as exc:
            log.warning("interference reference with fio failed: %s", exc)


def to_json(
    run: Run,
    info: dict,
    started: float,
    leftovers: list[str],
    best: dict,
    fio_best: dict,
    ratios: dict,
    config: dict | None,
) -> dict:
    args = run.args
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    rec = run.recommendation
    return {
        "tool": "infinity-bench",
        "format": 1,
        "argv": args.argv,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
        "elapsed_s": time.time() - started,
        "settings": settings,
        "machine": info,
        "points": [r.as_dict() for r in run.points],
        "fio": {
            "available": bool(run.fio_points),
            "note": run.fio_note,
            "version": run.fio_version,
            "jobs": [p.as_dict() for p in run.fio_points],
        },
        "transfer_sweep": run.sweep.as_dict() if run.sweep else None,
        "interference": [r.as_dict() for r in run.interference],
        "best": best,
        "fio_best": fio_best,
        "ratio_to_fio": ratios,
        "aiofiles": run.aiofiles
        and {**run.aiofiles, "ratio": report.ratios_to(best, run.aiofiles["summary"])},
        "recommendation": None
        if rec is None
        else {
            "config": config,
            "reason": rec.reason,
            "point": vars(rec.candidate),
            "score_gbps": rec.candidate.score,
        },
        "leftover_files": leftovers,
    }


def execute(args: argparse.Namespace, path: Path) -> int:
    started = time.time()
    run = Run(args, path, disk=DiskCounters(path))
    backends = resolve_backends(args.backends, path)
    if not backends:
        log.error("no usable backend on %s", path)
        return 1
    for point in grid(args, backends):
        run.points.append(PointResult(point))
    fio_path, run.fio_version = find_fio() if args.fio else (None, "")
    if not args.fio:
        run.fio_note = "disabled with --no-fio"
    elif not fio_path:
        run.fio_note = run.fio_version  # why it is missing
    need = args.size * (2 if fio_path else 1) + (64 << 20)
    free = shutil.disk_usage(path).free
    if free < need:
        log.error(
            "%s has %s free; this run needs about %s (lower --size)",
            path,
            format_size(free),
            format_size(need),
        )
        return 1
    info = machine_info(path)
    load, cpus = info["loadavg"][0], info["cpu_affinity"] or 1
    if load > 0.5 * cpus:
        log.warning(
            "load average %.1f on %d CPUs: other work is running on this machine, so "
            "expect noisier numbers (repeats and medians absorb some of it)",
            load,
            cpus,
        )
    stale = find_leftovers(path, RUN_DIR_PREFIX)
    if stale:  # the first engine below removes them
        print(f"reclaimed: {describe(stale)}")
    before = set(p.name for p in path.iterdir()) - {f.path.name for f in stale}
    fio: FioRunner | None = None
    fio_dir: Path | None = None
    pool = BufferPool(args.buffers, args.buffer_size, name="bench")
    total = args.repeats * len(run.points) + (
        args.repeats * 2 * len(backends) if args.interference else 0
    )
    bar = tqdm(
        total=total,
        file=sys.stderr,
        unit="pass",
        dynamic_ncols=True,
        disable=args.no_progress,
        desc="infinity-bench",
    )
    try:
        fill_pattern(pool)
        if fio_path:
            fio_dir = Path(tempfile.mkdtemp(prefix="infinity-bench-fio-", dir=path))
            fio = FioRunner(fio_path, fio_dir, args.size, disk=run.disk)
            bar.set_postfix_str("fio: laying out its file")
            if fio.prepare():
                for bs in args.fio_block_sizes:
                    for depth in args.fio_depths:
                        for rw in DIRECTIONS:
                            run.fio_points.append(
                                report.FioPoint(
                                    FioJob(rw, bs, depth, args.size, fio.ioengine or "io_uring")
                                )
                            )
                bar.total += args.repeats * len(run.fio_points) // 2
            else:
                run.fio_note = fio.note
                log.warning("%s", fio.note)
        else:
            log.warning("fio not measured: %s", run.fio_note)
        run_grid(run, pool, fio, bar)
        usable = [c for c in candidates(run.points) if c.score > 0]
        if not usable:
            log.error("no grid point completed both a read and a write")
            return 1
        choice = recommend(usable).candidate
        run_sweep(run, choice, bar)
        run.recommendation = recommend(
            usable, run.sweep.medians() if run.sweep else None, choice=choice
        )
        # The obvious Python baseline, at the recommended point's request size and --size bytes.
        bar.set_postfix_str("aiofiles baseline")
        run.aiofiles = aiofiles_baseline.measure(
            run.path, args.size, choice.block_size, args.repeats
        )
        if args.interference:
            run_interference(run, pool, fio, bar)
    finally:
        bar.close()
        pool.close()
        if fio is not None:
            fio.cleanup()
        if fio_dir is not None:
            shutil.rmtree(fio_dir, ignore_errors=True)
    leftovers = sorted(set(p.name for p in path.iterdir()) - before)
    if leftovers:
        log.warning("files left behind in %s: %s", path, leftovers)
    output(run, info, started, leftovers)
    return 0


def output(run: Run, info: dict, started: float, leftovers: list[str]) -> None:
    args = run.args
    best = report.best_by_backend(run.points)
    fio_best = report.best_fio(run.fio_points)
    ratios = report.ratios_to(best, fio_best)
    config = run.recommendation.config() if run.recommendation else None
    mount = info.get("mount", {})
    device = info.get("block_device", {}).get("name", "?")
    print(
        f"infinity-bench on {run.path} ({mount.get('fstype', '?')} on {device}), "
        f"{format_size(args.size)} per pass, {args.buffers} x {format_size(args.buffer_size)} "
        f"buffers in flight, {args.repeats} interleaved repeat(s)"
    )
    print()
    print("\n".join(report.engine_table(run.points, args.repeats)))
    if run.fio_points:
        print()
        print("\n".join(report.fio_table(run.fio_points, run.points, args.size)))
    if run.sweep:
        print()
        medians = run.sweep.medians()
        print(f"Buffer-size sweep, {run.sweep.point.label}: GB/s write/read by transfer size")
        for n in IN_FLIGHT:
            print(
                f"  {n} in flight: "
                + ", ".join(
                    f"{format_size(s)} {m[n]['write']:.2f}/{m[n]['read']:.2f}"
                    for s, m in medians.items()
                )
            )
    print()
    print(
        "\n".join(
            report.summary_lines(
                best,
                fio_best,
                run.fio_note,
                ratios,
                run.interference,
                run.recommendation,
                config,
                run.aiofiles,
            )
        )
    )
    if config:
        print(f"  config: {json.dumps(config)}")
    if args.json:
        data = to_json(run, info, started, leftovers, best, fio_best, ratios, config)
        args.json.write_text(json.dumps(data, indent=1, default=str) + "\n")
        log.info("measurements written to %s", args.json)
    if args.plot:
        from infinity.cli.disk.plot import plot

        plot(
            args.plot,
            run.points,
            run.fio_points,
            f"infinity-bench: {run.path} ({mount.get('fstype', '?')}), "
            f"{format_size(args.size)} per pass, medians of {args.repeats}",
        )
    if args.write_config and config and run.recommendation:
        rec = run.recommendation
        evidence = {
            "config": config,
            "reason": rec.reason,
            "point": vars(rec.candidate),
            "transfer_sweep": run.sweep.as_dict() if run.sweep else None,
            "machine": info,
            "measured": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        sibling = write_config(args.write_config, config, evidence)
        log.info(
            "recommended config written to %s (measurements in %s)", args.write_config, sibling
        )


def _setup_logging(verbose: bool) -> Callable[[], None]:
    """Installs the tool's log handler; returns what undoes it (main may run inside a test)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname).1s %(name)s: %(message)s"))
    root, swap_log = logging.getLogger(), logging.getLogger("swap")
    saved = root.level, swap_log.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG if verbose else logging.INFO)
    # The engine logs every construction at INFO; the bench builds hundreds of them.
    swap_log.setLevel(logging.DEBUG if verbose else logging.WARNING)
    logging.getLogger("matplotlib").setLevel(logging.WARNING)

    def undo() -> None:
        root.removeHandler(handler)
        root.setLevel(saved[0])
        swap_log.setLevel(saved[1])

    return undo


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    undo_logging = _setup_logging(args.verbose)
    made_dir = args.path is None
    path = Path(tempfile.mkdtemp(prefix="infinity-bench-")) if made_dir else args.path
    try:
        with logging_redirect_tqdm():
            if made_dir:
                log.info("no --path given: measuring in %s (removed at the end)", path)
            if not path.is_dir():
                log.error("--path %s is not a directory", path)
                return 2
            return execute(args, path.resolve())
    except KeyboardInterrupt:
        log.error("interrupted; files under %s were cleaned up", path)
        return 130
    finally:
        if made_dir:
            shutil.rmtree(path, ignore_errors=True)
        undo_logging()


if __name__ == "__main__":
    sys.exit(main())
