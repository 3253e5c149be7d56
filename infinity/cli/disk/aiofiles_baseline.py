"""The baseline a Python user would reach for first: ``aiofiles`` (asyncio over buffered files).

One pass writes ``size`` bytes in ``block_size`` requests with ``WINDOW`` of them outstanding,
fsyncs (inside the timed write, so it measures the disk and not the page cache), drops the file's
pages with POSIX_FADV_DONTNEED (so the read comes from the disk, as the engine's O_DIRECT read
does), reads it back the same way and removes the file. CPU is the whole process's (user +
kernel, every thread: aiofiles' executor threads included), from getrusage deltas.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

from infinity.cli.common.aggregate import summarize
from infinity.cli.common.units import format_size
from infinity.cli.disk.sweep import DIRECTIONS, Sample, _process_cpu

# asyncio.gather over WINDOW worker coroutines, each with its own aiofiles file object (seek then
# write/read), worker i taking blocks i, i + WINDOW, ...: WINDOW requests at distinct offsets are
# outstanding at any time. aiofiles runs each call on the loop's default thread pool, so on a small
# machine fewer than WINDOW may actually be in the kernel at once.
WINDOW = 8
MISSING = "aiofiles not installed (pip install aiofiles)"


def label(block_size: int) -> str:
    return (
        f"aiofiles, buffered, bs={format_size(block_size)}, {WINDOW} outstanding "
        "(asyncio.gather), write incl. fsync, read after FADV_DONTNEED (from the disk)"
    )


async def _write(aiofiles, path: Path, size: int, block_size: int) -> None:
    block = os.urandom(block_size)  # incompressible, like the engine's pattern

    async def worker(first: int) -> None:
        async with aiofiles.open(path, "r+b") as f:
            for offset in range(first * block_size, size, WINDOW * block_size):
                await f.seek(offset)
                await f.write(block[: min(block_size, size - offset)])

    await asyncio.gather(*(worker(i) for i in range(WINDOW)))
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


async def _read(aiofiles, path: Path, size: int, block_size: int) -> None:
    async def worker(first: int) -> int:
        got = 0
        async with aiofiles.open(path, "rb") as f:
            for offset in range(first * block_size, size, WINDOW * block_size):
                await f.seek(offset)
                got += len(await f.read(min(block_size, size - offset)))
        return got

    got = sum(await asyncio.gather(*(worker(i) for i in range(WINDOW))))
    if got != size:
        raise OSError(f"read back {got} of {size} bytes")


def _timed(coroutine, size: int, block_size: int) -> Sample:
    cpu, start = _process_cpu(), time.perf_counter()
    asyncio.run(coroutine)
    seconds, cpu = time.perf_counter() - start, _process_cpu() - cpu
    return Sample(
        nbytes=size,
        seconds=seconds,
        process_cpu=cpu,
        backend_cpu=0.0,
        requests=-(-size // block_size),
        busy_seconds=seconds,
    )


def measure_pass(directory: Path, size: int, block_size: int) -> dict[str, Sample]:
    """One write and one read pass; the file is removed whatever happens."""
    import aiofiles

    path = directory / f"infinity-bench-aiofiles-{os.getpid()}.dat"
    path.write_bytes(b"")
    try:
        write = _timed(_write(aiofiles, path, size, block_size), size, block_size)
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        read = _timed(_read(aiofiles, path, size, block_size), size, block_size)
    finally:
        path.unlink(missing_ok=True)
    return {"write": write, "read": read}


def measure(directory: Path, size: int, block_size: int, repeats: int) -> dict:
    """``repeats`` passes (after the engine grid, not interleaved with it); the JSON-ready entry
    with per-direction medians under ``summary``, or ``available: False`` and a note."""
    entry: dict = {
        "available": False,
        "note": "",
        "label": label(block_size),
        "size": size,
        "block_size": block_size,
        "window": WINDOW,
        "repeats": [],
        "summary": {},
    }
    try:
        import aiofiles  # noqa: F401
    except ImportError:
        entry["note"] = MISSING
        return entry
    runs = []
    for _ in range(repeats):
        try:
            runs.append(measure_pass(directory, size, block_size))
            entry["repeats"].append({d: s.as_dict() for d, s in runs[-1].items()})
        except Exception as exc:  # a failing baseline must not end the bench
            entry["repeats"].append({"error": str(exc)})
            entry["note"] = f"aiofiles failed: {exc}"
    for direction in DIRECTIONS:
        gbps = summarize(run[direction].gbps for run in runs)
        cpu = summarize(run[direction].cpu_per_gib for run in runs)
        if gbps and cpu:
            entry["summary"][direction] = {
                "gbps": gbps.median,
                "cpu_s_per_gib": cpu.median,
                "gbps_min_max": [gbps.min, gbps.max],
            }
    entry["available"] = bool(entry["summary"])
    return entry
