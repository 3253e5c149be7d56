"""Train the demo's small GPT on several ranks (torchrun, gloo) with ZeRO stage 3: each rank
holds and swaps to NVMe 1/N of the parameters, gradients and Adam state.

    python -m infinity.cli.demo_dist        # what `make demo-dist` runs: 2 ranks, a temp dir
    python -m infinity.cli.demo_dist --ranks 2 --steps 40 --nvme-path /mnt/nvme0
    python -m infinity.cli.demo_dist --trainer   # `make demo-trainer`: Hugging Face Trainer

The model, data, budgets and flags are those of ``python -m infinity.cli.demo``
(infinity/cli/demo.py); each rank trains on its own micro-batch (its share of one global batch of
--batch x ranks sequences), so the run is data-parallel training of that batch. Rank 0 shows a
progress bar (stderr); at the end each rank's summary is printed as the single-process demo prints
it (loss, step time, swap traffic against the disk's bandwidth, overlap, stalls, peak bytes per
tier), followed by what the ranks exchanged per step: the bytes this rank sent into all-gathers (its
parameter slices) and reduce-scatters (whole gradients), the seconds the training thread waited for
them and their share of the step. Each rank writes a Chrome trace of its last steps to --out.
With --trainer each rank runs the README's Hugging Face Trainer recipe instead of the loop
(infinity/cli/demo_trainer.py): a Llama of the same sizes, attached, then InfinityTrainer.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from infinity.cli.common.tiny_gpt import GPTConfig, TinyGPT, parameter_count, synthetic_batches
from infinity.cli.demo import (
    RECORDED_STEPS,
    TEXT_VOCAB,
    USER_ERRORS,
    DemoResult,
    UserError,
    build_parser,
    disk_bandwidth,
    learning_rate,
    listing,
    model_config,
    rank_config,
    split_paths,
    table,
    write_rank_result,
)
from infinity.config import format_size
from swap import SwapError

log = logging.getLogger("infinity.cli.demo_dist")

PROJECT = Path(__file__).resolve().parents[2]
PROG = "python -m infinity.cli.demo_dist"


def dist_parser() -> argparse.ArgumentParser:
    parser = build_parser()
    parser.prog = PROG
    parser.description = __doc__.split("\n\n")[0]
    parser.add_argument("--ranks", type=int, default=2, help="data-parallel ranks (%(default)s)")
    parser.add_argument(
        "--timeout",
        type=float,
        default=600,
        help="seconds the ranks may take before they are stopped (%(default)s)",
    )
    parser.add_argument(
        "--trainer",
        action="store_true",
        help="train with Hugging Face Trainer (InfinityTrainer) on a Llama of the same sizes",
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result-dir", type=Path, help=argparse.SUPPRESS)
    return parser


# ---------------------------------------------------------------------------- one rank


def worker(args: argparse.Namespace) -> int:
    import torch.distributed as dist
    from tqdm import tqdm

    from infinity import TieredStore

    began = time.perf_counter()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    gpt = model_config(args)
    torch.manual_seed(args.seed)
    model = TinyGPT(gpt)
    config = rank_config(args, model, split_paths(args.nvme_path))
    store = TieredStore(config)
    record = not args.no_timeline
    outputs: dict[str, str] = {}
    try:
        optimizer: torch.optim.Optimizer = torch.optim.AdamW(
            model.parameters(), lr=learning_rate(args)
        )
        model, optimizer = store.attach(model, optimizer)
        # One global batch per step, every rank its own slice of it: the same text the
        # single-process demo would train on with --batch x ranks sequences.
        text = synthetic_batches(
            GPTConfig(vocab_size=min(TEXT_VOCAB, gpt.vocab_size), context=gpt.context),
            args.batch * world,
            seed=args.seed,
        )
        mine = slice(rank * args.batch, (rank + 1) * args.batch)
        losses, times = [], []
        attached = previous = store.stats()
        bar = tqdm(
            range(args.steps),
            desc=f"training on {world} ranks",
            unit="step",
            file=sys.stderr,
            dynamic_ncols=True,
            disable=rank != 0,
        )
        for step in bar:
            if record and step == max(0, args.steps - RECORDED_STEPS):
                store.timeline.clear()
                store.timeline.enabled = True
            tokens, targets = (t[mine].to(store.device) for t in next(text))
            started = time.perf_counter()
            loss = model(tokens, targets)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - started)
            mean = loss.detach().clone()
            dist.all_reduce(mean)  # the loss of the global batch: the mean over the ranks
            losses.append(mean.item() / world)
            now = store.stats()
            moved = (
                now["bytes_read"]
                - previous["bytes_read"]
                + now["bytes_written"]
                - previous["bytes_written"]
            )
            comm = (
                now["comm"]["gather_seconds"]
                - previous["comm"]["gather_seconds"]
                + now["comm"]["reduce_seconds"]
                - previous["comm"]["reduce_seconds"]
            )
            previous = now
            bar.set_postfix(
                loss=f"{losses[-1]:.3f}",
                step=f"{times[-1]:.2f}s",
                swap=f"{moved / times[-1] / 1e9:.2f}GB/s",
                comm=f"{comm / times[-1]:.0%}",
            )
        bar.close()
        store.timeline.enabled = False
        stats = store.stats()
    finally:
        store.close(restore_params=False)
    write_rank_result(
        store,
        args,
        trace_name="demo-dist-trace",
        record=record,
        losses=losses,
        times=times,
        stats=stats,
        attached=attached,
        outputs=outputs,
        began=began,
    )
    return 0


# ---------------------------------------------------------------------------- the summary


def comm_rows(rank: dict) -> list[tuple[str, str]]:
    """What this rank exchanged with the others per training step (from attach to the end)."""
    after, before = rank["stats"]["comm"], rank["attached"]["comm"]
    steps, times = len(rank["step_seconds"]), rank["step_seconds"]

    def per_step(key: str) -> float:
        return (after[key] - before[key]) / steps

    def bytes_per_step(key: str) -> int:
        return (after[key] - before[key]) // steps

    wait = per_step("gather_seconds") + per_step("reduce_seconds")
    mean_step = sum(times) / steps
    return [
        (
            "all-gathered",
            f"{format_size(bytes_per_step('gathered_bytes'))}/step sent (this rank's "
            f"parameter slices), {per_step('gather_seconds'):.3f} s/step waited",
        ),
        (
            "reduce-scat.",
            f"{format_size(bytes_per_step('reduced_bytes'))}/step sent (whole "
            f"gradients), {per_step('reduce_seconds'):.3f} s/step",
        ),
        (
            "comm time",
            f"{wait:.3f} s/step, {wait / mean_step:.0%} of the mean step "
            f"({mean_step:.3f} s); {per_step('collectives'):.0f} collectives/step, "
            f"{after['backend']}, ZeRO stage {after['stage']}",
        ),
    ]


def rank_summary(
    rank: dict, disk: dict[str, float], paths: list[Path], leftovers: list[Path], nvme_free: int
) -> list[str]:
    result = DemoResult(
        rank["losses"],
        rank["step_seconds"],
        rank["stats"],
        rank["attached"],
        disk,
        rank["timeline"],
        {k: Path(v) for k, v in rank["outputs"].items()},
        paths,
        leftovers,
        nvme_free,
        rank["wall_seconds"],
    )
    lines = table(result)
    # The demo's rows are "name<padding>  value", the first one "steps": take its width.
    steps = str(len(rank["losses"]))
    width = len(lines[0]) - len(steps) - 2 if lines and lines[0].startswith("steps") else 12
    extra = comm_rows(rank)
    width = max(width, *(len(name) for name, _ in extra))
    # After the memory rows, before the file and wall-time rows.
    at = next(
        (
            i
            for i, line in enumerate(lines)
            if line.startswith(("Chrome trace", "swap files", "wall time"))
        ),
        len(lines),
    )
    return lines[:at] + [f"{name:<{width}}  {value}" for name, value in extra] + lines[at:]


# ---------------------------------------------------------------------------- the driver


def launch(
    args: argparse.Namespace, argv: Sequence[str], nvme: list[Path], result_dir: Path
) -> int:
    """Runs the ranks with torchrun; their output (rank 0's progress bar) goes to ours."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(args.ranks),
        "--standalone",
        "-m",
        "infinity.cli.demo_dist",
        *argv,
        "--worker",
        "--result-dir",
        str(result_dir),
        *(f"--nvme-path={path}" for path in nvme if not args.nvme_path),
    ]
    # One compute thread per rank unless told otherwise (torchrun's own default); the ranks
    # start where this process runs, so relative paths mean the same, with the project
    # importable from there.
    env = dict(
        os.environ,
        OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
        PYTHONPATH=os.pathsep.join(filter(None, [str(PROJECT), os.environ.get("PYTHONPATH")])),
    )
    process = subprocess.Popen(command, env=env, start_new_session=True)
    try:
        return process.wait(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        log.error("the ranks did not finish within %g s; stopping them", args.timeout)
        os.killpg(process.pid, signal.SIGTERM)
        return _reap(process)
    except KeyboardInterrupt:
        os.killpg(process.pid, signal.SIGINT)
        _reap(process)
        raise


def _reap(process: subprocess.Popen) -> int:
    try:
        return process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        return process.wait()


def run(args: argparse.Namespace, argv: Sequence[str]) -> int:
    began = time.perf_counter()
    gpt = model_config(args)
    if args.ranks < 2:
        raise UserError(
            f"--ranks {args.ranks}: use 2 or more (python -m infinity.cli.demo trains "
            f"in one process)"
        )
    torch.manual_seed(args.seed)
    nvme = split_paths(args.nvme_path)
    if args.trainer:
        from infinity.cli import demo_trainer

        model: torch.nn.Module = demo_trainer.llama(args)
    else:
        model = TinyGPT(gpt)
    config = rank_config(args, model, nvme)
    temp_dir: Path | None = None
    if not config.nvme_path and "nvme" in (config.offload_param, config.offload_optimizer):
        temp_dir = Path(tempfile.mkdtemp(prefix="infinity-demo-dist-"))
        config = config.replace(nvme_path=(temp_dir,))
    paths = list(config.nvme_path)
    before = listing(paths)
    nvme_free = shutil.disk_usage(paths[0]).free if paths and paths[0].is_dir() else 0
    state_bytes = sum(p.numel() for p in model.parameters()) * 4 * 4
    if args.trainer:
        print(demo_trainer.describe(args, model, args.ranks))
    else:
        print(
            f"model      TinyGPT {gpt.layers} layers x {gpt.width} wide, vocab "
            f"{gpt.vocab_size}, context {gpt.context}: {parameter_count(gpt) / 1e6:.2f} M "
            f"params, params+grads+Adam {format_size(state_bytes)}; AdamW lr "
            f"{learning_rate(args):g}"
        )
    print(
        f"ranks      {args.ranks} (torchrun, gloo), ZeRO stage {config.zero_stage}: each holds "
        f"~{format_size(state_bytes // args.ranks)} of the state; micro-batch {args.batch} "
        f"per rank, global batch {args.batch * args.ranks}"
    )
    print(config.describe())
    result_dir = Path(tempfile.mkdtemp(prefix="infinity-demo-dist-results-"))
    try:
        disk = disk_bandwidth(paths, config) if paths else {}
        if disk:
            print(
                f"disk       {disk['read'] / 1e9:.2f} GB/s read, {disk['write'] / 1e9:.2f} GB/s "
                f"write (swap engine on {', '.join(map(str, paths))}, measured just now)"
            )
        if not args.no_timeline:
            args.out.mkdir(parents=True, exist_ok=True)
        code = launch(args, argv, paths, result_dir)
        ranks = [json.loads(p.read_text()) for p in sorted(result_dir.glob("rank*.json"))]
    finally:
        leftovers = sorted(listing(paths) - before)
        if temp_dir is not None:
            shutil.rmtree(temp_dir, ignore_errors=True)
            if temp_dir.exists():
                leftovers.append(temp_dir)
        shutil.rmtree(result_dir, ignore_errors=True)
    if code or len(ranks) != args.ranks:
        print(
            f"{PROG}: the ranks failed (torchrun exit status {code}, {len(ranks)} of "
            f"{args.ranks} reported; their errors are above)",
            file=sys.stderr,
        )
        return 1
    for rank in sorted(ranks, key=lambda r: r["rank"]):
        print(f"\n-- rank {rank['rank']} of {rank['world']} --")
        print("\n".join(rank_summary(rank, disk, paths, leftovers, nvme_free)))
    print(
        f"\ntotal wall time {time.perf_counter() - began:.1f} s (launch, {args.ranks} ranks, "
        f"summaries)"
    )
    if leftovers:
        log.warning("the run left files in nvme_path: %s", ", ".join(map(str, leftovers)))
    return 1 if leftovers else 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = dist_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    if args.worker and args.trainer:
        from infinity.cli import demo_trainer

        return demo_trainer.worker(args)
    if args.worker:
        return worker(args)
    try:
        return run(args, argv)
    except USER_ERRORS as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    except SwapError as exc:
        print(f"{PROG}: swap I/O failed: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted; swap files removed", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
