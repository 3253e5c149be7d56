"""Scale benchmark: a model whose fp32 training state is several times the host budget.

Builds an MLP on the meta device (so the model never exists in host memory whole), attaches it
with parameters, gradients and Adam state on NVMe under a host budget, trains a few steps, and
prints the training state's size, the budgets and the process's peak RSS against
host budget + device budget (the device tier is host memory on a machine without a GPU) + a
fixed overhead: the Python process with torch loaded and initialised, measured before the model
is built, plus two of the largest parameter's size for the transient buffers autograd makes in
backward (a weight's gradient and the input gradient being computed next to it) before the store
moves them away. Neither term grows with the number of layers.

Each step prints its seconds per phase, the bytes it read and wrote and the share of each phase the
disk was busy; at the end, the step against its floor as ``tools.benchmarks.bench_budget`` computes
it (max(compute + device copies, the step's bytes at the disk's combined read+write GB/s), the
compute timed on one layer in memory and multiplied by the layers).

    python -m tools.benchmarks.bench_scale [--params 500M --host-budget 2GiB --steps 3]

Run it in the background: the default moves tens of GB through the disk.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import psutil
import torch
from torch import nn

import infinity
from infinity.config import parse_size
from infinity.core.memory import huge_page_allocations, peak_resident_bytes
from tools.benchmarks.bench_budget import PHASES, instrumented_steps, summarise
from tools.benchmarks.bench_overlap import engine_bandwidth, mlp


def peak_rss() -> int:
    return peak_resident_bytes()


def layer_compute_seconds(width: int, batch: int, repeats: int = 5) -> float:
    """Seconds of one Linear(width) layer's forward, backward and AdamW update in memory
    (the median of ``repeats``): the floor's compute is this times the layers."""
    layer = nn.Linear(width, width)
    optimizer = torch.optim.AdamW(layer.parameters(), lr=1e-5)
    x = torch.randn(batch, width)
    times = []
    for _ in range(repeats + 1):
        started = time.perf_counter()
        layer(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - started)
    del layer, optimizer
    return sorted(times[1:])[repeats // 2]


def add_scale_arguments(parser: argparse.ArgumentParser, steps_help: str = "") -> None:
    """The scale model and its budgets (shared with the checkpoint benchmark)."""
    parser.add_argument(
        "--params",
        type=lambda v: int(float(v.rstrip("Mm")) * 1e6),
        default=500_000_000,
        help="parameter count, e.g. 500M",
    )
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3, help=steps_help or None)
    parser.add_argument(
        "--host-budget", type=lambda v: parse_size(v, name="--host-budget"), default=2 << 30
    )
    parser.add_argument(
        "--device-budget", type=lambda v: parse_size(v, name="--device-budget"), default=256 << 20
    )
    parser.add_argument(
        "--buffer-size", type=lambda v: parse_size(v, name="--buffer-size"), default=64 << 20
    )
    parser.add_argument("--nvme-path", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_scale_arguments(parser)
    args = parser.parse_args(argv)
    root = args.nvme_path or Path(tempfile.mkdtemp(prefix="infinity-bench-scale-"))
    # As a process started with THP_MEM_ALLOC_ENABLE=1 (docs/tuning.md): the warm-up below
    # makes CPU tensors, after which torch no longer reads the setting.
    huge_page_allocations()
    # Python + torch with its runtime initialised (thread pools, kernels), before any model
    # exists: what every training process pays whatever its model.
    warm = nn.Linear(64, 64)
    warm(torch.randn(4, 64)).sum().backward()
    torch.optim.AdamW(warm.parameters()).step()  # the optimizer machinery loads on first use
    del warm
    overhead = psutil.Process().memory_info().rss
    layers = max(1, round(args.params / (args.width * args.width + args.width)))
    with torch.device("meta"):  # materialised by attach, one module at a time
        model = mlp(layers, args.width)
    params = sum(p.numel() for p in model.parameters())
    state = params * 16  # fp32 params + grads + two Adam moments
    print(
        f"model: {layers} x Linear({args.width}) = {params / 1e6:.0f} M params; fp32 training "
        f"state {state / 2**30:.2f} GiB = {state / args.host_budget:.1f}x the host budget "
        f"of {args.host_budget / 2**30:.2f} GiB"
    )
    config = infinity.OffloadConfig(
        offload_param="nvme",
        offload_optimizer="nvme",
        nvme_path=(root,),
        buffer_size=args.buffer_size,
        buffer_count=max(4, args.host_budget // args.buffer_size),
        host_budget=args.host_budget,
        device_budget=args.device_budget,
    )
    store = infinity.TieredStore(config)
    started = time.perf_counter()
    model, optimizer = store.attach(model, torch.optim.AdamW(model.parameters(), lr=1e-5))
    attach_s = time.perf_counter() - started
    print(f"attached in {attach_s:.1f} s; peak RSS so far {peak_rss() / 2**30:.2f} GiB")
    measured = []
    for step in range(args.steps):
        measured += instrumented_steps(
            model, optimizer, store, 1, args.batch, args.width, seed=step
        )
        last = measured[-1]
        phases = "/".join(f"{last['phase_s'][p]:.1f}" for p in PHASES)
        busy = "/".join(f"{last['busy_s'][p] / max(last['phase_s'][p], 1e-9):.0%}" for p in PHASES)
        print(
            f"step {step + 1}: {last['step_s']:.1f} s ({phases} forward/backward/step), read "
            f"{last['bytes_read'] / 1e9:.2f} GB, written {last['bytes_written'] / 1e9:.2f} GB, "
            f"disk busy {busy}, peak RSS {peak_rss() / 2**30:.2f} GiB",
            flush=True,
        )
    times = [m["step_s"] for m in measured]
    stats = store.stats()
    store.close(restore_params=False)
    peak = peak_rss()  # before the disk measurement's own buffers
    disk = engine_bandwidth(root, 1 << 30, config, combined=True)
    compute_s = layers * layer_compute_seconds(args.width, args.batch)
    steady = measured[1:] or measured  # the first step creates the optimizer state
    summary = summarise(steady, compute_s, disk["combined"])
    print(
        f"floor {summary['floor_s']:.2f} s ({summary['bound']}: compute {compute_s:.2f} "
        f"(one layer timed in memory, x {layers}) + device copies {summary['copy_s']:.2f}, "
        f"I/O {summary['io_s']:.2f} for {summary['bytes_read'] / 1e9:.2f} GB in + "
        f"{summary['bytes_written'] / 1e9:.2f} GB out at {disk['combined'] / 1e9:.2f} GB/s "
        f"combined); step {summary['step_s']:.2f} s (median of steps 2-{len(measured)}) = "
        f"{summary['vs_floor']:.2f}x the floor"
    )
    transient = 2 * args.width * args.width * 4
    limit = args.host_budget + args.device_budget + overhead + transient
    result = {
        "params": params,
        "training_state_bytes": state,
        "host_budget": args.host_budget,
        "device_budget": args.device_budget,
        "fixed_overhead_rss": overhead,
        "transient_bytes": transient,
        "peak_rss": peak,
        "limit": limit,
        "within_limit": peak <= limit,
        "attach_s": attach_s,
        "step_s": times,
        "steps": measured,
        "floor": summary,
        "peak_bytes": stats["peak_bytes"],
        "bytes_read": stats["bytes_read"],
        "bytes_written": stats["bytes_written"],
    }
    print(
        f"peak RSS {peak / 2**30:.2f} GiB vs host budget {args.host_budget / 2**30:.2f} "
        f"+ device budget {args.device_budget / 2**30:.2f} + fixed overhead "
        f"{overhead / 2**30:.2f} (process) + {transient / 2**30:.2f} (backward buffers) = "
        f"{limit / 2**30:.2f} GiB: "
        f"{'within' if result['within_limit'] else 'OVER'}"
    )
    peaks = {tier: stats["peak_bytes"][tier] / 2**30 for tier in ("host", "device", "nvme")}
    print(
        f"host tier peak {peaks['host']:.2f} GiB, device tier peak {peaks['device']:.2f} GiB, "
        f"NVMe {peaks['nvme']:.2f} GiB"
    )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    if args.nvme_path is None:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
