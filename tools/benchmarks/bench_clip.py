"""Clipping benchmark: what `clip_grad_norm_` after backward costs an attached step.

On the model of tools/bench_overlap (default: 24 x Linear(2048) + ReLU, fp32, batch 16,
100.7 M parameters) it measures the training step with
``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)`` between ``loss.backward()`` and
``optimizer.step()`` against the same step without it, for
  * nvme: attached, parameters and optimizer state on NVMe, under bench_overlap's default host
    budget with its middle staging arena (one that streams about half of the state every step)
    and a 0.1 GiB device tier;
  * plain: model and fused AdamW in memory, no store, for reference (what clipping costs
    PyTorch itself: a pass over every gradient for the norm and another to scale them).
Each configuration runs in a process of its own, warm-up steps first, then timed steps; the
repeats are interleaved, and within each pair the order of clip and no clip alternates from one
repeat to the next, so drift in the disk's speed hits both alike. For each configuration it
prints the median step seconds (min-max over the repeats' medians), the bytes read and written
per step (``store.stats()`` over the timed steps), the seconds of the clip call itself and the
mean total norm ``clip_grad_norm_`` returned (how many steps it exceeded ``--max-norm``, i.e.
were really clipped); then the clip / no-clip step-time ratio and the extra bytes read per step
against the goal: at most 2% slower, no extra reads. The default model's gradient norm is
about 3e-4, so the default ``--max-norm`` of 1e-4 clips every step.

    python -m tools.benchmarks.bench_clip [--host-budget 2.14 --arena 1.0 --max-norm 1e-4
                                          --repeats 3]
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import infinity
from infinity.cli.common.measure import store_deltas
from infinity.core.memory import peak_resident_bytes
from tools.common.workloads import DEFAULT_ARENAS, add_run_arguments, mlp, nvme_config, timed_steps

log = logging.getLogger("tools.benchmarks.bench_clip")

#: the issue's goal for an attached step with clip_grad_norm_: at most this step-time ratio
GOAL_RATIO = 1.02
#: ... and no more bytes read per step than without it
GOAL_EXTRA_READ_BYTES = 0

#: configuration name -> (run kind, clip after backward)
CONFIGS = {
    "plain": ("plain", False),
    "plain+clip": ("plain", True),
    "nvme": ("nvme", False),
    "nvme+clip": ("nvme", True),
}
#: the pairs compared: (without clip, with clip)
PAIRS = (("plain", "plain+clip"), ("nvme", "nvme+clip"))


def run_one(args: argparse.Namespace) -> dict:
    """One configuration in this process: step times, clip call times and norms, I/O bytes."""
    model = mlp(args.layers, args.width)
    optimizer: torch.optim.Optimizer = torch.optim.AdamW(
        model.parameters(), lr=1e-4, fused=True if args.run == "plain" else None
    )
    store = None
    if args.run == "nvme":
        store = infinity.TieredStore(
            nvme_config(
                args.nvme_path, args.host_budget, args.arena, args.device_budget, args.buffer_size
            )
        )
        model, optimizer = store.attach(model, optimizer)
    norms: list[float] = []
    clip_times: list[float] = []

    def clip() -> None:
        started = time.perf_counter()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_norm)
        value = float(norm)  # waits for the norm, as a loop that logs it does
        clip_times.append(time.perf_counter() - started)
        norms.append(value)

    hook = clip if args.clip else None
    # Warm-up (with the clip call when timed with it): the first step creates the optimizer
    # state, the first steps fault in the staging arena and the heap.
    timed_steps(model, optimizer, args.warmup, args.batch, args.width, after_backward=hook)
    norms.clear()
    clip_times.clear()
    before = store.stats() if store else None
    phases: list[tuple[float, float, float]] = []
    times = timed_steps(
        model, optimizer, args.steps, args.batch, args.width, phases, after_backward=hook
    )
    out = {
        "step_s": statistics.median(times),
        "steps_s": times,
        "phases_s": [statistics.median(p) for p in zip(*phases)],
        "clip_s": statistics.median(clip_times) if clip_times else None,
        "norms": norms,
        "peak_rss": peak_resident_bytes(),
    }
    if store is not None and before is not None:
        after = store.stats()
        out.update(store_deltas(before, after, args.steps))
        out.update(
            {
                "peak_bytes": after["peak_bytes"],
                "budgets": after["budgets"],
                "backend": after["backend"],
            }
        )
        store.close(restore_params=False)
    return out


def spread(values: list[float]) -> tuple[float, float, float]:
    """(median, min, max)"""
    return statistics.median(values), min(values), max(values)


def summarize(runs: dict[str, list[dict]], max_norm: float) -> dict:
    """Per configuration: step seconds, I/O and norms over the repeats; per pair: the clip /
    no-clip ratio (of the medians, and of each repeat's two runs) and the extra reads."""
    configs = {}
    for name, results in runs.items():
        norms = [n for r in results for n in r["norms"]]
        entry = {
            "step_s": spread([r["step_s"] for r in results]),
            "clip_s": (
                statistics.median(r["clip_s"] for r in results)
                if results[0]["clip_s"] is not None
                else None
            ),
            "mean_norm": statistics.fmean(norms) if norms else None,
            "clipped_steps": sum(n > max_norm for n in norms),
            "norm_steps": len(norms),
        }
        if "read_bytes" in results[0]:
            entry["read_bytes"] = spread([r["read_bytes"] for r in results])
            entry["write_bytes"] = spread([r["write_bytes"] for r in results])
        configs[name] = entry
    pairs = {}
    for base, clipped in PAIRS:
        a, b = runs[base], runs[clipped]
        ratio = configs[clipped]["step_s"][0] / configs[base]["step_s"][0]
        paired = [y["step_s"] / x["step_s"] for x, y in zip(a, b)]
        pair = {
            "ratio": ratio,
            "paired_ratios": paired,
            "noise": max(
                (s[2] - s[1]) / s[0] for s in (configs[base]["step_s"], configs[clipped]["step_s"])
            ),
        }
        if "read_bytes" in configs[base]:
            pair["extra_read_bytes"] = (
                configs[clipped]["read_bytes"][0] - configs[base]["read_bytes"][0]
            )
            pair["extra_write_bytes"] = (
                configs[clipped]["write_bytes"][0] - configs[base]["write_bytes"][0]
            )
            pair["goal_met"] = (
                ratio <= GOAL_RATIO and pair["extra_read_bytes"] <= GOAL_EXTRA_READ_BYTES
            )
        pairs[clipped] = pair
    return {"configs": configs, "pairs": pairs}


def report(summary: dict, max_norm: float) -> None:
    mb = 1e6
    configs, pairs = summary["configs"], summary["pairs"]
    print(
        f"{'config':11s} {'step s: median (min-max)':>26s} {'clip call s':>11s} "
        f"{'read MB/step':>13s} {'written MB/step':>16s}  mean norm (steps > {max_norm:g})"
    )
    for name, c in configs.items():
        step = "{:.3f} ({:.3f}-{:.3f})".format(*c["step_s"])
        clip_s = f"{c['clip_s']:.4f}" if c["clip_s"] is not None else "-"
        read = f"{c['read_bytes'][0] / mb:.1f}" if "read_bytes" in c else "-"
        write = f"{c['write_bytes'][0] / mb:.1f}" if "write_bytes" in c else "-"
        norm = (
            f"{c['mean_norm']:.4g} ({c['clipped_steps']}/{c['norm_steps']})"
            if c["mean_norm"] is not None
            else "-"
        )
        print(f"{name:11s} {step:>26s} {clip_s:>11s} {read:>13s} {write:>16s}  {norm}")
    for base, clipped in PAIRS:
        pair = pairs[clipped]
        paired = "{:.3f}-{:.3f}".format(min(pair["paired_ratios"]), max(pair["paired_ratios"]))
        noise = (
            f"the repeats' medians spread up to {pair['noise']:.0%}"
            if len(pair["paired_ratios"]) > 1
            else "one repeat: its noise is unmeasured"
        )
        print(
            f"\n{clipped} / {base}: step time {pair['ratio']:.3f}x (each repeat's pair: "
            f"{paired}; {noise})"
            + ("" if "extra_read_bytes" in pair else "; for reference, no store")
        )
        if "extra_read_bytes" in pair:
            print(
                f"  extra per step: read {pair['extra_read_bytes'] / mb:+.1f} MB, written "
                f"{pair['extra_write_bytes'] / mb:+.1f} MB"
            )
            print(
                f"  goal: at most {GOAL_RATIO:.2f}x and no extra reads: "
                f"{'met' if pair['goal_met'] else 'not met'}"
                + (
                    f" (but the repeats spread more than the goal's {GOAL_RATIO - 1:.0%})"
                    if pair["noise"] > GOAL_RATIO - 1
                    else ""
                )
            )
        c = configs[clipped]
        if c["norm_steps"] and not c["mean_norm"]:
            print(
                "  note: clip_grad_norm_ returned 0 on every step: the parameters expose no "
                "gradients after backward, so the call did nothing and the ratio is that of "
                "a no-op"
            )
        elif c["norm_steps"] and not c["clipped_steps"]:
            print(
                f"  note: no step's norm exceeded --max-norm {max_norm:g} (mean "
                f"{c['mean_norm']:.3g}): nothing was clipped; a --max-norm below the norm "
                f"times real clipping"
            )
        reference = configs["plain+clip"]["mean_norm"]
        if clipped != "plain+clip" and c["mean_norm"] and reference:
            print(
                f"  mean norm {c['mean_norm']:.6g} against plain's {reference:.6g} "
                f"(relative difference {abs(c['mean_norm'] / reference - 1):.1e})"
            )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_run_arguments(parser, repeats=3)
    parser.add_argument(
        "--arena",
        type=float,
        default=DEFAULT_ARENAS[1],
        help="GiB of staging arena (default: %(default)s)",
    )
    parser.add_argument(
        "--device-budget",
        type=float,
        default=0.1,
        help="GiB for the device tier (host memory on a machine without a GPU; "
        "default: %(default)s)",
    )
    parser.add_argument("--buffer-size", type=int, default=64 << 20)
    parser.add_argument(
        "--max-norm",
        type=float,
        default=1e-4,
        help="clip_grad_norm_'s max_norm (default: %(default)s; the default "
        "MLP's gradient norm is about 3e-4, so every step clips)",
    )
    parser.add_argument("--run", choices=("plain", "nvme"), help=argparse.SUPPRESS)
    parser.add_argument("--clip", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.run:
        print(json.dumps(run_one(args)))
        return 0
    if args.arena > args.host_budget:
        parser.error(
            f"an arena of {args.arena} GiB does not fit a host budget of {args.host_budget} GiB"
        )
    if min(args.steps, args.repeats) < 1 or args.warmup < 0 or args.max_norm <= 0:
        parser.error(
            "--steps and --repeats must be at least 1, --warmup at least 0, --max-norm positive"
        )

    root = args.nvme_path or Path(tempfile.mkdtemp(prefix="infinity-bench-clip-"))
    params = sum(p.numel() for p in mlp(args.layers, args.width).parameters())
    print(
        f"model: {args.layers} x Linear({args.width}) + ReLU, batch {args.batch}, "
        f"{params / 1e6:.1f} M params; nvme: params + optimizer state on NVMe, device tier "
        f"{args.device_budget:.2f} GiB, host tier {args.host_budget:.2f} GiB, staging arena "
        f"{args.arena:.2f} GiB; clip_grad_norm_(max_norm={args.max_norm:g}); {args.warmup} "
        f"warm-up + {args.steps} timed steps, {args.repeats} interleaved repeats"
    )
    common = [
        "--layers",
        str(args.layers),
        "--width",
        str(args.width),
        "--batch",
        str(args.batch),
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--host-budget",
        str(args.host_budget),
        "--arena",
        str(args.arena),
        "--device-budget",
        str(args.device_budget),
        "--buffer-size",
        str(args.buffer_size),
        "--max-norm",
        str(args.max_norm),
        "--nvme-path",
        str(root),
    ]
    runs: dict[str, list[dict]] = {name: [] for name in CONFIGS}
    try:
        for repeat in range(args.repeats):
            for pair in PAIRS:
                # Alternate which of the pair runs first: a drift within the repeat then
                # favours neither.
                for name in pair if repeat % 2 == 0 else pair[::-1]:
                    kind, clip = CONFIGS[name]
                    command = [
                        sys.executable,
                        "-m",
                        "tools.benchmarks.bench_clip",
                        *common,
                        "--run",
                        kind,
                        *(["--clip"] if clip else []),
                    ]
                    done = subprocess.run(command, capture_output=True, text=True)
                    if done.returncode:
                        raise SystemExit(f"the {name} run failed:\n{done.stderr}")
                    if done.stderr.strip():
                        log.debug("%s run's stderr:\n%s", name, done.stderr)
                    result = json.loads(done.stdout.strip().splitlines()[-1])
                    log.info("%s, repeat %d: %.3f s/step", name, repeat + 1, result["step_s"])
                    runs[name].append(result)
    finally:
        if args.nvme_path is None:
            shutil.rmtree(root, ignore_errors=True)
    summary = summarize(runs, args.max_norm)
    report(summary, args.max_norm)
    if args.json:
        settings = {
            k: (str(v) if isinstance(v, Path) else v)
            for k, v in vars(args).items()
            if k not in ("run", "clip", "json")
        }
        args.json.write_text(
            json.dumps({"settings": settings, "runs": runs, "summary": summary}, indent=2)
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
