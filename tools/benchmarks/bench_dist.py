"""Multi-rank benchmark: the tiered store's ZeRO-3 against FSDP2 and DeepSpeed, 2 ranks, gloo.

On the peer-comparison model (24 x Linear(2048) + ReLU, fp32, 100.7 M parameters, batch 16 per
rank) it launches, each with torchrun (``python -m torch.distributed.run --standalone``) in
processes of its own so that each peak RSS is its own, repeats interleaved:
  * ours: the store at ZeRO stage 3, parameters and optimizer state on NVMe (a fresh temporary
    directory under --nvme-path, removed afterwards), under a host budget per rank; the model
    is built on the meta device and attach gives it its values a module at a time (the
    recipe for a model larger than memory), as DeepSpeed's script builds it inside
    ``zero.Init``, so that no rank holds the whole model at once;
  * FSDP2: ``fully_shard`` per layer, no offload, the same model, batch and AdamW;
  * DeepSpeed ZeRO-3 with params and optimizer state on NVMe, through the peer harness's
    script, when its virtual environment is installed; otherwise its figures quoted from the
    peer harness's measurements, labelled as quoted.
Each rank of each run writes a JSON record: the median step (after --warmup untimed steps) and
its peak RSS (VmHWM); ours adds, per step, the collectives by kind (all-gathers of parameter
buckets, reduce-scatters of gradient buckets), the bytes this rank sent into them, the seconds
the training thread waited for them and their share of the step, the same per phase (forward,
backward, optimizer step), swap bytes read and written, and its peak bytes per tier; FSDP2's
adds its collectives per step, counted by torch's CommDebugMode in one more, untimed step. The
driver prints a table and the ratios against the goals (issue 36): step <= 0.5x DeepSpeed's,
<= 0.6x FSDP2's, peak RSS <= 0.3x DeepSpeed's.

    python -m tools.benchmarks.bench_dist [--steps 5 --repeats 3 --host-budget 1.0 --arena 0.5
                                --json OUT]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from infinity.cli.common.measure import store_deltas
from infinity.core.memory import peak_resident_bytes
from tools.common.workloads import add_run_arguments, mlp, nvme_config, timed_steps

PROJECT = Path(__file__).resolve().parents[2]
#: the peer harness (its README, the DeepSpeed script), beside the project's checkout
PEERS = PROJECT.parent / "shared" / "peers"
#: the peer harness's own virtual environment, with DeepSpeed (its 00_setup.sh makes it)
PEERS_VENV = Path(os.environ.get("PEERS_VENV", "/tmp/peers-venv"))
DEEPSPEED_SCRIPT = "30_ds_zero3_nvme.py"

GIB = 2**30
#: quoted from the peer harness's README (2 ranks, gloo, the default model and batch, on this
#: machine type), not re-run here: DeepSpeed ZeRO-3 with params and optimizer state on NVMe ...
QUOTED_DEEPSPEED = {"step_s": 4.60, "peak_rss_gib": 5.40}
#: ... and FSDP2 fully_shard per layer without offload (median step of 3.1-5.2 s)
QUOTED_FSDP2 = {"step_s": 4.3, "peak_rss_gib": 2.2}
QUOTED_FSDP2_RANGE_S = (3.1, 5.2)
#: the goals, as ratios of ours to the peer
GOAL_STEP_VS_DEEPSPEED = 0.5
GOAL_STEP_VS_FSDP2 = 0.6
GOAL_RSS_VS_DEEPSPEED = 0.3

LABELS = {
    "ours": "ours: ZeRO-3, params + optimizer on NVMe",
    "fsdp2": "FSDP2 fully_shard per layer, no offload",
    "deepspeed": "DeepSpeed ZeRO-3, params + optimizer on NVMe",
}


# ---------------------------------------------------------------------------- the ranks


def _init_ranks(timeout_s: float) -> tuple[int, int]:
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


PHASES = ("forward", "backward", "step")


def _timed(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    args: argparse.Namespace,
    snapshot: Any = None,
    mark: Any = None,
) -> tuple[dict, Any, Any]:
    """The warm-up steps, then the timed ones: their median and per-phase medians, with what
    ``snapshot()`` returned just before and just after the timed steps. ``mark()`` (cheap)
    runs as each timed step starts, after its forward, after its backward and at its end."""
    # Every rank draws the same inputs (timed_steps' fixed seed): the step's work does not
    # depend on their values, and the runs of all systems see the same data.
    timed_steps(model, optimizer, args.warmup, args.batch, args.width)
    before = snapshot() if snapshot else None
    phases: list[tuple[float, float, float]] = []
    times = timed_steps(
        model,
        optimizer,
        args.steps,
        args.batch,
        args.width,
        phases,
        after_backward=mark,
        at_start=mark,
        at_end=mark,
        after_forward=mark,
    )
    after = snapshot() if snapshot else None
    return (
        {
            "step_s": statistics.median(times),
            "steps_s": times,
            "phases_s": [statistics.median(p) for p in zip(*phases)],
            "phases_each_s": phases,
        },
        before,
        after,
    )


def comm_by_phase(marks: list[dict], phases: list[tuple[float, float, float]]) -> dict:
    """From four counter snapshots per step (start, after forward, after backward, end) and
    each step's phase seconds: per phase, the per-step mean of the collectives (by kind), the
    bytes and the seconds the training thread waited for them, and that wait's share of the
    phase's time."""
    steps = len(marks) // 4
    out: dict[str, dict] = {}
    for index, name in enumerate(PHASES):
        deltas = [
            {k: marks[4 * s + index + 1][k] - marks[4 * s + index][k] for k in marks[0]}
            for s in range(steps)
        ]
        mean = {k: statistics.mean(d[k] for d in deltas) for k in marks[0]}
        wait = mean["gather_seconds"] + mean["reduce_seconds"]
        seconds = statistics.mean(p[index] for p in phases[:steps])
        out[name] = {
            "all_gathers": mean["all_gathers"],
            "reductions": mean["reductions"],
            "collectives": mean["collectives"],
            "bytes": mean["gathered_bytes"] + mean["reduced_bytes"],
            "wait_s": wait,
            "wait_share": wait / seconds if seconds > 0 else 0.0,
        }
    return out


def count_collectives(model: torch.nn.Module, optimizer: Any, args: argparse.Namespace) -> dict:
    """One more (untimed) step under torch's CommDebugMode: the collectives it issued, by
    operation, and in total (for a system that does not count its own)."""
    try:
        from torch.distributed.tensor.debug import CommDebugMode
    except ImportError:
        return {}
    mode = CommDebugMode()
    with mode:
        timed_steps(model, optimizer, 1, args.batch, args.width)
    counts = {str(op).split(".")[-1]: n for op, n in mode.get_comm_counts().items()}
    return {"total": sum(counts.values()), "by_op": counts}


def comm_deltas(before: dict, after: dict, steps: int) -> dict:
    """Per-step collective traffic between two ``stats()["comm"]`` snapshots: every counter
    in them (bytes, seconds, collectives and whatever else the store counts there)."""
    out = {
        key: (after[key] - before[key]) / steps
        for key, value in after.items()
        if isinstance(value, (int, float))
        and not isinstance(value, bool)
        and key not in ("rank", "world", "stage")
        and key in before
    }
    # the short names the report uses
    out["gather_s"] = out.pop("gather_seconds", 0.0)
    out["reduce_s"] = out.pop("reduce_seconds", 0.0)
    return out


def worker_ours(args: argparse.Namespace, rank: int, world: int) -> dict:
    import infinity

    with torch.device("meta"):
        model = mlp(args.layers, args.width)
    config = nvme_config(
        args.swap_dir,
        args.host_budget,
        args.arena,
        args.device_budget,
        args.buffer_size,
        "nvme",
        device="cpu",
        zero_stage=3,
        reshard_after_forward=RESHARD_CHOICES[args.reshard_after_forward],
    )
    store = infinity.TieredStore(config)
    started = time.perf_counter()
    try:
        model, optimizer = store.attach(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    except infinity.BudgetError as exc:
        store.close(restore_params=False)
        return {
            "error": f"did not attach under a host budget of {args.host_budget:g} GiB "
            f"per rank: {exc}"
        }
    attach_s = time.perf_counter() - started
    partition = store.partition
    marks: list[dict] = []

    def mark() -> None:
        if partition is not None:
            marks.append(dataclasses.asdict(partition.stats))

    out, before, after = _timed(model, optimizer, args, store.stats, mark)
    each = out.pop("phases_each_s")
    if marks:
        out["comm_phases"] = comm_by_phase(marks, each)
    comm = comm_deltas(before["comm"], after["comm"], args.steps)
    comm_s = comm["gather_s"] + comm["reduce_s"]
    out.update(
        {
            "attach_s": attach_s,
            "comm": comm,
            "comm_s": comm_s,
            # of the mean step: the deltas are sums over the timed steps
            "comm_share": comm_s / statistics.mean(out["steps_s"]),
            "peak_bytes": after["peak_bytes"],
            "budgets": after["budgets"],
            "backend": after["backend"],
            "stage": after["comm"]["stage"],
            "comm_backend": after["comm"]["backend"],
        }
    )
    out.update(store_deltas(before, after, args.steps))
    store.close(restore_params=False)
    out["peak_rss"] = peak_resident_bytes()
    return out


def worker_fsdp2(args: argparse.Namespace, rank: int, world: int) -> dict:
    from torch.distributed.fsdp import fully_shard

    model = mlp(args.layers, args.width)
    started = time.perf_counter()
    for layer in model:
        if any(True for _ in layer.parameters()):
            fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    attach_s = time.perf_counter() - started
    out, _, _ = _timed(model, optimizer, args)
    out.pop("phases_each_s")
    out["attach_s"] = attach_s
    out["comm_counted"] = count_collectives(model, optimizer, args)
    out["peak_rss"] = peak_resident_bytes()
    return out


WORKERS = {"ours": worker_ours, "fsdp2": worker_fsdp2}
#: --reshard-after-forward's words, as the config takes them
RESHARD_CHOICES: dict[str, bool | str] = {"auto": "auto", "true": True, "false": False}


def run_worker(args: argparse.Namespace) -> int:
    import torch.distributed as dist

    rank, world = _init_ranks(args.collective_timeout)
    try:
        out = WORKERS[args.worker](args, rank, world)
    finally:
        dist.destroy_process_group()
    out.update(rank=rank, world=world)
    (args.result_dir / f"{args.worker}-rank{rank}.json").write_text(json.dumps(out))
    return 0


# ---------------------------------------------------------------------------- launching


def _launch(
    command: list[str], timeout_s: float, env: dict[str, str] | None = None, cwd: Path = PROJECT
) -> tuple[int, str, str]:
    """Runs ``command`` in a session of its own (torchrun and its ranks); on timeout the whole
    session is stopped. Returns (exit status, stdout, stderr); 124 when it timed out."""
    process = subprocess.Popen(
        command,
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout_s)
        return process.returncode, stdout, stderr
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            stdout, stderr = process.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            stdout, stderr = process.communicate()
        return 124, stdout, stderr + f"\n(stopped after {timeout_s:g} s)"


def _env(threads: int, venv: Path | None = None) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1")
    if venv is not None:  # what the peer harness's env.sh sets
        env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
        env["DS_ACCELERATOR"] = "cpu"
        env.setdefault("TORCH_EXTENSIONS_DIR", str(venv / "torch-extensions"))
    return env


def _tail(text: str, lines: int = 25) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def run_system(
    system: str, args: argparse.Namespace, swap_dir: Path, result_dir: Path
) -> list[dict] | str:
    """One run of ``system`` on ``args.ranks`` ranks: a record per rank, or why it failed."""
    for old in result_dir.glob(f"{system}-rank*.json"):
        old.unlink()
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(args.ranks),
        "--standalone",
        "-m",
        "tools.benchmarks.bench_dist",
        "--worker",
        system,
        "--result-dir",
        str(result_dir),
        "--swap-dir",
        str(swap_dir),
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
        "--reshard-after-forward",
        args.reshard_after_forward,
        "--buffer-size",
        str(args.buffer_size),
        "--collective-timeout",
        str(args.collective_timeout),
    ]
    code, stdout, stderr = _launch(command, args.timeout, _env(args.threads))
    records = [
        json.loads(path.read_text()) for path in sorted(result_dir.glob(f"{system}-rank*.json"))
    ]
    errors = [r["error"] for r in records if "error" in r]
    if errors:
        return errors[0]
    if code or len(records) != args.ranks:
        return (
            f"exit status {code}, {len(records)} of {args.ranks} ranks reported:\n"
            f"{_tail(stderr + stdout)}"
        )
    return sorted(records, key=lambda r: r["rank"])


def deepspeed_available(venv: Path, peers: Path) -> tuple[bool, str]:
    """Whether DeepSpeed's peer run can go, and if not, why."""
    python = venv / "bin" / "python"
    if not python.exists():
        return False, f"not installed (no {python}; the peer harness's 00_setup.sh makes it)"
    if not (peers / DEEPSPEED_SCRIPT).exists():
        return False, f"not installed (no {peers / DEEPSPEED_SCRIPT})"
    code, _, stderr = _launch([str(python), "-c", "import deepspeed"], 300, _env(1, venv))
    if code:
        return False, f"not installed (deepspeed does not import in {venv}: {_tail(stderr, 1)})"
    return True, f"{venv}"


SUMMARY_RE = re.compile(r"SUMMARY .*?mean_step_s=([0-9.]+).*?peak_rss_GiB=([0-9.]+)")


def parse_deepspeed(stdout: str) -> list[dict]:
    """The per-rank records in the DeepSpeed script's SUMMARY lines (one per rank). Its step
    is the mean of the steps after the first, as the script reports it."""
    return [
        {"rank": i, "step_s": float(m.group(1)), "peak_rss": float(m.group(2)) * GIB}
        for i, m in enumerate(SUMMARY_RE.finditer(stdout))
    ]


def run_deepspeed(
    args: argparse.Namespace, swap_dir: Path, venv: Path, peers: Path
) -> list[dict] | str:
    command = [
        str(venv / "bin" / "python"),
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(args.ranks),
        "--standalone",
        str(peers / DEEPSPEED_SCRIPT),
        "--nvme_path",
        str(swap_dir),
        "--steps",
        str(args.steps + 1),
        "--layers",
        str(args.layers),
        "--hidden",
        str(args.width),
        "--batch",
        str(args.batch),
    ]
    code, stdout, stderr = _launch(command, args.timeout, _env(args.threads, venv), cwd=peers)
    records = parse_deepspeed(stdout)
    if code or len(records) != args.ranks:
        return (
            f"exit status {code}, {len(records)} of {args.ranks} SUMMARY lines:\n"
            f"{_tail(stderr + stdout)}"
        )
    return records


# ---------------------------------------------------------------------------- the report


def summarize(runs: list[list[dict] | str]) -> dict | None:
    """Medians over the repeats that succeeded: the slowest rank's median step, the largest
    peak RSS of a rank, and per rank the median of each per-step figure."""
    good = [r for r in runs if not isinstance(r, str)]
    if not good:
        return None
    out = {
        "step_s": statistics.median(max(rank["step_s"] for rank in run) for run in good),
        "steps_s": [max(rank["step_s"] for rank in run) for run in good],
        "peak_rss": statistics.median(max(rank["peak_rss"] for rank in run) for run in good),
        "repeats": len(good),
        "failed": len(runs) - len(good),
    }
    out["ranks"] = [_median_record([run[i] for run in good]) for i in range(len(good[0]))]
    return out


def _median_record(records: list[dict]) -> dict:
    """The median over repeats of every number in ``records`` (nested dicts too)."""
    first = records[0]
    out: dict[str, Any] = {}
    for key, value in first.items():
        if (
            isinstance(value, list)
            and value
            and all(
                isinstance(v, (int, float)) and len(r[key]) == len(value)
                for r in records
                for v in r[key]
            )
        ):
            out[key] = [statistics.median(column) for column in zip(*(r[key] for r in records))]
        elif (
            key in ("rank", "world", "stage")
            or isinstance(value, bool)
            or not isinstance(value, (int, float, dict))
        ):
            out[key] = value
        elif isinstance(value, dict):
            out[key] = _median_record([r[key] for r in records])
        else:
            out[key] = statistics.median(r[key] for r in records)
    return out


def _gib(nbytes: float) -> str:
    return f"{nbytes / GIB:.2f}"


def _mb(nbytes: float) -> str:
    return f"{nbytes / 1e6:.1f}"


def report(
    args: argparse.Namespace,
    summaries: dict[str, dict | None],
    runs: dict[str, list],
    deepspeed_note: str,
    default_model: bool,
) -> dict:
    """Prints the table, the per-rank detail of ours and the goals; returns the ratios."""
    print(f"\n{'system':46s} {'step s':>8s}  {'per repeat':22s} {'peak RSS/rank GiB':>18s}")
    for system in ("ours", "fsdp2", "deepspeed"):
        if system not in runs:
            continue
        s = summaries[system]
        if s is None:
            print(f"{LABELS[system]:46s} {'failed':>8s}")
            continue
        per = "[" + ", ".join(f"{x:.2f}" for x in s["steps_s"]) + "]"
        ranks = ", ".join(_gib(r["peak_rss"]) for r in s["ranks"])
        print(
            f"{LABELS[system]:46s} {s['step_s']:8.3f}  {per:22s} "
            f"{_gib(s['peak_rss']):>8s} ({ranks})"
        )
    if "deepspeed" not in runs and default_model:
        print(
            f"{'DeepSpeed ZeRO-3, NVMe: QUOTED, not measured':46s} "
            f"{QUOTED_DEEPSPEED['step_s']:8.3f}  {'(peer README, 2 ranks)':22s} "
            f"{QUOTED_DEEPSPEED['peak_rss_gib']:8.2f}"
        )
    if default_model:
        low, high = QUOTED_FSDP2_RANGE_S
        print(
            f"{'FSDP2, no offload: QUOTED (earlier run)':46s} "
            f"{QUOTED_FSDP2['step_s']:8.3f}  {f'(range {low}-{high} s)':22s} "
            f"{QUOTED_FSDP2['peak_rss_gib']:8.2f}"
        )
    print(f"DeepSpeed: {deepspeed_note}")

    ours = summaries.get("ours")
    if ours is not None:
        print("\nours per rank, per step (median over repeats):")
        print(
            f"  {'rank':>4s} {'gathered MB':>11s} {'reduce-sc. MB':>13s} "
            f"{'comm wait s':>11s} {'share':>6s} {'read MB':>8s} {'written MB':>10s} "
            f"{'stall s':>8s}  peak device / host / nvme GiB (budgets device / host / arena)"
        )
        for r in ours["ranks"]:
            peak, budgets = r["peak_bytes"], r["budgets"]
            print(
                f"  {r['rank']:4d} {_mb(r['comm']['gathered_bytes']):>11s} "
                f"{_mb(r['comm']['reduced_bytes']):>13s} {r['comm_s']:11.3f} "
                f"{r['comm_share']:6.0%} {_mb(r['read_bytes']):>8s} "
                f"{_mb(r['write_bytes']):>10s} {r['stall_s']:8.3f}  "
                f"{_gib(peak['device'])} / {_gib(peak['host'])} / {_gib(peak['nvme'])} "
                f"({_gib(budgets['device'])} / {_gib(budgets['host'])} / "
                f"{_gib(budgets['arena'])})"
            )
        r0 = ours["ranks"][0]
        ahead = r0["comm"].get("assembled_ahead")
        print(
            f"  comm: {r0['comm_backend']}, ZeRO stage {r0['stage']}, "
            f"{r0['comm']['collectives']:.0f} collectives/step "
            f"({r0['comm'].get('all_gathers', 0):.0f} all-gathers, "
            f"{r0['comm'].get('reductions', 0):.0f} reduce-scatters)"
            + (f", {ahead:.0f} parameters all-gathered ahead" if ahead is not None else "")
            + f"; swap backend {r0['backend']}; "
            f"phases (forward / backward / optimizer step) "
            f"{' / '.join(f'{p:.3f}' for p in r0['phases_s'])} s; attach {r0['attach_s']:.1f} s"
        )
        phases = r0.get("comm_phases")
        if phases:
            print(
                f"  rank 0 per phase: {'phase':>8s} {'s':>6s} {'all-gathers':>11s} "
                f"{'reduce-sc.':>10s} {'MB':>7s} {'waited s':>8s} {'share':>6s}"
            )
            for (name, figures), seconds in zip(phases.items(), r0["phases_s"]):
                print(
                    f"  {'':17s} {name:>8s} {seconds:6.3f} {figures['all_gathers']:11.0f} "
                    f"{figures['reductions']:10.0f} {_mb(figures['bytes']):>7s} "
                    f"{figures['wait_s']:8.3f} {figures['wait_share']:6.0%}"
                )
    fsdp2 = summaries.get("fsdp2")
    if fsdp2 is not None:
        counted = fsdp2["ranks"][0].get("comm_counted") or {}
        if counted:
            ops = ", ".join(f"{n:.0f} {op}" for op, n in sorted(counted["by_op"].items()))
            print(
                f"\nFSDP2 rank 0: {counted['total']:.0f} collectives/step ({ops}; counted by "
                f"CommDebugMode in one more step; its waits are not measured)"
            )

    ratios: dict[str, Any] = {}
    if ours is None:
        print(f"\ngoals: ours {'failed' if 'ours' in runs else 'not run'}, nothing to compare")
        return ratios
    deepspeed = summaries.get("deepspeed")
    if deepspeed is not None:
        ds_step, ds_rss, ds_how = deepspeed["step_s"], deepspeed["peak_rss"] / GIB, "measured"
    elif default_model and "deepspeed" not in runs:
        ds_step, ds_rss = QUOTED_DEEPSPEED["step_s"], QUOTED_DEEPSPEED["peak_rss_gib"]
        ds_how = "QUOTED, not measured"
    else:
        ds_step = ds_rss = None
        ds_how = "failed" if "deepspeed" in runs else "no figures for this model"
    goals = []
    if ds_step is not None:
        goals.append(
            (
                "step vs DeepSpeed",
                ours["step_s"] / ds_step,
                GOAL_STEP_VS_DEEPSPEED,
                f"{ours['step_s']:.3f} / {ds_step:.2f} s, DeepSpeed {ds_how}",
            )
        )
    fsdp2 = summaries.get("fsdp2")
    if fsdp2 is not None:
        goals.append(
            (
                "step vs FSDP2",
                ours["step_s"] / fsdp2["step_s"],
                GOAL_STEP_VS_FSDP2,
                f"{ours['step_s']:.3f} / {fsdp2['step_s']:.3f} s, FSDP2 measured",
            )
        )
    if ds_rss is not None:
        goals.append(
            (
                "peak RSS vs DeepSpeed",
                ours["peak_rss"] / GIB / ds_rss,
                GOAL_RSS_VS_DEEPSPEED,
                f"{_gib(ours['peak_rss'])} / {ds_rss:.2f} GiB per rank, DeepSpeed {ds_how}",
            )
        )
    if not goals:
        print("\ngoals: nothing to compare (no peer figures for this model)")
        return ratios
    print("\nratios, ours / peer (goal):")
    met = []
    for name, ratio, goal, detail in goals:
        ok = ratio <= goal
        met.append(ok)
        ratios[name] = {"ratio": ratio, "goal": goal, "met": ok, "detail": detail}
        print(
            f"  {name:22s} {ratio:5.2f}x (goal <= {goal:.2f}x): "
            f"{'MET' if ok else 'NOT MET'}  [{detail}]"
        )
    missing = [
        n
        for n, present in (
            ("step vs DeepSpeed", ds_step is not None),
            ("step vs FSDP2", fsdp2 is not None),
            ("peak RSS vs DeepSpeed", ds_rss is not None),
        )
        if not present
    ]
    passed = [name for (name, *_), ok in zip(goals, met) if ok]
    failed = [name for (name, *_), ok in zip(goals, met) if not ok]
    quoted = " (DeepSpeed's figures quoted, not measured)" if ds_how.startswith("QUOTED") else ""
    print(
        f"goals: {len(passed)} of {len(goals)} met{quoted}. met: {', '.join(passed) or 'none'}; "
        f"not met: {', '.join(failed) or 'none'}"
        + (f"; not compared: {', '.join(missing)}" if missing else "")
    )
    return ratios


# ---------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_run_arguments(parser, repeats=3)
    # 1.0 GiB holds a rank's share of the state (0.8 GiB) in the arena. A larger budget would
    # not make the step faster, measured here, but lets the heap keep the step's freed
    # blocks for reuse under its line (infinity.core.memory): 0.1-0.2 GiB more RSS.
    parser.set_defaults(host_budget=1.0, warmup=1)
    parser.add_argument(
        "--arena",
        type=float,
        default=0.5,
        help="GiB of swap buffers per rank, inside the host budget (default: "
        "%(default)s); the staging arena grows past them to cache a rank's whole share of "
        "the state (about 0.8 GiB) where the host budget leaves room, as it does at the "
        "default budget, so no step reads or writes the disk",
    )
    parser.add_argument(
        "--device-budget",
        type=float,
        default=0.5,
        help="GiB for the device tier per rank (host memory without a GPU; default: "
        "%(default)s: room for every module's gathered parameters to stay from forward to "
        "backward, reshard_after_forward='auto')",
    )
    parser.add_argument(
        "--reshard-after-forward",
        choices=sorted(RESHARD_CHOICES),
        default="auto",
        help="ours: which modules keep their gathered parameters for backward (%(default)s; "
        "true: none, every backward all-gathers again; false: every module's)",
    )
    parser.add_argument("--buffer-size", type=int, default=64 << 20)
    parser.add_argument("--ranks", type=int, default=2, help="ranks per run (%(default)s)")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="OMP threads per rank, every system alike (%(default)s)",
    )
    parser.add_argument(
        "--systems",
        default="ours,fsdp2,deepspeed",
        help="which to run (%(default)s); DeepSpeed only where installed",
    )
    parser.add_argument(
        "--peers",
        type=Path,
        default=PEERS,
        help="the peer harness's directory (DeepSpeed's script)",
    )
    parser.add_argument(
        "--deepspeed-venv",
        type=Path,
        default=PEERS_VENV,
        help="the peer harness's virtual environment with DeepSpeed "
        "(default: $PEERS_VENV or %(default)s)",
    )
    parser.add_argument(
        "--timeout", type=float, default=900, help="seconds one run may take before it is stopped"
    )
    parser.add_argument("--collective-timeout", type=float, default=300, help=argparse.SUPPRESS)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    parser.add_argument("--result-dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--swap-dir", type=Path, help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.worker:
        return run_worker(args)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    if not systems or set(systems) - {"ours", "fsdp2", "deepspeed"}:
        parser.error(f"--systems {args.systems!r}: a comma list of ours, fsdp2, deepspeed")
    if args.arena > args.host_budget:
        parser.error(
            f"an arena of {args.arena} GiB does not fit a host budget of {args.host_budget} GiB"
        )
    if args.steps < 1 or args.warmup < 1 or args.repeats < 1 or args.ranks < 2:
        parser.error("--steps, --warmup and --repeats must be >= 1, --ranks >= 2")
    began = time.perf_counter()
    default_model = (args.layers, args.width, args.batch, args.ranks) == (24, 2048, 16, 2)
    deepspeed_note = "not run (--systems)"
    if "deepspeed" in systems:
        ok, deepspeed_note = deepspeed_available(args.deepspeed_venv, args.peers)
        if not ok:
            systems.remove("deepspeed")
            if default_model:
                deepspeed_note += (
                    "; its figures below are QUOTED from the peer harness's "
                    "README, not measured here"
                )
        else:
            deepspeed_note = f"measured with {deepspeed_note}"

    if args.nvme_path is not None:
        args.nvme_path.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="infinity-bench-dist-", dir=args.nvme_path)).resolve()
    result_dir = root / "results"
    result_dir.mkdir()
    params = sum(p.numel() for p in mlp(args.layers, args.width).parameters())
    print(
        f"model: {args.layers} x Linear({args.width}) + ReLU, fp32, {params / 1e6:.1f} M params, "
        f"batch {args.batch} per rank, {args.ranks} ranks (gloo, torchrun), {args.threads} "
        f"thread(s) per rank; {args.warmup} untimed + {args.steps} timed steps, "
        f"{args.repeats} repeat(s) interleaved"
    )
    if "ours" in systems:
        print(
            f"ours: ZeRO stage 3, params + optimizer state on NVMe under {root}, per rank: "
            f"host budget {args.host_budget:.2f} GiB, staging arena {args.arena:.2f} GiB, "
            f"device tier {args.device_budget:.2f} GiB"
        )
    runs: dict[str, list] = {s: [] for s in systems}
    summaries: dict[str, dict | None] = {}
    ratios: dict[str, Any] = {}
    leftovers: list[str] = []
    try:
        for repeat in range(args.repeats):
            for system in systems:  # interleaved: drift hits every system alike
                swap_dir = root / f"{system}-{repeat}"
                swap_dir.mkdir()
                started = time.perf_counter()
                if system == "deepspeed":
                    result = run_deepspeed(args, swap_dir, args.deepspeed_venv, args.peers)
                else:
                    result = run_system(system, args, swap_dir, result_dir)
                took = time.perf_counter() - started
                if isinstance(result, str):
                    print(f"  {system} run {repeat + 1}: FAILED after {took:.0f} s: {result}")
                else:
                    print(
                        f"  {system} run {repeat + 1}: {took:.0f} s, median step "
                        f"{max(r['step_s'] for r in result):.3f} s",
                        flush=True,
                    )
                if system == "ours" and swap_dir.exists() and any(swap_dir.iterdir()):
                    leftovers += [str(p) for p in swap_dir.iterdir()]
                runs[system].append(result)
        summaries = {s: summarize(r) for s, r in runs.items()}
        ratios = report(args, summaries, runs, deepspeed_note, default_model)
        if leftovers:
            print(f"WARNING: ours left files in its swap directory: {', '.join(leftovers)}")
        print(f"total wall time {time.perf_counter() - began:.0f} s")
    finally:
        shutil.rmtree(root, ignore_errors=True)
        if args.json:  # what there is, also after a failure
            args.json.write_text(
                json.dumps(
                    {
                        "args": {
                            k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                        },
                        "deepspeed": deepspeed_note,
                        "runs": runs,
                        "summary": summaries,
                        "ratios": ratios,
                        "leftovers": leftovers,
                    },
                    indent=2,
                )
            )
    return 0 if summaries.get("ours") is not None else 1


if __name__ == "__main__":
    raise SystemExit(main())
