"""Checkpoint benchmark: save and load of a model whose training state is several times the
host budget, against what the disk can do, and what an asynchronous save costs the steps.

On the scale benchmark's model (an MLP built on the meta device, default 500 M parameters,
parameters and Adam state on NVMe under a 2 GiB host budget), after a few steps (so the
optimizer state exists), in one run:
  * the swap engine's write and read bandwidth on the same path (the disk's);
  * a save: seconds, the checkpoint's bytes, and its floors: those bytes at the write
    bandwidth, and that plus the swap reads the save needed at the read bandwidth (a disk whose
    reads and writes share one budget does not overlap them); peak RSS during the save;
  * a load of that checkpoint into the attached store: the same against the read bandwidth
    (plus the swap writes it caused);
  * the step time of the steps right after an asynchronous save against the steps before.

    python -m tools.benchmarks.bench_checkpoint [--params 500M --host-budget 2GiB --steps 3]

Run it in the background: the default moves tens of GB through the disk.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path

import psutil
import torch
from torch import nn

import infinity
from infinity.cli.common.transfers import engine_bandwidth
from infinity.config import parse_size
from tools.common.workloads import mlp


def add_scale_arguments(parser: argparse.ArgumentParser, steps_help: str = "") -> None:
    """The scale model (an MLP of ``--params`` in ``Linear(--width)`` layers) and its budgets."""
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


class RssWatch:
    """Samples the process's RSS every few milliseconds while it is on (peak per phase)."""

    def __init__(self) -> None:
        self.peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> RssWatch:
        process = psutil.Process()
        self.peak = process.memory_info().rss

        def sample() -> None:
            while not self._stop.wait(0.005):
                self.peak = max(self.peak, process.memory_info().rss)

        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


def checkpoint_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_scale_arguments(parser, "steps before the save, and after the asynchronous save")
    args = parser.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="infinity-bench-checkpoint-", dir=args.nvme_path))
    try:
        result = run(args, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


def run(args: argparse.Namespace, root: Path) -> dict:
    warm = nn.Linear(64, 64)
    warm(torch.randn(4, 64)).sum().backward()
    torch.optim.AdamW(warm.parameters()).step()
    del warm
    overhead = psutil.Process().memory_info().rss
    swap = root / "swap"
    swap.mkdir()
    layers = max(1, round(args.params / (args.width * args.width + args.width)))
    with torch.device("meta"):
        model = mlp(layers, args.width)
    params = sum(p.numel() for p in model.parameters())
    config = infinity.OffloadConfig(
        offload_param="nvme",
        offload_optimizer="nvme",
        nvme_path=(swap,),
        buffer_size=args.buffer_size,
        buffer_count=max(4, args.host_budget // args.buffer_size),
        host_budget=args.host_budget,
        device_budget=args.device_budget,
    )
    disk = engine_bandwidth(swap, 2 << 30, config)
    print(
        f"disk (swap engine on {root}): write {disk['write'] / 1e9:.2f} GB/s, read "
        f"{disk['read'] / 1e9:.2f} GB/s"
    )
    print(
        f"model: {layers} x Linear({args.width}) = {params / 1e6:.0f} M params; training state "
        f"{params * 16 / 2**30:.2f} GiB, host budget {args.host_budget / 2**30:.2f} GiB"
    )
    store = infinity.TieredStore(config)
    model, optimizer = store.attach(model, torch.optim.AdamW(model.parameters(), lr=1e-5))
    generator = torch.Generator().manual_seed(0)

    def step() -> float:
        x = torch.randn(args.batch, args.width, generator=generator)
        started = time.perf_counter()
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        return time.perf_counter() - started

    before = [step() for _ in range(args.steps)]
    print(f"steps before: {', '.join(f'{t:.1f}' for t in before)} s")
    checkpoint = root / "ckpt"

    # -- save -----------------------------------------------------------------------------------
    stats = store.stats()
    with RssWatch() as watch:
        started = time.perf_counter()
        store.save_checkpoint(checkpoint)
        save_s = time.perf_counter() - started
    after = store.stats()
    size = checkpoint_bytes(checkpoint)
    swap_read = after["bytes_read"] - stats["bytes_read"]
    save_floor = size / disk["write"]
    save_io_floor = save_floor + swap_read / disk["read"]
    save_peak = watch.peak
    print(
        f"save: {save_s:.1f} s for {size / 1e9:.2f} GB ({size / save_s / 1e9:.2f} GB/s); "
        f"floor {save_floor:.1f} s at the write bandwidth ({save_s / save_floor:.2f}x), "
        f"{save_io_floor:.1f} s with the {swap_read / 1e9:.2f} GB of swap reads "
        f"({save_s / save_io_floor:.2f}x); peak RSS {save_peak / 2**30:.2f} GiB"
    )

    # -- load -----------------------------------------------------------------------------------
    stats = store.stats()
    with RssWatch() as watch:
        started = time.perf_counter()
        store.load_checkpoint(checkpoint)
        load_s = time.perf_counter() - started
    after = store.stats()
    swap_written = after["bytes_written"] - stats["bytes_written"]
    load_floor = size / disk["read"]
    load_io_floor = load_floor + swap_written / disk["write"]
    load_peak = watch.peak
    print(
        f"load: {load_s:.1f} s ({size / load_s / 1e9:.2f} GB/s); floor {load_floor:.1f} s at "
        f"the read bandwidth ({load_s / load_floor:.2f}x), {load_io_floor:.1f} s with the "
        f"{swap_written / 1e9:.2f} GB of swap writes ({load_s / load_io_floor:.2f}x); "
        f"peak RSS {load_peak / 2**30:.2f} GiB"
    )

    # -- an asynchronous save, then steps -------------------------------------------------------
    started = time.perf_counter()
    store.save_checkpoint(root / "ckpt-async", async_save=True)
    call_s = time.perf_counter() - started
    during = [step() for _ in range(args.steps)]
    started = time.perf_counter()
    store.wait_for_checkpoint()
    wait_s = time.perf_counter() - started
    figures = store.last_checkpoint
    baseline = statistics.median(before[1:] or before)
    overhead_s = sum(during) - baseline * len(during) + call_s + wait_s
    print(
        f"async save: the call took {call_s:.2f} s; steps after it "
        f"{', '.join(f'{t:.1f}' for t in during)} s against {baseline:.1f} s before; "
        f"{figures.get('copied_before_change', 0)} chunks copied before a step changed them, "
        f"the steps waited {figures.get('step_wait_seconds', 0.0):.2f} s for the writer; "
        f"wait_for_checkpoint {wait_s:.1f} s; cost over those steps {overhead_s:.1f} s "
        f"(the save alone took {save_s:.1f} s)"
    )
    store.close(restore_params=False)
    limit = args.host_budget + args.device_budget + overhead + 2 * args.width * args.width * 4
    print(
        f"peak RSS during save {save_peak / 2**30:.2f} GiB, load {load_peak / 2**30:.2f} GiB; "
        f"host budget + device budget + fixed overhead = {limit / 2**30:.2f} GiB: "
        f"{'within' if max(save_peak, load_peak) <= limit else 'OVER'}"
    )
    goal = max(save_s / save_floor, load_s / load_floor)
    print(
        f"goal: save and load within 1.3x of bytes / bandwidth: save {save_s / save_floor:.2f}x"
        f", load {load_s / load_floor:.2f}x: {'met' if goal <= 1.3 else 'NOT met'}"
    )
    return {
        "params": params,
        "disk": disk,
        "checkpoint_bytes": size,
        "save_s": save_s,
        "save_floor_s": save_floor,
        "save_io_floor_s": save_io_floor,
        "save_swap_read": swap_read,
        "save_peak_rss": save_peak,
        "load_s": load_s,
        "load_floor_s": load_floor,
        "load_io_floor_s": load_io_floor,
        "load_swap_written": swap_written,
        "load_peak_rss": load_peak,
        "steps_before": before,
        "steps_after_async_save": during,
        "async_call_s": call_s,
        "async_wait_s": wait_s,
        "async_overhead_s": overhead_s,
        "rss_limit": limit,
    }


if __name__ == "__main__":
    raise SystemExit(main())
