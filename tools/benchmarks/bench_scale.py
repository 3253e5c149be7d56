"""Scale benchmark: a GPT whose fp32 training state is several times the host budget and the
machine's memory, trained with the plain loop.

Builds the GPT on the meta device (so the model never exists in host memory whole; default
width 2560, 32 layers, vocab 8192: 2.56 B parameters counting the tied head twice, 38 GiB of
fp32 training state with AdamW), attaches it with parameters and optimizer state on NVMe under a
host budget (default 4 GiB) and nothing else set, and trains ``--steps`` steps of
``loss.backward(); optimizer.step(); optimizer.zero_grad()`` at batch 1 x 128.

Before anything it checks the swap directory's free space and refuses when the state does not
fit. Each step prints its seconds, the bytes it read and wrote, its I/O floor (those bytes at the
swap engine's combined read+write GB/s, measured on the same directory in the same run, after
the training), the seconds the training thread waited for the disk (near 0 where the cores
bind the step), the process's peak RSS in the step (VmHWM, reset per phase) against the host
budget and the store's bound (``stats()['rss_bound']``), and where the step's updates ran. Then
the peak per phase: attach, each step, an optional checkpoint save (``--save``: the checkpoint
needs 12 bytes per parameter more on the disk), and close.

Fewer bytes per step: ``--bf16`` computes in bf16 (fp32 masters), ``--compute-copies`` (with
it) keeps bf16 compute copies of the masters on NVMe for forward and backward to read
(``precision.storage_dtype``), ``--state-dtype bf16|int8`` keeps Adam's moments in fewer bytes
(``precision.optimizer_state_dtype``); each step prints what they saved in bytes read and
written (``stats()['compression']``).

The step is also held against its compute floor, measured in the same run: plain PyTorch
forward, backward and AdamW step (under bf16 autocast with ``--bf16``) in memory, of the GPT at
full width with one layer and with two, in a child process; the floor is the one-layer time
plus the other layers at the two-layer time's difference. Each step prints its ratio to the
compute floor, to the I/O floor and to the larger of the two. The load average is printed at
the start and the end (other work on the machine's cores moves both the step and the floor).

Neither floor counts what the compute and the disk take from each other on few cores, so each
step is also held against its overlap floor (:mod:`infinity.cli.common.contention`): a plain 2-layer
step timed alone and beside the swap engine streaming reads and writes, and the engine's GB/s
alone and beside that step, in a child process; the floor is the step's compute and bytes both
running from its start, each slowed as measured, and the one left then finishing alone.

    python -m tools.benchmarks.bench_scale [--width 2560 --layers 32 --host-budget 4GiB
        --steps 4 --nvme-path DIR --save --json out.json]
    python -m tools.benchmarks.bench_scale --bf16 --compute-copies --state-dtype bf16
    python -m tools.benchmarks.bench_scale --width 768 --layers 12 --host-budget 512MiB  # 0.1 B

Run it in the background: the default moves about 70 GB through the disk per step and needs
43 GB free (75 GB with ``--save``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import infinity
from infinity.cli.common import contention
from infinity.cli.common.measure import reset_peak
from infinity.cli.common.tiny_gpt import GPTConfig, TinyGPT
from infinity.cli.common.transfers import engine_bandwidth
from infinity.config import parse_size
from infinity.core.memory import huge_page_allocations, peak_resident_bytes, warm_runtime
from infinity.training.state_codecs import stored_nbytes

GIB = 1 << 30
#: a checkpoint's bytes per parameter: masters and two moments
CHECKPOINT_BYTES_PER_PARAM = 12
#: stats()["update_mode"] at a step's start, as where that step's updates ran
UPDATE_MODE_NAMES = {"watching the first step": "in optimizer.step() (watched)"}
#: what the engine's bandwidth pass writes next to the state
BANDWIDTH_PASS_BYTES = 2 << 30


def saved_bytes(before: dict[str, Any], after: dict[str, Any]) -> dict[str, int]:
    """Bytes compute copies and compressed optimizer state saved between two
    ``stats()['compression']``: reads and writes saved (negative: added)."""

    def delta(key: str) -> int:
        return int(after[key] - before[key])

    return {
        "state read saved": delta("state_read_as_fp32") - delta("state_read"),
        "state written saved": delta("state_written_as_fp32") - delta("state_written"),
        "compute-copy reads saved": delta("compute_read_as_masters") - delta("compute_read"),
        "compute-copy writes saved": -delta("compute_written"),
    }


def state_bytes_per_param(args: argparse.Namespace) -> float:
    """Bytes per parameter on the swap directory: fp32 masters and gradients, two Adam moments
    as ``--state-dtype`` keeps them, and bf16 compute copies with ``--compute-copies``."""
    moments = 2 * stored_nbytes(args.state_dtype, 1 << 20) / (1 << 20)
    return 8 + moments + (2 if args.compute_copies else 0)


def needed_disk(params: int, args: argparse.Namespace) -> int:
    per_param = state_bytes_per_param(args) + (CHECKPOINT_BYTES_PER_PARAM if args.save else 0)
    return int(params * per_param * 1.02) + BANDWIDTH_PASS_BYTES


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=2560)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument(
        "--host-budget", type=lambda v: parse_size(v, name="--host-budget"), default=4 * GIB
    )
    parser.add_argument("--nvme-path", type=Path, default=None)
    parser.add_argument(
        "--save", action="store_true", help="save a checkpoint after the steps (needs the disk)"
    )
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--bf16", action="store_true", help="compute in bf16 (fp32 masters)")
    parser.add_argument(
        "--compute-copies",
        action="store_true",
        help="bf16 compute copies of the masters on NVMe (implies --bf16)",
    )
    parser.add_argument("--state-dtype", choices=("fp32", "bf16", "int8"), default="fp32")
    parser.add_argument(
        "--compute-floor",
        action="store_true",
        help="(the child process) time plain PyTorch steps of 1 and 2 layers; print JSON",
    )
    parser.add_argument(
        "--contention",
        action="store_true",
        help="(the child process) time a 2-layer step and the engine alone and together",
    )
    args = parser.parse_args(argv)
    args.bf16 = args.bf16 or args.compute_copies
    return args


def gpt_config(args: argparse.Namespace, layers: int) -> GPTConfig:
    return GPTConfig(
        vocab_size=args.vocab,
        context=args.context,
        layers=layers,
        width=args.width,
        heads=max(1, args.width // 128),
    )


def plain_step(args: argparse.Namespace, layers: int) -> Callable[[], None]:
    """One plain PyTorch forward, backward and fused AdamW step of the GPT with ``layers``
    layers in memory (under bf16 autocast with ``--bf16``), as a call."""
    torch.manual_seed(0)
    model = TinyGPT(gpt_config(args, layers))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    generator = torch.Generator().manual_seed(0)

    def step() -> None:
        tokens = torch.randint(0, args.vocab, (args.batch, args.context + 1), generator=generator)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
            loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    return step


def plain_step_seconds(args: argparse.Namespace, layers: int, repeats: int = 3) -> float:
    """Median seconds of :func:`plain_step` with ``layers`` layers, after one untimed."""
    step = plain_step(args, layers)
    step()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def _child(args: argparse.Namespace, *flags: str) -> Any:
    """The JSON a child run of this benchmark with ``flags`` (and the model's shape) prints."""
    command = [
        sys.executable,
        "-m",
        "tools.benchmarks.bench_scale",
        *flags,
        f"--width={args.width}",
        f"--vocab={args.vocab}",
        f"--context={args.context}",
        f"--batch={args.batch}",
    ] + (["--bf16"] if args.bf16 else [])
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def compute_floor(args: argparse.Namespace) -> dict[str, float]:
    """The compute floor of a step of the whole GPT (see the module docstring), measured in a
    child process: its memory stays out of this one's peaks."""
    one, two = _child(args, "--compute-floor")
    per_layer = max(two - one, 0.0)
    return {
        "one_layer_s": one,
        "two_layers_s": two,
        "per_layer_s": per_layer,
        "floor_s": one + (args.layers - 1) * per_layer,
    }


def overlap_contention(args: argparse.Namespace, swap: Path) -> dict[str, float]:
    """How much the compute and the swap engine slow each other when they run at once
    (:mod:`infinity.cli.common.contention`), measured in a child process on ``swap``: one plain
    step of the GPT with two layers, alone and beside the engine streaming reads and writes."""
    result: dict[str, float] = _child(args, "--contention", f"--nvme-path={swap}")
    return result


def load_average() -> str:
    try:
        return " / ".join(f"{v:.1f}" for v in os.getloadavg())
    except OSError:
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.compute_floor:
        print(json.dumps([plain_step_seconds(args, 1), plain_step_seconds(args, 2)]))
        return 0
    if args.contention:
        huge_page_allocations()
        assert args.nvme_path is not None
        settings = infinity.OffloadConfig(offload_param="nvme").aio.engine_settings()
        found = contention.measure(args.nvme_path, settings, plain_step(args, 2))
        print(json.dumps(found.as_dict()))
        return 0
    logging.basicConfig(level=logging.WARNING, format="  %(name)s: %(message)s")
    # As a process started with THP_MEM_ALLOC_ENABLE=1 (docs/tuning.md), before any CPU tensor.
    huge_page_allocations()
    with torch.device("meta"):  # materialised by attach, one module at a time
        model = TinyGPT(gpt_config(args, args.layers))
    params = sum(p.numel() for p in model.parameters())
    parent = args.nvme_path or Path(tempfile.gettempdir())
    parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(parent).free
    needed = needed_disk(params, args)
    if free < needed:
        print(
            f"refused: the {params / 1e9:.2f} B-param model needs {needed / 1e9:.1f} GB free on "
            f"{parent} (training state {state_bytes_per_param(args):g} B/param"
            f"{', a checkpoint 12 B/param' if args.save else ''}, and the bandwidth pass), "
            f"which has {free / 1e9:.1f} GB: free space, pass --nvme-path on a larger drive, "
            f"or fewer --layers"
        )
        return 2
    root = Path(tempfile.mkdtemp(prefix="infinity-bench-scale-", dir=parent))
    try:
        result = run(args, model, params, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


def run(args: argparse.Namespace, model: torch.nn.Module, params: int, root: Path) -> dict:
    warm_runtime()  # what any training process pays, before the store measures the process
    swap = root / "swap"
    swap.mkdir()
    budget = args.host_budget
    state = params * state_bytes_per_param(args)
    copies = "bf16 compute copies, " if args.compute_copies else ""
    print(
        f"model: GPT width {args.width}, {args.layers} layers, vocab {args.vocab}: "
        f"{params / 1e9:.3f} B params ({(params + args.vocab * args.width) / 1e9:.2f} B "
        f"counting the tied head twice); training state with AdamW on NVMe "
        f"{state / GIB:.1f} GiB = {state / budget:.1f}x the host budget of "
        f"{budget / GIB:.2f} GiB; batch {args.batch} x {args.context}; compute "
        f"{'bf16' if args.bf16 else 'fp32'}, {copies}"
        f"Adam state {args.state_dtype}; load average {load_average()}",
        flush=True,
    )
    config = infinity.OffloadConfig(
        offload_param="nvme",
        offload_optimizer="nvme",
        nvme_path=(swap,),
        host_budget=budget,
        precision=infinity.PrecisionConfig(
            dtype="bf16" if args.bf16 else "fp32",
            storage_dtype="bf16" if args.compute_copies else "auto",
            optimizer_state_dtype=args.state_dtype,
        ),
    )
    peaks: dict[str, int] = {}
    reset_peak()
    store = infinity.TieredStore(config)
    started = time.perf_counter()
    model, optimizer = store.attach(model, torch.optim.AdamW(model.parameters(), lr=1e-5))
    assert optimizer is not None
    attach_s = time.perf_counter() - started
    peaks["attach"] = peak_resident_bytes()
    stats = store.stats()
    budgets = stats["budgets"]
    print(
        f"attached in {attach_s:.1f} s: device tier {budgets['device'] / GIB:.2f} GiB "
        f"({'part of the host budget' if budgets['device_in_host'] else 'outside it'}), arena "
        f"{budgets['arena'] / GIB:.2f} GiB in buffers of {budgets['slot'] >> 20} MiB, transient "
        f"reserve {budgets['transient_reserved'] / GIB:.2f} GiB; peak RSS "
        f"{peaks['attach'] / GIB:.2f} GiB",
        flush=True,
    )
    generator = torch.Generator().manual_seed(0)
    steps: list[dict[str, Any]] = []
    print(f"{'step':>4} {'s':>7} {'read GB':>8} {'written GB':>10} {'peak RSS GiB':>12}  update")
    for step in range(args.steps):
        tokens = torch.randint(0, args.vocab, (args.batch, args.context + 1), generator=generator)
        before = store.stats()
        reset_peak()
        started = time.perf_counter()
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        seconds = time.perf_counter() - started
        peak = peak_resident_bytes()
        after = store.stats()
        record = {
            "step_s": seconds,
            "bytes_read": after["bytes_read"] - before["bytes_read"],
            "bytes_written": after["bytes_written"] - before["bytes_written"],
            # the training thread waiting for the disk: near 0 when the cores bind the step
            "stall_s": after["stall_seconds"] - before["stall_seconds"],
            "peak_rss": peak,
            # where this step's updates ran: the mode at its start ('auto' watches the first
            # step with its updates in optimizer.step())
            "update_mode": UPDATE_MODE_NAMES.get(before["update_mode"], before["update_mode"]),
            "update_mode_reasons": after["update_mode_reasons"],
            "loss": loss.item(),
            "slab_misses": after["device_slab_misses"],
            # what compute copies and compressed state saved this step (stats()['compression'])
            "saved": saved_bytes(before["compression"], after["compression"]),
        }
        steps.append(record)
        peaks[f"step {step}"] = peak
        print(
            f"{step:>4} {seconds:>7.1f} {record['bytes_read'] / 1e9:>8.2f} "
            f"{record['bytes_written'] / 1e9:>10.2f} {peak / GIB:>12.2f}  "
            f"{record['update_mode']}"
            + (
                f" ({'; '.join(record['update_mode_reasons'])})"
                if record["update_mode_reasons"]
                else ""
            ),
            flush=True,
        )
    save_s = None
    if args.save:
        reset_peak()
        started = time.perf_counter()
        store.save_checkpoint(root / "checkpoint")
        save_s = time.perf_counter() - started
        peaks["save"] = peak_resident_bytes()
        shutil.rmtree(root / "checkpoint", ignore_errors=True)
    final = store.stats()
    bound = final["rss_bound"]
    reset_peak()
    started = time.perf_counter()
    store.close()  # restore_params='auto': a model larger than the budget stays on meta
    close_s = time.perf_counter() - started
    peaks["close"] = peak_resident_bytes()
    disk = engine_bandwidth(swap, BANDWIDTH_PASS_BYTES // 2, config, combined=True)
    combined = disk["combined"]
    peak = max(peaks.values())
    floor_compute = compute_floor(args)
    compute_s = floor_compute["floor_s"]
    print(
        f"\nswap engine on {swap.parent}: combined read+write {combined / 1e9:.2f} GB/s "
        f"(write {disk['write'] / 1e9:.2f}, read {disk['read'] / 1e9:.2f})"
    )
    print(
        f"compute floor {compute_s:.1f} s: plain PyTorch forward + backward + AdamW in memory"
        f"{' (bf16 autocast)' if args.bf16 else ''}, 1 layer {floor_compute['one_layer_s']:.2f} "
        f"s, 2 layers {floor_compute['two_layers_s']:.2f} s, so {args.layers} layers "
        f"{floor_compute['one_layer_s']:.2f} + {args.layers - 1} x "
        f"{floor_compute['per_layer_s']:.2f} s; load average {load_average()}"
    )
    both_at_once = overlap_contention(args, swap)
    slowdown, retained = both_at_once["compute_slowdown"], both_at_once["io_retained"]
    print(
        f"both at once (a 2-layer plain step beside the engine streaming reads and writes): "
        f"compute {both_at_once['compute_alone_s']:.2f} s alone, "
        f"{both_at_once['compute_beside_io_s']:.2f} s beside the engine ({slowdown:.2f}x); "
        f"the engine {both_at_once['io_alone_bps'] / 1e9:.2f} GB/s alone, "
        f"{both_at_once['io_beside_compute_bps'] / 1e9:.2f} GB/s beside compute "
        f"({retained:.0%} kept). Overlap floor: compute and I/O both from the step's start, "
        f"each slowed so, the one left then alone"
    )
    print(
        f"{'step':>4} {'s':>7} {'moved GB':>9} {'I/O floor s':>11} {'x I/O':>6} "
        f"{'x compute':>9} {'x max':>6} {'overlap s':>9} {'x overlap':>9} {'stall s':>7} "
        f"{'peak RSS GiB':>12} {'vs budget':>9}  update"
    )
    for index, record in enumerate(steps):
        moved = record["bytes_read"] + record["bytes_written"]
        floor = moved / combined
        record["io_floor_s"] = floor
        record["compute_floor_s"] = compute_s
        record["vs_floor"] = record["step_s"] / floor if floor else None
        record["vs_compute_floor"] = record["step_s"] / compute_s if compute_s else None
        both = max(floor, compute_s)
        record["vs_max_floor"] = record["step_s"] / both if both else None
        overlap = contention.overlapped_floor(compute_s, moved, combined, slowdown, retained)
        record["overlap_floor_s"] = overlap
        record["vs_overlap_floor"] = record["step_s"] / overlap
        print(
            f"{index:>4} {record['step_s']:>7.1f} {moved / 1e9:>9.2f} {floor:>11.1f} "
            f"{record['step_s'] / floor:>6.2f} {record['step_s'] / compute_s:>9.2f} "
            f"{record['step_s'] / both:>6.2f} {overlap:>9.1f} {record['vs_overlap_floor']:>9.2f} "
            f"{record['stall_s']:>7.1f} "
            f"{record['peak_rss'] / GIB:>12.2f} "
            f"{record['peak_rss'] / budget:>8.2f}x  {record['update_mode']}"
        )
    for index, record in enumerate(steps):
        saved = record["saved"]
        if any(saved.values()):
            print(
                f"step {index} saved: "
                + "; ".join(f"{what} {value / 1e9:+.2f} GB" for what, value in saved.items())
            )
    print(
        "peak RSS per phase (GiB): "
        + ", ".join(f"{name} {value / GIB:.2f}" for name, value in peaks.items())
        + (f"; save took {save_s:.1f} s" if save_s is not None else "")
        + f"; close took {close_s:.1f} s"
    )
    print(
        f"bound {bound['bound'] / GIB:.2f} GiB = process {bound['process'] / GIB:.2f} "
        f"(interpreter, torch, the module objects, at attach) + host_budget "
        f"{bound['host_budget'] / GIB:.2f} "
        f"+ device outside it {bound['device_outside_host'] / GIB:.2f} + transients outside it "
        f"{bound['transient_outside_host'] / GIB:.2f} + saved activations "
        f"{bound['activations'] / GIB:.2f}: peak {peak / GIB:.2f} GiB, "
        f"{'within' if peak <= bound['bound'] else 'OVER'}; slab misses "
        f"{final['device_slab_misses']}"
    )
    steady = steps[1:] or steps
    ratios = sorted(r["vs_floor"] for r in steady if r["vs_floor"])
    median = ratios[len(ratios) // 2] if ratios else None
    median_step = statistics.median(r["step_s"] for r in steady)
    median_max = statistics.median(r["vs_max_floor"] for r in steady if r["vs_max_floor"])
    median_overlap = statistics.median(r["overlap_floor_s"] for r in steady)
    io_floor = statistics.median(r["io_floor_s"] for r in steady)
    print(
        f"steady steps: median {median_step:.1f} s, {median or 0:.2f}x the I/O floor, "
        f"{median_step / compute_s:.2f}x the compute floor, {median_max:.2f}x the larger, "
        f"{median_step / median_overlap:.2f}x the overlap floor ({median_overlap:.1f} s, itself "
        f"{median_overlap / io_floor:.2f}x the I/O floor)"
    )
    return {
        "precision": {
            "bf16": args.bf16,
            "compute_copies": args.compute_copies,
            "state_dtype": args.state_dtype,
        },
        "compute_floor": floor_compute,
        "contention": both_at_once,
        "median_step_s": median_step,
        "median_vs_max_floor": median_max,
        "params": params,
        "width": args.width,
        "layers": args.layers,
        "host_budget": budget,
        "budgets": budgets,
        "attach_s": attach_s,
        "steps": steps,
        "peaks": peaks,
        "peak_rss": peak,
        "rss_bound": bound,
        "disk": disk,
        "median_vs_floor": median,
        "save_s": save_s,
        "close_s": close_s,
    }


if __name__ == "__main__":
    raise SystemExit(main())
