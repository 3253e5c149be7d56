"""Optimizer-step benchmark: the pipelined offloaded step against its parts.

For an MLP (default: 24 x Linear(2048), 100.7 M fp32 parameters) with parameters, gradients and
Adam state on NVMe, it measures in one run
  * the offloaded step time, pipelined and unpipelined (reads, updates and writes in sequence);
  * the pure read and write time of the step's bytes at the swap engine's bandwidth on the same
    path, and the pure update time of the same number of parameters in memory;
and prints pipelined step / max(read, write, compute) (target <= 1.2). That bound assumes the
disk reads and writes at full speed at once; many do not (a shared or rate-limited device serves
the sum), so it also measures the step's reads and writes issued together through the engine, with
no compute, and prints the step's ratio to that floor. It also prints the update throughput of the
fused Adam kernel the store uses against torch's per-tensor loop.

    python -m tools.benchmarks.bench_step [--layers 24 --width 2048 --host-budget 1GiB]

With ``--state-loss STEPS`` it measures instead what keeping the optimizer state in fewer bytes
(``precision.optimizer_state_dtype``) costs the training: the MLP (regressing a fixed random
teacher), the demo's GPT (``infinity-train``'s defaults: 8 x 256, vocab 512, its synthetic
text) and the same GPT with a vocab of 64 (``gpt-v64``: the demo's text then has 4096 pairs of
tokens to learn the next one from, which 200 steps of 512 tokens see 25 times each, where the
demo's 262144 pairs stay near chance) train STEPS steps each with the state in fp32, bf16 and
int8, on the same data from the same seeds, and it prints each final loss (the mean of the last
ten) against fp32's (targets: within 1% for bf16, 2% for int8), with the bytes read and written
per step and the state's share of them.

    python -m tools.benchmarks.bench_step --state-loss 200
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

import infinity
from infinity.cli.common.tiny_gpt import GPTConfig, TinyGPT, synthetic_batches
from infinity.cli.common.transfers import engine_bandwidth, run_transfers
from infinity.cli.demo import DEMO_LR, HEADS
from infinity.config import parse_size
from swap import BufferPool, SwapEngine
from tools.common.workloads import duplex_order, mlp

#: --state-loss: the state dtypes compared, and how far each final loss may be from fp32's
STATE_DTYPE_TARGETS = {"fp32": 0.0, "bf16": 0.01, "int8": 0.02}
#: the demo's GPT (infinity-train's defaults), and the same with a vocab it can learn in 200 steps
DEMO_GPT = GPTConfig(vocab_size=512, context=64, layers=8, width=256, heads=HEADS)
SMALL_VOCAB_GPT = dataclasses.replace(DEMO_GPT, vocab_size=64)


def update_throughput(numel: int, fused: bool, repeats: int = 3) -> float:
    """Parameters per second of one AdamW update over ``numel`` fp32 parameters in memory."""
    chunk = 1 << 22
    params = [nn.Parameter(torch.randn(min(chunk, numel - i))) for i in range(0, numel, chunk)]
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer = torch.optim.AdamW(
        params, lr=1e-4, fused=fused, foreach=False if not fused else None
    )
    optimizer.step()  # creates the state
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        optimizer.step()
        times.append(time.perf_counter() - started)
    return numel / statistics.median(times)


def duplex_seconds(
    path: Path,
    read_bytes: int,
    write_bytes: int,
    config: infinity.OffloadConfig,
    chunk: int = 32 << 20,
    slots: int = 8,
) -> float:
    """Seconds to read ``read_bytes`` while writing ``write_bytes`` through the swap engine.

    Reads and writes are submitted in proportion to their byte counts, so both streams run from
    start to end together, as in a pipelined step.
    """
    pool = BufferPool(slots, chunk)
    with SwapEngine([path], config.aio.engine_settings()) as engine:

        def extents(nbytes: int) -> list:
            return [engine.allocate(min(chunk, nbytes - o)) for o in range(0, nbytes, chunk)]

        sources, targets = extents(read_bytes), extents(write_bytes)
        buffers = pool.buffers
        for i, extent in enumerate(sources):  # something to read back
            engine.write(extent, buffers[i % len(buffers)]).result()
        elapsed = run_transfers(duplex_order(engine, sources, targets), buffers)
    pool.close()
    return elapsed


def step_times(args: argparse.Namespace, root: Path, pipeline: bool) -> dict:
    model = mlp(args.layers, args.width)
    config = infinity.OffloadConfig(
        offload_param="nvme",
        offload_optimizer="nvme",
        nvme_path=(root,),
        buffer_size=args.buffer_size,
        buffer_count=max(4, args.host_budget // args.buffer_size),
        host_budget=args.host_budget,
    )
    store = infinity.TieredStore(config)
    model, optimizer = store.attach(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    store.pipeline_step = pipeline
    generator = torch.Generator().manual_seed(0)
    times, reads, writes = [], [], []
    for step in range(args.steps + 1):
        x = torch.randn(args.batch, args.width, generator=generator)
        model(x).square().mean().backward()
        before = store.stats()
        started = time.perf_counter()
        optimizer.step()
        elapsed = time.perf_counter() - started
        after = store.stats()
        optimizer.zero_grad()
        if step:  # the first step creates the optimizer state
            times.append(elapsed)
            reads.append(after["bytes_read"] - before["bytes_read"])
            writes.append(after["bytes_written"] - before["bytes_written"])
    store.close(restore_params=False)
    del model, optimizer, store
    gc.collect()
    return {
        "step_s": statistics.median(times),
        "steps_s": times,
        "read_bytes": statistics.median(reads),
        "write_bytes": statistics.median(writes),
    }


def _mlp_run(args: argparse.Namespace) -> tuple[nn.Module, Any, float, int]:
    """The MLP, its batches (regressing a fixed random teacher), AdamW's lr, the host budget."""
    model = mlp(args.layers, args.width)
    generator = torch.Generator().manual_seed(1)
    teacher = torch.randn(args.width, args.width, generator=generator) / args.width**0.5

    def batches() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            x = torch.randn(args.batch, args.width, generator=generator)
            yield x, torch.relu(x @ teacher)

    def loss(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return nn.functional.mse_loss(model(batch[0]), batch[1])

    return model, (batches(), loss), 1e-4, args.host_budget


def _gpt_run(
    gpt: GPTConfig,
) -> Callable[[argparse.Namespace], tuple[nn.Module, Any, float, int]]:
    """The demo's GPT (of config ``gpt``), its synthetic text, its lr, and its host budget (a
    quarter of params, gradients and Adam state)."""

    def make(args: argparse.Namespace) -> tuple[nn.Module, Any, float, int]:
        torch.manual_seed(0)
        model = TinyGPT(gpt)
        data = synthetic_batches(gpt, 8, seed=0)
        numel = sum(p.numel() for p in model.parameters())
        return model, (data, lambda batch: model(*batch)), DEMO_LR, 4 * numel

    return make


def state_loss_run(
    make: Callable[[argparse.Namespace], tuple[nn.Module, Any, float, int]],
    args: argparse.Namespace,
    root: Path,
    dtype: str,
) -> dict:
    """``args.state_loss`` steps of one model with the state kept as ``dtype``: the losses,
    and the median bytes per step (after the first, which creates the state)."""
    model, (data, loss_of), lr, host_budget = make(args)
    path = root / f"state-{dtype}"
    path.mkdir(parents=True, exist_ok=True)
    config = infinity.OffloadConfig(
        device="cpu",
        offload_param="nvme",
        offload_optimizer="nvme",
        nvme_path=(path,),
        host_budget=host_budget,
        precision=infinity.PrecisionConfig(optimizer_state_dtype=dtype),
    )
    store = infinity.TieredStore(config)
    model, optimizer = store.attach(model, torch.optim.AdamW(model.parameters(), lr=lr))
    losses, per_step = [], []
    before = store.stats()
    for _ in range(args.state_loss):
        loss = loss_of(next(data))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        after = store.stats()
        moved = {k: after[k] - before[k] for k in ("bytes_read", "bytes_written")}
        for key, value in after["compression"].items():
            if key.startswith("state_"):
                moved[key] = value - before["compression"][key]
        per_step.append(moved)
        before = after
    store.close(restore_params=False)
    shutil.rmtree(path, ignore_errors=True)
    del model, optimizer, store
    gc.collect()
    steady = per_step[1:] or per_step
    return {
        "losses": losses,
        "final_loss": statistics.fmean(losses[-10:]),
        **{key: statistics.median(s[key] for s in steady) for key in steady[0]},
    }


def state_loss(args: argparse.Namespace, root: Path) -> dict:
    """``--state-loss``: see the module docstring."""
    results: dict = {}
    print(
        f"optimizer state dtype against fp32, {args.state_loss} steps each (final loss: the "
        f"mean of the last ten; bytes: the median step after the first)"
    )
    print(
        f"{'model':<7} {'state':<5} {'final loss':>11} {'vs fp32':>8} {'target':>7} "
        f"{'read/step':>10} {'written/step':>12} {'state read+written (fp32 would)':>32}"
    )
    for name, make in (
        ("mlp", _mlp_run),
        ("gpt", _gpt_run(DEMO_GPT)),
        ("gpt-v64", _gpt_run(SMALL_VOCAB_GPT)),
    ):
        if name not in args.state_loss_models.split(","):
            continue
        runs = {dtype: state_loss_run(make, args, root, dtype) for dtype in STATE_DTYPE_TARGETS}
        base = runs["fp32"]["final_loss"]
        for dtype, run in runs.items():
            change = run["final_loss"] / base - 1
            run["vs_fp32"] = change
            target = STATE_DTYPE_TARGETS[dtype]
            run["within_target"] = abs(change) <= target
            moved = run["state_read"] + run["state_written"]
            would = run["state_read_as_fp32"] + run["state_written_as_fp32"]
            saved = f"{(would - moved) / 1e6:.1f}MB"
            print(
                f"{name:<7} {dtype:<5} {run['final_loss']:>11.5f} {change:>+8.2%} "
                f"{'' if not target else ('ok' if run['within_target'] else 'over'):>7} "
                f"{run['bytes_read'] / 1e6:>8.1f}MB {run['bytes_written'] / 1e6:>10.1f}MB "
                + (
                    f"{moved / 1e6:>10.1f}MB ({would / 1e6:.1f}MB, saved {saved})"
                    if would
                    else f"{'(as is)':>32}"
                )
            )
        results[name] = runs
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--nvme-path", type=Path, default=None)
    parser.add_argument(
        "--host-budget", type=lambda v: parse_size(v, name="--host-budget"), default=1 << 30
    )
    parser.add_argument(
        "--buffer-size", type=lambda v: parse_size(v, name="--buffer-size"), default=32 << 20
    )
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument(
        "--state-loss",
        type=int,
        default=0,
        metavar="STEPS",
        help="compare the optimizer state dtypes' training loss instead (see above)",
    )
    parser.add_argument(
        "--state-loss-models",
        default="mlp,gpt,gpt-v64",
        help="which of mlp, gpt, gpt-v64 --state-loss trains (%(default)s)",
    )
    args = parser.parse_args(argv)
    root = args.nvme_path or Path(tempfile.mkdtemp(prefix="infinity-bench-step-"))
    if args.state_loss:
        compared = state_loss(args, root)
        if args.json:
            args.json.write_text(json.dumps(compared, indent=2))
        if args.nvme_path is None:
            shutil.rmtree(root, ignore_errors=True)
        return 0
    params = sum(p.numel() for p in mlp(args.layers, args.width).parameters())
    print(
        f"model: {args.layers} x Linear({args.width}), {params / 1e6:.1f} M params; params, "
        f"grads and Adam state on NVMe; host budget {args.host_budget / 2**30:.2f} GiB"
    )
    results: dict = {"params": params}
    # Interleave the two modes so the disk's drift hits both alike.
    runs: dict[bool, list[dict]] = {True: [], False: []}
    for pipeline in (True, False, True, False):
        runs[pipeline].append(step_times(args, root, pipeline))
    pipelined = min(runs[True], key=lambda r: r["step_s"])
    sequential = min(runs[False], key=lambda r: r["step_s"])
    bandwidth = engine_bandwidth(
        root, int(max(pipelined["read_bytes"], 256 << 20)), infinity.OffloadConfig()
    )
    read_s = pipelined["read_bytes"] / bandwidth["read"]
    write_s = pipelined["write_bytes"] / bandwidth["write"]
    duplex_s = duplex_seconds(
        root, int(pipelined["read_bytes"]), int(pipelined["write_bytes"]), infinity.OffloadConfig()
    )
    fused = update_throughput(params, fused=True)
    loop = update_throughput(params, fused=False)
    compute_s = params / fused
    bound = max(read_s, write_s, compute_s)
    results.update(
        {
            "pipelined_step_s": pipelined["step_s"],
            "unpipelined_step_s": sequential["step_s"],
            "read_bytes": pipelined["read_bytes"],
            "write_bytes": pipelined["write_bytes"],
            "read_s": read_s,
            "write_s": write_s,
            "compute_s": compute_s,
            "ratio_to_bound": pipelined["step_s"] / bound,
            "duplex_s": duplex_s,
            "ratio_to_duplex": pipelined["step_s"] / max(duplex_s, compute_s),
            "fused_mparams_per_s": fused / 1e6,
            "loop_mparams_per_s": loop / 1e6,
            "engine_read_gbps": bandwidth["read"] / 1e9,
            "engine_write_gbps": bandwidth["write"] / 1e9,
            "all_runs": {"pipelined": runs[True], "unpipelined": runs[False]},
        }
    )
    print(
        f"step bytes                read {pipelined['read_bytes'] / 1e9:.2f} GB, "
        f"write {pipelined['write_bytes'] / 1e9:.2f} GB"
    )
    print(
        f"engine bandwidth          read {bandwidth['read'] / 1e9:.2f} GB/s, "
        f"write {bandwidth['write'] / 1e9:.2f} GB/s"
    )
    print(f"pure read / write / update {read_s:.3f} / {write_s:.3f} / {compute_s:.3f} s")
    print(
        f"read and write together   {duplex_s:.3f} s   "
        f"({duplex_s / max(read_s, write_s):.2f}x max(read, write): the disk's own overlap)"
    )
    print(
        f"pipelined step            {pipelined['step_s']:.3f} s   "
        f"({results['ratio_to_bound']:.2f}x max(read, write, update); target <= 1.2; "
        f"{results['ratio_to_duplex']:.2f}x reads and writes together)"
    )
    print(
        f"unpipelined step          {sequential['step_s']:.3f} s   "
        f"({sequential['step_s'] / pipelined['step_s']:.2f}x pipelined)"
    )
    print(
        f"AdamW update throughput   fused {fused / 1e6:.0f} Mparam/s, per-tensor loop "
        f"{loop / 1e6:.0f} Mparam/s ({fused / loop:.1f}x)"
    )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    if args.nvme_path is None:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
