"""Reducing repeated, noisy measurements to median, min and max."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Summary:
    """Median, min and max of ``n`` samples. The median, not the mean, is the headline because
    a shared virtual disk occasionally delivers a fraction of its usual speed for one run."""

    median: float
    min: float
    max: float
    n: int

    @property
    def spread(self) -> float:
        """(max - min) / median: how far apart the repeats were."""
        return (self.max - self.min) / self.median if self.median else 0.0

    def as_dict(self) -> dict:
        return asdict(self)


def summarize(values: Iterable[float | None]) -> Summary | None:
    """The summary of the finite values, or None when there are none (every repeat failed)."""
    kept = [float(v) for v in values if v is not None and math.isfinite(v)]
    if not kept:
        return None
    return Summary(statistics.median(kept), min(kept), max(kept), len(kept))


def harmonic_mean(a: float, b: float) -> float:
    """The rate at which equal amounts are moved at ``a`` and then at ``b``: a swap moves each
    shard out and back in, so this is what one read plus one write of it costs."""
    if a <= 0 or b <= 0:
        return 0.0
    return 2.0 / (1.0 / a + 1.0 / b)
