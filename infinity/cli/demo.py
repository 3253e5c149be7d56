"""Train a small GPT with its parameters, gradients and Adam state swapped to NVMe.

    python -m infinity.cli.demo                      # what `make demo` runs: a temporary swap dir
    infinity-train --nvme-path /mnt/nvme0,/mnt/nvme1 --steps 100
    infinity-train --config ds_config.json --nvme-path /mnt/nvme0

Without flags the model (random init, synthetic text, nothing downloaded) is sized so its
parameters plus Adam state are about 100 MB, and the device and host budgets are set well below
that, so every step really moves bytes through the swap files. A progress bar (stderr) shows the
loss, step time and swap traffic; at the end a table (stdout) compares the swap I/O with the
disk's own bandwidth, measured on the same nvme_path at the start of the run, and a Chrome trace
and a PNG timeline of the last two steps are written to --out.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tqdm import tqdm

from infinity import OffloadConfig, TieredStore
from infinity.cli.common.args import (
    USER_ERRORS,
    UserError,
    config_size,
    guarded,
    parse,
    positive,
)
from infinity.cli.common.tiny_gpt import GPTConfig, TinyGPT, parameter_count, synthetic_batches
from infinity.config import format_size, load_json
from swap import (
    BufferPool,
    SwapEngine,
)
from swap.files import RUN_DIR_PREFIX
from swap.leftovers import describe, find_leftovers

log = logging.getLogger("infinity.cli.demo")

HEADS = 4
#: The synthetic text uses only the first TEXT_VOCAB token ids: its rule (each token follows
#: from the two before) then has 64 x 64 entries, which the model visibly learns in a minute;
#: over the full 512-token vocabulary it has 262,144 and the loss barely moves in a demo's steps.
TEXT_VOCAB = 64
DEMO_BUFFER = 1 << 20  # largest swap buffer (and so shard) the demo picks itself
DEMO_LR = 2e-3  # high for Adam, so the loss falls clearly within the demo's steps
BANDWIDTH_SECONDS = 0.6  # per direction, for the disk measurement at the start
RECORDED_STEPS = 2


@dataclass
class DemoResult:
    losses: list[float]
    step_seconds: list[float]
    stats: dict[str, Any]  # store.stats() after the last step
    attached: dict[str, Any]  # store.stats() after attach, before step 1
    disk: dict[str, float]  # bytes/s measured at the start: "read", "write"
    timeline: dict[str, Any] | None  # store.timeline.summary() of the recorded steps
    outputs: dict[str, Path] = field(default_factory=dict)
    nvme_paths: list[Path] = field(default_factory=list)
    leftovers: list[Path] = field(default_factory=list)  # anything the run left in nvme_path
    nvme_free: int = 0  # bytes free on the first nvme_path at the start
    wall_seconds: float = 0.0
    table: list[str] = field(default_factory=list)


# ---------------------------------------------------------------------------- arguments


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="infinity-train", description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add(
        "--nvme-path",
        action="append",
        default=[],
        metavar="DIR",
        help="swap directory; repeat or comma-separate for several drives (default: the "
        "config's, else a fresh temporary directory, removed at the end)",
    )
    add(
        "--config",
        type=Path,
        metavar="FILE",
        help="a DeepSpeed ds_config.json or a native "
        "infinity JSON config; the flags below override it",
    )
    add("--steps", type=positive(int), default=40, help="training steps (%(default)s)")
    add("--layers", type=positive(int), default=8, help="transformer blocks (%(default)s)")
    add(
        "--width",
        type=positive(int),
        default=256,
        help=f"model width, a multiple of {HEADS} (%(default)s)",
    )
    add("--vocab", type=positive(int), default=512, help="vocabulary size (%(default)s)")
    add("--context", type=positive(int), default=64, help="tokens per sequence (%(default)s)")
    add("--batch", type=positive(int), default=8, help="sequences per step (%(default)s)")
    add(
        "--lr",
        type=positive(float),
        help=f"AdamW learning rate (default: the DeepSpeed "
        f"config's optimizer lr, else {DEMO_LR:g})",
    )
    add(
        "--device-budget",
        type=config_size,
        metavar="SIZE",
        help="e.g. 8MiB (default: the config's, else a quarter of the parameter bytes)",
    )
    add(
        "--host-budget",
        type=config_size,
        metavar="SIZE",
        help="e.g. 32MiB (default: the config's, else a quarter of params + grads + Adam state)",
    )
    add("--bf16", action="store_true", help="bf16 working parameters and compute")
    add(
        "--out",
        type=Path,
        default=Path("demo-output"),
        metavar="DIR",
        help="where the Chrome trace and timeline plot go (%(default)s)",
    )
    add("--seed", type=int, default=0, help="model and data seed (%(default)s)")
    add("--no-timeline", action="store_true", help="record no timeline; write no trace or plot")
    add("-v", "--verbose", action="store_true", help="log the runtime's INFO messages")
    return parser


def split_paths(values: Sequence[str]) -> list[Path]:
    return [Path(p.strip()).expanduser() for v in values for p in v.split(",") if p.strip()]


def model_config(args: argparse.Namespace) -> GPTConfig:
    if args.width % HEADS:
        raise UserError(f"--width {args.width} must be a multiple of {HEADS} (attention heads)")
    if args.vocab < 2 or args.context < 2:
        raise UserError("--vocab and --context must be at least 2")
    return GPTConfig(
        vocab_size=args.vocab,
        context=args.context,
        layers=args.layers,
        width=args.width,
        heads=HEADS,
    )


def offload_config(
    args: argparse.Namespace, model: torch.nn.Module, nvme: list[Path]
) -> OffloadConfig:
    """The config file (else the demo's NVMe defaults) with the flags given on top."""
    changes: dict[str, Any] = {"nvme_path": tuple(nvme)}
    if args.config is not None:
        base = OffloadConfig.from_file(args.config)
    else:
        base = OffloadConfig(offload_param="nvme", offload_optimizer="nvme", prefetch_depth=2)
        # Budgets below what the model needs, so that the run has to swap: the device holds a
        # quarter of the working params, the host a quarter of params + grads + Adam state.
        itemsize = 2 if args.bf16 else 4
        numel = sum(p.numel() for p in model.parameters())
        largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
        changes["device_budget"] = max(numel * itemsize // 4, 2 * largest * itemsize)
        changes["host_budget"] = 4 * numel * 4 // 4
    if args.device_budget is not None:
        changes["device_budget"] = args.device_budget
    if args.host_budget is not None:
        changes["host_budget"] = args.host_budget
    if "host_budget" in changes:
        host = changes["host_budget"]
        buffer = base.buffer_size
        if args.config is None:
            # About 16 buffers in the budget (64 KiB..1 MiB, whole 4 KiB blocks): shards are at
            # most one buffer, so there are enough of them for prefetch and the tiled optimizer
            # step to overlap, and each request is still large enough for the disk.
            buffer = min(DEMO_BUFFER, max(64 << 10, host // 16 >> 12 << 12))
            changes["buffer_size"] = buffer
        # The swap buffers are the host tier: let them fill the budget, not more.
        changes["buffer_count"] = max(2, host // buffer)
    if args.bf16:
        changes["precision"] = {"dtype": "bf16"}
    return base.replace(**changes)


def write_rank_result(
    store: Any,
    args: argparse.Namespace,
    *,
    trace_name: str,
    record: bool,
    losses: list[float],
    times: list[float],
    stats: dict[str, Any],
    attached: Any,
    outputs: dict[str, str],
    began: float,
) -> None:
    """A rank's end of a multi-rank demo, once its store is closed: its timeline's summary and
    Chrome trace (``<trace_name>-rank<N>.json`` under ``args.out``) where recorded, the process
    group left, and what it measured written to ``args.result_dir/rank<N>.json`` for the launcher
    to summarise."""
    rank, world = dist.get_rank(), dist.get_world_size()
    summary = store.timeline.summary() if record and hasattr(store.timeline, "summary") else None
    if record and hasattr(store.timeline, "export_chrome"):
        path = store.timeline.export_chrome(Path(args.out) / f"{trace_name}-rank{rank}.json")
        outputs["Chrome trace"] = str(path)
    dist.destroy_process_group()
    result = {
        "rank": rank,
        "world": world,
        "losses": losses,
        "step_seconds": times,
        "stats": stats,
        "attached": attached,
        "timeline": summary,
        "outputs": outputs,
        "wall_seconds": time.perf_counter() - began,
    }
    (Path(args.result_dir) / f"rank{rank}.json").write_text(json.dumps(result, default=str))


def rank_config(
    args: argparse.Namespace, model: torch.nn.Module, nvme: list[Path]
) -> OffloadConfig:
    """The demo's configuration for one of several ranks, computed on CPU: the collectives
    are gloo's."""
    return offload_config(args, model, nvme).replace(device="cpu")


def learning_rate(args: argparse.Namespace) -> float:
    if args.lr is not None:
        return args.lr
    if args.config is not None:
        optimizer = load_json(args.config).get("optimizer")
        params = optimizer.get("params") if isinstance(optimizer, dict) else None
        lr = params.get("lr") if isinstance(params, dict) else None
        if isinstance(lr, (int, float)) and not isinstance(lr, bool) and lr > 0:
            return float(lr)
    return DEMO_LR


# ---------------------------------------------------------------------------- measuring


def disk_bandwidth(paths: list[Path], config: OffloadConfig) -> dict[str, float]:
    """Bytes/s the swap engine reaches on ``paths`` with the store's aio settings: write for
    about BANDWIDTH_SECONDS, then read the same bytes back. Busy time is the engine's own clock,
    the same one the store's io_seconds come from, so the two GB/s compare like for like."""
    chunk, depth = 16 << 20, 4 * len(paths)
    limit = 1 << 30
    settings = config.aio.engine_settings(file_size=limit // len(paths) + (chunk << 1))
    with (
        BufferPool(depth, chunk, name="demo-bandwidth") as pool,
        SwapEngine(paths, settings) as engine,
    ):
        pending: list = []

        def submit(call: Any, extent: Any, i: int) -> None:
            if len(pending) >= depth:
                pending.pop(0).result()
            pending.append(call(extent, pool.buffers[i % depth]))

        extents: list = []
        started = time.perf_counter()
        while len(extents) * chunk < limit and time.perf_counter() - started < BANDWIDTH_SECONDS:
            extents.append(engine.allocate(chunk))
            submit(engine.write, extents[-1], len(extents))
        for future in pending:  # every write lands before the first read of it
            future.result()
        pending.clear()
        for i, extent in enumerate(extents):
            submit(engine.read, extent, i)
        for future in pending:
            future.result()
        stats = engine.stats()
    return {
        "read": stats.bytes_read / stats.read_seconds,
        "write": stats.bytes_written / stats.write_seconds,
    }


def listing(paths: list[Path]) -> set[Path]:
    # Top level only: the engine makes one run directory per drive there, and a user's real
    # drive may hold far too many files to walk.
    return {p for root in paths if root.is_dir() for p in root.iterdir()}


# ---------------------------------------------------------------------------- the run


def run(args: argparse.Namespace) -> DemoResult:
    began = time.perf_counter()
    gpt = model_config(args)
    torch.manual_seed(args.seed)
    model = TinyGPT(gpt)
    temp_dir: Path | None = None
    nvme = split_paths(args.nvme_path)
    config = offload_config(args, model, nvme)
    if not config.nvme_path and "nvme" in (config.offload_param, config.offload_optimizer):
        temp_dir = Path(tempfile.mkdtemp(prefix="infinity-demo-"))
        config = config.replace(nvme_path=(temp_dir,))
    paths = list(config.nvme_path)
    before = listing(paths)
    nvme_free = shutil.disk_usage(paths[0]).free if paths and paths[0].is_dir() else 0
    state_bytes = parameter_count(gpt) * 4 * 4  # fp32 params, grads, Adam's two moments
    print(
        f"model      TinyGPT {gpt.layers} layers x {gpt.width} wide, vocab {gpt.vocab_size}, "
        f"context {gpt.context}: {parameter_count(gpt) / 1e6:.2f} M params, "
        f"params+grads+Adam {format_size(state_bytes)}; AdamW lr {learning_rate(args):g}"
    )
    print(config.describe())
    store: TieredStore | None = None
    stale = [
        found for path in paths if path.is_dir() for found in find_leftovers(path, RUN_DIR_PREFIX)
    ]
    if stale:  # the first swap engine below removes them
        print(f"reclaimed  {describe(stale)}")
        before -= {found.path for found in stale}
    try:
        log.info("measuring the swap engine's bandwidth on %s", ", ".join(map(str, paths)))
        disk = disk_bandwidth(paths, config) if paths else {}
        if disk:
            print(
                f"disk       {disk['read'] / 1e9:.2f} GB/s read, {disk['write'] / 1e9:.2f} GB/s "
                f"write (swap engine on {', '.join(map(str, paths))}, measured just now)"
            )
        record = not args.no_timeline
        if record:
            try:  # before training, so a bad --out costs no training time
                args.out.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise UserError(f"cannot use --out {args.out}: {exc.strerror or exc}") from None
        store = TieredStore(config)
        optimizer: torch.optim.Optimizer = torch.optim.AdamW(
            model.parameters(), lr=learning_rate(args)
        )
        model, optimizer = store.attach(model, optimizer)
        text = synthetic_batches(
            GPTConfig(vocab_size=min(TEXT_VOCAB, gpt.vocab_size), context=gpt.context),
            args.batch,
            seed=args.seed,
        )
        losses, times = [], []
        attached = previous = store.stats()
        bar = tqdm(
            range(args.steps), desc="training", unit="step", file=sys.stderr, dynamic_ncols=True
        )
        for step in bar:
            if record and step == max(0, args.steps - RECORDED_STEPS):
                store.timeline.clear()
                store.timeline.enabled = True
            tokens, targets = (t.to(store.device) for t in next(text))
            started = time.perf_counter()
            loss = model(tokens, targets)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - started)
            losses.append(loss.item())
            now = store.stats()
            moved = (
                now["bytes_read"]
                - previous["bytes_read"]
                + now["bytes_written"]
                - previous["bytes_written"]
            )
            previous = now
            bar.set_postfix(
                loss=f"{losses[-1]:.3f}",
                step=f"{times[-1]:.2f}s",
                swap=f"{moved / times[-1] / 1e9:.2f}GB/s",
            )
        bar.close()
        store.timeline.enabled = False
        stats = store.stats()
    finally:
        if store is not None:
            store.close(restore_params=False)
        # Looked at before the temporary directory goes, so a file the store failed to remove
        # is reported rather than swept away with it.
        leftovers = sorted(listing(paths) - before)
        if temp_dir is not None:
            shutil.rmtree(temp_dir, ignore_errors=True)
            if temp_dir.exists():
                leftovers.append(temp_dir)
    # After close: it waits for the last writes, so the views end where the I/O really ended.
    assert store is not None
    summary = store.timeline.summary() if record and hasattr(store.timeline, "summary") else None
    outputs = write_outputs(store, args.out, gpt) if record else {}
    result = DemoResult(
        losses,
        times,
        stats,
        attached,
        disk,
        summary,
        outputs,
        paths,
        leftovers,
        nvme_free,
        time.perf_counter() - began,
    )
    result.table = table(result)
    return result


def write_outputs(store: TieredStore, out: Path, gpt: GPTConfig) -> dict[str, Path]:
    timeline = store.timeline
    written: dict[str, Path] = {}
    if hasattr(timeline, "export_chrome"):
        written["Chrome trace"] = timeline.export_chrome(out / "demo-trace.json")
    if hasattr(timeline, "plot"):
        title = f"infinity demo: TinyGPT {gpt.layers}x{gpt.width}, last {RECORDED_STEPS} steps"
        written["timeline plot"] = timeline.plot(out / "demo-timeline.png", title=title)
    return written


def table(result: DemoResult) -> list[str]:
    s, steps, times, size = result.stats, len(result.losses), result.step_seconds, format_size
    # I/O of the training steps only: what attach wrote is shown on its own.
    io = {
        key: s[key] - result.attached[key]
        for key in ("bytes_read", "bytes_written", "read_seconds", "write_seconds")
    }
    busy = io["read_seconds"] + io["write_seconds"]
    rows = [
        ("steps", f"{steps}"),
        ("loss", f"{result.losses[0]:.3f} -> {result.losses[-1]:.3f} (first -> last step)"),
        (
            "step time",
            f"{statistics.median(times):.3f} s median (min {min(times):.3f}, max {max(times):.3f})",
        ),
        ("swap read", f"{size(io['bytes_read'])} total, {size(io['bytes_read'] // steps)}/step"),
        (
            "swap written",
            f"{size(io['bytes_written'])} total, "
            f"{size(io['bytes_written'] // steps)}/step, "
            f"+ {size(result.attached['bytes_written'])} during attach",
        ),
    ]
    if result.disk:
        achieved = []
        for op, nbytes in (("read", io["bytes_read"]), ("write", io["bytes_written"])):
            rate = f"{nbytes / io[op + '_seconds'] / 1e9:.2f}" if io[op + "_seconds"] else "-"
            achieved.append(f"{op} {rate} GB/s (disk {result.disk[op] / 1e9:.2f})")
        rows.append(("achieved", ", ".join(achieved) + ": bytes / engine busy s"))
    if busy == 0:
        rows.append(("overlap", "no swap I/O to overlap"))
    elif result.timeline is not None:
        t = result.timeline
        rows.append(
            (
                "overlap",
                f"{t['overlap_efficiency']:.2f} efficiency, "
                f"{t['hidden_fraction']:.0%} of I/O time under compute (last "
                f"{RECORDED_STEPS} steps: I/O busy {t['io_busy_seconds']:.2f} s, "
                f"compute {t['compute_seconds']:.2f} s)",
            )
        )
    else:
        rows.append(
            (
                "overlap",
                f"I/O busy {busy:.2f} s during {sum(times):.2f} s of steps (no timeline recorded)",
            )
        )
    rows.append(
        (
            "stalls",
            f"{s['stall_seconds']:.2f} s in all waiting on I/O ({s['demand_loads']}"
            f" demand loads, {s['prefetched_loads']} prefetched)",
        )
    )
    for tier in ("device", "host"):
        budget = s.get("budgets", {}).get(tier)
        limit = f" of {size(budget)} budget" if budget else " (no budget)"
        rows.append((f"peak {tier}", f"{size(s['peak_bytes'][tier])}{limit}"))
    if result.nvme_paths:
        rows.append(
            (
                "peak nvme",
                f"{size(s['peak_bytes']['nvme'])} (no budget; {size(result.nvme_free)} was free)",
            )
        )
    rows.append(("peak RSS", size(s["rss_peak_bytes"])))
    if s["backend"]:
        rows.append(("io backend", s["backend"]))
    rows += [(name, str(path)) for name, path in result.outputs.items()]
    if result.nvme_paths:
        where = ", ".join(map(str, result.nvme_paths))
        rows.append(
            (
                "swap files",
                f"LEFT BEHIND: {', '.join(map(str, result.leftovers))}"
                if result.leftovers
                else f"removed, nothing left ({where})",
            )
        )
    rows.append(("wall time", f"{result.wall_seconds:.1f} s"))
    width = max(len(name) for name, _ in rows)
    return [f"{name:<{width}}  {value}" for name, value in rows]


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parse(parser, argv)
    if isinstance(args, int):
        return args
    code, result = guarded(
        parser.prog, lambda: run(args), USER_ERRORS, "interrupted; swap files removed"
    )
    if code:
        return code
    print()
    print("\n".join(result.table))
    if result.leftovers:
        log.warning("the run left files in nvme_path: %s", ", ".join(map(str, result.leftovers)))
    return 1 if result.leftovers else 0


if __name__ == "__main__":
    raise SystemExit(main())
