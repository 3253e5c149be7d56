"""Tight host budgets: each step against its floor, with DeepSpeed measured in the same run.

On bench_overlap's model (default: 24 x Linear(2048) + ReLU, fp32, batch 16, 100.7 M
parameters; parameters and AdamW state on NVMe) it runs, each in a process of its own (its peak
RSS is its own):

* plain: model and AdamW in memory (fused AdamW); and the same with the heap bounded as an
  attached run under a host budget bounds it (on a CPU every gradient autograd makes then
  faults its pages). Both, like the attached runs, with torch's large blocks in huge pages
  (``infinity.core.memory.huge_page_allocations``); the floor starts from the faster of the two;
* for each host budget B (default 1.0 and 0.7 GiB) and each update mode (default: in
  ``optimizer.step()``, and the default config's, ``step_in_backward='auto'``, which updates in
  backward from the second step on this loop): attached with a staging arena of all of B,
  warmed up, then ``--steps`` (default 20) steps, each measured: its seconds per phase (forward,
  backward, optimizer step), the bytes read and written, the device tier's copy seconds, and the
  share of each phase the disk was busy (the swap engine had a transfer of either direction in
  flight: ``EngineStats.busy_seconds``); the peak RSS after the last step;
* DeepSpeed ZeRO-3 with parameters and optimizer state on NVMe, where the peer harness is
  installed (``--peers``: its ``30_ds_zero3_nvme.py`` and the venv its ``env.sh`` names); else
  its figures as last measured on this machine type, marked quoted;
* the disk through the swap engine: reads alone, writes alone, and both at once (the combined
  GB/s when reads and writes share the drive, as during a step), before the first run and
  after each, the floor taking the medians (this disk varies by +-15% and more).

The floor of a step is max(plain compute + the device tier's copies, the step's bytes read and
written at the combined GB/s): the time the cores or the disk need at least, whichever is more.
Without a GPU the device tier is host memory and its copies are memcpy on the cores that also
compute; they are counted as the floor's (a GPU's copy engine would take them off the cores).

That floor takes the cores and the disk each on its own. Three lines beside it show what they cost
each other on this machine: plain PyTorch with the step's bytes moved through the same swap engine
from each step's start (``tools.common.step_io``: the best overlap any schedule can have, so the
floor with the contention is max(that compute + the device copies, its bytes)); plain PyTorch beside
fio in another process at the step's read and write rates (the machine's share of the contention,
where fio is installed); and the I/O path's own CPU at the step's bytes (process CPU seconds per
byte in the disk passes), with the least the cores need once it is spread over them.

    python -m tools.benchmarks.bench_budget [--budgets 1.0,0.7 --modes step,default --steps 20]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

import infinity
from infinity.cli.common.args import spawn_child
from infinity.cli.common.transfers import engine_bandwidth
from infinity.cli.disk.fio import find_fio
from infinity.core.memory import (
    bound_heap_retention,
    huge_page_allocations,
    huge_pages_advised,
    peak_resident_bytes,
    resident_bytes,
)
from tools.common.step_io import StepIO, fio_beside, steps_beside_io
from tools.common.workloads import (
    DEEPSPEED_PEAK_RSS_GIB,
    DEEPSPEED_STEP_S,
    mlp,
    nvme_config,
    timed_steps,
)

log = logging.getLogger("tools.benchmarks.bench_budget")

GIB = 1 << 30
GOALS = {"floor": 1.3, "deepspeed_step": 0.5, "deepspeed_rss": 0.25}
PHASES = ("forward", "backward", "step")
#: --modes: the step_in_backward setting each runs with ('default': what a config that does
#: not set it gets)
UPDATE_SETTINGS: dict[str, Any] = {"step": False, "backward": True, "default": "auto"}
#: where the peer harness lies, relative to the repository
DEFAULT_PEERS = Path(__file__).resolve().parents[2].parent / "shared" / "peers"


# -- measuring ------------------------------------------------------------------------------------
def instrumented_steps(
    model: nn.Module, optimizer: Any, store: Any, steps: int, batch: int, width: int, seed: int = 1
) -> list[dict[str, Any]]:
    """``steps`` training steps of an attached MLP, each measured: seconds per phase, bytes read
    and written, the device tier's copy seconds, the disk's busy seconds per phase (either
    direction in flight) and the process's RSS after the step."""
    generator = torch.Generator().manual_seed(seed)
    engine = store.engine if store is not None else None

    def busy() -> float:
        return engine.stats().busy_seconds if engine is not None else 0.0

    def moved() -> tuple[int, int, float]:
        if store is None:
            return 0, 0, 0.0
        stats = store.stats()
        return stats["bytes_read"], stats["bytes_written"], stats["device_copy_seconds"]

    out = []
    for _ in range(steps):
        x = torch.randn(batch, width, generator=generator)
        read0, written0, copies0 = moved()
        marks = [(time.perf_counter(), busy())]
        loss = model(x).square().mean()
        marks.append((time.perf_counter(), busy()))
        loss.backward()
        marks.append((time.perf_counter(), busy()))
        optimizer.step()
        optimizer.zero_grad()
        marks.append((time.perf_counter(), busy()))
        read1, written1, copies1 = moved()
        seconds = {p: marks[i + 1][0] - marks[i][0] for i, p in enumerate(PHASES)}
        busy_s = {p: marks[i + 1][1] - marks[i][1] for i, p in enumerate(PHASES)}
        out.append(
            {
                "step_s": marks[-1][0] - marks[0][0],
                "phase_s": seconds,
                "busy_s": busy_s,
                "bytes_read": read1 - read0,
                "bytes_written": written1 - written0,
                "copy_s": copies1 - copies0,
                "rss": resident_bytes(),
            }
        )
    return out


def run_child(args: argparse.Namespace) -> dict[str, Any]:
    """One configuration in this process. An attached model is built on the meta device and
    initialised by attach module by module, so that it never exists whole in host memory (as
    DeepSpeed's zero.Init builds its own partitioned)."""
    if args.child == "plain-bounded":
        # As an attached run under a host budget pins it (infinity.core.memory): every block of
        # 1 MiB and more mapped afresh and returned when freed.
        bound_heap_retention()
    # torch's large blocks in huge pages in every run, as a store with a host budget asks for
    # them (infinity.core.memory): plain PyTorch is faster with them too, and the floor must not be
    # a slower plain step than this machine can do.
    huge_page_allocations()
    if args.child.startswith("plain"):
        model = mlp(args.layers, args.width)
    else:
        with torch.device("meta"):
            model = mlp(args.layers, args.width)
    optimizer: Any = torch.optim.AdamW(
        model.parameters(), lr=1e-4, fused=True if args.child.startswith("plain") else None
    )
    store = None
    if not args.child.startswith("plain"):
        config = nvme_config(
            args.nvme_path,
            args.budget,
            args.budget,
            args.device_budget,
            args.buffer_size,
            step_in_backward=UPDATE_SETTINGS[args.child],
        )
        store = infinity.TieredStore(config)
        model, optimizer = store.attach(model, optimizer)
    timed_steps(model, optimizer, args.warmup, args.batch, args.width)
    if args.child == "plain-io":
        probe = nvme_config(args.nvme_path, 1.0, 1.0, args.device_budget, args.buffer_size)
        with StepIO(args.nvme_path, probe.aio.engine_settings(), args.io_read, args.io_write) as io:
            times, computes = steps_beside_io(
                model, optimizer, io, args.steps, args.batch, args.width
            )
            return {
                "step_s": statistics.median(times),
                "compute_s": statistics.median(computes),
                "io_s": statistics.median(io.seconds),
                "peak_rss": peak_resident_bytes(),
            }
    steps = instrumented_steps(model, optimizer, store, args.steps, args.batch, args.width)
    out: dict[str, Any] = {
        "steps": steps,
        "peak_rss": peak_resident_bytes(),
        "huge_pages": bool(huge_pages_advised()),
    }
    if store is not None:
        stats = store.stats()
        out.update(
            peak_bytes=stats["peak_bytes"],
            budgets=stats["budgets"],
            heap_reuse=stats["heap_reuse"],
            update_mode=stats["update_mode"],
            huge_pages=stats["huge_page_allocations"],
        )
        store.close(restore_params=False)
    return out


def run_deepspeed(args: argparse.Namespace) -> dict[str, Any] | None:
    """DeepSpeed ZeRO-3 (params and optimizer state on NVMe) through the peer harness, or None
    where it is not installed."""
    peers = args.peers
    script, env = peers / "30_ds_zero3_nvme.py", peers / "env.sh"
    if not (script.is_file() and env.is_file()):
        return None
    directory = Path(tempfile.mkdtemp(prefix="ds-nvme-", dir=args.nvme_path))
    command = (
        f"source {env} && python {script} --nvme_path {directory} --steps "
        f"{args.deepspeed_steps} --layers {args.layers} --hidden {args.width} "
        f"--batch {args.batch}"
    )
    try:
        done = subprocess.run(
            ["bash", "-c", command],
            capture_output=True,
            text=True,
            timeout=args.deepspeed_timeout,
            check=False,
        )
    except subprocess.TimeoutExpired:
        log.warning("DeepSpeed did not finish within %d s", args.deepspeed_timeout)
        return None
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    found = re.search(r"SUMMARY .*mean_step_s=([\d.]+).*peak_rss_GiB=([\d.]+)", done.stdout)
    if done.returncode != 0 or found is None:
        log.warning(
            "DeepSpeed run failed (exit %d): %s",
            done.returncode,
            (done.stderr or done.stdout)[-800:],
        )
        return None
    return {
        "step_s": float(found.group(1)),
        "peak_rss": float(found.group(2)) * GIB,
        "source": "measured in this run",
    }


# -- reporting ----------------------------------------------------------------------------------
#: the cores this process may run on: the I/O path's CPU is spread over them at best
CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def summarise(
    steps: list[dict[str, Any]], compute_s: float, combined: float, cpu_per_byte: float = 0.0
) -> dict[str, Any]:
    """Medians over the measured steps, the floor and the ratio to it, and the I/O path's own
    CPU at the step's bytes (``cpu_per_byte`` from the disk passes)."""

    def median(key: str) -> float:
        return statistics.median(s[key] for s in steps)

    step_s = median("step_s")
    moved = median("bytes_read") + median("bytes_written")
    io_s = moved / combined
    copy_s = median("copy_s")
    floor = max(compute_s + copy_s, io_s)
    io_cpu_s = moved * cpu_per_byte
    # The cores cannot do better than compute on all of them plus the I/O path's CPU spread
    # over them: a lower bound of its own, not part of the floor.
    cores_with_io = compute_s + copy_s + io_cpu_s / CORES
    phase_s = {p: statistics.median(s["phase_s"][p] for s in steps) for p in PHASES}
    busy_share = {
        p: statistics.median(
            s["busy_s"][p] / s["phase_s"][p] if s["phase_s"][p] else 0.0 for s in steps
        )
        for p in PHASES
    }
    whole_busy = statistics.median(sum(s["busy_s"].values()) / s["step_s"] for s in steps)
    return {
        "step_s": step_s,
        "io_s": io_s,
        "copy_s": copy_s,
        "floor_s": floor,
        "bound": "disk" if io_s >= compute_s + copy_s else "cores",
        "vs_floor": step_s / floor,
        "phase_s": phase_s,
        "busy_share": busy_share,
        "busy_share_step": whole_busy,
        "bytes_read": median("bytes_read"),
        "bytes_written": median("bytes_written"),
        "io_cpu_s": io_cpu_s,
        "cores_with_io_s": cores_with_io,
    }


def step_lines(steps: list[dict[str, Any]]) -> list[str]:
    lines = [
        f"    {'step':>4} {'s':>6} {'fwd/bwd/step s':>18} {'read MB':>8} {'write MB':>8} "
        f"{'disk busy fwd/bwd/step':>23} {'RSS GiB':>7}"
    ]
    for i, s in enumerate(steps, 1):
        phase = "/".join(f"{s['phase_s'][p]:.2f}" for p in PHASES)
        busy = "/".join(
            f"{s['busy_s'][p] / s['phase_s'][p]:.2f}" if s["phase_s"][p] else "-" for p in PHASES
        )
        lines.append(
            f"    {i:>4} {s['step_s']:6.3f} {phase:>18} {s['bytes_read'] / 1e6:8.0f} "
            f"{s['bytes_written'] / 1e6:8.0f} {busy:>23} {s['rss'] / GIB:7.2f}"
        )
    return lines


def report(
    results: dict[str, Any],
    disk: dict[str, Any],
    deepspeed: dict[str, Any],
    budgets: list[float],
    modes: list[str],
    verbose: bool,
) -> list[str]:
    plain = results["plain"]
    plain_s = statistics.median(s["step_s"] for s in plain["steps"])
    low, high = disk["combined_range"]
    bounded_s = statistics.median(s["step_s"] for s in results["plain-bounded"]["steps"])
    compute_s = min(plain_s, bounded_s)  # the floor starts from the faster plain step
    lines = [
        f"disk (swap engine, this run, medians of {disk['samples']} measurements "
        f"between the runs): read {disk['read'] / 1e9:.2f} GB/s, write "
        f"{disk['write'] / 1e9:.2f} GB/s, both at once {disk['combined'] / 1e9:.2f} GB/s "
        f"combined [{low / 1e9:.2f}-{high / 1e9:.2f}]",
        f"plain in memory: {plain_s:.3f} s/step, peak RSS {plain['peak_rss'] / GIB:.2f} GiB",
        f"plain in memory with the heap bounded as under a host budget (blocks of 1 MiB "
        f"and more mapped afresh): {bounded_s:.3f} s/step",
        f"both with torch's large blocks in huge pages: "
        f"{'yes' if plain.get('huge_pages') else 'no'}; the floors' compute is the faster "
        f"of the two plain steps, {compute_s:.3f} s",
        f"DeepSpeed ZeRO-3, params + optimizer state on NVMe ({deepspeed['source']}): "
        f"{deepspeed['step_s']:.2f} s/step, peak RSS {deepspeed['peak_rss'] / GIB:.2f} GiB",
        "",
    ]
    verdicts = []
    for budget in budgets:
        for mode in modes:
            key = f"{mode}@{budget}"
            run = results[key]
            s = summarise(run["steps"], compute_s, disk["combined"], disk.get("cpu_per_byte", 0.0))
            label = {
                "step": "update in optimizer.step()",
                "backward": "step_in_backward=True",
                "default": f"the default (step_in_backward='auto': updates "
                f"{run.get('update_mode')})",
            }[mode]
            lines.append(
                f"host budget {budget:.2f} GiB, {label}: {s['step_s']:.3f} s/step (median of "
                f"{len(run['steps'])}), floor {s['floor_s']:.3f} s ({s['bound']}: compute "
                f"{compute_s:.3f} + device copies {s['copy_s']:.3f}, I/O {s['io_s']:.3f} for "
                f"{s['bytes_read'] / 1e9:.2f} GB in + {s['bytes_written'] / 1e9:.2f} GB out) -> "
                f"{s['vs_floor']:.2f}x the floor"
            )
            lines.append(
                "  phases "
                + ", ".join(
                    f"{p} {s['phase_s'][p]:.3f} s (disk busy {s['busy_share'][p]:.0%})"
                    for p in PHASES
                )
                + f"; disk busy {s['busy_share_step']:.0%} of the step"
            )
            beside = run.get("beside_io")
            if beside:
                # Copies run on the cores: they add to the compute, not to the disk's time
                contended = max(beside["compute_s"] + s["copy_s"], beside["io_s"])
                lines.append(
                    f"  plain PyTorch with these bytes moved beside it from its start (the "
                    f"best overlap, the contention measured): compute {beside['compute_s']:.3f} "
                    f"s, bytes {beside['io_s']:.3f} s; floor with the contention max(compute + "
                    f"device copies, bytes) {contended:.3f} s -> {s['step_s'] / contended:.2f}x "
                    f"that"
                )
            if run.get("beside_fio"):
                lines.append(
                    f"  plain PyTorch beside fio in another process at this step's read and "
                    f"write rates: {run['beside_fio']:.3f} s/step against {plain_s:.3f} alone"
                )
            lines.append(
                f"  the I/O path's own CPU at these bytes {s['io_cpu_s']:.3f} cpu-s (submission, "
                f"completions, checksums; measured in the disk passes): the {CORES} cores that "
                f"compute need at least {s['cores_with_io_s']:.3f} s with it -> "
                f"{s['step_s'] / s['cores_with_io_s']:.2f}x that"
            )
            lines.append(
                f"  peak RSS after {len(run['steps'])} steps {run['peak_rss'] / GIB:.2f} GiB "
                f"(host tier peak {run['peak_bytes']['host'] / GIB:.2f}, device tier "
                f"{run['peak_bytes']['device'] / GIB:.2f}); vs DeepSpeed: step "
                f"{s['step_s'] / deepspeed['step_s']:.2f}x, peak RSS "
                f"{run['peak_rss'] / deepspeed['peak_rss']:.2f}x; torch's large blocks in "
                f"{'huge' if run.get('huge_pages') else '4 KiB'} pages"
            )
            if verbose:
                lines += step_lines(run["steps"])
            verdicts.append((key, budget, s, run))
    lines.append("")
    for key, _budget, s, _run in verdicts:
        ok = s["vs_floor"] <= GOALS["floor"]
        lines.append(
            f"goal {key}: step within {GOALS['floor']}x of its floor: "
            f"{'met' if ok else 'not met'} ({s['vs_floor']:.2f}x)"
        )
    best: dict[float, tuple[dict, dict, str]] = {}
    for key, budget, s, run in verdicts:
        if budget not in best or s["step_s"] < best[budget][0]["step_s"]:
            best[budget] = (s, run, key)
    if 1.0 in best:
        s, run, key = best[1.0]
        step_ratio = s["step_s"] / deepspeed["step_s"]
        rss_ratio = run["peak_rss"] / deepspeed["peak_rss"]
        met = step_ratio <= GOALS["deepspeed_step"] and rss_ratio <= GOALS["deepspeed_rss"]
        lines.append(
            f"goal at 1.0 GiB ({key}, the faster mode): at most "
            f"{GOALS['deepspeed_step']}x DeepSpeed's step and "
            f"{GOALS['deepspeed_rss']}x its peak RSS: "
            f"{'met' if met else 'not met'} ({step_ratio:.2f}x, {rss_ratio:.2f}x)"
        )
    return lines


# -- driving ------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bench_budget", description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--layers", type=int, default=24)
    add("--width", type=int, default=2048)
    add("--batch", type=int, default=16)
    add("--steps", type=int, default=20, help="measured steps per run, after the warm-up")
    add("--warmup", type=int, default=3)
    add(
        "--budgets",
        type=lambda t: [float(x) for x in t.split(",")],
        default=[1.0, 0.7],
        help="host budgets in GiB, a comma list (the staging arena takes all of each)",
    )
    add(
        "--modes",
        type=lambda t: t.split(","),
        default=["step", "default"],
        help="where updates run: 'step' (step_in_backward=False), 'backward' "
        "(step_in_backward=True), 'default' (not set: 'auto')",
    )
    add("--device-budget", type=float, default=0.1, help="GiB")
    add("--buffer-size", type=int, default=64 << 20)
    add("--disk-bytes", type=int, default=1 << 30, help="bytes of each disk measurement")
    add("--nvme-path", type=Path, default=None)
    add(
        "--peers",
        type=Path,
        default=DEFAULT_PEERS,
        help="the peer harness (30_ds_zero3_nvme.py and env.sh); missing: DeepSpeed's figures "
        "are quoted",
    )
    add("--deepspeed-steps", type=int, default=6)
    add("--deepspeed-timeout", type=int, default=900)
    add("--per-step", action="store_true", help="print every measured step")
    add("--json", type=Path, default=None)
    add(
        "--child",
        choices=("plain", "plain-bounded", "plain-io", *UPDATE_SETTINGS),
        help=argparse.SUPPRESS,
    )
    add("--io-read", type=int, default=0, help=argparse.SUPPRESS)
    add("--io-write", type=int, default=0, help=argparse.SUPPRESS)
    add("--budget", type=float, help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    for mode in args.modes:
        if mode not in UPDATE_SETTINGS:
            parser.error(
                f"--modes: unknown mode {mode!r}; use step, backward, default or a "
                f"comma list of them"
            )
    if args.child:
        print(json.dumps(run_child(args), default=float))
        return 0
    own_dir = args.nvme_path is None
    args.nvme_path = args.nvme_path or Path(tempfile.mkdtemp(prefix="bench-budget-"))
    args.forward = [
        f"--layers={args.layers}",
        f"--width={args.width}",
        f"--batch={args.batch}",
        f"--steps={args.steps}",
        f"--warmup={args.warmup}",
        f"--device-budget={args.device_budget}",
        f"--buffer-size={args.buffer_size}",
        f"--nvme-path={args.nvme_path}",
    ]
    try:
        probe = nvme_config(
            args.nvme_path,
            max(args.budgets),
            max(args.budgets),
            args.device_budget,
            args.buffer_size,
        )
        # The disk is measured before the first run and after each (this disk varies by
        # +-15% or more from one minute to the next): the floor uses the medians.
        samples: list[dict[str, float]] = []

        def measure_disk() -> None:
            samples.append(engine_bandwidth(args.nvme_path, args.disk_bytes, probe, combined=True))
            last = samples[-1]
            print(
                f"disk: read {last['read'] / 1e9:.2f}, write {last['write'] / 1e9:.2f}, "
                f"combined {last['combined'] / 1e9:.2f} GB/s",
                flush=True,
            )

        measure_disk()
        results = {
            "plain": spawn_child("tools.benchmarks.bench_budget", args.forward, ["--child=plain"]),
            "plain-bounded": spawn_child(
                "tools.benchmarks.bench_budget", args.forward, ["--child=plain-bounded"]
            ),
        }
        for budget in args.budgets:
            for mode in args.modes:
                key = f"{mode}@{budget}"
                results[key] = spawn_child(
                    "tools.benchmarks.bench_budget",
                    args.forward,
                    [f"--child={mode}", f"--budget={budget}"],
                )
                step = statistics.median(s["step_s"] for s in results[key]["steps"])
                print(f"  {key}: {step:.3f} s/step", flush=True)
                measure_disk()
        fio, _ = find_fio(install=False)
        for key in [k for k in results if "@" in k]:
            # The same bytes beside plain PyTorch: the floor with the contention measured,
            # through this engine and, at the same rate, through fio in another process
            steps = results[key]["steps"]
            read = statistics.median(s["bytes_read"] for s in steps)
            written = statistics.median(s["bytes_written"] for s in steps)
            results[key]["beside_io"] = spawn_child(
                "tools.benchmarks.bench_budget",
                args.forward,
                ["--child=plain-io", f"--io-read={int(read)}", f"--io-write={int(written)}"],
            )
            if fio is not None:
                step = statistics.median(s["step_s"] for s in steps)
                with fio_beside(fio, args.nvme_path, read / step, written / step):
                    beside = spawn_child(
                        "tools.benchmarks.bench_budget", args.forward, ["--child=plain"]
                    )
                results[key]["beside_fio"] = statistics.median(s["step_s"] for s in beside["steps"])
        disk: dict[str, Any] = {
            key: statistics.median(sample[key] for sample in samples) for key in samples[0]
        }
        disk["combined_range"] = (
            min(x["combined"] for x in samples),
            max(x["combined"] for x in samples),
        )
        disk["samples"] = len(samples)
        deepspeed = run_deepspeed(args)
        if deepspeed is None:
            deepspeed = {
                "step_s": DEEPSPEED_STEP_S,
                "peak_rss": DEEPSPEED_PEAK_RSS_GIB * GIB,
                "source": "quoted: the peer harness is not installed here",
            }
    finally:
        if own_dir:
            shutil.rmtree(args.nvme_path, ignore_errors=True)
    print("\n".join(report(results, disk, deepspeed, args.budgets, args.modes, args.per_step)))
    if args.json:
        args.json.write_text(
            json.dumps(
                {"disk": disk, "deepspeed": deepspeed, "runs": results}, indent=2, default=float
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
