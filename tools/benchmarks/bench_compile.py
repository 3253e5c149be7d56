"""Compile benchmark: what torch.compile gains on the demo's GPT, with and without the store.

In one run, each configuration in a process of its own (compiled code and caches do not carry
over), interleaved over repeats: the model plain and attached (parameters and optimizer state on
NVMe), each eager and compiled (each block compiled, FSDP2's recipe; ``--compile whole``
compiles the whole model). It prints the median step of each, the gain of compiling,
1 - compiled / eager, for plain and attached, and the goal: the attached gain at least the
plain gain minus 0.10.

    python -m tools.benchmarks.bench_compile [--layers 6 --width 384 --context 256 --batch 8]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import infinity
from infinity.cli.common.tiny_gpt import GPTConfig, TinyGPT, parameter_count, synthetic_batches

CONFIGS = ("plain eager", "plain compiled", "attached eager", "attached compiled")


def worker(args: argparse.Namespace) -> dict:
    torch.manual_seed(0)
    gpt = GPTConfig(
        vocab_size=args.vocab,
        context=args.context,
        layers=args.layers,
        width=args.width,
        heads=args.heads,
    )
    model = TinyGPT(gpt)
    attached = args.config.startswith("attached")
    compiled = args.config.endswith("compiled")
    store = None
    optimizer: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    with tempfile.TemporaryDirectory(dir=args.nvme_path) as swap:
        if attached:
            store = infinity.TieredStore(
                infinity.OffloadConfig(
                    offload_param="nvme",
                    offload_optimizer="nvme",
                    nvme_path=swap,
                    buffer_size=args.buffer_size,
                    buffer_count=8,
                )
            )
            model, optimizer = store.attach(model, optimizer)
        if compiled:
            if args.compile == "whole":
                model = torch.compile(model)  # type: ignore[assignment]  # a module's stays one
            else:
                for block in model.blocks:
                    block.compile()
        data = synthetic_batches(gpt, args.batch, seed=1)
        times = []
        for _ in range(args.warmup + args.steps):
            tokens, targets = next(data)
            started = time.perf_counter()
            loss = model(tokens, targets)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            times.append(time.perf_counter() - started)
        if store is not None:
            store.close(restore_params=False)
    return {
        "config": args.config,
        "first_step_s": times[0],
        "step_s": statistics.median(times[args.warmup :]),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=384)
    parser.add_argument("--heads", type=int, default=6)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=2, help="steps before timing (compile)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--compile", choices=("blocks", "whole"), default="blocks")
    parser.add_argument("--buffer-size", type=int, default=16 << 20)
    parser.add_argument("--nvme-path", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--config", choices=CONFIGS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.config:  # a worker process
        print(json.dumps(worker(args)))
        return 0
    gpt = GPTConfig(
        vocab_size=args.vocab,
        context=args.context,
        layers=args.layers,
        width=args.width,
        heads=args.heads,
    )
    print(
        f"model: GPT {args.layers} x {args.width}, context {args.context}, vocab {args.vocab}"
        f" ({parameter_count(gpt) / 1e6:.1f} M params), batch {args.batch}; compile: "
        f"{args.compile}; {args.steps} timed steps after {args.warmup}, {args.repeats} "
        f"repeats interleaved"
    )
    runs: dict[str, list[dict]] = {c: [] for c in CONFIGS}
    forwarded = [
        a for a in (argv if argv is not None else sys.argv[1:]) if not a.startswith("--json")
    ]
    for repeat in range(args.repeats):
        for config in CONFIGS:
            done = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "tools.benchmarks.bench_compile",
                    *forwarded,
                    "--config",
                    config,
                ],
                capture_output=True,
                text=True,
            )
            if done.returncode:
                print(f"{config} failed:\n{done.stderr[-3000:]}")
                return 1
            result = json.loads(done.stdout.strip().splitlines()[-1])
            runs[config].append(result)
            print(
                f"  {config} run {repeat + 1}: step {result['step_s']:.3f} s (first step "
                f"{result['first_step_s']:.1f} s)"
            )
    step = {c: statistics.median(r["step_s"] for r in runs[c]) for c in CONFIGS}
    print(f"\n{'configuration':<20} {'median step s':>14}")
    for config in CONFIGS:
        print(f"{config:<20} {step[config]:>14.3f}")
    plain_gain = 1 - step["plain compiled"] / step["plain eager"]
    attached_gain = 1 - step["attached compiled"] / step["attached eager"]
    met = attached_gain >= plain_gain - 0.10
    print(
        f"\ncompiling gains: plain {plain_gain:+.1%}, attached {attached_gain:+.1%}; goal: "
        f"attached >= plain - 10 points: {'met' if met else 'NOT met'}"
    )
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "runs": runs,
                    "median_step_s": step,
                    "plain_gain": plain_gain,
                    "attached_gain": attached_gain,
                    "met": met,
                },
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
