"""Eviction and prefetch policies, fed by the recorded trace.

Both are small interfaces so a different policy (a cost model, a learned one) can be dropped in.
Eviction picks, among candidates that may be dropped, the one to drop first: with a trace, the one
whose next use is furthest away (Belady's optimal choice); without one, the least recently used.
Prefetch lists the parameter entries worth fetching now, nearest first; the store decides how many
it can afford without over-committing its buffers.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

from infinity.core.trace import TraceFollower

T = TypeVar("T")


class EvictionPolicy(ABC):
    @abstractmethod
    def order(
        self,
        candidates: Sequence[T],
        next_use: Callable[[T], float] | None,
        recency: Callable[[T], int],
    ) -> list[T]:
        """``candidates`` in the order they should be evicted. ``next_use`` (events until the
        candidate is needed again) is None when no trace is being followed; ``recency`` is a
        logical clock of the last use."""


class LRUEviction(EvictionPolicy):
    def order(
        self,
        candidates: Sequence[T],
        next_use: Callable[[T], float] | None,
        recency: Callable[[T], int],
    ) -> list[T]:
        return sorted(candidates, key=recency)


class BeladyEviction(EvictionPolicy):
    """Furthest next use first; least recently used while no trace is being followed."""

    def order(
        self,
        candidates: Sequence[T],
        next_use: Callable[[T], float] | None,
        recency: Callable[[T], int],
    ) -> list[T]:
        if next_use is None:
            return sorted(candidates, key=recency)
        return sorted(candidates, key=lambda c: (-next_use(c), recency(c)))


class PrefetchPolicy(ABC):
    @abstractmethod
    def wanted(self, follower: TraceFollower) -> Iterable[int]:
        """Entry indices to fetch ahead, nearest use first."""


class LookaheadPrefetch(PrefetchPolicy):
    """The entries of the next ``depth`` events of the trace.

    ``stream_inference``: in an iteration without autograd, the whole trace ahead, wrapping into
    the next iteration. Such an iteration only reads weights, each once, in an order that repeats
    token after token, so the arena is best spent as a window running ahead of compute (the store
    bounds it: a read may only evict what is needed after it). In training the arena also holds
    gradients and optimizer state, which a deep prefetch would push out."""

    def __init__(self, depth: int, stream_inference: bool = True) -> None:
        self.depth = depth
        self.stream_inference = stream_inference

    def wanted(self, follower: TraceFollower) -> Iterable[int]:
        seen: set[int] = set()
        trace = follower.trace
        if self.stream_inference and self.depth and trace is not None and follower.inference:
            upcoming = follower.upcoming(len(trace), wrap=True)
        else:
            upcoming = follower.upcoming(self.depth)
        for event in upcoming:
            for entry in event.entries:
                if entry not in seen:
                    seen.add(entry)
                    yield entry
