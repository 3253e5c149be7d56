"""The planner against the store: predictions for budgets not run yet, then runs with them.

On bench_overlap's model (default: 24 x Linear(2048), fp32, batch 16, 100.7 M parameters; params
and AdamW state on NVMe, 1.6 GB of training state) it records one configuration (a staging
arena of ``--record-arena`` GiB, and a host budget of as much unless ``--host-budget`` says),
asks ``store.predict`` for the arenas of ``--arenas`` with the disk's read and write bandwidth
measured through the swap engine in the same run (in the store's own requests) and how the
model's plain step and the engine slow each other here (``infinity/cli/common/contention.py``;
``--no-contention``: predicted as if they did not), then runs each of them, every run in a
process of its own (its peak RSS is its own), and prints predicted against measured: step time
(goal: within 20%), bytes read and written per step (within 5%) and peak RSS (within 10%).

    python -m tools.benchmarks.bench_plan [--record-arena 1.6 --arenas 1.35,1.0,0.7]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import shutil
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

import infinity
from infinity.cli.common import contention
from infinity.cli.common.args import spawn_child
from infinity.cli.common.measure import compare, measure_steps, reset_peak
from infinity.cli.common.transfers import store_disk_profile
from infinity.planning.planner import DiskProfile
from infinity.planning.simulated_time import Contention
from tools.common.workloads import mlp, nvme_config

log = logging.getLogger("tools.benchmarks.bench_plan")

GIB = 1 << 30
GOALS = {"step_s": 0.20, "read_bytes": 0.05, "write_bytes": 0.05, "peak_rss": 0.10}


#: --update-mode's words, as step_in_backward takes them
UPDATE_MODES: dict[str, bool | str] = {"auto": "auto", "step": False}


def _config(args: argparse.Namespace, arena: float) -> infinity.OffloadConfig:
    # The host budget bounds the whole process; one larger than the arena holds more of the
    # state in the host tier than the arena does (by default the two are one, as in
    # bench_budget: with a 2.14 GiB budget the whole 1.6 GB state stayed in RAM at every arena)
    return nvme_config(
        args.nvme_path,
        args.host_budget or arena,
        arena,
        args.device_budget,
        args.buffer_size,
        step_in_backward=UPDATE_MODES[args.update_mode],
    )


def _store(args: argparse.Namespace, arena: float) -> infinity.TieredStore:
    return infinity.TieredStore(_config(args, arena))


def _training_step(
    args: argparse.Namespace, model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> Callable[[], None]:
    """One training step of the benchmark's loop on a fresh batch (the same batches each run)."""
    generator = torch.Generator().manual_seed(1)

    def step() -> None:
        model(torch.randn(args.batch, args.width, generator=generator)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()

    return step


def _train(args: argparse.Namespace, arena: float) -> tuple[infinity.TieredStore, dict]:
    """The model attached under ``arena``, warmed up, then timed: median step, bytes/step."""
    model = mlp(args.layers, args.width)
    store = _store(args, arena)
    model, optimizer = store.attach(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    step = _training_step(args, model, optimizer)
    return store, measure_steps(store, step, args.warmup, args.steps)


def child_disk(args: argparse.Namespace) -> dict:
    """The disk in the recorded configuration's requests, in a process of its own: its buffers
    (64 MiB, as many as the arena holds: 1.6 GB at the default) are not to be in the peak RSS
    the recording's base is taken from."""
    disk = store_disk_profile(args.nvme_path, args.disk_bytes, _config(args, args.record_arena))
    return dataclasses.asdict(disk)


def child_contention(args: argparse.Namespace) -> dict:
    """How the model's plain training step (in memory, no store) and the swap engine, with the
    recorded configuration's settings, slow each other here."""
    model = mlp(args.layers, args.width)
    step = _training_step(args, model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    config = _config(args, args.record_arena)
    what = f"a plain step of the {args.layers} x {args.width} MLP"
    found = contention.measure_for_planner(args.nvme_path, config, step, what, args.disk_bytes)
    return found.as_dict()


def child_record(args: argparse.Namespace) -> dict:
    """Runs the recorded configuration and predicts the others on the measured disk."""
    disk = DiskProfile(**json.loads(args.disk_json))
    measured_contention = Contention(**json.loads(args.contention)) if args.contention else None
    reset_peak()
    store, measured = _train(args, args.record_arena)
    predictions = {}
    for arena in [args.record_arena, *args.arenas]:
        config = _config(args, arena)
        predictions[str(arena)] = store.predict(
            disk=disk,
            contention=measured_contention,
            host_budget=config.host_budget,
            buffer_count=config.buffer_count,
        )
    store.close(restore_params=False)
    return {
        "disk": dataclasses.asdict(disk),
        "contention": measured_contention.as_dict() if measured_contention else None,
        "recorded": measured,
        "predictions": predictions,
    }


def child_run(args: argparse.Namespace) -> dict:
    store, measured = _train(args, args.arena)
    store.close(restore_params=False)
    return measured


def report(record: dict, runs: dict[str, list[dict]]) -> list[str]:
    disk = record["disk"]
    lines = [
        f"disk ({disk['source']}): read {disk['read_gbps']:.2f} GB/s, write "
        f"{disk['write_gbps']:.2f} GB/s, both at once {disk['combined_gbps']:.2f} GB/s, one "
        f"shared budget",
        f"contention: {(record.get('contention') or {}).get('source', 'not measured')}",
        "",
        f"{'arena GiB':>9} | {'step s pred/meas':>17} {'ratio':>6} | "
        f"{'read MB pred/meas':>18} {'ratio':>6} | {'write MB pred/meas':>19} "
        f"{'ratio':>6} | {'RSS GiB pred/meas':>18} {'ratio':>6}",
        "-" * 122,
    ]
    verdicts: dict[str, list[bool]] = {key: [] for key in GOALS}
    for arena, measured_runs in runs.items():
        prediction = record["predictions"][arena]
        if not prediction.get("fits", True):
            lines.append(f"{arena:>9} | does not fit: {prediction['error']}")
            continue
        measured = {
            "step_s": statistics.median(r["step_s"] for r in measured_runs),
            "read_bytes": statistics.median(r["read_bytes"] for r in measured_runs),
            "write_bytes": statistics.median(r["write_bytes"] for r in measured_runs),
            "peak_rss": statistics.median(r["peak_rss"] for r in measured_runs),
        }
        compared = compare(prediction, measured, GOALS)
        predicted = {key: c["predicted"] for key, c in compared.items()}
        ratios = {key: c["ratio"] for key, c in compared.items()}
        for key, c in compared.items():
            verdicts[key].append(c["met"])
        lines.append(
            f"{arena:>9} | {predicted['step_s']:7.3f} / {measured['step_s']:7.3f} "
            f"{ratios['step_s']:6.2f} | {predicted['read_bytes'] / 1e6:8.1f} / "
            f"{measured['read_bytes'] / 1e6:7.1f} {ratios['read_bytes']:6.3f} | "
            f"{predicted['write_bytes'] / 1e6:8.1f} / {measured['write_bytes'] / 1e6:8.1f} "
            f"{ratios['write_bytes']:6.3f} | {predicted['peak_rss'] / GIB:8.2f} / "
            f"{measured['peak_rss'] / GIB:7.2f} {ratios['peak_rss']:6.2f}"
        )
    lines.append("")
    names = {
        "step_s": "step time within 20%",
        "read_bytes": "bytes read within 5%",
        "write_bytes": "bytes written within 5%",
        "peak_rss": "peak RSS within 10%",
    }
    for key, name in names.items():
        met = verdicts[key]
        lines.append(
            f"goal {name}: {'met' if met and all(met) else 'not met'} "
            f"({sum(met)} of {len(met)} arenas)"
        )
    return lines


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bench_plan", description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--layers", type=int, default=24)
    add("--width", type=int, default=2048)
    add("--batch", type=int, default=16)
    add("--steps", type=int, default=10, help="timed steps after the warm-up")
    add("--warmup", type=int, default=3)
    add("--repeats", type=int, default=2, help="measured runs per predicted arena")
    add(
        "--host-budget",
        type=float,
        default=None,
        help="GiB, the same for every arena (default: each arena's own size)",
    )
    add("--device-budget", type=float, default=0.1, help="GiB")
    add("--buffer-size", type=int, default=64 << 20)
    add("--record-arena", type=float, default=1.6, help="GiB of the recorded run's arena")
    add(
        "--arenas",
        type=lambda t: [float(x) for x in t.split(",")],
        default=[1.35, 1.0, 0.7],
        help="GiB of arena to predict and then run",
    )
    add("--disk-bytes", type=int, default=1 << 30, help="bytes of the disk measurement")
    add(
        "--update-mode",
        choices=sorted(UPDATE_MODES),
        default="auto",
        help="where updates run: auto (step_in_backward='auto': in backward from the second "
        "step, the default) or step (in optimizer.step())",
    )
    add(
        "--no-contention",
        action="store_true",
        help="predict as if compute and the disk did not slow each other (not measured)",
    )
    add("--nvme-path", type=Path, default=None)
    add("--child", choices=("contention", "disk", "record", "run"), help=argparse.SUPPRESS)
    add("--disk-json", help=argparse.SUPPRESS)
    add("--contention", help=argparse.SUPPRESS)
    add("--arena", type=float, help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.child:
        children = {
            "contention": child_contention,
            "disk": child_disk,
            "record": child_record,
            "run": child_run,
        }
        result = children[args.child](args)
        print(json.dumps(result, default=float))
        return 0
    own_dir = args.nvme_path is None
    args.nvme_path = args.nvme_path or Path(tempfile.mkdtemp(prefix="bench-plan-"))
    args.forward = [
        *([f"--host-budget={args.host_budget}"] if args.host_budget else []),
        f"--layers={args.layers}",
        f"--width={args.width}",
        f"--batch={args.batch}",
        f"--steps={args.steps}",
        f"--warmup={args.warmup}",
        f"--device-budget={args.device_budget}",
        f"--buffer-size={args.buffer_size}",
        f"--record-arena={args.record_arena}",
        f"--arenas={','.join(map(str, args.arenas))}",
        f"--disk-bytes={args.disk_bytes}",
        f"--nvme-path={args.nvme_path}",
        f"--update-mode={args.update_mode}",
    ]
    try:
        budget = f"{args.host_budget} GiB" if args.host_budget else "the arena's size"
        print(
            f"recording at a {args.record_arena} GiB arena (host budget {budget}, updates: "
            f"{args.update_mode}), predicting {', '.join(map(str, args.arenas))} GiB ...",
            flush=True,
        )
        disk = spawn_child("tools.benchmarks.bench_plan", args.forward, ["--child=disk"])
        found = ""
        if not args.no_contention:
            measured = spawn_child(
                "tools.benchmarks.bench_plan", args.forward, ["--child=contention"]
            )
            found = json.dumps(measured)
            print(f"contention: {measured['source']}", flush=True)
        record = spawn_child(
            "tools.benchmarks.bench_plan",
            args.forward,
            ["--child=record", f"--disk-json={json.dumps(disk)}", f"--contention={found}"],
        )
        runs: dict[str, list[dict]] = {str(a): [] for a in args.arenas}
        for repeat in range(args.repeats):  # interleaved: the machine's drift hits them all
            for arena in args.arenas:
                runs[str(arena)].append(
                    spawn_child(
                        "tools.benchmarks.bench_plan",
                        args.forward,
                        ["--child=run", f"--arena={arena}"],
                    )
                )
                print(
                    f"  run {repeat + 1}: arena {arena} GiB: "
                    f"{runs[str(arena)][-1]['step_s']:.3f} s/step",
                    flush=True,
                )
    finally:
        if own_dir:
            shutil.rmtree(args.nvme_path, ignore_errors=True)
    print("\n".join(report(record, runs)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
