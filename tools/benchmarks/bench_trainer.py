"""Hugging Face Trainer with the store against the same run without it, and against a raw loop
on the same store: 2 ranks (torchrun, gloo), the demo's Llama (``make demo-trainer``'s model and
budgets: parameters, gradients and Adam state on NVMe under tight host and device budgets).

Three variants, each in processes of its own, repeats interleaved:
  * ``plain``: ``transformers.Trainer`` on the model, no store (DistributedDataParallel);
  * ``trainer``: the model attached, then ``InfinityTrainer`` (the README's recipe);
  * ``loop``: the model attached, then a raw loop (forward, backward, ``clip_grad_norm_``,
    ``optimizer.step()``, ``zero_grad()``) over the same per-rank batches.
Each rank times its optimizer steps (Trainer's ``on_step_begin`` to ``on_step_end``; the same span
in the loop) after --warmup untimed steps. Printed: each variant's median step (the median over
repeats of each rank's median, then the slower rank), and the ratios trainer/loop (what Trainer
and the integration add on top of the store) and trainer/plain (what the store costs against
DDP on a model that fits in memory). The machine's load is part of every figure: compare the
ratios of one run, never figures of different runs.

    python -m tools.benchmarks.bench_trainer [--steps 12 --warmup 2 --repeats 2 --json OUT]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from infinity.cli.demo import build_parser, learning_rate, split_paths

PROJECT = Path(__file__).resolve().parents[2]
VARIANTS = ("plain", "trainer", "loop")


def parser() -> argparse.ArgumentParser:
    result = build_parser()
    result.prog = "python -m tools.benchmarks.bench_trainer"
    result.description = __doc__.split("\n\n")[0]
    result.set_defaults(steps=12)
    add = result.add_argument
    add("--warmup", type=int, default=2, help="untimed steps first (%(default)s)")
    add("--repeats", type=int, default=2, help="runs of each variant, interleaved (%(default)s)")
    add("--ranks", type=int, default=2, help="data-parallel ranks (%(default)s)")
    add("--json", type=Path, help="write the figures here")
    add("--timeout", type=float, default=900, help="seconds per run (%(default)s)")
    add("--variant", choices=VARIANTS, help=argparse.SUPPRESS)
    add("--result", type=Path, help=argparse.SUPPRESS)
    return result


# -- one rank -----------------------------------------------------------------------------------
def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist
    import transformers

    from infinity import TieredStore
    from infinity.cli.demo import rank_config
    from infinity.cli.demo_trainer import TextDataset, llama
    from infinity.integrations.hf import InfinityTrainer

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    model = llama(args)
    optimizer: Any = torch.optim.AdamW(model.parameters(), lr=learning_rate(args))
    store = None
    if args.variant != "plain":
        store = TieredStore(rank_config(args, model, split_paths(args.nvme_path)))
        model, optimizer = store.attach(model, optimizer)
    data = TextDataset(args, args.steps * args.batch * world)
    times: list[float] = []
    started: list[float] = []

    class Time(transformers.TrainerCallback):
        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            started.append(time.perf_counter())

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            times.append(time.perf_counter() - started[-1])

    try:
        if args.variant == "loop":
            # The batches Trainer's sharded loader gives this rank: every world-th batch.
            batches = [
                data.tokens[i * args.batch : (i + 1) * args.batch]
                for i in range(rank, args.steps * world, world)
            ]
            model.train()
            for tokens in batches:
                begin = time.perf_counter()
                loss = model(input_ids=tokens, labels=tokens).loss
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                optimizer.zero_grad()
                times.append(time.perf_counter() - begin)
        else:
            trainer_class = InfinityTrainer if store is not None else transformers.Trainer
            with tempfile.TemporaryDirectory(prefix="bench-trainer-") as output_dir:
                trainer = trainer_class(
                    model=model,
                    args=transformers.TrainingArguments(
                        output_dir=output_dir,
                        use_cpu=True,
                        max_steps=args.steps,
                        per_device_train_batch_size=args.batch,
                        lr_scheduler_type="constant",
                        max_grad_norm=1.0,
                        logging_steps=args.steps,
                        save_strategy="no",
                        report_to=[],
                        train_sampling_strategy="sequential",
                        dataloader_num_workers=0,
                        disable_tqdm=True,
                    ),
                    train_dataset=data,
                    optimizers=(optimizer, None),
                    callbacks=[Time()],
                )
                trainer.train()
    finally:
        if store is not None:
            store.close(restore_params=False)
    dist.destroy_process_group()
    timed = times[args.warmup :]
    record = {"rank": rank, "median": statistics.median(timed), "times": times}
    (args.result / f"{args.variant}-rank{rank}.json").write_text(json.dumps(record))


# -- the driver ---------------------------------------------------------------------------------
def launch(args: argparse.Namespace, argv: list[str], variant: str, result: Path) -> None:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(args.ranks),
        "-m",
        "tools.benchmarks.bench_trainer",
        *argv,
        "--variant",
        variant,
        "--result",
        str(result),
    ]
    env = dict(
        os.environ,
        OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
        PYTHONPATH=os.pathsep.join(filter(None, [str(PROJECT), os.environ.get("PYTHONPATH")])),
    )
    subprocess.run(command, env=env, check=True, timeout=args.timeout, stdout=subprocess.DEVNULL)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    if args.variant is not None:
        worker(args)
        return 0
    passed = list(argv)  # the workers ignore --json
    temp = Path(tempfile.mkdtemp(prefix="bench-trainer-"))
    if not args.nvme_path:
        passed.append(f"--nvme-path={temp / 'nvme'}")
        (temp / "nvme").mkdir()
    medians: dict[str, list[float]] = {v: [] for v in VARIANTS}
    try:
        for repeat in range(args.repeats):
            for variant in VARIANTS:
                result = temp / f"{variant}-{repeat}"
                result.mkdir()
                began = time.perf_counter()
                launch(args, passed, variant, result)
                ranks = [json.loads(p.read_text()) for p in sorted(result.glob("*.json"))]
                slowest = max(r["median"] for r in ranks)
                medians[variant].append(slowest)
                per_rank = ", ".join(f"{r['median']:.3f}" for r in ranks)
                print(
                    f"{variant:8s} repeat {repeat + 1}: median step {slowest:.3f} s "
                    f"(ranks {per_rank}; "
                    f"run {time.perf_counter() - began:.0f} s)",
                    flush=True,
                )
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    step = {v: statistics.median(m) for v, m in medians.items()}
    print(
        f"\nmedian step: plain Trainer (DDP) {step['plain']:.3f} s, InfinityTrainer "
        f"{step['trainer']:.3f} s, raw loop on the store {step['loop']:.3f} s"
    )
    print(f"InfinityTrainer / raw loop on the store: {step['trainer'] / step['loop']:.2f}x")
    print(f"InfinityTrainer / plain Trainer (DDP):   {step['trainer'] / step['plain']:.2f}x")
    print(f"load average at the end: {', '.join(f'{x:.1f}' for x in os.getloadavg())}")
    if args.json is not None:
        args.json.write_text(json.dumps({"medians": medians, "step": step}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
