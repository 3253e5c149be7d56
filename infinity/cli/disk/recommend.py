"""From measurements to the runtime settings worth using on this disk.

The config is written in the runtime's native JSON format and nothing else: its loader rejects
unknown keys, so the evidence behind a recommendation goes to a sibling file.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from infinity.cli.common.aggregate import harmonic_mean

AIO_KEYS = ("backend", "block_size", "queue_depth", "thread_count")
CONFIG_KEYS = ("aio", "buffer_count", "buffer_size")

#: points whose score is within this fraction of the best are treated as equally fast; the disk
#: varies by more than that between runs, so ranking inside the band would be ranking noise.
TIE_BAND = 0.03
#: a buffer is "large enough" once transfers of it reach this fraction of the best.
ENOUGH = 0.95
MIN_BUFFER_COUNT = 3


@dataclass(frozen=True)
class Candidate:
    """What the choice needs to know about one grid point (medians over repeats)."""

    backend: str
    block_size: int
    queue_depth: int
    thread_count: int | None
    read_gbps: float
    write_gbps: float
    cpu_per_gib: float  # process CPU seconds per GiB, read and write averaged

    @property
    def score(self) -> float:
        return harmonic_mean(self.read_gbps, self.write_gbps)

    @property
    def unit(self) -> int:
        """Bytes the engine has in flight when the queue is full."""
        return self.block_size * self.queue_depth


@dataclass(frozen=True)
class Recommendation:
    candidate: Candidate
    buffer_size: int
    buffer_count: int
    reason: str

    def config(self) -> dict:
        return config_dict(self.candidate, self.buffer_size, self.buffer_count)


def choose_point(candidates: Sequence[Candidate], tie_band: float = TIE_BAND) -> Candidate:
    """The point that swaps fastest (harmonic mean of read and write GB/s); among those within
    ``tie_band`` of it, the one using the least CPU per GiB (the CPU is shared with the training
    loop), then the one with the most bytes in flight. The latter because completions need the
    GIL: next to a busy interpreter each batch of them waits up to a switch interval (5 ms), so
    the disk is kept busy by what was queued before the wait, and bandwidth under load scales
    with block_size x queue_depth (see --interference)."""
    usable = [c for c in candidates if c.score > 0]
    if not usable:
        raise ValueError("no grid point has both a read and a write measurement")
    best = max(c.score for c in usable)
    tied = [c for c in usable if c.score >= best * (1 - tie_band)]
    return min(tied, key=lambda c: (c.cpu_per_gib, -c.unit, -c.score))


#: size -> transfers in flight -> direction -> GB/s, as TransferSweep.medians() returns it
BySize = Mapping[int, Mapping[int, Mapping[str, float]]]
DEFAULT_BUFFER = 64 << 20


def buffer_count_for(in_flight: int) -> int:
    """Buffers for a step: one being computed on plus ``in_flight`` per direction (prefetch
    reads and write-back writes both overlap the compute)."""
    return max(MIN_BUFFER_COUNT, 1 + 2 * in_flight)


def choose_buffers(by_size: BySize, unit: int, enough: float = ENOUGH) -> tuple[int, int, str]:
    """(buffer_size, buffer_count, why).

    For each regime of the sweep (one transfer per direction in flight, or two), the smallest
    transfer size at which each direction reaches ``enough`` of the best the sweep saw in that
    direction (the larger of the two sizes); of the
    regimes that get there, the one needing the least buffer memory (count x size), fewer
    buffers on a tie. The size is rounded up to a multiple of ``unit`` (block_size x
    queue_depth), so that one buffer fills the whole queue."""
    best: dict[str, float] = {}
    for by_flight in by_size.values():
        for rates in by_flight.values():
            for direction, rate in rates.items():
                best[direction] = max(best.get(direction, 0.0), rate)
    best = {d: r for d, r in best.items() if r > 0}
    options = []
    for in_flight in sorted({n for by_flight in by_size.values() for n in by_flight}):
        # Per direction, then the larger: the best read and the best write of a noisy sweep
        # rarely fall on the same size.
        need = 0
        for direction, top in best.items():
            reaching = [
                size
                for size, by_flight in by_size.items()
                if by_flight.get(in_flight, {}).get(direction, 0.0) >= enough * top
            ]
            if not reaching:
                break
            need = max(need, min(reaching))
        else:
            if need:
                count = buffer_count_for(in_flight)
                options.append((count * need, count, need, in_flight))
    if not options:
        size = -(-max(DEFAULT_BUFFER, unit) // unit) * unit
        return size, buffer_count_for(2), "no buffer-size sweep: ~64 MiB, double buffered"
    _, count, size, in_flight = min(options)
    size = -(-max(size, unit) // unit) * unit
    why = (
        f"{in_flight} transfer(s) of this size in flight per direction reach {enough:.0%} of "
        f"the best bandwidth of the buffer-size sweep, with the least buffer memory of the "
        f"{len(options)} regime(s) that do; +1 buffer for compute"
    )
    return size, count, why


def recommend(
    candidates: Sequence[Candidate], by_size: BySize | None = None, choice: Candidate | None = None
) -> Recommendation:
    """The whole recommendation. ``by_size`` is the transfer-size sweep of ``choice`` (chosen
    here when not given)."""
    choice = choice or choose_point(candidates)
    buffer_size, buffer_count, why = choose_buffers(by_size or {}, choice.unit)
    reason = (
        f"point: fastest read+write (harmonic mean {choice.score:.2f} GB/s; ties within "
        f"{TIE_BAND:.0%} go to less CPU per GiB, then more bytes in flight); "
        f"buffers: {why}"
    )
    return Recommendation(choice, buffer_size, buffer_count, reason)


def config_dict(candidate: Candidate, buffer_size: int, buffer_count: int) -> dict:
    """The native config fragment, keys exactly as the runtime's strict loader expects."""
    return {
        "aio": {
            "backend": candidate.backend,
            "block_size": candidate.block_size,
            "queue_depth": candidate.queue_depth,
            # The runtime ignores it for uring; null means "follow queue_depth" for threads.
            "thread_count": candidate.thread_count if candidate.backend != "uring" else None,
        },
        "buffer_count": buffer_count,
        "buffer_size": buffer_size,
    }


def check_config(config: Mapping) -> None:
    """Raises ValueError unless ``config`` has exactly the native keys with sane values."""
    if set(config) != set(CONFIG_KEYS):
        raise ValueError(f"config keys {sorted(config)} are not exactly {sorted(CONFIG_KEYS)}")
    aio = config["aio"]
    if not isinstance(aio, Mapping) or set(aio) != set(AIO_KEYS):
        raise ValueError(f"aio keys {sorted(aio)} are not exactly {sorted(AIO_KEYS)}")
    for key in ("block_size", "queue_depth"):
        if not isinstance(aio[key], int) or aio[key] < 1:
            raise ValueError(f"aio.{key} must be a positive integer, got {aio[key]!r}")
    unit = aio["block_size"] * aio["queue_depth"]
    if not isinstance(config["buffer_size"], int) or config["buffer_size"] % unit:
        raise ValueError(
            f"buffer_size {config['buffer_size']!r} is not a multiple of "
            f"block_size x queue_depth = {unit}"
        )
    if not isinstance(config["buffer_count"], int) or config["buffer_count"] < MIN_BUFFER_COUNT:
        raise ValueError(f"buffer_count must be an integer >= {MIN_BUFFER_COUNT}")


def write_config(path: Path, config: Mapping, evidence: Mapping | None = None) -> Path | None:
    """Writes ``config`` to ``path``; ``evidence`` (the measurements behind it) goes to
    ``<stem>.measured.json`` next to it, never into the config itself. Returns that path."""
    check_config(config)
    path = Path(path)
    path.write_text(json.dumps(config, indent=2) + "\n")
    if evidence is None:
        return None
    sibling = path.with_name(f"{path.stem}.measured.json")
    sibling.write_text(json.dumps(evidence, indent=2, default=str) + "\n")
    return sibling
