"""The swap engine's transfer probe: transfers kept in flight over a pool of host buffers, the
engine's bandwidth each way and both at once on a path, and the planner's disk profile measured
in a store's own requests (``infinity-plan`` and ``infinity-generate`` use it, and so do the
repository's benchmarks)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import infinity
from infinity.planning.planner import DiskProfile
from swap import BufferPool, Extent, HostBuffer, SwapEngine


def run_transfers(
    calls: list[tuple[Callable[..., Any], Extent]], buffers: Sequence[HostBuffer]
) -> float:
    """Runs ``call(extent, buffer)`` for each pair in order, one per buffer in flight (the
    oldest waited for before a buffer is reused); returns the seconds they all took."""
    started = time.perf_counter()
    futures: list[Future] = []
    for i, (call, extent) in enumerate(calls):
        if len(futures) >= len(buffers):
            futures.pop(0).result()
        futures.append(call(extent, buffers[i % len(buffers)]))
    for future in futures:
        future.result()
    return time.perf_counter() - started


def engine_bandwidth(
    path: Path,
    nbytes: int,
    config: infinity.OffloadConfig,
    combined: bool = False,
    requests: tuple[int, int] | None = None,
) -> dict:
    """Bytes per second writing then reading ``nbytes`` through the swap engine on ``path``;
    with ``combined``, also reading them back while writing as many elsewhere (bytes of both
    directions over the time both took: what a step that reads and writes at once gets) and
    ``cpu_per_byte``, the process's CPU seconds per byte of that pass: the I/O path's own cost
    (submission, completions, checksums) on the cores a step computes on. The transfers are
    64 MiB, four in flight, or ``requests`` = (bytes, in flight): a store moves its shards
    ``buffer_size`` at a time, and on this machine's disk 4 MiB reads, four or five in flight,
    moved 20% fewer GB/s than 64 MiB ones."""
    chunk, in_flight = requests or (64 << 20, 4)
    pool = BufferPool(in_flight, chunk)
    settings = config.aio.engine_settings()
    result = {}
    with SwapEngine([path], settings) as engine:
        extents = [engine.allocate(min(chunk, nbytes - o)) for o in range(0, nbytes, chunk)]

        result["write"] = nbytes / run_transfers([(engine.write, e) for e in extents], pool.buffers)
        result["read"] = nbytes / run_transfers([(engine.read, e) for e in extents], pool.buffers)
        if combined:
            others = [engine.allocate(e.nbytes) for e in extents]
            mixed = [
                pair
                for r, w in zip(extents, others)
                for pair in ((engine.read, r), (engine.write, w))
            ]
            cpu = time.process_time()
            result["combined"] = 2 * nbytes / run_transfers(mixed, pool.buffers)
            result["cpu_per_byte"] = (time.process_time() - cpu) / (2 * nbytes)
    pool.close()
    return result


def store_disk_profile(path: Path, nbytes: int, config: infinity.OffloadConfig) -> DiskProfile:
    """The planner's disk profile for a store with ``config`` on ``path``: each direction and
    both at once, measured in the store's own requests (``buffer_size`` bytes, ``buffer_count``
    in flight)."""
    requests = (config.swap_buffer_size(), config.buffer_count)
    bandwidth = engine_bandwidth(path, nbytes, config, combined=True, requests=requests)
    return DiskProfile(
        bandwidth["read"] / 1e9,
        bandwidth["write"] / 1e9,
        shared=True,
        source=f"swap engine, this run ({requests[0] / (1 << 20):g} MiB requests, "
        f"{config.buffer_count} in flight)",
        combined_gbps=bandwidth["combined"] / 1e9,
    )
