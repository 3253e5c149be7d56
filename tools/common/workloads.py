"""The benchmarks' shared workload: the peer-comparison MLP (24 x Linear(2048) + ReLU by default),
its timed training steps, the NVMe store configuration of a run and the run options
bench_overlap, bench_clip and bench_dist share, and DeepSpeed's figures they report against."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

import infinity
from swap import Extent, SwapEngine

#: DeepSpeed 0.19.8 ZeRO-3 on this machine type with params and optimizer state on NVMe, for the
#: default model (quoted from the project's measurements, not re-run here)
DEEPSPEED_STEP_S = 2.73
DEEPSPEED_PEAK_RSS_GIB = 6.43


def mlp(layers: int, width: int, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    blocks: list[nn.Module] = []
    for _ in range(layers):
        blocks += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*blocks)


def timed_steps(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    steps: int,
    batch: int,
    width: int,
    phases: list[tuple[float, float, float]] | None = None,
    after_backward: Callable[[], object] | None = None,
    at_start: Callable[[], object] | None = None,
    at_end: Callable[[], object] | None = None,
    after_forward: Callable[[], object] | None = None,
) -> list[float]:
    """Seconds per training step; with ``phases``, also appends each step's (forward,
    backward, optimizer step + zero_grad) seconds to it. ``after_backward`` (e.g. a
    ``clip_grad_norm_`` call) runs between ``loss.backward()`` and ``optimizer.step()``; its
    time counts in the step and in the third phase. ``at_start`` runs as the step's clock
    starts, ``at_end`` after ``zero_grad`` (e.g. waiting for work started at the start): it
    counts in the step, in none of the phases. ``after_forward`` runs between forward and
    backward (a counter's snapshot); its time counts in the step and in the second phase."""
    generator = torch.Generator().manual_seed(1)
    times = []
    for _ in range(steps):
        x = torch.randn(batch, width, generator=generator)
        started = time.perf_counter()
        if at_start is not None:
            at_start()
        loss = model(x).square().mean()
        forward_done = time.perf_counter()
        if after_forward is not None:
            after_forward()
        loss.backward()
        backward_done = time.perf_counter()
        if after_backward is not None:
            after_backward()
        optimizer.step()
        optimizer.zero_grad()
        ended = time.perf_counter()
        if at_end is not None:
            at_end()
        times.append(time.perf_counter() - started)
        if phases is not None:
            phases.append(
                (forward_done - started, backward_done - forward_done, ended - backward_done)
            )
    return times


def nvme_config(
    nvme_path: Path,
    host_budget: float,
    arena: float,
    device_budget: float,
    buffer_size: int = 64 << 20,
    offload_optimizer: str = "nvme",
    **settings: Any,
) -> infinity.OffloadConfig:
    """The store configuration of an NVMe run: parameters on NVMe, the optimizer state where
    ``offload_optimizer`` says, a staging arena of ``arena`` GiB in slots of ``buffer_size``
    bytes, under host and device budgets in GiB; ``settings`` are further OffloadConfig keys."""
    return infinity.OffloadConfig(
        offload_param="nvme",
        offload_optimizer=offload_optimizer,
        nvme_path=(nvme_path,),
        buffer_size=buffer_size,
        buffer_count=max(2, int(arena * 2**30) // buffer_size),
        host_budget=int(host_budget * 2**30),
        device_budget=int(device_budget * 2**30),
        **settings,
    )


def duplex_order(
    engine: SwapEngine, sources: Sequence[Extent], targets: Sequence[Extent]
) -> list[tuple[Callable[..., Any], Extent]]:
    """Reads of ``sources`` and writes of ``targets`` interleaved by bytes (the next goes to
    whichever stream is further behind), so both run from start to end together, as in a
    pipelined step: the calls for :func:`run_transfers`."""
    order: list[tuple[Callable[..., Any], Extent]] = []
    r = w = 0
    while r < len(sources) or w < len(targets):
        if w >= len(targets) or (r < len(sources) and r / len(sources) <= w / len(targets)):
            order.append((engine.read, sources[r]))
            r += 1
        else:
            order.append((engine.write, targets[w]))
            w += 1
    return order


#: the host budget of the default run, GiB: a third of DeepSpeed's peak RSS (#3 reports there)
DEFAULT_HOST_BUDGET = round(DEEPSPEED_PEAK_RSS_GIB / 3, 2)
#: staging arenas of the default run, GiB: one that caches all but a few of the 1.6 GB of
#: state, one that streams about half of it every step, one where the disk dominates the step
DEFAULT_ARENAS = (1.35, 1.0, 0.7)


def add_run_arguments(parser: argparse.ArgumentParser, repeats: int) -> None:
    """The model, step-count and placement options this benchmark shares with bench_clip."""
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=5, help="timed steps (after the warm-up)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--repeats", type=int, default=repeats, help="interleaved runs per config")
    parser.add_argument("--nvme-path", type=Path, default=None)
    parser.add_argument(
        "--host-budget",
        type=float,
        default=DEFAULT_HOST_BUDGET,
        help="GiB for the host tier (default: %(default)s)",
    )
